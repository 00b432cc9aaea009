"""The shard loader reads the next epoch ahead: its workers start at half-epoch, from a thread, so no step
waits for them at the boundary or while they start, and they prefetch ~2 s of steps. Partitioning, resume and
safety: test_streaming.py."""
from __future__ import annotations

import os
import threading
import time

from clsys.data.epoch_layout import plan_epoch
from clsys.data.streaming import ShardLoader, prefetch_depth
from test_streaming import SIZES, collate, take, write_stream


class PidRecorder:
    """Collate that appends the loader worker's pid to a file: which processes have made a batch."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, samples):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return {"n": len(samples)}


def test_the_next_epoch_is_read_ahead_before_the_boundary(tmp_path):
    """A GPU step takes tens of ms; new loader workers, their first shards and shuffle buffers take seconds.
    Once half an epoch is handed out, the next epoch's workers must already be making batches while the
    trainer still works on this one, and the batches after the boundary are those of a loader read without
    the read-ahead (same keys, same order)."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    log = tmp_path / "pids.txt"
    args = dict(rank=0, ranks=1, micro_batch=4, seed=3, loader_workers=2, shuffle_buffer=8)
    loader = ShardLoader(url, collate=PidRecorder(str(log)), **args)
    per_epoch = plan_epoch(loader.shards, 0, 3, 1, 2, 4).batches_per_rank
    batches = iter(loader)
    first = [next(batches) for _ in range(per_epoch // 2 + 1)]
    this_epoch = set(log.read_text().split())
    deadline = time.monotonic() + 60
    while len(set(log.read_text().split()) - this_epoch) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ahead = set(log.read_text().split()) - this_epoch
    assert len(ahead) == 2, f"the next epoch's workers made no batch before the boundary (workers seen: {this_epoch})"
    assert loader.state_dict()["epoch"] == 0
    rest = [next(batches) for _ in range(per_epoch - len(first) + 3)]
    assert loader.state_dict()["epoch"] == 1
    plain = take(ShardLoader(url, collate=collate, **args), per_epoch + 3)
    assert [b["keys"] for b in first + rest] == plain


class SlowToUnpickle:
    """A collate that takes ``seconds`` to unpickle in a loader worker, followed by 1 MiB of state: the
    parent's write of the worker's dataset blocks until the worker has read it all (a real collate's
    tokenizer is rebuilt from its JSON the same way)."""

    def __init__(self, seconds: float):
        self.seconds, self.padding = seconds, b"\0" * 2**20

    def __getstate__(self):
        return {"seconds": self.seconds, "then": _Sleep(self.seconds), "padding": self.padding}

    def __setstate__(self, state):
        self.seconds, self.padding = state["seconds"], state["padding"]

    def __call__(self, samples):
        return {"n": len(samples)}


class _Sleep:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def __reduce__(self):
        return time.sleep, (self.seconds,)


def unpickling_thread() -> str:
    return threading.current_thread().name


class UnpickledOn:
    """Becomes, in the trainer, the name of the thread that unpickled it: the one that took its batch off the pipe."""

    def __reduce__(self):
        return unpickling_thread, ()


def tag_with_unpickling_thread(samples):
    return {"unpickled_on": UnpickledOn()}


def test_the_next_epochs_first_batches_are_taken_off_the_pipe_before_the_boundary(tmp_path):
    """Reading a bundle off the workers' pipe and unpickling it took 2.4-3.5 ms of a step's wait, and at a boundary
    the first bundle of each new worker came in the epoch's first two steps (bench/epoch_boundary.py). The read-ahead
    thread takes each new worker's first bundle off the pipe before the boundary (and any later one that came while
    it waited: the DataLoader unpickles what arrives out of turn and keeps it for its turn)."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    loader = ShardLoader(url, 0, 1, 4, tag_with_unpickling_thread, seed=3, loader_workers=2, shuffle_buffer=8,
                         bundle=2)
    per_epoch = plan_epoch(loader.shards, 0, 3, 1, 2, 4).batches_per_rank
    batches = iter(loader)
    threads = [next(batches)["unpickled_on"] for _ in range(per_epoch + 8)]
    assert loader.state_dict()["epoch"] == 1
    boundary = threads[per_epoch:]
    assert all(t != threading.main_thread().name for t in boundary[:4]), boundary  # two bundles of two batches
    assert all(t == threading.main_thread().name for t in threads[:per_epoch]), threads  # the first reader's own


def test_starting_the_next_epochs_workers_does_not_hold_up_the_steps(tmp_path):
    """The next epoch's workers are started at half-epoch while training goes on: no step waits for them to
    unpickle their collate (with the training thread starting them, one step waited 2 × 1.5 s here)."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    loader = ShardLoader(url, 0, 1, 4, SlowToUnpickle(1.5), seed=3, loader_workers=2, shuffle_buffer=8)
    per_epoch = plan_epoch(loader.shards, 0, 3, 1, 2, 4).batches_per_rank
    batches = iter(loader)
    for _ in range(per_epoch // 2 - 1):
        next(batches)
        time.sleep(0.02)  # a step: the workers keep their prefetch full
    waits = []
    for _ in range(6):  # across the half-epoch mark
        start = time.perf_counter()
        next(batches)
        waits.append(time.perf_counter() - start)
        time.sleep(0.02)
    assert max(waits) < 1.0, f"a step waited {max(waits):.1f} s for the next epoch's workers to start"


def test_the_next_epochs_prefetch_depth_follows_the_step_time(tmp_path):
    """Each loader worker keeps ~2 s of steps ready (at least the DataLoader's 2) besides its first batch, which
    the reader takes off the pipe as it is made: steps of 0.26 s with two workers make the next epoch's workers
    prefetch ⌈2 / 0.26 / 2⌉ = 4 batches each, 8 in all, before the boundary, and 2 first ones (any step time from
    0.25 to 0.33 s gives 4: a loaded machine's slower steps too); the first epoch, with no step measured yet, 2
    each besides the first."""
    assert [prefetch_depth(None, 2), prefetch_depth(1.0, 2), prefetch_depth(0.05, 4), prefetch_depth(1e-4, 1)] == \
        [2, 2, 10, 64]
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    log = tmp_path / "pids.txt"
    # One batch a transfer, so that the DataLoader's prefetch counts batches (it counts bundles, test_streaming.py).
    loader = ShardLoader(url, 0, 1, 16, PidRecorder(str(log)), seed=3, loader_workers=2, shuffle_buffer=8, bundle=1)
    per_epoch = plan_epoch(loader.shards, 0, 3, 1, 2, 16).batches_per_rank
    batches = iter(loader)
    next(batches)
    deadline = time.monotonic() + 60
    while len(log.read_text().split()) < 2 + 2 * 2 and time.monotonic() < deadline:  # workers fill their prefetch
        time.sleep(0.1)
    time.sleep(0.5)  # and make no more than that
    made = log.read_text().split()
    assert len(made) == 2 + 2 * 2  # the first batch of each (one handed out), and 2 a worker ready
    for _ in range(per_epoch // 2 + 1):  # the read-ahead starts at the request after the half-epoch's batch
        time.sleep(0.26)
        next(batches)
    assert loader.state_dict()["epoch"] == 0
    this_epoch = set(made)

    def ahead() -> list[str]:
        return [pid for pid in log.read_text().split() if pid not in this_epoch]

    deadline = time.monotonic() + 60
    while len(ahead()) < 2 + 2 * 4 and time.monotonic() < deadline:  # the next epoch's workers start and prefetch
        time.sleep(0.1)
    time.sleep(1.0)  # and make no more than that
    assert len(set(ahead())) == 2 and len(ahead()) == 2 + 2 * 4, ahead()
