"""The driver's stop request: the first SIGUSR1 writes ``<run>/STOP``, and later ones cannot kill it.

SLURM's script (deploy/slurm/clbert.sh) repeats the notice every 10 s until the driver exits, because
the driver ignores it until its handler is installed. Python restores the default action of the
signals it handles while the interpreter shuts down, so a repeat arriving then used to kill the driver
with SIGUSR1 (exit 138: a requeue that never happened, CI's failure). Here a real driver-side process
is flooded with SIGUSR1 from its first notice to its exit, and must exit with 75 every time.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from clsys.engine.preemption import EXIT_PREEMPTED, stop_marker

from faults import REPO

DRIVER = """
import sys, time
from clsys import storage
from clsys.engine.preemption import EXIT_PREEMPTED, install_stop_handlers, stop_marker
run = sys.argv[1]
install_stop_handlers(run)
print("ready", flush=True)
while not storage.exists(stop_marker(run)):
    time.sleep(0.01)
install_stop_handlers(run)  # as clsys.pretrain does after ray.init: must not undo the ignore
sys.exit(EXIT_PREEMPTED)
"""


def test_repeated_stop_notices_never_kill_the_driver(tmp_path):
    for attempt in range(2):
        run = f"file://{tmp_path}/run{attempt}"
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, run], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        assert driver.stdout.readline().strip() == "ready", driver.communicate()
        sent = 0
        while driver.poll() is None:  # every millisecond until it has exited
            try:
                os.kill(driver.pid, signal.SIGUSR1)
                sent += 1
            except ProcessLookupError:
                break
            time.sleep(0.001)
        _, err = driver.communicate()
        assert driver.returncode == EXIT_PREEMPTED, (attempt, driver.returncode, sent, err)
        assert err.count("[clsys] SIGUSR1: asking the workers to checkpoint and stop") == 1, err
        assert Path(stop_marker(run).removeprefix("file://")).read_text() == "SIGUSR1"
        assert sent > 10, sent  # the flood really overlapped the shutdown
