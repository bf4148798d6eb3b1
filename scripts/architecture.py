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
    fig, ax = plt.subplots(figsize=(13, 9))
    ax.set_xlim(0, 13), ax.set_ylim(-0.2, len(LAYERS)), ax.axis("off")
    for level, names in enumerate(LAYERS):
        width = 9.0 / len(names)
        for i, name in enumerate(names):
            x0 = 0.1 + i * width
            members = [m[len(name) + 1:] for m in known if m.startswith(name + ".")]
            folder = name.replace(".", "/") + ("/" if members else ".py")
            ax.add_patch(plt.Rectangle((x0, level + 0.08), width - 0.15, 0.8,
                                       facecolor="#eef3fa", edgecolor="#34495e"))
            ax.text(x0 + 0.1, level + 0.7, folder, weight="bold", fontsize=10, va="center")
            ax.text(x0 + 0.1, level + 0.35, _wrap(", ".join(members), int(width * 15)),
                    fontsize=7.5, va="center", color="#2c3e50")
        below = Counter()
        for name in names:
            for (a, b), n in arrows.items():
                if a == name:
                    below[b] += n
        text = ", ".join(f"{b.replace('labavg.', '')} ({n})" for b, n in
                         sorted(below.items(), key=lambda kv: -layer(kv[0])[0]))
        ax.text(9.25, level + 0.48, _wrap("imports " + text, 52) if text else "imports nothing "
                "of the project", fontsize=8, va="center", color="#555555")
    ax.set_title("labavg's layers, lowest at the bottom: each imports only from layers below it\n"
                 "(right: the layers it imports, with the number of import statements)",
                 fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, max(width, 20))[:3])


if __name__ == "__main__":
    print(draw(REPO / "docs" / "figures" / "architecture.png"))
