"""A notebook's cluster dies with its kernel (labavg.jobs.cluster_guard), and a second
Cluster.start in the same profile replaces the first: a kernel killed with kill -9 left 19
processes and about 1.5 GB behind, and Run All twice left two clusters."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from support import running

# A stand-in for a kernel: Run All twice (two Cluster.start in one profile), then it waits.
KERNEL = r'''
import json, sys, time
from labavg.jobs.cluster import Cluster
first = Cluster.start(2, device="cpu", profile_dir=sys.argv[1])
second = Cluster.start(2, device="cpu", profile_dir=sys.argv[1])
print(json.dumps({"first_closed": first.closed, "first": first.process_ids(),
                  "second": second.process_ids()}), flush=True)
time.sleep(600)
'''


@pytest.mark.slow  # end to end: out of the fast suite's 10 minutes
def test_a_killed_kernel_leaves_no_process_of_its_cluster(tmp_path):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(tmp_path / "profile")],
                              stdout=subprocess.PIPE, text=True)
    try:
        started = json.loads(kernel.stdout.readline())
        assert started["first_closed"] and running(started["first"]) == [], "Run All again replaced the first"
        tree = [p.pid for p in psutil.Process(kernel.pid).children(recursive=True)]
        assert set(started["second"]) <= set(tree) and len(started["second"]) >= 5, started
    finally:
        kernel.kill()  # kill -9: no exit hook of the kernel runs
        kernel.wait()
    deadline = time.monotonic() + 10
    while running(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(tree) == [], [psutil.Process(p).cmdline() for p in running(tree)]
