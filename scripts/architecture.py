"""The layers of labavg, its import graph, and the picture of both (docs/architecture.md).

`python scripts/architecture.py` redraws docs/figures/architecture.png from the source: a box
per layer (lowest at the bottom) listing its modules, an arrow per pair of layers that import
one another, labelled with the number of import statements. tests/test_architecture.py checks
the rules on the same graph.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = [REPO / "labavg", REPO / "dashboard"]

# Lowest first; a module may import its own layer's modules and those of lower layers only.
# Layers on one line are peers that do not import each other.
LAYERS = [
    ["labavg.base"],
    ["labavg.comm", "labavg.optim", "labavg.data"],
    ["labavg.averaging"],
    ["labavg.training"],
    ["labavg.decode"],
    ["labavg.jobs"],
    ["labavg.studies"],
    ["dashboard"],
    ["labavg.cli"],
    ["labavg.__main__"],
]


def modules() -> dict[str, Path]:
    """Every module of the two packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer(module: str) -> tuple[int, str]:
    """(level, layer name) of a module: its place in LAYERS."""
    if module in ("labavg", "dashboard"):  # the packages themselves: a docstring and a version
        return 0, module
    for level, names in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + "."):
                return level, name
    raise LookupError(f"{module} belongs to no layer: add it to LAYERS in scripts/architecture.py "
                      "and to docs/architecture.md")


def imports(path: Path, known: dict[str, Path] | set[str]) -> list[str]:
    """The project modules `path` imports (at module level or inside functions), once per
    import statement and target."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        targets = set()
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name not in ("labavg", "dashboard"):
                targets.add(name)
        found.extend(sorted(targets))
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imports(path, known)) - {name} for name, path in known.items()}


def layer_arrows() -> Counter:
    """(from layer, to layer) -> number of import statements, across layers only."""
    known = modules()
    arrows: Counter = Counter()
    for name, path in known.items():
        if name in ("labavg", "dashboard"):
            continue
        for target in imports(path, known):
            a, b = layer(name)[1], layer(target)[1]
            if a != b:
                arrows[a, b] += 1
    return arrows


def draw(out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    known = sorted(m for m in modules() if m not in ("labavg", "dashboard"))
    arrows = layer_arrows()
    rows = []  # (names, their member texts, row height)
    for names in LAYERS:
        width = 9.0 / len(names)
        texts = [_wrap(", ".join(_grouped([m[len(n) + 1:] for m in known
                                          if m.startswith(n + ".")])), int(width * 12))
                 for n in names]
        rows.append((names, texts, 0.45 + 0.17 * max(t.count("\n") + 1 for t in texts)))
    total = sum(h for *_, h in rows) + 0.1 * len(rows)
    fig, ax = plt.subplots(figsize=(13, 1.1 * total))
    ax.set_xlim(0, 13), ax.set_ylim(0, total), ax.axis("off")
    y = 0.0
    for names, texts, height in rows:
        width = 9.0 / len(names)
        for i, (name, text) in enumerate(zip(names, texts)):
            x0 = 0.1 + i * width
            folder = name.replace(".", "/") + ("/" if text else ".py")
            ax.add_patch(plt.Rectangle((x0, y), width - 0.15, height,
                                       facecolor="#eef3fa", edgecolor="#34495e"))
            ax.text(x0 + 0.1, y + height - 0.18, folder, weight="bold", fontsize=10, va="center")
            ax.text(x0 + 0.1, y + (height - 0.3) / 2, text, fontsize=7.5, va="center",
                    color="#2c3e50")
        below = Counter()
        for (a, b), n in arrows.items():
            if a in names:
                below[b] += n
        said = ", ".join(f"{b.replace('labavg.', '')} ({n})" for b, n in
                         sorted(below.items(), key=lambda kv: -layer(kv[0])[0]))
        ax.text(9.25, y + height / 2, _wrap("imports " + said, 52) if said else
                "imports nothing of the project", fontsize=8, va="center", color="#555555")
        y += height + 0.1
    ax.set_title("labavg's layers, lowest at the bottom: each imports only from layers below it\n"
                 "(right: the layers it imports, with the number of import statements)",
                 fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def _grouped(members: list[str]) -> list[str]:
    """'reproduction.beyond', 'reproduction.paper' -> 'reproduction/{beyond, paper}'."""
    out, sub = [], {}
    for m in members:
        head, _, tail = m.partition(".")
        if tail:
            sub.setdefault(head, []).append(tail)
        elif m not in sub:
            out.append(m)
    out = [m for m in out if m not in sub]
    return out + [f"{head}/{{{', '.join(tails)}}}" for head, tails in sub.items()]


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, max(width, 20)))


if __name__ == "__main__":
    print(draw(REPO / "docs" / "figures" / "architecture.png"))
