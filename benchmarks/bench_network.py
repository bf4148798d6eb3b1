"""Seconds per averaging round against parameter bytes: loopback, and emulated nodes at tbf rates.

    .venv/bin/python benchmarks/bench_network.py [--links loopback,1gbit,10gbit,none]
        [--ranks 2] [--reps 9] [--json network.json] [--train]

For each link and rank count, MPI ranks time (a) `MpiCommunicator.allreduce_mean` of a flat
float32 buffer, the data exchange of an averaging round, and (b) `average_parameters`, the whole
round labavg runs (the control allreduce, the finiteness check, the divergence), for buffers of
4 KB .. 32 MB. Each repetition starts at a barrier and lasts for the slowest rank; repetitions
are outermost, so a slow spell of a shared machine spreads over all sizes; the tables show the
median of --reps repetitions after two warm-up ones. Links:

    loopback   all ranks on this machine, as a local labavg run starts them (MPICH's shared
               memory between ranks of one node)
    RATE       one rank per emulated node (scripts/emulated-nodes.sh up P RATE: namespaces,
               veth links shaped by tbf at RATE, MPICH's tcp provider); needs root
    none       emulated nodes with unshaped veth links: what the kernel and CPUs manage

alpha and beta of each link and rank count are then fitted by least squares on relative error
to the alpha-beta formula of MPICH's allreduce for large buffers (Rabenseifner,
`2 lg p alpha + 2 (p-1)/p n beta`; labavg.studies.costfit.fit_network), once to every size and once
to sizes >= 1 MB (what averaging a real model moves, and above tbf's bucket), and each
measurement is shown against both. --train adds a 2-rank training run on loopback and across
1 Gb/s nodes, and compares the communication and epoch time the cost model predicts from the
loopback run and the fitted link with those measured. Not a test: one machine, one run, with
whatever else the machine was doing (the load average is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "emulated-nodes.sh"
SIZES = [4096 * 2**k for k in range(14)]  # 4 KB .. 32 MB
WARMUP = 2


# -- one MPI rank -------------------------------------------------------------------------------


def worker(sizes: list[int], reps: int, out: Path) -> None:
    """Time both operations at every size on this rank; rank 0 writes the results to `out`."""
    import torch
    from mpi4py import MPI

    from labavg.averaging.mean import average_parameters
    from labavg.comm.mpi import MpiCommunicator

    torch.set_num_threads(1)
    comm = MpiCommunicator()
    world = MPI.COMM_WORLD
    ops = {"allreduce": comm.allreduce_mean,
           "round": lambda buf: average_parameters(buf, comm)}
    buffers = [torch.ones(n // 4, dtype=torch.float32) for n in sizes]
    walls = {(n, k): [] for n in sizes for k in ops}
    cpu_share: dict[int, list[float]] = {n: [] for n in sizes}
    # Repetitions outermost, sizes and operations interleaved within each: a slow spell of a
    # shared machine then spreads over every size instead of spoiling one.
    for rep in range(WARMUP + reps):
        for n, flat in zip(sizes, buffers):
            for kind, op in ops.items():
                comm.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                op(flat)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                wall = world.allreduce(wall, op=MPI.MAX)  # the round lasts for its slowest rank
                if rep < WARMUP:
                    continue
                walls[(n, kind)].append(wall)
                if kind == "allreduce":
                    cpu_share[n].append(world.allreduce(cpu, op=MPI.SUM) / (world.size * wall))
    rows = [{"n_bytes": n,
             **{f"{k}_s": statistics.median(walls[(n, k)]) for k in ops},
             **{f"{k}_min_s": min(walls[(n, k)]) for k in ops},
             **{f"{k}_all_s": walls[(n, k)] for k in ops},
             "cpu_share": statistics.median(cpu_share[n])} for n in sizes]
    if world.rank == 0:
        out.write_text(json.dumps({"ranks": world.size, "rows": rows}, indent=1) + "\n")


# -- the driver ---------------------------------------------------------------------------------


def _bad(message: str) -> None:
    print(f"bench_network: {message}", file=sys.stderr)
    raise SystemExit(2)


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


class Emulation:
    """scripts/emulated-nodes.sh up N RATE for the duration of a `with` block (down however it ends)."""

    def __init__(self, n: int, rate: str, state: Path):
        self.n, self.rate, self.state = n, rate, state
        self._env = {**os.environ, "LABAVG_NODES_DIR": str(state)}

    def __enter__(self) -> Emulation:
        try:
            subprocess.run(["bash", str(SCRIPT), "up", str(self.n), self.rate], env=self._env,
                           check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            self._down()
            raise RuntimeError(f"emulated-nodes.sh up {self.n} {self.rate}: {exc.stderr.strip()}")
        self.hosts = (self.state / "hosts").read_text().strip().split(",")
        self.env = _env_file(self.state / "env")
        return self

    def qdisc_counters(self) -> list[dict[str, int]]:
        """Sent bytes, drops and overlimits of each node's outgoing tbf."""
        import re

        out = []
        for i in range(self.n):
            text = subprocess.run(["ip", "netns", "exec", f"labavg-n{i}", "tc", "-s", "qdisc",
                                   "show", "dev", "lab0"], capture_output=True, text=True).stdout
            m = re.search(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+), overlimits (\d+)", text)
            out.append(dict(zip(("sent", "dropped", "overlimits"), map(int, m.groups())))
                       if m else {})
        return out

    def _down(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "down"], env=self._env, capture_output=True)

    def __exit__(self, *exc) -> None:
        self._down()


