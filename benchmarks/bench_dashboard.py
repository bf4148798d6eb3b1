"""Dashboard update latency at scale: 32 ranks, 5,000 points per curve (never a timed test).

    .venv/bin/python benchmarks/bench_dashboard.py [--ranks 32] [--points 5000] [--ticks 40]
                                                  [--steps-per-tick 20] [--json out.json]

Builds the real state (LiveRun) and plots (LivePlots) and renders them into a bokeh Document
as a served page does, fills every curve to `--points` points, then times the periodic update
(`LiveRun.drain` + `LivePlots.stream`, the page's flush every 500 ms) while synthetic events
arrive: each tick brings `--steps-per-tick` minibatches and averaging rounds from every rank.
The bokeh model changes are made and serialised to the JSON patches a browser would receive,
so the time includes that; the browser's own drawing is not included.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dashboard/ from the checkout

import numpy as np  # noqa: E402
import panel as pn  # noqa: E402
from bokeh.document import Document  # noqa: E402
from bokeh.protocol import Protocol  # noqa: E402

from dashboard.live_view import LivePlots  # noqa: E402
from labavg.base.events import event_from_dict  # noqa: E402
from dashboard.live import LiveRun  # noqa: E402


def synthetic_events(ranks: int, first_step: int, steps: int, rng: np.random.Generator) -> list[dict]:
    """Minibatch and averaging events of `ranks` ranks for steps [first_step, first_step + steps)."""
    events = []
    for step in range(first_step, first_step + steps):
        loss = 4.8 * np.exp(-step / 3000) + 0.05 * rng.standard_normal(ranks)
        for rank in range(ranks):
            events.append({"type": "minibatch", "rank": rank, "epoch": 0, "step": step,
                           "loss": float(loss[rank]), "frame_accuracy": 0.5, "frames": 256,
                           "lr": 0.008, "applied": True, "max_change_scale": 1.0})
        for rank in range(ranks):  # K = 1: one averaging round a step, the most rows a run can make
            events.append({"type": "average", "rank": rank, "round": step, "step": step,
                           "divergence": float(abs(rng.normal(0.01, 0.002))),
                           "compute_seconds": 0.05, "comm_seconds": 0.01, "frames_per_second": 5000.0})
    return events


def feed(live: LiveRun, events: list[dict]) -> None:
    """Queue events as the training thread's on_event callback would."""
    for event in events:
        live._inbox.put(event_from_dict(event))  # noqa: SLF001 - the worker thread's side


def measure(ranks: int, points: int, ticks: int, steps_per_tick: int) -> dict:
    """Run the benchmark; returns the latencies in seconds."""
    rng = np.random.default_rng(0)
    live = LiveRun(maxlen=points)
    live._reset(ranks, {"ranks": ranks}, "synthetic", "live")  # noqa: SLF001 - no real run
    plots = LivePlots(live, maxlen=points)
    plots.stream()
    doc = Document()
    root = pn.Column(*plots.panes.values()).get_root(doc)
    doc.add_root(root)
    patches = []
    protocol = Protocol()
    doc.on_change(lambda event: patches.append(event))

    start = time.perf_counter()
    feed(live, synthetic_events(ranks, 1, points, rng))
    live.drain()
    plots.stream()
    fill_seconds = time.perf_counter() - start

    latencies, sizes = [], []
    step = points + 1
    for _ in range(ticks):
        feed(live, synthetic_events(ranks, step, steps_per_tick, rng))
        step += steps_per_tick
        patches.clear()
        t0 = time.perf_counter()
        live.drain()
        plots.stream()
        # What the server does next: serialise the model changes into one PATCH-DOC message.
        message = protocol.create("PATCH-DOC", list(patches)) if patches else None
        latencies.append(time.perf_counter() - t0)
        sizes.append(0 if message is None else
                     len(message.content_json) + sum(memoryview(b.data).nbytes for b in message.buffers))
    curves = [len(p) for p in live.buffers.of("loss").points]
    return {
        "ranks": ranks, "points_per_curve": points, "ticks": ticks, "steps_per_tick": steps_per_tick,
        "points_in_loss_buffers": curves[0], "rows_in_loss_plot": len(plots.loss.data),
        "points_in_browser_loss_source": min(len(s.data["step"]) for v in plots.loss.sources.values() for s in v),
        "initial_fill_seconds": fill_seconds,
        "tick_median_seconds": statistics.median(latencies),
        "tick_p95_seconds": sorted(latencies)[int(0.95 * (len(latencies) - 1))],
        "tick_max_seconds": max(latencies),
        "slowest_tick_index": latencies.index(max(latencies)),
        "ticks_over_1s": sum(t >= 1.0 for t in latencies),
        "model_change_events_per_tick": len(patches),
        "patch_kib_per_tick_median": statistics.median(sizes) / 1024,
    }


def main() -> None:
    """Parse arguments, run, print (and optionally save) the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--points", type=int, default=5000)
    parser.add_argument("--ticks", type=int, default=40)
    parser.add_argument("--steps-per-tick", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.ranks, args.points, args.ticks, args.steps_per_tick)
    for key, value in result.items():
        print(f"{key:32s} {value:.4f}" if isinstance(value, float) else f"{key:32s} {value}")
    # The page's periodic update runs every 500 ms; it keeps a once-a-second refresh when
    # drain + update + serialisation stays well under that.
    ok = result["tick_p95_seconds"] < 0.5
    print(f"updates at least once a second: {'yes' if ok else 'NO'} "
          f"(p95 {result['tick_p95_seconds']:.3f} s, slowest {result['tick_max_seconds']:.3f} s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
