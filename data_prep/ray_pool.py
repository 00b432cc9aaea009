"""Ray tasks and actors in place of process pools: ``data_prep wiki --ray`` (tasks) and ``data_prep pairs --ray``
(actors: ``stateful_pool.StatefulPool``'s workers, fed by streaming tasks).

``RayPool`` has the one method of ``multiprocessing.Pool`` that ``wiki_tasks.ordered_map`` uses, ``apply_async``,
so the driver runs the same bounded, ordered map (at most ``2 × slots`` tasks in flight: backpressure and
the memory bound) and writes the results in input order, which keeps the output byte-identical to a run in
one process. The results are samples the tasks already encoded as tar bytes (``wiki.EncodedPage``): the
driver, the one serial part, only counts them and concatenates them into shards. Tasks get their inputs
from the dump itself (a ranged read of one bz2 stream, local or in object storage) or, for a dump without
an index, from a streaming task (``stream``) that reads the dump from the start and yields batches of
pages: the dumps of several languages are then read at once, none of them by the driver.

A task that fails is run again, up to ``MAX_RETRIES`` times: when its worker process or node dies (Ray does
that for every task), and when it raises a storage error that outlived ``clsys.storage``'s own retries.
Other exceptions (a ``BadIndex``, a bug) are not retried: they reach the driver as the task raised them.
An actor (``actors``) is not restarted: what it held is gone with it, so its next call fails the run with a
``WorkerDied`` naming it, as a dead worker process does.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Iterator

from clsys.engine.launch import init_ray_for_tasks
from clsys.storage import StorageError
from data_prep.process_pool import WorkerDied

log = logging.getLogger(__name__)

MAX_RETRIES = 3
# Fault injection for the tests, off unless set: "raise:PATH" or "exit:PATH". The first task to create the
# file PATH (one task in the whole cluster, a file on a machine every worker shares) raises a StorageError or
# exits its worker process; the tests check that the task is run again and the output is unchanged.
FAULT_ENV = "DATA_PREP_FAULT_ONCE"
# Settings the tasks need, handed over in Ray's runtime_env by init_ray_for_tasks, but one whose value holds a
# secret (AWS_ENDPOINT_URL with a password: launch.handed_env); credentials come from each worker's own
# environment or role.
WORKER_ENV = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", FAULT_ENV)


def _inject_fault() -> None:
    """The test fault, if set and not yet taken by another task."""
    fault = os.environ.get(FAULT_ENV)
    if fault:
        how, _, path = fault.partition(":")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            if how == "exit":
                os._exit(1)
            raise StorageError(f"{FAULT_ENV}: an injected storage fault")


def _task(fn, *args):
    """What every Ray task runs: ``fn(*args)``, once the test fault (if any) has had its turn."""
    _inject_fault()
    return fn(*args)


def _stream_task(fn, *args):
    """What a streaming task runs: the generator ``fn(*args)``, once the test fault has had its turn."""
    _inject_fault()
    yield from fn(*args)


class _Result:
    """A task's or an actor call's result; ``name``: what messages call the actor ("worker 1 of 2")."""

    def __init__(self, ref, name: str = "a Ray actor"):
        self.ref, self.name = ref, name

    def get(self):
        import ray

        try:
            return ray.get(self.ref)
        except ray.exceptions.RayTaskError as err:
            # The task's own exception, as a pool worker's would arrive: the driver reports a BadIndex or a
            # StorageError in one line; the remote traceback stays attached for anything else.
            raise err.cause from err
        except ray.exceptions.RayActorError as err:
            raise actor_died(self.name, str(err)) from None


def actor_died(name: str, message: str) -> WorkerDied:
    """A dead actor, in one line: where it ran, out of Ray's message of several lines (``ActorDiedError``'s pid and
    ip lines, when it has them)."""
    where = dict(re.findall(r"^\s*(pid|ip): (\S+)$", message, re.M))
    at = f", pid {where['pid']}" * ("pid" in where) + f" on {where['ip']}" * ("ip" in where)
    return WorkerDied(f"{name} (a Ray actor{at}) died: its process was killed (kill -9, or the OOM killer when "
                      "memory ran out) or crashed, or its node was lost; the node's Ray logs say which")


class RayPool:
    """Tasks on the Ray cluster at ``RAY_ADDRESS`` (as under ``ray job submit``), else on a local cluster of
    ``cpus`` CPUs started on 127.0.0.1 for this run. ``slots``: the cluster's CPUs, one task each. ``command``:
    the data_prep command its messages name."""

    def __init__(self, cpus: int, command: str = "wiki"):
        joining = init_ray_for_tasks(cpus, WORKER_ENV)
        import ray

        self.slots = max(1, int(ray.cluster_resources().get("CPU", 1)))
        retries = {"max_retries": MAX_RETRIES, "retry_exceptions": [StorageError, OSError]}
        self._remote = ray.remote(num_cpus=1, **retries)(_task)
        # A streaming task takes no CPU slot: it waits (backpressure) for the tasks that consume what it
        # yields, and those must be able to run however many streams are open.
        self._stream = ray.remote(num_cpus=0, **retries)(_stream_task)
        where = f"the Ray cluster at {os.environ['RAY_ADDRESS']}" if joining else "a local Ray cluster"
        log.info(f"data_prep {command}: {self.slots} tasks at a time on {where}")

    def apply_async(self, fn, args: tuple) -> _Result:
        return _Result(self._remote.remote(fn, *args))

    def actors(self, cls, arguments: list[tuple]) -> list:
        """An actor ``cls(*args)`` for each of ``arguments``, each holding one CPU slot for the run; ``call`` runs
        their methods. One is not restarted when its process or node dies: its state would be lost, so its
        next call fails, and with it the run."""
        import ray

        remote = ray.remote(num_cpus=1, max_restarts=0)(cls)
        return [remote.remote(*args) for args in arguments]

    @staticmethod
    def call(actor, method: str, args: tuple, name: str) -> _Result:
        """``actor.method(*args)``, run after the calls made to it before (Ray runs one caller's calls to an
        actor in order); an ``ObjectRef`` among ``args`` reaches it as its object. ``name``: what a message
        calls the actor if it died."""
        return _Result(getattr(actor, method).remote(*args), name)

    def stream(self, fn, args: tuple, ahead: int) -> Iterator:
        """Run the generator ``fn(*args)`` as one Ray task: references to what it yields, in order, to pass
        to ``apply_async`` (the object goes from the streaming task to the consuming one, not through this
        process). It runs at most ``ahead`` objects ahead of what was taken. Retried as a whole when it
        fails; Ray hands out what an earlier attempt yielded only once."""
        return iter(self._stream.options(_generator_backpressure_num_objects=ahead).remote(fn, *args))

    def terminate(self) -> None:
        import ray

        ray.shutdown()