def _mpiexec(p: int, argv: list[str], hosts: list[str] | None, env: dict[str, str],
             timeout: float) -> None:
    from labavg.comm.launchers import find_mpiexec, local_mpiexec_args

    mpiexec = find_mpiexec()
    where = ["-hosts", ",".join(hosts[:p])] if hosts else local_mpiexec_args(mpiexec)
    proc = subprocess.run([str(mpiexec), "-n", str(p), *where, sys.executable, *argv],
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                               **env}, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"mpiexec -n {p} failed ({proc.returncode}): {proc.stderr[-2000:]}")


def measure(links: list[str], ranks: list[int], sizes: list[int], reps: int,
            tmp: Path) -> dict[str, dict]:
    """{link: {"ranks": {p: worker rows}, "tbf": counters}} for every link and rank count."""
    results: dict[str, dict] = {}
    for link in links:
        entry: dict = {"ranks": {}}

        def worker_argv(p: int, link: str = link) -> list[str]:
            return [str(Path(__file__).resolve()), "--worker", "--reps", str(reps),
                    "--sizes", ",".join(map(str, sizes)), "--worker-out", str(tmp / f"{link}-{p}.json")]

        start = time.monotonic()
        if link == "loopback":
            for p in ranks:
                _mpiexec(p, worker_argv(p), None, {}, timeout=1800)
                entry["ranks"][p] = json.loads((tmp / f"{link}-{p}.json").read_text())["rows"]
        else:
            with Emulation(max(ranks), link, tmp / f"nodes-{link}") as nodes:
                for p in ranks:
                    _mpiexec(p, worker_argv(p), nodes.hosts, nodes.env, timeout=1800)
                    entry["ranks"][p] = json.loads((tmp / f"{link}-{p}.json").read_text())["rows"]
                entry["tbf"] = nodes.qdisc_counters()
        entry["seconds"] = time.monotonic() - start
        results[link] = entry
        print(f"  {link}: {entry['seconds']:.0f} s", file=sys.stderr, flush=True)
    return results


LARGE = 1 << 20  # from here up each half of a 2-rank exchange is 4x tbf's bucket and more


