"""How the report's figures reach the disk: whole or not at all (a reader of REPRODUCTION.md
or notebook 08 never meets half a PNG while a sweep rewrites it)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def save_png(fig: Any, path: Path) -> Path:
    """Write matplotlib figure `fig` to `path` (through a temporary file), then close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path
