"""Workers that keep state from one call to the next: ``data_prep pairs``' workers each hold the records of their
parts until the main process says which of them are new pairs, and write them to shards of their own.

``StatefulPool`` has the one method of ``multiprocessing.Pool`` that ``wiki_tasks.ordered_map`` uses,
``apply_async``, so the main process runs the same bounded, ordered map as over ``data_prep wiki``'s stateless
workers. The k-th ``apply_async`` goes to worker ``k % size``: which worker gets a task depends on its place in
the input alone, and so does what each worker writes. ``submit`` calls one worker. A worker runs its calls one
at a time, in the order they were made: a process of its own (a ``process_pool.ProcessPool`` of one), a Ray actor
(``RayPool.actors``), or, for one worker without Ray, this process.

A worker whose call failed answers every later call with that failure (its state is no longer what they
expect): the main process learns of a failed call it did not wait for at the worker's next answer. A worker
that dies is not replaced (its state is gone with it): its next answer, or the next call made to it, raises
``WorkerDied`` naming it ("worker 1 of 2").
"""
from __future__ import annotations

from typing import Any, Callable

from data_prep.process_pool import ProcessPool
from data_prep.ray_pool import RayPool


class Served:
    """Worker ``index`` of ``size``: its state (``make(index, size)``) and the first failure of a call on it, or
    of ``make`` itself: raised by the next call rather than here, where it would break the worker's pool and read
    as a worker that died."""

    def __init__(self, make: Callable[[int, int], Any], index: int, size: int):
        self.state: Any = None
        self.failure: BaseException | None = None
        try:
            self.state = make(index, size)
        except Exception as err:
            self.failure = err

    def run(self, fn: Callable, *args) -> Any:
        """``fn(state, *args)``; once a call has failed, its failure."""
        if self.failure is not None:
            raise self.failure
        try:
            return fn(self.state, *args)
        except BaseException as err:
            self.failure = err
            raise


class _Done:
    """A call already run here, as ``apply_async`` answers: ``get`` gives its value or raises its failure."""

    def __init__(self, served: Served, fn: Callable, args: tuple):
        self.value: Any = None
        self.failure: Exception | None = None
        try:
            self.value = served.run(fn, *args)
        except Exception as err:  # raised by get, where a pool's failure would be
            self.failure = err

    def get(self) -> Any:
        if self.failure is not None:
            raise self.failure
        return self.value


_served: Served | None = None  # in a worker process: its state (``_start``)


def _start(make: Callable[[int, int], Any], index: int, size: int) -> None:
    global _served
    _served = Served(make, index, size)


def _run(fn: Callable, args: tuple) -> Any:
    return _served.run(fn, *args)


class StatefulPool:
    """``size`` workers, worker ``i`` holding ``make(i, size)``: ``ray``'s actors (one per slot of its cluster),
    else ``workers`` processes, else (``workers`` 1) this process. Calls are ``fn(state, *args)``; ``fn`` and
    the arguments must pickle (a module's function, a class's method)."""

    def __init__(self, make: Callable[[int, int], Any], workers: int, ray: RayPool | None = None):
        self.ray = ray
        self.size = ray.slots if ray is not None else workers
        if ray is not None:
            self._actors = ray.actors(Served, [(make, i, self.size) for i in range(self.size)])
        elif workers > 1:
            self._pools = [ProcessPool(1, self.name(i), _start, (make, i, self.size)) for i in range(workers)]
        else:
            self._here = Served(make, 0, 1)
        self._calls = 0

    def name(self, worker: int) -> str:
        """What messages call ``worker``."""
        return f"worker {worker + 1} of {self.size}"

    def worker(self, call: int) -> int:
        """The worker that the ``call``-th ``apply_async`` (from 0) goes to: they take turns."""
        return call % self.size

    def apply_async(self, fn: Callable, args: tuple):
        """``fn(state, *args)`` on the next worker in turn (``ordered_map``'s interface); ``get()`` its value."""
        worker = self.worker(self._calls)
        self._calls += 1
        return self.submit(worker, fn, args)

    def submit(self, worker: int, fn: Callable, args: tuple):
        """``fn(state, *args)`` on ``worker``, after the calls made to it before; ``get()`` its value."""
        if self.ray is not None:
            return self.ray.call(self._actors[worker], "run", (fn, *args), self.name(worker))
        if self.size > 1:
            return self._pools[worker].apply_async(_run, (fn, args))
        return _Done(self._here, fn, args)

    def terminate(self) -> None:
        """Stop the workers at once (the run is over, or failed): their state is dropped."""
        if self.ray is not None:
            self.ray.terminate()
        elif self.size > 1:
            for pool in self._pools:
                pool.terminate()