def fit(results: dict[str, dict], min_bytes: int = 0,
        statistic: str = "allreduce_s") -> dict[str, dict]:
    """{"LINK p=P": alpha, beta, errors} fitted to the sizes >= `min_bytes` of each link and p.

    `statistic` "allreduce_s" fits the medians, "allreduce_min_s" the fastest repetitions.
    Rank counts are fitted apart: on a machine with fewer cores than ranks the extra ranks
    measure the scheduler, not the link.
    """
    from labavg.studies.costfit import LinkSample, fit_network

    fits = {}
    for link, entry in results.items():
        for p, rows in entry["ranks"].items():
            samples = [LinkSample(int(p), row["n_bytes"], row[statistic]) for row in rows
                       if row["n_bytes"] >= min_bytes]
            f = fit_network(link, samples)
            fits[f"{link} p={p}"] = {
                "link": link, "ranks": int(p), "min_bytes": min_bytes, "statistic": statistic,
                "alpha_s": f.network.alpha, "beta_s_per_byte": f.network.beta,
                "bandwidth_bytes_per_s": 1 / f.network.beta if f.network.beta else None,
                "rms_error_pct": f.rms_error_pct, "max_error_pct": f.max_error_pct,
                "samples": [{"n_bytes": s.n_bytes, "measured_s": s.seconds,
                             "fitted_s": f.fitted_seconds(s), "error_pct": e}
                            for s, e in zip(f.samples, f.errors_pct)]}
    return fits


def _size(n: float) -> str:
    return f"{n / 2**20:g} MB" if n >= 2**20 else f"{n / 2**10:g} KB"


def fit_table(fits_by_range: dict[str, dict[str, dict]]) -> str:
    """Markdown: alpha, 1/beta and the fit error of every link, p and size range."""
    lines = ["| link | ranks | sizes fitted | alpha | 1/beta | fit error rms / max |",
             "|---|---|---|---|---|---|"]
    for label, fits in fits_by_range.items():
        for f in fits.values():
            bw = f["bandwidth_bytes_per_s"]
            bw_text = f"{bw / 1e6:.0f} MB/s ({bw * 8 / 1e9:.2f} Gb/s)" if bw else "inf"
            lines.append(f"| {f['link']} | {f['ranks']} | {label} | {f['alpha_s'] * 1e6:.0f} us | "
                         f"{bw_text} | {f['rms_error_pct']:.0f} % / {f['max_error_pct']:.0f} % |")
    return "\n".join(lines)


def size_tables(results: dict[str, dict], every: dict[str, dict], large: dict[str, dict]) -> str:
    """Markdown: median allreduce per size against both fits; whole averaging rounds."""
    columns = [(link, int(p)) for link, entry in results.items() for p in entry["ranks"]]
    head = "| bytes | " + " | ".join(f"{link} p={p}" for link, p in columns) + " |"
    rule = "|---" * (len(columns) + 1) + "|"
    lines = ["Allreduce, ms: median measured (error of the all-sizes fit / of the >= 1 MB fit)",
             "", head, rule]
    for i, n in enumerate(SIZES):
        cells = []
        for link, p in columns:
            a = every[f"{link} p={p}"]["samples"][i]
            big = [s for s in large[f"{link} p={p}"]["samples"] if s["n_bytes"] == n]
            tail = f" / {big[0]['error_pct']:+.0f} %" if big else ""
            cells.append(f"{a['measured_s'] * 1e3:.2f} ({a['error_pct']:+.0f} %{tail})")
        lines.append(f"| {_size(n)} | " + " | ".join(cells) + " |")
    lines += ["", "Whole averaging round (labavg.averaging.mean.average_parameters), ms: median", "",
              head, rule]
    for i, n in enumerate(SIZES):
        lines.append(f"| {_size(n)} | " + " | ".join(
            f"{results[link]['ranks'][p][i]['round_s'] * 1e3:.2f}" for link, p in columns) + " |")
    return "\n".join(lines)


def cpu_note(results: dict[str, dict]) -> str:
    """Achieved rate at the largest size (against a link's nominal rate), and the CPU share."""
    out = []
    for link, entry in results.items():
        for p, rows in entry["ranks"].items():
            big = rows[-1]
            # Rabenseifner sends 2 (p-1)/p n bytes from each rank (n for p = 2).
            moved = 2 * (int(p) - 1) / int(p) * big["n_bytes"]
            rate = moved / big["allreduce_s"]
            out.append(f"{link} p={p}: {rate / 1e6:.0f} MB/s ({rate * 8 / 1e9:.2f} Gb/s) sent per "
                       f"rank at {_size(big['n_bytes'])}; the ranks were on a CPU "
                       f"{100 * big['cpu_share']:.0f} % of the allreduce's wall time")
    return "\n".join(out)


