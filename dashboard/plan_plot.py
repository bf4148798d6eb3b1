"""The Plan tab's plot: `labavg plan`'s rows at one N, predicted speedup against predicted
accuracy change, one curve per averaging method across K.

At one N the speedup barely moves with K (a few per cent) while the accuracy change moves by
points, so each method's curve runs sideways through its Ks, labelled at each point, and the
three methods sit apart: the trade read off the plot is "how much accuracy does a larger K (or
another method) cost for how little speed". Curves per K across the three methods would be
eight three-point curves with no order along them.
"""

from __future__ import annotations

from typing import Any, Sequence

import holoviews as hv
import pandas as pd

from dashboard.plots import _PALETTE, _plot_opts
from labavg.studies.plan import PlanRow

# Each method's colour and what its legend entry says.
METHOD_STYLE = {"model": (_PALETTE[0], "model: plain averaging"),
                "bmuf": (_PALETTE[1], "bmuf: block momentum"),
                "diloco": (_PALETTE[2], "diloco: outer Nesterov")}
PLAN_PLOT_HEIGHT = 380
STAR = "recommended"
X_LABEL = "predicted CV frame accuracy change vs 1 worker (points, − = lost)"
Y_LABEL = "predicted speedup (× 1 worker)"
# What hover calls each column.
_DIMS = {"acc_change": "accuracy change (points)", "speedup": "speedup (×)", "K": "K",
         "method": "method", "acc_sd": "accuracy ± (sd)", "speedup_sd": "speedup ±",
         "mb": "MB / worker / epoch", "extrapolated": "outside the fits"}


def _dim(name: str) -> hv.Dimension:
    return hv.Dimension(name, label=_DIMS[name])


def plan_frame(rows: Sequence[PlanRow]) -> pd.DataFrame:
    """The rows as the plot's columns (one per row, K ascending within a method)."""
    frame = pd.DataFrame([{
        "method": r.method, "K": r.K, "speedup": r.speedup, "speedup_sd": r.speedup_sd,
        "acc_change": r.acc_change, "acc_sd": r.acc_sd, "mb": r.bytes_per_epoch / 1e6,
        "extrapolated": "; ".join(r.extrapolated)} for r in rows],
        columns=["method", "K", "speedup", "speedup_sd", "acc_change", "acc_sd", "mb",
                 "extrapolated"])
    return frame.sort_values(["method", "K"], kind="stable").reset_index(drop=True)


def _method_style(method: str, index: int) -> tuple[str, str]:
    return METHOD_STYLE.get(method, (_PALETTE[(3 + index) % len(_PALETTE)], method))


def plan_plot(rows: Sequence[PlanRow], best: PlanRow | None, budget: float | None,
              title: str) -> hv.Overlay:
    """One curve per method across K with its points (hollow grey where the prediction leaves
    what the fits saw, the reason on hover), each point labelled by K, the accuracy's ± sd and
    the speedup's ± as error bars, the budget as a dashed line and the recommended row as a
    star."""
    frame = plan_frame(rows)
    hover = [_dim(c) for c in ("speedup", "K", "method", "speedup_sd", "acc_sd", "mb",
                               "extrapolated")]
    layers: list[Any] = []
    if budget is not None:
        layers.append(hv.VLine(-budget).opts(color="gray", line_dash="dashed", line_width=1))
    for index, (method, group) in enumerate(frame.groupby("method", sort=False)):
        color, label = _method_style(method, index)
        bars = dict(color=color, alpha=0.3, lower_head=None, upper_head=None)
        layers.append(hv.ErrorBars(group, _dim("acc_change"), [_dim("speedup"), "acc_sd"],
                                   horizontal=True).opts(**bars))
        layers.append(hv.ErrorBars(group, _dim("acc_change"), [_dim("speedup"), "speedup_sd"]
                                   ).opts(**bars))
        layers.append(hv.Curve(group, _dim("acc_change"), _dim("speedup"), label=label).opts(
            color=color, line_width=2))
        covered = group[group["extrapolated"] == ""]
        layers.append(hv.Scatter(covered, _dim("acc_change"), hover, label=label).opts(
            color=color, size=8, tools=["hover"]))
    outside = frame[frame["extrapolated"] != ""]
    if len(outside):
        layers.append(hv.Scatter(outside, _dim("acc_change"), hover,
                                 label="outside the fits (hover: why)").opts(
            color="white", line_color="gray", line_width=1.5, size=8, tools=["hover"]))
    layers += _k_labels(frame)
    if best is not None:
        star = pd.DataFrame([{"acc_change": best.acc_change, "speedup": best.speedup,
                              "K": best.K, "method": best.method}])
        layers.append(hv.Scatter(star, _dim("acc_change"), [_dim("speedup"), _dim("K"),
                                                             _dim("method")], label=STAR).opts(
            marker="star", size=22, color="gold", line_color="black", tools=["hover"]))
    # Legend bottom left: low speedup and lost accuracy, where no point the front keeps lies
    # (speedup rises with K and accuracy falls, so each curve runs from bottom right to top left).
    opts = _plot_opts(title, X_LABEL, Y_LABEL, legend_position="bottom_left", padding=0.08)
    return hv.Overlay(layers).opts(**{**opts, "height": PLAN_PLOT_HEIGHT})


# Where each method's K labels sit: plain averaging's above its points, BMUF's to the right,
# DiLoCo's to the left. BMUF's and DiLoCo's points at one K lie close together, and labels on
# the same side wrote over each other.
_LABEL_SIDE = {"model": "above", "bmuf": "right", "diloco": "left"}


def _k_labels(frame: pd.DataFrame) -> list[hv.Labels]:
    """Each point's K (the number only, to collide less), one layer per method."""
    if not len(frame):
        return []
    dx = 0.02 * (float(frame["acc_change"].max() - frame["acc_change"].min()) or 1.0)
    dy = 0.02 * (float(frame["speedup"].max() - frame["speedup"].min())
                 or float(frame["speedup"].max()) or 1.0)
    side = {"above": dict(yoffset=dy, text_baseline="bottom", text_align="center"),
            "right": dict(xoffset=dx, text_baseline="middle", text_align="left"),
            "left": dict(xoffset=-dx, text_baseline="middle", text_align="right")}
    return [hv.Labels(group.assign(label=group["K"].astype(str)),
                      [_dim("acc_change"), _dim("speedup")], "label").opts(
                text_font_size="8pt", text_color="#333333",
                **side[_LABEL_SIDE.get(method, "above")])
            for method, group in frame.groupby("method", sort=False)]
