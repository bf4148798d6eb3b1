"""How long each teaching notebook takes at one size, against the class budget (never a timed test).

    .venv/bin/python benchmarks/bench_notebooks.py [--size class] [--work DIR] [--only 03 04]
                                                  [--load 2] [--write-timings] [--html DIR]

Executes the notebooks in order in one fresh working folder, as a class would (01 makes the
corpus, later ones reuse it), each in its own kernel running this interpreter, and prints one line
per notebook: seconds, the machine's mean 1-minute load average while it ran, and the ratio to
its budget (half its slot in the 90-minute plan, `teaching.budget_seconds`). `--load 2` runs two
busy processes beside the notebooks for the whole measurement, as a class laptop's other
programs would. `--write-timings` stores the seconds in notebooks/timings.json under "plain" (no
load of its own) or "loaded" (`--load 2`), which each notebook's banner prints.
`--html DIR` also exports every executed notebook as a self-contained HTML file (the plots'
JavaScript is inline, so the files open offline). Exit status 1 when a notebook fails or, at the
class size beside the load, runs over its budget.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import nbclient
import nbformat

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from labavg.studies import teaching  # noqa: E402


def kernel_spec(root: Path) -> str:
    """A kernel spec running this interpreter, so the notebooks see this labavg."""
    spec = root / "kernels" / "labavg-bench"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "labavg bench", "language": "python"}))
    return "labavg-bench"


# Notebook 03 leaves its engines up for the exercises; a class stops them when done, and so does
# the benchmark (untimed): a kernel killed before ipyparallel's exit hook leaves them running.
SHUT_DOWN = "if 'cluster' in globals():\n    cluster.shutdown()"


def run_notebook(path: Path, cwd: Path, kernel: str, timeout: float) -> tuple[float, nbformat.NotebookNode]:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name=kernel,
                                     resources={"metadata": {"path": str(cwd)}})
    with client.setup_kernel():
        start = time.perf_counter()
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        took = time.perf_counter() - start
        nb.cells.append(nbformat.v4.new_code_cell(SHUT_DOWN))
        client.execute_cell(nb.cells[-1], len(nb.cells) - 1)
        nb.cells.pop()  # not part of the notebook's exported copy
    return took, nb


class LoadSampler:
    """The machine's 1-minute load average, sampled every few seconds on a thread."""

    def __init__(self, every: float = 5.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every,), daemon=True)
        self._thread.start()

    def _sample(self, every: float) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(every)

    def mean(self) -> float:
        self._stop.set()
        self._thread.join()
        return sum(self.samples) / len(self.samples)


def busy_processes(n: int) -> list[subprocess.Popen]:
    """`n` processes that each keep one core busy until they are ended."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def export_html(nb: nbformat.NotebookNode, out: Path) -> None:
    # Equations typeset offline: MathJax copied beside the HTML files, no CDN script.
    body, _ = teaching.offline_html_exporter(out.parent).from_notebook_node(nb)
    out.write_text(body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="class", choices=list(teaching.SIZES))
    parser.add_argument("--work", type=Path, help="working folder (default: a new temporary one)")
    parser.add_argument("--only", nargs="*", default=None, help="notebook numbers, e.g. 03 04")
    parser.add_argument("--load", type=int, default=0, choices=(0, teaching.LOAD_PROCESSES),
                        help="busy processes to run beside the notebooks")
    parser.add_argument("--write-timings", action="store_true", help="store the seconds in notebooks/timings.json")
    parser.add_argument("--html", type=Path, help="export each executed notebook as HTML into this folder")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per cell")
    args = parser.parse_args(argv)

    work_root = args.work or Path(tempfile.mkdtemp(prefix=f"labavg-nb-{args.size}-"))
    work_root.mkdir(parents=True, exist_ok=True)
    jupyter = work_root / "jupyter"
    os.environ["JUPYTER_PATH"] = str(jupyter)
    os.environ[teaching.SIZE_VARIABLE] = args.size
    os.environ.pop(teaching.SMALL_VARIABLE, None)
    os.environ.pop("LABAVG_NOTEBOOK_WORK", None)  # each notebook's labavg-work/ under the cwd
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    kernel = kernel_spec(jupyter)
    cwd = work_root / "notebooks"
    cwd.mkdir(exist_ok=True)
    if args.html:
        args.html.mkdir(parents=True, exist_ok=True)

    notebooks = sorted(teaching.NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))
    if not notebooks:
        print(f"no notebook found in {teaching.NOTEBOOKS}", file=sys.stderr)
        return 2
    if args.only:
        notebooks = [p for p in notebooks if p.name[:2] in args.only]
    condition = "loaded" if args.load else "plain"
    print(f"size {args.size!r} ({teaching.SIZES[args.size].describe()}), "
          f"{teaching.CONDITION_WORDS[condition]}, working folder {cwd}")
    print(f"{'notebook':<52} {'seconds':>8} {'load avg':>8} {'of budget':>10}")
    seconds: dict[str, float] = {}
    loads: list[float] = []
    failed = over = False
    load = busy_processes(args.load)
    try:
        for path in notebooks:
            sampler = LoadSampler()
            try:
                took, nb = run_notebook(path, cwd, kernel, args.timeout)
            except Exception as exc:  # one failing notebook must not hide the others' times
                sampler.mean()
                print(f"{path.stem:<52} FAILED: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[-1] if str(exc) else ''}")
                failed = True
                continue
            loads.append(sampler.mean())
            seconds[path.stem] = round(took, 1)
            budget = teaching.budget_seconds(path.stem)
            over |= args.size == "class" and condition == "loaded" and took > budget
            print(f"{path.stem:<52} {took:8.1f} {loads[-1]:8.2f} {took / budget:10.2f}", flush=True)
            if args.html:
                export_html(nb, args.html / f"{path.stem}.html")
    finally:
        for process in load:
            process.kill()
            process.wait()
    if seconds:
        print(f"{'total':<52} {sum(seconds.values()):8.1f}")
    if args.write_timings and seconds and not failed:
        write_timings(args.size, condition, seconds, sum(loads) / len(loads), args.only)
    return 1 if failed or over else 0


def write_timings(size: str, condition: str, seconds: dict[str, float], load: float,
                  only: list[str] | None = None) -> None:
    timings = teaching.read_timings()
    timings["machine"] = f"a {os.cpu_count()}-core {platform.machine()} machine"
    entry = timings.setdefault("sizes", {}).setdefault(size, {}).setdefault(condition, {})
    record = dict(date=datetime.date.today().isoformat(), load_average=round(load, 2),
                  command=f"benchmarks/bench_notebooks.py --size {size}"
                          + (f" --load {teaching.LOAD_PROCESSES}" if condition == "loaded" else "")
                          + (f" --only {' '.join(only)}" if only else ""))
    remeasured = entry.pop("remeasured", {})
    if only:  # the others keep the date and load they were measured at; these say their own
        entry["remeasured"] = {**remeasured, **{stem: record for stem in seconds}}
    else:
        entry.update(record)
    entry["notebooks"] = {**entry.get("notebooks", {}), **seconds}
    teaching.TIMINGS_FILE.write_text(json.dumps(timings, indent=1) + "\n")
    print(f"wrote {teaching.TIMINGS_FILE}")


if __name__ == "__main__":
    raise SystemExit(main())
