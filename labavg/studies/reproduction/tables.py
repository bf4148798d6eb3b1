"""How the reproduction's report writes numbers and tables: means over seeds, intervals, shares,
and GitHub pipe tables (tabulate)."""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Sequence

from tabulate import tabulate

from labavg.studies.reproduction.verdicts import Spread


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A GitHub pipe table, as lines; cells are written as given (str), never parsed as numbers,
    so "0.10" and "1,234" stay as the report formatted them."""
    cells = [[str(cell) for cell in row] for row in rows]
    return tabulate(cells, headers=list(header), tablefmt="github",
                    disable_numparse=True).splitlines()


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def mean_sd(s: Spread | None, digits: int = 2) -> str:
    if s is None:
        return "-"
    return num(s.mean, digits) if s.n == 1 else f"{s.mean:.{digits}f} ± {s.sd:.{digits}f}"


def interval(s: Spread | None, digits: int = 2, sign: bool = True) -> str:
    """"+m [+lo, +hi]", or "+m (1 seed)"."""
    if s is None:
        return "-"
    fmt = f"{{:+.{digits}f}}" if sign else f"{{:.{digits}f}}"
    if s.n < 2:
        return fmt.format(s.mean) + " (1 seed)"
    return f"{fmt.format(s.mean)} [{fmt.format(s.low)}, {fmt.format(s.high)}]"


def percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f} %"


def words(items: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    if len(items) < 3:
        return " and ".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def wer_interval_of(runs: dict) -> str:
    """The test-set 95 % interval of WER (bootstrap over utterances) of runs by seed, averaged
    over the seeds."""
    cis = [r.summary.wer_ci for r in runs.values() if r.summary.wer_ci]
    if not cis:
        return "-"
    return f"{statistics.fmean(c[0] for c in cis):.2f}-{statistics.fmean(c[1] for c in cis):.2f}"
