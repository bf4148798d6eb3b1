"""Notebook-style demo of labavg.jobs.cluster: 2 MPI engines, two runs back to back, live events.

Run it with the project's venv from the repository root:

    .venv/bin/python examples/cluster_demo.py [WORK_DIR]

Each `# %%` block is one notebook cell. It builds a tiny synthetic corpus, starts 2 engines,
trains with averaging every 2 and then every 8 minibatches on the same warm engines while
printing each rank's loss and the divergence at each averaging round, and shuts down.
"""

# %%
import sys
import tempfile
from pathlib import Path

from labavg.averaging.settings import AveragingConfig
from labavg.base.events import Averaged, Event, MinibatchDone, RunFinished
from labavg.jobs.cluster import Cluster
from labavg.jobs.launch import start_run
from labavg.data.settings import DataConfig
from labavg.training.config import TrainConfig
from labavg.data.synth import synthesize
from labavg.training.settings import ModelConfig

work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="labavg-cluster-"))
corpus = work / "corpus"
if not corpus.exists():
    synthesize(corpus, hours=0.02, seed=0)


def config(average_every: int) -> TrainConfig:
    """The tiny model of the demo, averaging every `average_every` minibatches."""
    return TrainConfig(
        out=str(work / f"run-k{average_every}"), ranks=2, backend="mpi", minibatch=64, epochs=1,
        averaging=AveragingConfig(average_every=average_every),
        model=ModelConfig(hidden_layers=1, hidden_dim=32),
        data=DataConfig(data=str(corpus), context=2, buffer_frames=2048), tensorboard=False,
    )


def show(event: Event) -> None:
    """One line per event worth watching."""
    rank = event.rank
    if isinstance(event, MinibatchDone) and event.step % 8 == 0:
        print(f"  rank {rank} step {event.step:3d}  loss {event.loss:.3f}  "
              f"acc {event.frame_accuracy:.3f}")
    elif isinstance(event, Averaged):
        print(f"  rank {rank} round {event.round:2d} (step {event.step:3d})  "
              f"divergence {event.divergence:.3e}  comm {event.comm_seconds * 1e3:.1f} ms")
    elif isinstance(event, RunFinished):
        print(f"  rank {rank} finished at step {event.step}")


# %% start 2 engines (controller and engines on 127.0.0.1 only)
cluster = Cluster.start(2, device="cpu", profile_dir=str(work / "ipython-profile"))
for engine in cluster.info():
    print(engine)

# %% two configurations, one after the other, on the same engines
try:
    for k in (2, 8):
        print(f"averaging.average_every = {k}")
        run = start_run(config(k), cluster=cluster)  # the one door to a run, on these engines
        for event in run.events():  # as they arrive, until the run has ended
            show(event)
        summary = run.result()
        latency = run.handle.latency()
        print(f"  cv frame accuracy {summary.cv_frame_accuracy:.3f}, "
              f"{summary.averaging_rounds} averaging rounds, wall {summary.wall_seconds:.2f} s; "
              f"event latency median {latency['median'] * 1e3:.0f} ms, p95 {latency['p95'] * 1e3:.0f} ms")
finally:
    # %% stop controller and engines
    cluster.shutdown()
