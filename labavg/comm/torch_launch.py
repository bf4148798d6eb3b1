"""`python -m labavg.comm.torch_launch TORCHRUN_ARGS...`: torchrun for a job on this machine,
every store it needs on 127.0.0.1 (`labavg.comm.launchers.torchrun_command` builds the command).

torchrun's stores bind every interface whatever host they are given (c10d's TCPStore server
listens on [::]); only a store handed a socket already bound (`master_listen_fd`) listens
where that socket does. So this process hosts the rendezvous store itself on a loopback
socket and runs torchrun's agent in the same process as a client of it (c10d rendezvous,
`is_host=false`); the agent makes no store of its own for the workers
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and the workers' rank 0 hosts theirs on a loopback
socket too (labavg.comm.torch_dist). Otherwise this is `python -m torch.distributed.run`:
same agent, signals, exit statuses and failure reports.
"""

from __future__ import annotations

import os
import sys

from labavg.comm.torch_dist import loopback_store

LOOPBACK = "127.0.0.1"


def main(argv: list[str]) -> None:
    from torch.distributed.run import main as torchrun

    store = loopback_store()
    # The workers' store: on worker rank 0 (loopback, torch_dist), not a second one in here.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    torchrun(["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{LOOPBACK}:{store.port}",
              "--rdzv-conf", "is_host=false", "--local-addr", LOOPBACK, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
