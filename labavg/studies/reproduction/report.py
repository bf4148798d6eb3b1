"""REPRODUCTION.md: the report of the reproduction of Su & Chen (2015), assembled from its parts.

The first screen answers whether the paper holds here (paper_tables, prose); then what was
chosen, the paper's comparisons, the regime map (regime), the real recipe, real speech
(real_speech), the experiments behind each disagreement, the speedup (speedup) and the methods
beyond the paper (beyond).
Running the experiments and writing the file is labavg.studies.reproduction.pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from labavg.studies.reproduction import beyond, elastic, real_speech, regime, schedules
from labavg.studies.reproduction.paper import PROBES, base_settings
from labavg.studies.reproduction.paper_tables import (comparison_sections, headline_table,
                                                      probe_section, schedule_trace, yesno_section)
from labavg.studies.reproduction.prose import (READING, chosen, headline_sentence, provenance,
                                               seeds_per_point)
from labavg.studies.reproduction.results import Run
from labavg.studies.reproduction.speedup import speedup_section
from labavg.studies.reproduction.sweep_files import Experiments

DISCUSSION_MARKER = "<!-- discussion below: kept when the report is regenerated -->"


def _answer(runs: dict[str, list[Run]], base: dict[str, Any]) -> list[str]:
    """The first screen: does the paper hold here? Every comparison under the one rule."""
    paper_runs = runs.get("paper", [])
    fix = beyond.fix_sentence(runs.get("beyond", []))
    return (["# Reproducing Su & Chen (2015) with labavg", "", "## Does the paper hold here?", ""]
            + headline_table(paper_runs, base)
            + ["", headline_sentence(paper_runs, base) + (" " + fix if fix else ""), "", READING,
               ""])


def _explain_section(runs: dict[str, list[Run]], base: dict[str, Any], sweep_file: Path) -> list[str]:
    out = ["## Why the disagreements: experiments", "",
           f"Made by `labavg sweep {sweep_file}` (also run by this command), against the runs "
           f"above; same corpus and base settings, {seeds_per_point(runs['explain'])} seeds per "
           "setting.", ""]
    for probe in PROBES:
        out += probe_section(runs, base, probe) + [""]
    out += ["#### The two schedules epoch by epoch (16 workers, seed 0)", ""]
    return out + schedule_trace(runs.get("paper", []), base)


def render_report(runs: dict[str, list[Run]], experiments: Experiments, *, command: str,
                  seconds: float, figure: Path | None, report: Path,
                  beyond_figure: Path | None = None, yesno: dict[str, Any] | None = None) -> str:
    """REPRODUCTION.md (above the discussion marker) from the finished runs."""
    paper_runs = runs.get("paper", [])
    base = base_settings(paper_runs, experiments.paper)
    points = regime.regime_points(runs.get("regime", []))
    found = regime.variants(runs.get("regime-variables", []), runs.get("regime", []))
    parts = _answer(runs, base) + [provenance(runs, command, seconds), ""]
    parts += ["## What was chosen, and why", ""] + chosen(paper_runs, base) + [""]
    parts += ["## The paper's comparisons", "",
              f"Made by `labavg sweep {experiments.paper}` (also run by this command). WER and "
              "PER in %, lower is better; frame accuracy in %, higher is better.", ""]
    parts += comparison_sections(paper_runs, base) + [""]
    parts += regime.section(points, found, regime.comparison_points(paper_runs, base), figure,
                            report, experiments.regime, experiments.regime_variables)
    if runs.get("yesno"):
        parts += [""] + yesno_section(runs["yesno"], yesno or {}, experiments.yesno)
    if runs.get("asterisk"):
        parts += [""] + real_speech.section(runs["asterisk"], paper_runs, base, experiments.asterisk)
    if runs.get("explain"):
        parts += [""] + _explain_section(runs, base, experiments.explain)
    parts += ["", "## Speedup", ""] + speedup_section(runs.get("mpi", []))
    if runs.get("beyond"):
        parts += [""] + beyond.section(runs["beyond"], experiments.beyond, beyond_figure, report)
    if runs.get("elastic"):
        parts += [""] + elastic.section(runs["elastic"], experiments.elastic)
    if runs.get("schedules"):
        parts += [""] + schedules.section(runs["schedules"], experiments.schedules, figure and
                                          figure.with_name(schedules.FIGURE), report)
    return "\n".join(parts) + "\n"

