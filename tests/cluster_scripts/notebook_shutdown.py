"""Start 2 MPI engines, train on them and shut them down the way a notebook does.

Run as `python notebook_shutdown.py CORPUS WORK_DIR`. Like a Jupyter kernel, it has an IPython
shell (so ipyparallel logs to stdout) and runs the cells inside an event loop that goes on
after the shutdown (ipyparallel's stop callbacks print from it). Stdout carries the markers
`=== shutdown` and `=== end` around what the shutdown printed; WORK_DIR/pids.json lists the
processes the cluster had started.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from IPython.core.interactiveshell import InteractiveShell

from labavg.averaging.settings import AveragingConfig
from labavg.jobs.cluster import Cluster
from labavg.jobs.launch import start_run
from labavg.data.settings import DataConfig
from labavg.training.config import TrainConfig
from labavg.training.settings import ModelConfig


async def notebook(corpus: Path, work: Path) -> None:
    cluster = Cluster.start(2, device="cpu", profile_dir=str(work / "profile"), timeout=90)
    cfg = TrainConfig(out=str(work / "run"), ranks=2, backend="mpi", minibatch=64, epochs=1,
                      averaging=AveragingConfig(average_every=2),
                      model=ModelConfig(hidden_layers=1, hidden_dim=32),
                      data=DataConfig(data=str(corpus), context=2, buffer_frames=2048),
                      tensorboard=False)
    start_run(cfg, cluster=cluster).result(timeout=120)
    cluster.view.execute("import os; seen = os.getpid()")
    (work / "pids.json").write_text(json.dumps(cluster.process_ids()))
    await asyncio.sleep(0.5)
    print("=== shutdown", flush=True)
    print("=== shutdown", file=sys.stderr, flush=True)
    cluster.shutdown()
    await asyncio.sleep(3)  # the kernel's loop runs on after the cell
    print("=== end", flush=True)
    print("=== end", file=sys.stderr, flush=True)


if __name__ == "__main__":
    InteractiveShell.instance()
    asyncio.run(notebook(Path(sys.argv[1]), Path(sys.argv[2])))
