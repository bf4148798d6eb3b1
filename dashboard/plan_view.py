"""The Plan tab: `labavg plan`'s computation (labavg.studies.plan) behind widgets, before any
training: for N workers on a network, each averaging method's predicted speedup against its
predicted accuracy change across K, the fastest row within an accuracy budget marked, and a
button that trains that row here at the class size, so that a student checks one prediction
against a run.

The accuracy model is fitted once per server process (`fitted_accuracy`, Panel's per-process
cache); a page's costs are read once per source. Moving a widget recomputes the rows (a few
milliseconds) and redraws one plot.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import panel as pn
import param

from dashboard.plan_plot import plan_plot
from dashboard.plots import load_backend
from dashboard.runs_table import RunTable
from dashboard.settings import RunSettings
from dashboard.speedup import machine_cores
from labavg.base.errors import UserError, one_line
from labavg.studies.costmodel import MeasuredCosts
from labavg.studies.plan import (DEFAULT_KS, METHODS, NETWORKS, PlanRow, measured_costs, plan,
                                 recommend, speed_error)
from labavg.studies.plan_accuracy import MAP_K, AccuracyModel, accuracy_model
from labavg.studies.teaching import SIZES

RESULTS = Path(__file__).resolve().parents[1] / "experiments" / "reproduction-results.jsonl"
RANK_CHOICES = (2, 4, 8, 16, 32, 64)
RECORDED = "the reproduction's recorded run (MPI, 1 rank)"
CLASS_PRESET = SIZES["class"].preset  # the notebooks' class size: the "teaching" preset
CACHE_KEY = "labavg-plan-accuracy"
_ERROR_STYLE = {"color": "#b00020", "font-size": "0.85em"}


def fitted_accuracy(results: Path = RESULTS) -> AccuracyModel:
    """The accuracy model of `results`, fitted once per server process."""
    return pn.state.as_cached(CACHE_KEY, accuracy_model, results=Path(results))


def number_of(text: str, what: str, *, positive: bool = False) -> float:
    """The number typed as `text`, or UserError in the widget's words."""
    text = (text or "").strip()
    try:
        value = float(text)
    except ValueError:
        hint = f" (with a decimal point: {text.replace(',', '.')})" if "," in text else ""
        raise UserError(f"{what} must be a number; got {text!r}{hint}") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise UserError(f"{what} must be {'> 0' if positive else '>= 0'}; got {text}")
    return value


