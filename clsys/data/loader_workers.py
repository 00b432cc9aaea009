"""How a rank's loader worker processes start, live and end under the fast transport (``clsys.data.transport``).

``clsys.data.streaming`` decides what a loader worker reads and hands out; this module holds what makes a
worker the process it is, apart from what it reads: which start method makes it (a forkserver, and what that
forkserver imports once: ``worker_start``, ``forkserver_preload``), what it takes from its trainer as it begins
(the trainer's environment, a lower scheduling priority, its imports out of the garbage collector's sight:
``WorkerSetup``), and that it ends with its trainer (``follow_trainer``). These are the loader's process lifecycle,
which the data it reads never changes, so they live apart from it; ``clsys.data.transport`` puts them together at a
worker's start, with the one step that reaches a private name (the forkserver's "alive" pipe).
"""
from __future__ import annotations

import gc
import io
import multiprocessing
import os
import pickle
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Callable

# What the forkserver imports once, so that each loader worker forked from it starts in a fraction of a second
# ("__main__": the trainer's main module, which each worker would otherwise import again: under Ray, Ray's own).
_FORKSERVER_PRELOAD = ["__main__", "torch", "transformers", "clsys.data.streaming", "clsys.objectives"]

# Loader workers run this much nicer than the trainer (Linux's scheduling priority: +10 weighs ~1/10 of a default
# process). Where the cores are shared (a 2-core machine; a GPU node with more workers than spare cores), a worker
# that has just been sent its next index is making a bundle exactly when the trainer asks for the one before, and at
# equal priority the trainer's thread, the one that feeds the step (on a GPU, its kernel launches), waited a time
# slice for a core: 4-9 ms at ~half the steps that read a bundle, twice that at epoch boundaries. The workers' work is
# the same, only later in a step, and a step is long against it.
LOADER_WORKER_NICENESS = 10


class _ModuleRecorder(pickle.Pickler):
    """Pickles to nowhere, noting the module of every class and function the pickle names."""

    def __init__(self):
        super().__init__(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: dict[str, None] = {}  # in the order met

    def persistent_id(self, obj):  # called for every object pickled; None: pickle it as usual
        defined_in = getattr(obj, "__module__", None) if isinstance(obj, (type, types.FunctionType)) else None
        self.modules[defined_in or type(obj).__module__] = None
        return None


def forkserver_preload(collate: Callable) -> list[str]:
    """What the loader workers' forkserver imports once: ``_FORKSERVER_PRELOAD`` and every module that ``collate``'s
    pickle names. A worker unpickles its collate when it starts, and whatever that imports, each worker imports again
    at every epoch: MiniLM's tokenizer class alone pulls in ``transformers.models``, whose import scans transformers'
    source files, 0.3 s of CPU per worker start."""
    recorder = _ModuleRecorder()
    recorder.dump(collate)
    named = [m for m in recorder.modules if m not in ("builtins", "__main__") and not m.startswith("_")]
    return _FORKSERVER_PRELOAD + [m for m in named if m not in _FORKSERVER_PRELOAD]


def worker_start(collate: Callable) -> multiprocessing.context.BaseContext:
    """How loader workers start: forked from a forkserver, a clean process, not from the trainer. A worker forked
    from the trainer shares its pages copy-on-write, and every page the trainer then writes (weights, gradients,
    optimizer state; ZeRO-Offload's on GPU nodes) stays behind as the worker's private copy: measured on CPU
    with multilingual-e5-small, ~5 GB per worker, new workers every epoch."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(forkserver_preload(collate))  # heeded by the first loader, which starts it
    return context


@dataclass(frozen=True)
class WorkerSetup:
    """What a loader worker takes from its trainer as it begins, read in the trainer (``in_trainer``) and pickled with
    the dataset: the trainer's environment now (storage endpoints, credentials), as a worker forked from the trainer
    would have it (the forkserver has the one it was started with), and ``LOADER_WORKER_NICENESS``, read in the
    trainer, where a benchmark may change it."""

    environ: dict[str, str] = field(repr=False)  # credentials among them: never in a repr
    niceness: int

    @classmethod
    def in_trainer(cls) -> WorkerSetup:
        return cls(dict(os.environ), LOADER_WORKER_NICENESS)

    def apply(self) -> None:
        """In the loader worker, as it starts (the DataLoader's ``worker_init_fn``)."""
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if self.niceness:
            os.nice(self.niceness)  # this worker process, a new one for each segment; its threads start later
        # Out of the garbage collector's sight: what the worker starts with (the forkserver's torch and
        # transformers, ~220,000 objects, none of them garbage to be). A full collection walks every object it
        # tracks (0.11-0.13 s here), and the chunk tokenizer's growing dictionary set one off within each
        # new worker's first 150 batches: a quarter of their time. Frozen, a collection walks what the worker
        # made since (~70,000 objects, ~20 ms).
        gc.freeze()


# How often a loader worker looks whether its trainer is still there (``follow_trainer``): a read of /proc, ~20 µs.
TRAINER_CHECK_SECONDS = 0.5


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, from Linux's /proc): with the pid it names one process,
    whatever process later reuses the number. None where there is no such process, or it has exited (a zombie), or
    no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])  # fields 3 (state) and 22 (starttime)


def follow_trainer(trainer: int, started: int | None) -> None:
    """In a loader worker as it starts: exit it as soon as its trainer, process ``trainer`` started at ``started``
    (``process_start``; None: unknown, the worker does not watch), is gone.

    Ray restarting a rank, the OOM killer and scancel past its grace period kill the trainer's process alone, and its
    loader processes ran on: torch's watchdog in a worker watches the worker's parent, which is the forkserver. So a
    thread exits the worker as soon as the trainer is gone: at once (``os._exit``), as its batches have no reader now
    and an exit the usual way would wait for its queue's thread, which may be blocked on a full pipe. The forkserver
    ends with the trainer as well once every worker has closed its copy of the forkserver's "alive" pipe
    (``clsys.data.transport.close_forkserver_alive_copy``)."""
    if started is None:
        return

    def exit_when_the_trainer_is_gone() -> None:
        while process_start(trainer) == started:
            time.sleep(TRAINER_CHECK_SECONDS)
        os._exit(1)

    threading.Thread(target=exit_when_the_trainer_is_gone, name="clsys-follow-trainer", daemon=True).start()
