"""The report's Speedup section: the cost model (labavg.studies.costmodel, costfit) on the
paper's timing table, fitted and held out row by row, and this machine's MPI measurement."""

from __future__ import annotations

from labavg.jobs.speedup import Speedup, speedup_from_summary
from labavg.studies import costfit, costmodel
from labavg.studies.reproduction.paper import PAPER_SPEEDUP_K
from labavg.studies.reproduction.results import Run
from labavg.studies.reproduction.tables import markdown_table, words

# The MPI runs `labavg reproduce` measures: (run name, ranks, K).
MPI_POINTS = (("ranks1", 1, 10), ("ranks2", 2, 10), ("ranks2-K20", 2, 20))


def held_out_speedups() -> dict[int, float]:
    """Each multi-GPU row of the paper's table predicted by the cost model fitted to the others."""
    table = costfit.PAPER_TABLE
    out = {}
    for row in table:
        if row.ranks > 1:
            fit = costfit.fit_table([r for r in table if r is not row], costfit.PAPER_SETUP)
            out[row.ranks] = costfit.fitted_speedup(fit, row.ranks)
    return out


def cost_model_table() -> list[str]:
    """The paper's timing table, the model fitted to all of it, and leave-one-out predictions."""
    fit = costfit.fit_paper_table()
    held = held_out_speedups()
    t1 = costfit.PAPER_TABLE[0].train_min
    rows, errors = [], []
    for row in fit.rows:
        paper = t1 / row.train_min
        pred = held.get(row.ranks)
        err = None if pred is None else 100 * (pred - paper) / paper
        if err is not None:
            errors.append((abs(err), row.ranks, err))
        rows.append((row.ranks, costfit.PAPER_SETUP.K, row.train_min, row.comm_min, f"{paper:.2f}",
                     f"{costfit.fitted_speedup(fit, row.ranks):.2f}",
                     "-" if pred is None else f"{pred:.2f}",
                     "-" if err is None else f"{err:+.1f} %"))
    predicted = [(16, 20, PAPER_SPEEDUP_K[20]), (32, 10, costfit.PAPER_SPEEDUPS[(32, 10)])]
    for ranks, k, paper in predicted:
        pred = costfit.fitted_speedup(fit, ranks, K=k)
        rows.append((ranks, k, "-", "-", f"{paper:g} (reported)", "not in the table",
                     f"{pred:.2f} (from every row)", f"{100 * (pred - paper) / paper:+.1f} %"))
    worst = max(errors) if errors else None
    fit_err = max(abs(costfit.fitted_speedup(fit, r.ranks) / (t1 / r.train_min) - 1)
                  for r in fit.rows)
    table = markdown_table(
        ("GPUs", "K", "paper train min/epoch", "paper comm min", "paper speedup",
         "fitted to every row (a fit)", "predicted with this row held out", "prediction error"),
        rows)
    return table + [
        "", "Speedup = train(1) / train(N), communication inside the train column "
        f"(docs/cost-model.md). Fitted to every row, the model is within {100 * fit_err:.1f} % "
        "of the table's speedups: a fit, not a test. Predicting each row from the others, "
        + ("" if worst is None else f"its largest error is {worst[2]:+.1f} % (at {worst[1]} "
           "GPUs)") + "; the last two rows are not in the table and are predictions: "
        + words([f"{costfit.fitted_speedup(fit, n, K=k):.2f} against the paper's {p:g} at "
                 f"{n} GPUs and K = {k}" for n, k, p in predicted]) + "."]


def speedup_section(mpi_runs: list[Run]) -> list[str]:
    """The cost model on the paper's timing table, and this machine's measurement."""
    out = ["#### The paper's timing table and the cost model", ""] + cost_model_table()
    summaries = {r.name: r.summary for r in mpi_runs}
    if not any(summaries.get(name) for name, ranks, _ in MPI_POINTS if ranks > 1):
        return out + ["", "No MPI measurement in this report."]
    rows, flags = [], []
    for name, ranks, k in MPI_POINTS:
        s = summaries.get(name)
        if s is None:
            continue
        speedup = speedup_from_summary(s)
        predicted = "-"
        if ranks > 1:
            pred = costmodel.predict(costmodel.from_summary(s), [16], Ks=[k])[0]
            predicted = f"{pred.speedup:.2f} (efficiency {pred.efficiency:.2f})"
        if speedup is not None and speedup.flag:
            flags.append(f"{ranks} ranks, K = {k}: {speedup.flag}.")
        rows.append((ranks, k, f"{s.wall_seconds:.1f}", f"{s.compute_seconds:.1f}",
                     f"{s.comm_seconds:.2f}", f"{100 * s.comm_fraction:.1f}",
                     _measured(speedup), speedup.cores if speedup and speedup.cores else "-",
                     "-" if speedup is None or speedup.load is None else f"{speedup.load:.1f}",
                     predicted))
    out += ["", "#### Measured on this machine (MPI ranks, one thread each, 1 epoch)", ""]
    out += markdown_table(("ranks", "K", "wall s", "compute s", "comm s", "comm %",
                           "speedup (range over pairs)", "cores", "load",
                           "cost model at 16 ranks, 10 GbE"), rows)
    return out + ["", "Each speedup is measured inside its run, in pairs (labavg.jobs.speedup, "
                  "docs/cost-model.md): rank 0 trains a few minibatches alone while the other "
                  "ranks wait idle, then all ranks train to the next averaging round; the median "
                  "of ranks x solo / parallel seconds per minibatch over the pairs, with their "
                  "range, and the load (1-minute average) as each run started. On idle cores no "
                  "speedup can exceed min(ranks, cores); under other work each pair measures "
                  "what the ranks reach beside it. The wall times of different rows are not "
                  "a speedup: each run ran at its own time, under its own load. "
                  + " ".join(flags),
                  "", "The prediction takes this run's compute per minibatch and its measured "
                  "seconds per averaging round as the local overhead, plus the allreduce of its "
                  "parameters over 10 GbE (costmodel.predict)."]


def _measured(speedup: Speedup | None) -> str:
    if speedup is None or speedup.value is None:
        return "not measured"
    if speedup.ranks == 1:
        return "1 (reference)"
    return f"{speedup.value:.2f} ({speedup.low:.2f}-{speedup.high:.2f}, {speedup.pairs} pairs)"
