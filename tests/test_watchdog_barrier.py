"""The watchdog also covers Ray Train's own barrier: ``ray.train.report`` waits for every rank through
Ray's sync actor, not gloo, and by default waits forever. A rank that never reaches it must fail its
peer within ``cluster.collective_timeout_s``, and clsys must say so on the console (rank and reason).

A real local Ray cluster, two real Ray Train workers; the worker function is a stand-in for the step
loop so that the hang happens exactly at the barrier (a real step loop hangs in gloo first, which
tests/test_fault_tolerance.py covers with SIGSTOP).
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

from faults import REPO

SCRIPT = """
import sys, time
import ray.train
from clsys.config import load_config
from clsys.pretrain import init_ray, train

def stuck_before_report(config):
    if ray.train.get_context().get_world_rank() == 1:
        time.sleep(300)  # never reaches the barrier within the test
    ray.train.report({"step": 1})

cfg = load_config("quickstart", ["cluster.collective_timeout_s=5", "cluster.max_restarts=0",
                                 "train.run_root=" + sys.argv[1]])
init_ray(cfg)
try:
    train(cfg, None, worker=stuck_before_report)
except RuntimeError as err:
    print("[test]", err, flush=True)
"""


def test_a_rank_missing_ray_trains_report_barrier_fails_its_peer_within_the_timeout(tmp_path):
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=240)
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert "[test] training failed after 0 restart(s)" in output, output[-4000:]
    assert re.search(r"\[clsys\] rank 0 failed: \w*CollectiveTimeoutError: The collective operation timed out "
                     r"after 5\.\d\d seconds", output), output[-4000:]
    assert output.count("[clsys] rank 0 failed") == 1, "the failure is reported once"
    assert elapsed < 150, f"rank 0 waited {elapsed:.0f} s: the barrier did not time out"