class PlanView(pn.viewable.Viewer):
    """The plan's widgets, its rows at the chosen N, the recommendation and its plot."""

    ranks = param.Selector(default=16, objects=list(RANK_CHOICES), label="N workers")
    network = param.Selector(default="10gbe", objects={n.name: k for k, n in NETWORKS.items()},
                             label="network")
    # 2 points: at the default N = 16 the fits cover a point within it (BMUF, K = 10), so a
    # first look shows a recommendation rather than "raise the budget".
    budget = param.String(default="2", label="accuracy budget (points lost at most)")
    epochs = param.String(default="1", label="epochs")
    costs = param.Selector(default=RECORDED, objects=[RECORDED], label="costs from")
    errors = param.Dict(default={}, doc="what is wrong, by widget name; empty when it plans")
    rows = param.List(default=[], doc="the PlanRows at N, every K and method")
    best = param.ClassSelector(class_=PlanRow, default=None, allow_None=True,
                               doc="the fastest row at N within the budget")
    overall = param.ClassSelector(class_=PlanRow, default=None, allow_None=True,
                                  doc="the fastest row within the budget at any N offered")
    source = param.String(default="", doc="where the costs come from, in words")
    train_text = param.String(default="", doc="what the train button did, or why it did not")

    def __init__(self, table: RunTable | None = None, settings: RunSettings | None = None,
                 live: Any = None, results: Path = RESULTS, **params: Any) -> None:
        super().__init__(**params)
        load_backend()
        self.table, self.settings, self.live, self.results = table, settings, live, Path(results)
        self.show_live: Callable[[], None] | None = None  # the page's "go to the Live tab"
        self.cores = machine_cores()
        self._costs: dict[str, tuple[MeasuredCosts, float, str]] = {}
        if table is not None:
            pn.bind(self._offer_runs, table.param.rows, watch=True)
            self._offer_runs(table.rows)
        self._compute()

    # ------------------------------------------------------------------ state

    def _offer_runs(self, rows: list[dict[str, Any]]) -> None:
        """The finished runs of the table as sources of costs (a run gone keeps the choice
        only while it is listed)."""
        names = [r["run"] for r in rows if r.get("status") == "finished"]
        self.param.costs.objects = [RECORDED, *names]
        if self.costs not in self.param.costs.objects:
            self.costs = RECORDED

    def _measured(self, name: str) -> tuple[MeasuredCosts, float, str]:
        if name not in self._costs:
            if name == RECORDED or self.table is None:
                # The same file for every page: read once per server process.
                self._costs[name] = pn.state.as_cached(CACHE_KEY + "-costs", measured_costs,
                                                       run_dir=None, results=self.results)
            else:
                run_dir = Path(self.table.runs_dir).expanduser() / name
                self._costs[name] = measured_costs(run_dir, self.results)
        return self._costs[name]

    @param.depends("costs", watch=True)
    def _on_costs(self) -> None:
        # A run's own epochs are what its costs and updates per worker were measured at.
        try:
            self.epochs = f"{self._measured(self.costs)[1]:g}"
        except UserError:
            pass  # said beside the costs box by _compute

    @param.depends("ranks", "network", "budget", "epochs", "costs", watch=True)
    def _compute(self) -> None:
        errors: dict[str, str] = {}
        budget = epochs = None
        try:
            budget = number_of(self.budget, "accuracy budget")
        except UserError as exc:
            errors["budget"] = str(exc)
        try:
            epochs = number_of(self.epochs, "epochs", positive=True)
        except UserError as exc:
            errors["epochs"] = str(exc)
        try:
            measured, _, source = self._measured(self.costs)
            accuracy = fitted_accuracy(self.results)
        except UserError as exc:
            errors["costs"] = one_line(exc)
        if "epochs" not in errors and "costs" not in errors:
            every = plan(measured, accuracy, NETWORKS[self.network], ranks=RANK_CHOICES,
                         Ks=DEFAULT_KS, methods=METHODS, epochs=epochs)
            self.source = source.replace(str(self.results), self.results.name)
            self.rows = [r for r in every if r.ranks == self.ranks]
            within = [r for r in every if r.ranks <= self.ranks]
            self.overall = None if budget is None else recommend(within, budget)
        self.best = None if errors or budget is None else recommend(self.rows, budget)
        self.errors = errors

    def figure(self) -> Any:
        """The plot of the rows at N, the budget and the recommended row (drawn when the tab
        is shown: a page that never opens it never pays for it)."""
        try:
            budget = number_of(self.budget, "accuracy budget")
        except UserError:
            budget = None
        return plan_plot(self.rows, self.best, budget, self._title())

    def _drawn_from(self) -> tuple[Any, ...]:
        return self.param.rows, self.param.best, self.param.errors, self.param.budget

    def _title(self) -> str:
        name = next(label for label, key in self.param.network.objects.items()
                    if key == self.network)
        return f"N = {self.ranks} machines on {name}: each method across K (the numbers)"

    # ------------------------------------------------------------------ text

    def recommendation_text(self) -> str:
        """The recommended row in words (or why there is none)."""
        if self.errors:
            return "_Fix the value marked on the left to plan._"
        best, budget = self.best, self.budget.strip()
        if best is None:
            return (f"**No (K, method) at N = {self.ranks} is predicted to lose at most {budget} "
                    "points**: raise the budget or book fewer workers.")
        text = (f"★ **Recommended at N = {best.ranks}: K = {best.K}, {best.method}**: speedup "
                f"{best.speedup:.2f} ± {best.speedup_sd:.2f}, CV frame accuracy "
                f"{best.acc_change:+.2f} ± {best.acc_sd:.2f} points against one worker, "
                f"{best.bytes_per_epoch / 1e6:,.1f} MB per worker per epoch.")
        if best.extrapolated:
            text += " It lies outside what the fits saw: " + "; ".join(best.extrapolated) + "."
        return text

    def overall_text(self) -> str:
        """The fastest row within the budget with at most N workers: which N to book."""
        o = self.overall
        if self.errors or o is None:
            return ""
        if self.best is not None and o.ranks == self.best.ranks:
            return ("" if self.ranks == RANK_CHOICES[0] else
                    f"No smaller N does better within the budget (N = 2-{self.ranks}).")
        return (f"Over N = 2-{self.ranks}, the plan's pick (the fastest within the budget, among the "
                f"points the fits cover) is N = {o.ranks}, K = {o.K}, {o.method} "
                f"(speedup {o.speedup:.2f}, {o.acc_change:+.2f} points).")

    def explanation(self) -> str:
        """What the prediction rests on, from the fits themselves."""
        acc = fitted_accuracy(self.results)
        regime = acc.regime
        k_term = (f"K's effect, {acc.k_term.slope:+.2f} points per doubling of K from "
                  f"K = {MAP_K} (± {acc.k_term.residual_sd:.2f}, {acc.k_term.points} pairs)"
                  if acc.k_term is not None else "no fit of K's effect")
        methods = ", ".join(f"{m} ± {line.residual_sd:.2f} ({line.points} pairs at N = "
                            f"{', '.join(map(str, acc.method_ranks.get(m, ())))})"
                            for m, line in acc.methods.items())
        return (
            "**What this rests on.** It is a prediction, not a measurement. The *speedup* is "
            "the cost model (docs/cost-model.md) on the costs of "
            f"{self.source or 'the chosen run'}, for N machines of one worker each; its ± is the "
            "model's largest leave-one-out error on the paper's timing table "
            f"({100 * speed_error():.1f} %). The *accuracy change* against one worker adds three "
            "fits to the runs recorded in experiments/reproduction-results.jsonl: the regime "
            f"line, {regime.intercept:+.2f} {regime.slope:+.2f} × log2 N / √(updates per "
            f"worker) points at K = {MAP_K} (residual sd {regime.residual_sd:.2f}, {regime.points} "
            f"points, N = {acc.ranks_seen[0]}-{acc.ranks_seen[1]}); {k_term}; and each "
            f"method's offset from plain averaging: {methods or 'none measured'}. The ± adds "
            "their residual spreads. Hollow grey points leave what a fit saw (hover for "
            "which) and are never recommended; the dashed line is the budget; the star is the "
            "fastest point within it among the points the fits cover.")

    def machine_text(self) -> str:
        """What a run here can and cannot check."""
        return (f"**Trained here**, the N workers share this machine's {self.cores} cores: the "
                "speedup will not be the plan's for N machines (at most "
                f"{self.cores}×). The accuracy change is what to compare, against a 1-worker "
                f"run of the same size (the `{CLASS_PRESET}` preset). The prediction is for the "
                "corpus and epochs of its costs: take the costs from a finished 1-rank run of "
                "the class size (the Runs table) for a like-for-like check.")

    # ------------------------------------------------------------------ training

    def can_train(self) -> bool:
        return (self.settings is not None and self.live is not None and not self.errors
                and self.best is not None and not self.live.running)

    def train(self) -> bool:
        """Put the recommended N, K and method into the sidebar at the class size and start
        it as the sidebar's Start does (`LiveRun.start`: a job, never this process)."""
        best = self.best
        if best is None or self.errors or self.settings is None or self.live is None:
            self.train_text = "**Nothing to train:** no recommended point."
            return False
        settings = self.settings
        settings.preset = CLASS_PRESET
        settings.param.trigger("preset")  # the class size again, even if boxes changed since
        settings.param.update(ranks=best.ranks, average_every=best.K, averaging=best.method)
        problem = settings.first_error()
        if problem is not None:
            self.train_text = f"**Cannot start:** {problem}".replace("_", "\\_")
            return False
        started = self.live.start(settings)
        what = f"N = {best.ranks}, K = {best.K}, {best.method}, the {CLASS_PRESET} preset"
        self.train_text = (f"**Started {what}**: {self.live.status}" if started
                           else f"**Not started:** {self.live.status}")
        if started and self.show_live is not None:
            self.show_live()
        return started

    # ------------------------------------------------------------------ the page

    def _widgets(self) -> pn.Column:
        def boxed(name: str) -> pn.Column:
            box = pn.widgets.TextInput(label=self.param[name].label, value=getattr(self, name),
                                       sizing_mode="stretch_width")
            # Judged as typed, not when the box loses focus; the box is written back only with
            # a value it does not say (another run's epochs): echoing each keystroke back
            # overwrote what was typed after it on a slow server.
            pn.bind(lambda text: setattr(self, name, text), box.param.value_input, watch=True)

            def follow(value: str) -> None:
                if value != box.value_input:
                    box.param.update(value=value, value_input=value)

            pn.bind(follow, self.param[name], watch=True)
            message = pn.pane.Markdown(pn.bind(lambda e: e.get(name, ""), self.param.errors),
                                       visible=pn.bind(lambda e: name in e, self.param.errors),
                                       styles=_ERROR_STYLE, margin=(0, 10),
                                       css_classes=["labavg-error"], sizing_mode="stretch_width")
            return pn.Column(box, message, margin=0, sizing_mode="stretch_width")

        costs = pn.widgets.Select.from_param(self.param.costs, sizing_mode="stretch_width")
        costs_error = pn.pane.Markdown(pn.bind(lambda e: e.get("costs", ""), self.param.errors),
                                       visible=pn.bind(lambda e: "costs" in e, self.param.errors),
                                       styles=_ERROR_STYLE, margin=(0, 10))
        button = pn.widgets.Button(
            label="Train the recommended point here", color="primary",
            sizing_mode="stretch_width",
            disabled=pn.bind(lambda *_: not self.can_train(), self.param.errors, self.param.best,
                             *([self.live.param.running] if self.live is not None else [])))
        button.on_click(lambda _: self.train())
        return pn.Column(
            pn.widgets.DiscreteSlider.from_param(self.param.ranks, sizing_mode="stretch_width"),
            pn.widgets.Select.from_param(self.param.network, sizing_mode="stretch_width"),
            boxed("budget"), boxed("epochs"), costs, costs_error, button,
            pn.pane.Markdown(self.param.train_text, sizing_mode="stretch_width"),
            width=280, margin=(0, 10, 0, 0))

    def __panel__(self) -> pn.Row:
        """The widgets on the left; the plot, the recommendation and what it rests on."""
        words = pn.pane.Markdown(
            pn.bind(lambda *_: self.recommendation_text() + "  \n" + self.overall_text(),
                    self.param.best, self.param.overall, self.param.errors),
            sizing_mode="stretch_width", margin=(0, 10))
        return pn.Row(
            self._widgets(),
            pn.Column(pn.pane.HoloViews(pn.bind(lambda *_: self.figure(), *self._drawn_from()),
                                        sizing_mode="stretch_width"), words,
                      pn.pane.Markdown(self.machine_text(), margin=(0, 10),
                                       sizing_mode="stretch_width"),
                      pn.pane.Markdown(pn.bind(lambda _: self.explanation(), self.param.source),
                                       margin=(0, 10), sizing_mode="stretch_width",
                                       styles={"font-size": "0.9em"}),
                      sizing_mode="stretch_width"),
            sizing_mode="stretch_width")
