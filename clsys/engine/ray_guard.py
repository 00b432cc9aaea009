"""Ends what a local Ray cluster leaves running when the process that started it dies without ``ray.shutdown()``
(SIGKILL, the OOM killer).

The kernel ends the cluster's GCS and raylet with the process that started them, but not the raylet's agents,
``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``: they see the raylet gone, then wait on the dead GCS for about
a minute, with ppid 1, holding their memory and ports (a command run again at once starts a dashboard agent that
cannot bind its port). ``guard`` starts a process of its own session (no signal to the command's process group
reaches it) that waits for the session's raylet to end, however it ends, then ends every process still holding
a file of the session's folder: SIGTERM, then SIGKILL after ``GRACE_S``. After a ``ray.shutdown()`` there is
nothing left to end, and it exits.

    python -m clsys.engine.ray_guard SESSION_DIR    (what ``guard`` starts)
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import psutil

GRACE_S = 3.0  # what an agent gets to end on SIGTERM before SIGKILL
POLL_S = 0.5  # how often the raylet is looked for


def guard(session_dir: str) -> None:
    """Watch the local cluster that this process started, whose session folder is ``session_dir``
    (``ray.init(...).address_info``)."""
    subprocess.Popen([sys.executable, "-m", __name__, session_dir, str(os.getpid())], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def holding(session_dir: str, spared: set[int]) -> list[psutil.Process]:
    """The processes, but ``spared``'s, with a file of ``session_dir`` open: the session's, whatever their parent
    now is (its logs are each process's stdout, stderr and log files)."""
    folder = os.path.join(os.path.realpath(session_dir), "")
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid not in spared and any(f.path.startswith(folder) for f in proc.open_files()):
                found.append(proc)
        except psutil.Error:  # gone meanwhile, or another user's
            pass
    return found


def running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(session_dir: str, starter: int) -> None:
    """Wait for the session's raylet to end, then end what is left of the session; never the process that
    started it (alive after a ``ray.shutdown()``, it may still hold a log of the session) nor this one."""
    spared = {starter, os.getpid()}
    raylets = [proc for proc in holding(session_dir, spared) if proc.name() == "raylet"]
    if not raylets:
        return  # no cluster to watch: nothing here is known to be left over
    while any(map(running, raylets)):
        time.sleep(POLL_S)
    left = holding(session_dir, spared)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(left, timeout=GRACE_S)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