# -- optional: a training run predicted from loopback and the fitted 1 Gb/s link ----------------


def train_check(fits: dict[str, dict], tmp: Path, reps: int) -> dict:
    """2-rank runs on loopback and across 1 Gb/s nodes, interleaved `reps` times; the cost
    model's communication and epoch time, predicted from the loopback runs and the fitted
    link, against the medians measured across the nodes."""
    from labavg.studies.costmodel import Network, allreduce_seconds, from_summary, predict
    from labavg.data.synth import synthesize

    corpus = tmp / "corpus"
    synthesize(corpus, hours=0.05, seed=3)
    # 4 x 512 sigmoid: ~1 M parameters, 3.8 MB per round, ~35 ms at 1 Gb/s, against two
    # 64-frame minibatches of compute per round: the network is a fifth or so of the epoch.
    args = ["--data", str(corpus), "--ranks", "2", "--backend", "mpi", "--minibatch", "64",
            "--epochs", "1", "--hidden-layers", "4", "--hidden-dim", "512", "--average-every", "2",
            "--context", "2", "--no-progress", "--set", "tensorboard=false",
            "--set", "data.buffer_frames=4096", "--optimizer", "sgd"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    runs: dict[str, list[dict]] = {"loopback": [], "1gbit": []}
    with Emulation(2, "1gbit", tmp / "nodes-train") as nodes:
        for rep in range(reps):  # interleaved, so a busy spell of the machine hits both
            for name in runs:
                out = tmp / f"train-{name}-{rep}"
                extra, run_env = [], env
                if name != "loopback":
                    extra, run_env = ["--hosts", ",".join(nodes.hosts)], {**env, **nodes.env}
                proc = subprocess.run([sys.executable, "-m", "labavg", "train", *args, "--out",
                                       str(out), *extra], env=run_env, capture_output=True,
                                      text=True, timeout=1800)
                if proc.returncode != 0:
                    raise RuntimeError(f"training on {name} failed: {proc.stderr[-2000:]}")
                runs[name].append(json.loads((out / "summary.json").read_text()))
    keys = ("compute_seconds", "comm_seconds", "wall_seconds")
    medians = {name: {**summaries[0], **{k: statistics.median(s[k] for s in summaries)
                                         for k in keys}}
               for name, summaries in runs.items()}
    local = from_summary(medians["loopback"])
    lo, gb = fits["loopback p=2"], fits["1gbit p=2"]
    # What a round costs beyond the data exchange (control allreduce, checks, waiting for the
    # slower rank), from the loopback runs: their round minus loopback's fitted exchange.
    exchange_lo = allreduce_seconds(2, local.n_bytes, lo["alpha_s"], lo["beta_s_per_byte"])
    overhead = max(local.allreduce_s - exchange_lo, 0.0)
    net = Network("1gbit (fitted)", gb["alpha_s"], gb["beta_s_per_byte"])
    K = medians["loopback"]["average_every"]
    pred = predict(local, [2], Ks=[K], network=net, local_overhead_s=overhead)[0]
    measured = medians["1gbit"]
    # The prediction's compute is the loopback runs'; the measured epoch is compute + comm on
    # the nodes (wall time also holds start-up and the end-of-epoch validation, left out).
    measured_epoch = measured["compute_seconds"] + measured["comm_seconds"]
    return {
        "num_params": local.num_params, "n_bytes": local.n_bytes, "K": K, "reps": reps,
        "rounds": measured["averaging_rounds"],
        **{f"{name}_runs": [{k: s[k] for k in keys} for s in summaries]
           for name, summaries in runs.items()},
        "loopback": {k: medians["loopback"][k] for k in keys},
        "1gbit": {k: measured[k] for k in keys},
        "round_overhead_s": overhead,
        "predicted_compute_s": pred.compute_s, "predicted_comm_s": pred.comm_s,
        "predicted_epoch_s": pred.total_s, "measured_epoch_s": measured_epoch,
        "compute_error_pct": 100 * (pred.compute_s - measured["compute_seconds"])
        / measured["compute_seconds"],
        "comm_error_pct": 100 * (pred.comm_s - measured["comm_seconds"]) / measured["comm_seconds"],
        "epoch_error_pct": 100 * (pred.total_s - measured_epoch) / measured_epoch,
    }


def main() -> None:
    """Parse arguments; run the workers, or measure every link, fit, print and write JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", default="loopback,1gbit,10gbit,none",
                    help="comma-separated: loopback, none, or tc rates such as 1gbit")
    ap.add_argument("--ranks", default="2", help="comma-separated rank counts (>= 2), e.g. 2,4")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", help="also write everything measured and fitted here")
    ap.add_argument("--train", action="store_true",
                    help="also predict and measure a 2-rank training run across 1 Gb/s nodes")
    ap.add_argument("--train-reps", type=int, default=3, help="training runs per link (median)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker([int(s) for s in args.sizes.split(",")], args.reps, Path(args.worker_out))
        return
    links = [s.strip() for s in args.links.split(",") if s.strip()]
    try:
        ranks = sorted({int(s) for s in args.ranks.split(",")})
    except ValueError:
        _bad(f"--ranks {args.ranks!r}: comma-separated whole numbers, e.g. 2,4")
    import re

    for link in links:
        if link not in ("loopback", "none") and not re.fullmatch(r"\d+(\.\d+)?[kmgt]?bit", link):
            _bad(f"link {link!r}: loopback, none, or a tc rate such as 1gbit or 10gbit")
    if not links or not ranks or ranks[0] < 2 or ranks[-1] > 16:
        _bad("need at least one link and rank counts from 2 to 16")
    if args.reps < 3:
        _bad(f"--reps {args.reps}: a median needs at least 3")
    if args.train_reps < 1:
        _bad(f"--train-reps {args.train_reps}: at least 1")
    if any(link != "loopback" for link in links) and os.geteuid() != 0:
        _bad("emulated nodes need root (network namespaces); run as root or use --links loopback")
    if args.train and not {"loopback", "1gbit"} <= set(links):
        _bad("--train predicts from the loopback and 1gbit fits: keep both in --links")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-network-") as tmp:
        results = measure(links, ranks, SIZES, args.reps, Path(tmp))
        every, large = fit(results), fit(results, LARGE)
        fastest = fit(results, LARGE, "allreduce_min_s")
        train = train_check(large, Path(tmp), args.train_reps) if args.train else None
    fits_text = fit_table({"4 KB - 32 MB": every, ">= 1 MB": large,
                           ">= 1 MB, fastest rep": fastest})
    sizes_text = size_tables(results, every, large)
    print(fits_text, "", sizes_text, "", cpu_note(results), sep="\n")
    if train:
        print()
        t = train
        print(f"2-rank training across 1gbit nodes ({t['num_params']} parameters, K={t['K']}, "
              f"{t['rounds']} rounds, median of {t['reps']} runs), predicted from loopback vs "
              f"measured: compute {t['predicted_compute_s']:.2f} s vs "
              f"{t['1gbit']['compute_seconds']:.2f} s ({t['compute_error_pct']:+.1f} %), comm "
              f"{t['predicted_comm_s']:.2f} s vs {t['1gbit']['comm_seconds']:.2f} s "
              f"({t['comm_error_pct']:+.1f} %), epoch {t['predicted_epoch_s']:.2f} s vs "
              f"{t['measured_epoch_s']:.2f} s ({t['epoch_error_pct']:+.1f} %)")
    machine = {"cpus": os.cpu_count(), "loadavg_before": load_before,
               "loadavg_after": os.getloadavg(), "reps": args.reps}
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"machine": machine, "links": results, "fits_all_sizes": every, "fits_large": large,
             "fits_large_fastest": fastest, "train": train,
             "markdown": fits_text + "\n\n" + sizes_text}, indent=1) + "\n")


if __name__ == "__main__":
    main()
