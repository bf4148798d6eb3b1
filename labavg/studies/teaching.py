"""The teaching notebooks' sizes, their shared set-up and their measured running times.

Every notebook starts the same way: pick a size, make the built-in corpus once, build the base
configuration the notebook varies. The sizes are named, so a teacher says one word
(`LABAVG_NOTEBOOK_SIZE=class`) instead of editing ten numbers in eight notebooks:

- ``small``: seconds per notebook; what CI executes, and what a 1-core Binder session can afford;
- ``class``: the dashboard's "teaching" preset on the 1 h corpus with 4 workers; every effect
  the notebooks teach is visible, and each notebook's computing takes at most half its slot of
  the 90-minute plan on a 2-core laptop beside a 2-core load (`budget_seconds`, measured by
  ``benchmarks/bench_notebooks.py``, whose figures `banner` prints);
- ``full``: TrainConfig's own defaults (the CLI's run), for a course with more time.

The class and full sizes share one corpus, so runs of the notebooks, the CLI and the dashboard
pair up for a speedup.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from labavg.training.config import TrainConfig, preset_config
from labavg.base.settings import with_overrides
from labavg.base.errors import UserError
from labavg.base.events import EpochDone
from labavg.jobs.run_json import RunSummary

SIZE_VARIABLE = "LABAVG_NOTEBOOK_SIZE"
# Kept because the tests and older instructions say it; it means SIZE_VARIABLE=small.
SMALL_VARIABLE = "LABAVG_NOTEBOOK_SMALL"
DEFAULT_SIZE = "class"
# Minutes of each notebook in the 90-minute plan (notebooks/README.md); 04 and 06 share a slot
# (one is homework), 05 and 09 are homework.
CLASS_PLAN_MINUTES = {"01": 10, "02": 15, "03": 20, "04": 15, "06": 15, "07": 15, "08": 15}
HOMEWORK_MINUTES = 20.0
# How benchmarks/bench_notebooks.py measures: with nothing of its own beside the notebook, and
# beside LOAD_PROCESSES busy processes (a class laptop running a browser, a video call, ...).
CONDITIONS = ("plain", "loaded")
LOAD_PROCESSES = 2
CONDITION_WORDS = {"plain": "alone", "loaded": f"beside a {LOAD_PROCESSES}-core load"}
# The notebooks and the shipped yesno run live in the clone, beside the package: labavg/studies/
# is two levels below the repository root.
REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
TIMINGS_FILE = NOTEBOOKS / "timings.json"
# The part of a real Kaldi egs/yesno run that notebook 01 reads (its README says what and whence).
YESNO = REPO / "examples" / "kaldi-yesno"


@dataclasses.dataclass(frozen=True)
class NotebookSize:
    """One size of the notebooks: the corpus made and the configuration every run starts from."""

    name: str
    hours: float  # training speech of the built-in corpus
    dev_hours: float  # held-out speakers for the acoustic scale
    test_hours: float  # held-out speakers that are scored
    ranks: int  # workers of a notebook's parallel runs
    base: TrainConfig  # what a 1-worker run trains, corpus path aside
    about: str
    preset: str = "defaults"  # the dashboard's preset that trains the same model

    @property
    def small(self) -> bool:
        return self.name == "small"

    def describe(self) -> str:
        m = self.base.model
        return (f"{self.hours:g} h corpus, {m.hidden_layers} x {m.hidden_dim} {m.nonlinearity}, "
                f"{self.base.epochs} epoch(s), {OPTIMIZER_LABELS[self.base.optimizer]}, "
                f"{self.ranks} workers")


# What each optimizer setting means, for labels that say what ran.
OPTIMIZER_LABELS = {"ngsgd": "NG-SGD", "sgd": "plain SGD"}
# One colour per optimizer in every figure, by its label (NG-SGD was blue in one plot, red in the next).
OPTIMIZER_COLORS = {"plain SGD": "#1f77b4", "NG-SGD": "#d62728"}


def _tiny() -> TrainConfig:
    return with_overrides(TrainConfig(), {
        "model.hidden_layers": 1, "model.hidden_dim": 32, "epochs": 1, "minibatch": 64,
        "data.context": 2, "data.buffer_frames": 2048})


SIZES: dict[str, NotebookSize] = {
    "small": NotebookSize("small", 0.02, 0.01, 0.02, 2, _tiny(),
                          "seconds per notebook; the numbers mean little (CI, Binder)"),
    "class": NotebookSize("class", 1.0, 0.1, 0.5, 4, preset_config("teaching"),
                          "the dashboard's teaching preset; half its class slot per notebook on 2 cores",
                          preset="teaching"),
    "full": NotebookSize("full", 1.0, 0.1, 0.5, 4, TrainConfig(),
                         "the CLI's defaults: a 4 x 512 model, several times the class size's time"),
}


def size_name(environ: Mapping[str, str] | None = None) -> str:
    """The size the environment asks for: LABAVG_NOTEBOOK_SIZE, or "small" when only
    LABAVG_NOTEBOOK_SMALL=1 is set, else the class size."""
    env = os.environ if environ is None else environ
    name = env.get(SIZE_VARIABLE, "").strip()
    if not name:
        return "small" if env.get(SMALL_VARIABLE) == "1" else DEFAULT_SIZE
    if name not in SIZES:
        raise UserError(f"{SIZE_VARIABLE}={name!r} is not a notebook size; choose one of "
                        f"{', '.join(SIZES)}")
    return name


def notebook_size(name: str | None = None) -> NotebookSize:
    """The size called `name` (the environment's when None)."""
    name = size_name() if name is None else name
    if name not in SIZES:
        raise UserError(f"unknown notebook size {name!r}; choose one of {', '.join(SIZES)}")
    return SIZES[name]


def corpus_dir(work: Path, size: NotebookSize) -> Path:
    return Path(work) / f"corpus-{size.hours:g}h"


def base_config(work: str | os.PathLike, size: NotebookSize) -> TrainConfig:
    """The size's 1-worker configuration on its corpus under `work`, making the corpus the first
    time (every notebook calls this, so any one of them can be run first)."""
    from labavg.data.synth import synthesize

    work = Path(work)
    corpus = corpus_dir(work, size)
    if not (corpus / "test" / "feats.scp").exists():
        # the training files are the same with or without the dev and test sets
        synthesize(corpus, hours=size.hours, seed=0, dev_hours=size.dev_hours,
                   test_hours=size.test_hours, overwrite=True)
    data = dataclasses.replace(size.base.data, data=str(corpus.resolve()))
    # Validated where a run starts (start_run), not here as well.
    return dataclasses.replace(size.base, out=str(work / "runs" / "base"), ranks=1,
                               backend="inproc", data=data, tensorboard=False)


def epoch_line(event: EpochDone, epochs: int) -> str:
    """One printed line per epoch, in place of progress bars (which an exported notebook shows
    on stderr's red background)."""
    return (f"epoch {event.epoch + 1} of {epochs}: CV frame accuracy "
            f"{100 * event.cv_frame_accuracy:.2f} %, learning rate {event.lr:.3g} at its end, "
            f"{event.seconds:.0f} s")


def train(cfg: TrainConfig, **start: Any) -> RunSummary:
    """Train `cfg` through the one door (`start_run`, keywords passed on), printing a line per
    epoch, and return its summary; a finished run in `cfg.out` is read instead (a notebook
    rerun trains nothing twice)."""
    from labavg.jobs.launch import start_run
    from labavg.jobs.summary import load_summary

    if (Path(cfg.out) / "summary.json").is_file():
        return load_summary(cfg.out)
    run = start_run(cfg, **start)
    for event in run.events():
        if isinstance(event, EpochDone) and event.rank == 0:
            print(epoch_line(event, cfg.epochs), flush=True)
    return run.result()


def lr_words(cfg: TrainConfig) -> str:
    """The learning rate and its schedule in words, not "lr 0.008 -> 8e-05"."""
    rate = f"learning rate {_plain(cfg.lr)} per frame"
    if cfg.ranks > 1 and cfg.lr_scaling == "linear":
        rate += f" (x {cfg.ranks} workers: {_plain(cfg.lr * cfg.ranks)})"
    if cfg.schedule == "exponential":
        return f"{rate}, decaying to {_plain(cfg.final_learning_rate())}"
    return f"{rate}, {cfg.schedule} schedule"


def _plain(x: float) -> str:
    """A rate as a decimal a class reads aloud (0.00008, not 8e-05)."""
    return f"{x:.10f}".rstrip("0").rstrip(".") if x >= 1e-8 else f"{x:g}"


def read_timings(path: Path = TIMINGS_FILE) -> dict[str, Any]:
    """benchmarks/bench_notebooks.py's last measurements ({} when it was never run)."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}


def _number(notebook: str) -> str:
    return notebook.split("-")[0]


def slot_minutes(notebook: str) -> float:
    """The notebook's minutes in the 90-minute plan (notebooks/README.md); homework's own."""
    return CLASS_PLAN_MINUTES.get(_number(notebook), HOMEWORK_MINUTES)


def budget_seconds(notebook: str) -> float:
    """Computing a notebook may take under a 2-core load: half its slot, the rest is teaching."""
    return 60.0 * slot_minutes(notebook) / 2


def measurement(size: str, condition: str, timings: dict[str, Any] | None = None) -> dict[str, Any]:
    """One benchmark run's record at `size`, `condition` one of CONDITIONS ({} if none)."""
    timings = read_timings() if timings is None else timings
    return timings.get("sizes", {}).get(size, {}).get(condition, {})


def expected_seconds(notebook: str, size: str, timings: dict[str, Any] | None = None,
                     condition: str = "plain") -> float | None:
    """Measured seconds of `notebook` (its number, "03", or its file stem) at `size`."""
    measured = measurement(size, condition, timings).get("notebooks", {})
    for stem, seconds in measured.items():
        if stem == notebook or _number(stem) == notebook:
            return float(seconds)
    return None


def timing_problems(stems: list[str], timings: dict[str, Any] | None = None,
                    size: str = "class") -> list[str]:
    """What keeps the measured times from vouching for the plan: a notebook not measured in
    each condition, or over its budget under the load. Empty when the plan fits."""
    timings = read_timings() if timings is None else timings
    problems = []
    for stem in stems:
        for condition in CONDITIONS:
            seconds = expected_seconds(stem, size, timings, condition)
            if seconds is None:
                problems.append(f"{stem}: not measured at the {size} size "
                                f"{CONDITION_WORDS[condition]}")
            elif seconds > budget_seconds(stem):
                problems.append(f"{stem}: {seconds:.0f} s {CONDITION_WORDS[condition]}, over its "
                                f"budget of {budget_seconds(stem):.0f} s (half its "
                                f"{slot_minutes(stem):g}-minute slot)")
    return problems


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def banner(notebook: str, size: NotebookSize, timings: dict[str, Any] | None = None) -> str:
    """The notebook's first printed lines: which size runs, and how long it took when measured,
    alone and beside a 2-core load."""
    timings = read_timings() if timings is None else timings
    lines = [f"Size {size.name!r}: {size.describe()} ({size.about})."]
    plain = expected_seconds(notebook, size.name, timings, "plain")
    loaded = expected_seconds(notebook, size.name, timings, "loaded")
    if plain is None:
        lines.append("Expected time: not measured at this size (benchmarks/bench_notebooks.py).")
    else:
        record = measurement(size.name, "plain", timings)
        # a notebook measured again alone (benchmarks/bench_notebooks.py --only) has its own date
        record = next((r for stem, r in record.get("remeasured", {}).items()
                       if notebook in (stem, _number(stem))), record)
        when = f" (measured {record['date']})" if record.get("date") else ""
        also = f", about {_minutes(loaded)} {CONDITION_WORDS['loaded']}" if loaded is not None else ""
        lines.append(f"Expected time: about {_minutes(plain)} on {timings.get('machine', 'this machine')}"
                     f"{also}{when}; a later run reuses finished runs.")
    others = [n for n in SIZES if n != size.name]
    lines.append(f"Other sizes: {SIZE_VARIABLE}={' or '.join(others)} before starting Jupyter.")
    return "\n".join(lines)


def load_plotting(panel: bool = False) -> None:
    """HoloViews objects shown in a notebook as PNG images (its matplotlib backend): an image
    shrinks to the notebook's width (a row of three plots is never cut, whatever the window and
    the side panels), needs no JavaScript (a class without internet, an exported HTML file) and
    weighs tens of kilobytes where each bokeh plot carried its own JavaScript and data. No
    `hv.extension`: its loader asks a CDN for bokeh's JavaScript even for images. Panel only
    when asked (notebook 03's widgets), with its JavaScript and stylesheets inline.

    The notebooks' sizes and tools are bokeh's options (`width=`, `tools=`): they stay valid
    for the interactive dashboard and are set aside for the images, without a warning each."""
    import logging

    import holoviews as hv
    import holoviews.plotting.bokeh  # noqa: F401 - its option names stay valid
    import holoviews.plotting.mpl  # noqa: F401 - the images' backend

    if panel:
        import panel as pn

        pn.extension(inline=True)
    hv.Store.set_current_backend("matplotlib")
    # wider than matplotlib's square, for curves over steps; no A, B, C on a row's plots
    wide = {"aspect": 1.6, "show_grid": True}
    hv.opts.defaults(*(getattr(hv.opts, kind)(**wide) for kind in
                       ("Curve", "Scatter", "Bars", "ErrorBars", "Labels", "Overlay", "NdOverlay")),
                     hv.opts.Layout(sublabel_format="", hspace=0.35), backend="matplotlib")
    logger = logging.getLogger("param.main")  # where HoloViews' option warnings are logged
    if not any(isinstance(f, _OtherBackendsOptions) for f in logger.filters):
        logger.addFilter(_OtherBackendsOptions())
    shell = _shell()
    if shell is not None:
        renderer = hv.renderer("matplotlib").instance(dpi=DPI, size=SIZE_PERCENT, fig="png")
        shell.display_formatter.formatters["image/png"].for_type(
            hv.core.Dimensioned, lambda obj: renderer(obj, fmt="png")[0])
    show_user_errors_in_one_line()


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


DPI = 90
SIZE_PERCENT = 130  # of matplotlib's size: a plot about 550 px wide, a row of three about 1600


class _OtherBackendsOptions:
    """Drops HoloViews' warning that an option belongs to bokeh, not to the images' backend."""

    def filter(self, record) -> bool:
        return "Option only applies to following backends" not in record.getMessage()


# MathJax 2 as nbconvert's template loads it, from a local copy:
MATHJAX_CONFIG = "?config=TeX-AMS-MML_HTMLorMML-full,Safe"  # the configs the package ships


def offline_html_exporter(out_dir: str | os.PathLike | None = None):
    """nbconvert's HTMLExporter with no script from a CDN, so an exported notebook opens and
    typesets its equations without internet: MathJax from the jupyter-server-mathjax package
    (copied to OUT_DIR/mathjax/ when `out_dir` is given, so the folder can be handed out; else
    referenced where it is installed), and no require.js or mermaid (bokeh's inline
    JavaScript needs neither)."""
    import shutil

    import jupyter_server_mathjax
    from nbconvert import HTMLExporter

    mathjax = Path(jupyter_server_mathjax.__file__).parent / "static"
    if out_dir is None:
        url = (mathjax / "MathJax.js").as_uri()
    else:
        copy = Path(out_dir) / "mathjax"
        if not (copy / "MathJax.js").is_file():
            shutil.copytree(mathjax, copy, dirs_exist_ok=True)
        url = "mathjax/MathJax.js"
    return HTMLExporter(mathjax_url=url + MATHJAX_CONFIG, require_js_url="", mermaid_js_url="",
                        mermaid_layout_elk_js_url="")


def show_user_errors_in_one_line() -> None:
    """In IPython, a UserError (a bad value, engines already shut down) prints its one line
    instead of a traceback, as the CLI does: a class rerunning a cell after Run All reads
    what to do, not forty lines of someone else's stack."""
    shell = _shell()
    if shell is None:
        return

    def one_line(shell, etype, value, tb, tb_offset=None):
        print(f"{etype.__name__}: {value}")

    shell.set_custom_exc((UserError,), one_line)
