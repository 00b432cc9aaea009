"""Worker processes whose death fails the run: ``data_prep wiki``'s and ``align``'s pools, and each of ``data_prep
pairs``' workers (``stateful_pool.StatefulPool``).

``ProcessPool`` has the one method of ``multiprocessing.Pool`` that ``wiki_tasks.ordered_map`` uses,
``apply_async`` (``get()`` its value), on a ``concurrent.futures.ProcessPoolExecutor``. A ``multiprocessing.Pool``
replaces a worker that dies (kill -9, the OOM killer) with a fresh one and never fails the task the dead one
held: the run waited for it for good, or a stateful worker's replacement went on without its state. An
executor instead marks itself broken: every call waiting on it or made after raises ``WorkerDied``, naming the
process that died and how, and the command stops with that one line.

The main process takes SIGTERM and Ctrl-C (``cli.stop_on_sigterm``) and ends the workers (``terminate``): a
worker takes SIGTERM's default action, dying at once, and ignores SIGINT.
"""
from __future__ import annotations

import multiprocessing
import signal
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

# Fork, as multiprocessing.Pool did here: every process of an executor starts at its first call, so the pool
# knows them (and can name the one that died) from the start.
_CONTEXT = multiprocessing.get_context("fork")


class WorkerDied(Exception):
    """A worker process or Ray actor died (killed, out of memory, its node lost): what it held is gone, so the
    run cannot go on. The message names it and says how it ended."""


def _start_worker(initializer: Callable | None, initargs: tuple) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the main process's handler, inherited by the fork
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the main process ends us
    if initializer is not None:
        initializer(*initargs)


def how_it_ended(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return f"exited with status {exitcode}"
    name = signal.Signals(-exitcode).name
    return f"killed by {name}" + (" (kill -9, or the OOM killer when memory ran out)" * (name == "SIGKILL"))


class _Call:
    """A call made on a ``ProcessPool``: ``get()`` waits for its value, or raises its failure."""

    def __init__(self, pool: ProcessPool, future: Future):
        self.pool, self.future = pool, future

    def get(self) -> Any:
        try:
            return self.future.result()
        except BrokenProcessPool:
            raise self.pool.died() from None


class ProcessPool:
    """``processes`` worker processes, each running ``initializer(*initargs)`` first; ``name``: what messages call
    one of them ("worker 1 of 2")."""

    def __init__(self, processes: int, name: str = "a worker process", initializer: Callable | None = None,
                 initargs: tuple = ()):
        self.name = name
        before = set(multiprocessing.active_children())
        self._executor = ProcessPoolExecutor(processes, _CONTEXT, _start_worker, (initializer, initargs))
        first = self._executor.submit(int)  # forks them all, before it returns
        self.processes = [p for p in multiprocessing.active_children() if p not in before]
        _Call(self, first).get()

    def apply_async(self, fn: Callable, args: tuple) -> _Call:
        """``fn(*args)`` in a worker; ``get()`` its value."""
        try:
            return _Call(self, self._executor.submit(fn, *args))
        except BrokenProcessPool:
            raise self.died() from None

    def died(self) -> WorkerDied:
        """The broken pool's dead worker, once the executor has ended the others (with SIGTERM) and reaped all."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        dead = [p for p in self.processes if p.exitcode != -signal.SIGTERM] or self.processes
        return WorkerDied(f"{self.name} (pid {dead[0].pid}) died: {how_it_ended(dead[0].exitcode)}")

    def terminate(self) -> None:
        """End the workers at once (the run is over, or failed), whatever they are doing."""
        for process in self.processes:
            process.terminate()
        self._executor.shutdown(wait=True, cancel_futures=True)
