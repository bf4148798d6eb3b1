"""The Live tab's plots, declared: one `LivePlot` per plot, in the order the tab shows them.

A plot names the event type that feeds it (labavg.base.events), the event's x and the
series it takes from each such event, how the ranks are drawn, and its figure. The run's
buffers (dashboard.buffers) and the tab (dashboard.live_view) are made from `LIVE_PLOTS`
alone, so a new live plot is one entry here, e.g. each rank's learning rate:

    LivePlot("lr", MinibatchDone, "step", (Series("lr", "lr", lambda e: e.lr),),
             title="Learning rate per rank", xlabel="step (minibatches)", ylabel="lr"),
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from labavg.base.events import Averaged, CVChecked, EpochDone, Event, MinibatchDone

# How a plot draws the ranks: EACH a curve per rank and their mean (the series' values are
# per rank); MEAN and SUM one curve per series over the ranks; RANK0 rank 0's events only.
# RUN one value of the whole run (the workers present), however many ranks say it.
EACH, MEAN, SUM, RANK0, RUN = "each", "mean", "sum", "rank 0", "run"
# The figure a plot is: streamed bokeh curves (dashboard.plots.StreamedCurves), the accuracy
# plot of the few epochs (redrawn whole), or the speedup plot (fed by the run's speedup, not
# by rows).
CURVES, ACCURACY, SPEEDUP = "curves", "accuracy", "speedup"
# The step plot of the workers present (dashboard.membership.Workers: each change once, not
# one curve per rank; fed by run_started, averaging rounds, member_lost and member_joined).
WORKERS = "workers"
# Streamed curves drawn as steps: each value holds from its x until the next one's (an
# averaging round's K is the K in force up to the next round, not a slope between them).
STEPS = "steps"


@dataclasses.dataclass(frozen=True)
class Series:
    """One quantity an event carries: its rows' column (a prefix with EACH), its label and
    style in the legend, and how to read it off the event."""

    column: str
    label: str
    value: Callable[[Any], float]
    style: dict[str, Any] = dataclasses.field(default_factory=dict)
    # A value the event carries for "not recorded" (an older log's 0), drawn as a gap (NaN)
    # rather than as that value. Not NaN in the rows: the buffers read NaN as a rank not heard.
    gap: float | None = None


@dataclasses.dataclass(frozen=True)
class RunKind:
    """What decides which plots a run shows (dashboard.membership.run_kind reads it from the
    run's config): whether workers may leave and join, and whether K changes during the run."""

    elastic: bool = False
    scheduled: bool = False


@dataclasses.dataclass(frozen=True)
class LivePlot:
    """One live plot: what feeds it and how it is drawn."""

    name: str
    feed: type[Event] | None  # the event type that feeds it (None: not fed by rows)
    x: str  # the rows' x column; the event's field of that name unless `x_of` says otherwise
    series: tuple[Series, ...] = ()
    ranks: str = EACH
    title: str | Callable[[int], str] = ""  # or the title for a run of so many ranks
    xlabel: str = ""
    ylabel: str = ""
    legend: str | None = "top_right"  # where the legend goes; None: no legend
    over: bool = False  # EACH: thick rank curves under a thin dashed mean
    draw: str = CURVES
    x_of: Callable[[Any], float] | None = None
    # Shown for every run (None), only for an elastic one (True: workers leave and join), or
    # only for a run of fixed N (False: the speedup, which an elastic run does not measure).
    elastic: bool | None = None
    # Likewise by averaging.schedule: only for a run whose K changes (True: a schedule that is
    # not constant), only for one of constant K (False), or for both (None).
    scheduled: bool | None = None
    # Drawn on the figure of the plot of this name, not on one of its own: another feed of
    # the same axes (the CV checks inside epochs, on the accuracy plot of the epoch ends).
    onto: str | None = None

    def x_value(self, event: Event) -> float:
        """The event's x in this plot."""
        return self.x_of(event) if self.x_of is not None else getattr(event, self.x)

    def title_for(self, ranks: int) -> str:
        """The title of this plot for a run of `ranks` ranks."""
        return self.title(ranks) if callable(self.title) else self.title

    def shown(self, kind: RunKind) -> bool:
        """Whether the plot is shown for a run of this kind."""
        return all(wanted is None or wanted == is_ for wanted, is_ in
                   ((self.elastic, kind.elastic), (self.scheduled, kind.scheduled)))

    @property
    def per_rank(self) -> bool:
        """Whether the plot has a curve per rank (redrawn for a run of other ranks)."""
        return self.feed is not None and self.ranks == EACH

    def takes(self, event: Event) -> bool:
        """Whether `event` feeds this plot."""
        return type(event) is self.feed and (self.ranks != RANK0 or event.rank == 0)


def _divergence_title(ranks: int) -> str:
    # One rank has nothing to diverge from: its flat zero is said in the title. With more, a
    # plain round gives every rank the same number, the RMS over the ranks (issue 45: no copy
    # of the parameters to measure each rank's own); eager overlap and lossy payloads give each
    # rank its own, so the curves stay per rank.
    return "Divergence: 0 with one rank" if ranks == 1 else "Divergence from the average"


LIVE_PLOTS: tuple[LivePlot, ...] = (
    LivePlot("loss", MinibatchDone, "step", (Series("loss", "loss", lambda e: e.loss),),
             title="Training loss per rank", xlabel="step (minibatches)",
             ylabel="loss (nats/frame)"),
    # averaging.schedule's K at rank 0's rounds (every rank has the same), beside the loss
    # that adacomm follows: each round's K holds up to the next round, so a change is a step.
    LivePlot("k", Averaged, "step",
             (Series("average_every", "K", lambda e: e.average_every,
                     {"color": "#17becf", "line_width": 2.5}, gap=0),),
             ranks=RANK0, title="Averaging interval K", xlabel="step (minibatches)",
             ylabel="K (minibatches)", legend=None, draw=STEPS, scheduled=True),
    LivePlot("divergence", Averaged, "round", (Series("div", "divergence", lambda e: e.divergence),),
             title=_divergence_title, xlabel="averaging round", ylabel="relative RMS distance",
             over=True),
    LivePlot("workers", None, "step", (Series("workers", "workers present", lambda n: n,
                                               {"color": "#8c564b", "line_width": 2.5}),),
             title="Workers present (N)", xlabel="step (minibatches)", ylabel="workers present (N)",
             ranks=RUN, legend=None, draw=WORKERS, elastic=True),
    LivePlot("speedup", None, "ranks", draw=SPEEDUP, elastic=False),
    LivePlot("times", Averaged, "round",
             (Series("compute_s", "compute", lambda e: e.compute_seconds, {"color": "#1f77b4"}),
              Series("comm_s", "communication", lambda e: e.comm_seconds, {"color": "#d62728"})),
             ranks=MEAN, title="Compute vs comm", xlabel="averaging round",
             ylabel="seconds per round", legend="top_left"),
    LivePlot("fps", Averaged, "round",
             (Series("frames_per_s", "all ranks", lambda e: e.frames_per_second, {"color": "#2ca02c"}),),
             ranks=SUM, title="Frames/s (all ranks)", xlabel="averaging round", ylabel="frames/s",
             legend=None),
    LivePlot("cv", EpochDone, "epoch",
             (Series("cv_acc_pct", "CV", lambda e: 100 * e.cv_frame_accuracy),
              Series("train_acc_pct", "train", lambda e: 100 * e.train_frame_accuracy)),
             ranks=RANK0, draw=ACCURACY, x_of=lambda e: e.epoch + 1),
    # `cv_every`'s checks, at the epochs trained so far (the epoch ends' included, at 1, 2..).
    LivePlot("cv_checks", CVChecked, "epochs",
             (Series("cv_check_pct", "CV checks", lambda e: 100 * e.cv_frame_accuracy),),
             ranks=RANK0, draw=ACCURACY, onto="cv"),
)
