"""The sweep files of one reproduction (experiments/ by default) and their tiny versions: the
same grids with two seeds, a tiny model for a few epochs on tiny corpora (tests, notebooks at
their CI size), written by tomli_w."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from labavg.base.paths import require_writable
from labavg.base.checkpoint import atomic_write_text

# The repository's experiments/ (labavg is installed editable from its checkout).
EXPERIMENTS = Path(__file__).resolve().parents[3] / "experiments"

# The model must learn something even at the tiny size: an untrained one's flat posteriors make
# the decoder's beam search slow (every path stays within the beam), and the test sets are a
# few utterances.
TINY_BASE = {"epochs": 2, "log_every": 50, "checkpoint_every": 1000, "tensorboard": False,
             "model": {"hidden_layers": 1, "hidden_dim": 64},
             "data": {"context": 2, "buffer_frames": 4096}, "rbm": {"epochs": 1}}
TINY_HOURS = {"paper": [(0.1, 0.002, 0.003)], "regime": [(0.03, 0, 0), (0.06, 0, 0)]}
TINY_RANKS = {"regime": [1, 2, 4]}


@dataclass(frozen=True)
class Experiments:
    """The sweep files of one reproduction (experiments/ by default, tiny ones in the tests)."""

    directory: Path

    @property
    def paper(self) -> Path:
        return self.directory / "paper.toml"

    @property
    def regime(self) -> Path:
        return self.directory / "regime.toml"

    @property
    def yesno(self) -> Path:
        return self.directory / "yesno.toml"

    @property
    def explain(self) -> Path:
        return self.directory / "explain.toml"

    @property
    def regime_variables(self) -> Path:
        return self.directory / "regime-variables.toml"

    @property
    def beyond(self) -> Path:
        return self.directory / "beyond.toml"

    @property
    def asterisk(self) -> Path:
        return self.directory / "asterisk.toml"

    @property
    def elastic(self) -> Path:
        return self.directory / "elastic.toml"

    @property
    def schedules(self) -> Path:
        return self.directory / "schedules.toml"


def tiny_sweep(spec: dict[str, Any], corpora: list[dict[str, Any]],
               ranks: list[int] | None = None) -> dict[str, Any]:
    """A sweep file's contents at the tiny size: `corpora` to train on, TINY_BASE over its base,
    seeds 0 and 1, the corpora (and `ranks`, where given) in place of its grids' own."""
    base = dict(spec.get("base", {}))
    for key, value in TINY_BASE.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    base["data"] = {**base.get("data", {}), "data": corpora[0]["out"]}
    if base.get("decode_data"):
        base["decode_data"] = corpora[0]["out"]
    grids = spec.get("grid", [])
    tiny_grids = []
    for grid in grids if isinstance(grids, list) else [grids]:
        grid = dict(grid)
        if "seed" in grid:
            grid["seed"] = [0, 1]
        if "data.data" in grid:
            grid["data.data"] = [c["out"] for c in corpora]
        if ranks is not None and "ranks" in grid:
            grid["ranks"] = ranks
        tiny_grids.append(grid)
    return {"corpus": corpora, "base": base, "grid": tiny_grids}


def tiny_experiments(source: Path, dest: Path) -> Path:
    """Write DEST/{paper,regime,explain}.toml: SOURCE's grids with seeds 0 and 1, on tiny corpora
    under DEST, with TINY_BASE over SOURCE's base; return DEST."""
    require_writable(dest, "--out", "the tiny experiments' directory")
    dest.mkdir(parents=True, exist_ok=True)
    names = ("paper", "regime") + (("explain",) if (source / "explain.toml").is_file() else ())
    for name in names:
        spec = tomllib.loads((source / f"{name}.toml").read_text(encoding="utf-8"))
        data = "paper" if name == "explain" else name  # explain.toml trains on paper.toml's corpus
        corpora = [{"out": str((dest / f"{data}-{i}").resolve()), "hours": h, "dev_hours": d,
                    "test_hours": t} for i, (h, d, t) in enumerate(TINY_HOURS[data])]
        head = (f"# Tiny version of {source / name}.toml "
                "(labavg.studies.reproduction.sweep_files.tiny_experiments)\n\n")
        text = tomli_w.dumps(tiny_sweep(spec, corpora, TINY_RANKS.get(name)))
        atomic_write_text(dest / f"{name}.toml", head + text)
    return dest
