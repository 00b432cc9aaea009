"""Graceful stop on request: checkpoint at the next step and exit, so a requeued job resumes.

Schedulers warn before they take nodes away: SLURM sends SIGUSR1 (``--signal=B:USR1@120``) or
SIGTERM on preemption, Kubernetes sends SIGTERM. The driver (``clsys.pretrain``) turns either
signal into a stop request, a small ``<run>/STOP`` object on the run's storage, because the Ray
workers run elsewhere (other nodes, other process trees) and never see the driver's signals.
An operator can write the same object by hand to stop a run cleanly.

In the workers, rank 0 polls for that object in a background thread (one HEAD request every
``cluster.stop_poll_s`` seconds) and every step the ranks agree on it with a one-integer
broadcast over a CPU (gloo) group, so all of them stop after the same step and no GPU stream is
synchronised for it. They write a checkpoint and return; the driver sees a run that ended before
``train.steps`` and exits with ``EXIT_PREEMPTED``.
"""
from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist

from clsys import storage

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later", which is what a requeue does
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def stop_marker(run_url: str) -> str:
    return storage.join(run_url, "STOP")


_stop_requested = threading.Event()  # one request per driver process, however many signals arrive


def install_stop_handlers(run_url: str) -> None:
    """In the driver: SIGUSR1/SIGTERM write the stop marker (once) instead of killing the process.

    Call it again after ``ray.init``, which installs a SIGTERM handler of its own."""

    def write_marker(reason: str) -> None:
        storage.write_bytes(stop_marker(run_url), reason.encode())

    def on_signal(signum, _frame) -> None:
        if _stop_requested.is_set():
            return  # a second notice that arrived before the first one's handler ran
        _stop_requested.set()
        ignore_stop_signals()
        name = signal.Signals(signum).name
        log.warning(f"[clsys] {name}: asking the workers to checkpoint and stop")
        # Storage calls do not belong in a signal handler (it interrupts arbitrary code): a thread writes.
        threading.Thread(target=write_marker, args=(name,), daemon=True).start()

    if _stop_requested.is_set():
        ignore_stop_signals()
        return
    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)


def ignore_stop_signals() -> None:
    """After the first request, later notices (SLURM's script repeats them until the driver exits)
    are ignored by the kernel rather than by a handler: Python restores the default action of the
    signals it handles while the interpreter shuts down, and a notice arriving then would kill the
    driver with SIGUSR1 (exit 138) instead of letting it exit 75. SIG_IGN survives that shutdown."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def clear_stop_marker(run_url: str) -> None:
    """A new job (or a requeued one) starts without the previous job's stop request."""
    if storage.exists(stop_marker(run_url)):
        storage.delete(stop_marker(run_url))


class StopWatch:
    """In the workers: ``should_stop()`` is the same answer on every rank, asked once per step."""

    def __init__(self, run_url: str, poll_s: float):
        self.marker = stop_marker(run_url)
        self.seen = threading.Event()
        self.done = threading.Event()
        # A CPU group so that the per-step agreement never waits on a GPU stream.
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        if dist.get_rank() == 0:
            threading.Thread(target=self._poll, args=(poll_s,), daemon=True).start()

    def _poll(self, poll_s: float) -> None:
        while not self.done.wait(poll_s):
            try:
                if storage.exists(self.marker):
                    self.seen.set()
                    return
            except storage.StorageError:
                continue  # a storage hiccup must not stop training; ask again next time

    def should_stop(self) -> bool:
        flag = torch.tensor([int(self.seen.is_set())])
        dist.broadcast(flag, src=0, group=self.group)
        return bool(flag.item())

    def close(self) -> None:
        self.done.set()
