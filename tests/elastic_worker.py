"""One worker of the elastic communicator's tests: `python tests/elastic_worker.py ROUNDS
[--rank R --size N --lighthouse URL] [--die-at R] [--pause S]`; rank, size and lighthouse come
from the elastic launcher's environment where not given. Prints one JSON line per round."""

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch

from labavg.comm.elastic import ElasticCommunicator


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("rounds", type=int)
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", "-1")))
    p.add_argument("--size", type=int, default=int(os.environ.get("WORLD_SIZE", "-1")))
    p.add_argument("--lighthouse", default=os.environ.get("LABAVG_LIGHTHOUSE"))
    p.add_argument("--die-rank", type=int, default=-1, help="only this rank dies (all if -1)")
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--pause", type=float, default=0.05)
    p.add_argument("--min-workers", type=int, default=int(os.environ.get("LABAVG_MIN_WORKERS", "1")))
    p.add_argument("--timeout", type=float, default=5.0, help="round_timeout_s")
    p.add_argument("--quorum-timeout", type=float, default=10.0, help="quorum_timeout_s")
    p.add_argument("--die-on-heal", metavar="FILE",
                   help="the first worker asked for its state by a joiner after the start "
                        "(the one that makes FILE) dies there: a loss during a heal")
    p.add_argument("--join", action="store_true",
                   default=os.environ.get("LABAVG_JOINING") == "1")
    p.add_argument("--stop-in-round", type=int, default=-1, metavar="R",
                   help="--die-rank stops itself (SIGSTOP) at round R inside the collective "
                        "after the admission round, the others 0.6 s behind it there")
    p.add_argument("--same", action="store_true", help="every worker moves alike")
    p.add_argument("--big", type=int, default=1000,
                   help="elements of the second mean of --admit (large: most time in it)")
    p.add_argument("--admit", action="store_true",
                   help="each round: an admission round, then two means of other sizes")
    a = p.parse_args()
    comm = ElasticCommunicator(a.rank, a.size, a.lighthouse, min_workers=a.min_workers,
                               timeout_s=a.timeout, quorum_timeout_s=a.quorum_timeout,
                               joining=a.join)
    # The "model": every worker moves its own way between rounds, as local SGD does.
    state = {"x": torch.zeros(6, dtype=torch.float64), "round": torch.zeros((), dtype=torch.int64),
             "momentum": torch.zeros(6, dtype=torch.float64)}

    def serve():
        if a.die_on_heal and int(state["round"]) > 0:  # not a late starter's heal in gather()
            try:
                open(a.die_on_heal, "x").close()
            except FileExistsError:
                return state
            os._exit(1)
        return state

    comm.set_state(serve, lambda s: [state[k].copy_(v) for k, v in s.items()])
    if not a.join:
        comm.gather(30)
    while int(state["round"]) < a.rounds:
        r = int(state["round"]) + 1
        if r == a.die_at and a.die_rank in (-1, a.rank) and not a.join:
            os._exit(1)
        state["x"] += (1 if a.same else a.rank + 1) * 0.001 * r
        buf = state["x"].clone()
        healed = False
        if a.admit:
            # As the trainer does: admission, then the averager's collectives (other sizes).
            healed = comm.admit().healed
            if r == a.stop_in_round and not a.join:
                if a.die_rank == a.rank:  # stops while it waits for the others in the reduction
                    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGSTOP)).start()
                else:
                    time.sleep(0.6)
            other = torch.full((a.big,), float(a.rank))
            comm.allreduce_mean(other)
        comm.allreduce_mean(buf)
        state["x"].copy_(buf)
        state["momentum"].mul_(0.5).add_(buf)
        state["round"] += 1
        g = comm.last_round
        # One write per line, newline included: the workers of a job share one pipe.
        sys.stdout.write(json.dumps({"rank": a.rank, "round": int(state["round"]), "size": comm.size,
                          "members": list(g.members), "healed": g.healed or healed, "attempts": g.attempts,
                          "x": state["x"].tolist(), "m": state["momentum"].tolist(),
                          "t": time.time()}) + "\n")
        sys.stdout.flush()
        time.sleep(a.pause)
    comm.close()


if __name__ == "__main__":
    sys.exit(main())
