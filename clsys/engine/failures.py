"""Why a worker group failed, said on the console by clsys itself.

Ray Train restarts a failed worker group (``cluster.max_restarts``) or gives up; the reason sits in
the failed worker's traceback, which reaches the driver's console only through Ray's log forwarding:
merged with other ranks' identical lines, or lost when the process is torn down before its last lines
are read. This callback runs in Ray Train's controller, which outlives the workers, and prints one
line per failed rank.
"""
from __future__ import annotations

import logging

from ray.train import UserCallback

from clsys import logs, storage

log = logging.getLogger(__name__)


class FailureReport(UserCallback):
    def __init__(self) -> None:
        # The controller polls a failed group more than once before tearing it down; say it once.
        self.reported: set[str] = set()

    def after_report(self, run_context, metrics, checkpoint) -> None:
        self.reported.clear()  # a (re)started group is training: its next failure is news

    def after_exception(self, run_context, worker_exceptions) -> None:
        logs.configure()  # in Ray Train's controller: the driver's level, from the environment it handed Ray
        for rank, error in sorted(worker_exceptions.items()):
            # A worker's error arrives wrapped with its traceback as its text (Ray Train's
            # UserExceptionWithTraceback, which keeps the exception itself in _base_exc): name that one. A
            # library's message may quote a URL whole, secrets and all.
            cause = getattr(error, "_base_exc", error)
            lines = [line.strip() for line in storage.redact(str(cause)).splitlines() if line.strip()]
            line = f"[clsys] rank {rank} failed: {type(cause).__name__}: {lines[0] if lines else ''}"
            if line not in self.reported:
                self.reported.add(line)
                log.error(line)
