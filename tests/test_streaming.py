"""The shard loader: partitioning over ranks and loader workers, equal batch counts, exact and elastic
resume, safety. Bad data has its own file (test_streaming_faults.py)."""
from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from clsys import storage
from clsys.shards.reader import ShardError, load_shards, read_shard
from clsys.data.epoch_layout import plan_epoch, round_robin_position
from clsys.data.streaming import ShardLoader
from clsys.shards.writer import ShardWriter


def write_stream(url: str, tmp_path, sizes: list[int], text=lambda n, i: f"sentence {n} {i}") -> list[str]:
    """Shards with the given sample counts (sample i of shard n says ``text(n, i)``); returns every key."""
    keys = []
    for n, size in enumerate(sizes):
        writer = ShardWriter(storage.join(url, f"part{n}"), str(tmp_path), max_bytes=1 << 30)
        for i in range(size):
            keys.append(f"s{n:02d}-{i:04d}")
            writer.write(keys[-1], text(n, i), {"lang": "en"})
        writer.close()
        # Move the single shard into the common stream folder under a unique name.
        src = storage.join(url, f"part{n}", "shard-000000.tar")
        dst = storage.join(url, f"shard-{n:06d}.tar")
        storage.write_bytes(dst, storage.read_bytes(src))
        storage.delete(storage.join(url, f"part{n}"))
    shards = []
    for n, size in enumerate(sizes):
        data = storage.read_bytes(storage.join(url, f"shard-{n:06d}.tar"))
        shards.append({"name": f"shard-{n:06d}.tar", "samples": size, "bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()})
    storage.write_json(storage.join(url, "manifest.json"), {"format": "clsys-shards/1", "stream": "sentences",
                                                            "shards": shards, "samples": sum(sizes)})
    return keys


def collate(samples):
    return {"texts": [s["txt"] for s in samples]}


def worker_environment(samples):
    return {"env": os.environ.get("CLSYS_TEST_LOADER_ENV")}


def worker_niceness(samples):
    return {"niceness": os.nice(0)}


def worker_collector(samples):
    """What a full collection of the cyclic garbage collector would traverse in this process, and what it leaves."""
    return {"traversed": len(gc.get_objects()), "frozen": gc.get_freeze_count()}


def take(loader, n):
    it = iter(loader)
    return [next(it)["keys"] for _ in range(n)]


class NoisyCollate:
    """Draws from the global RNGs and keeps state across batches, as TaCL's and CLIR's collates do."""

    def __init__(self):
        self.seen, self.pool = 0, collections.deque(maxlen=5)

    def __call__(self, samples):
        self.seen += len(samples)
        self.pool.extend(s["__key__"] for s in samples)
        return {"noise": torch.rand(4), "coin": random.random(), "seen": self.seen,
                "negative": random.choice(list(self.pool))}


def same_batches(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
                                     for k in x)
        for x, y in zip(a, b))


def consume(loader, n):
    """n batches from a fresh iterator, and the loader's state after each."""
    it, batches, states = iter(loader), [], []
    for _ in range(n):
        batches.append(next(it))
        states.append(loader.state_dict())
    return batches, states


def rest_of_epoch(loader) -> tuple[list[str], list[str]]:
    """The keys of the batches the loader yields until its epoch changes, and of the next epoch's first."""
    epoch, keys = loader.state_dict()["epoch"], []
    for batch in loader:
        if loader.state_dict()["epoch"] != epoch:
            return keys, batch["keys"]
        keys += batch["keys"]


SIZES = [37, 52, 41, 29, 60, 33, 45, 50]


def test_ranks_and_workers_partition_an_epoch_with_equal_batch_counts(tmp_path):
    url = f"file://{tmp_path}/stream"
    keys = write_stream(url, tmp_path, SIZES)
    ranks, micro = 2, 4
    plan = plan_epoch(load_shards(url), 0, 7, ranks, 2, micro)
    seen = []
    for rank in range(ranks):
        loader = ShardLoader(url, rank, ranks, micro, collate, seed=7, loader_workers=2, shuffle_buffer=16)
        batches = take(loader, plan.batches_per_rank)
        state = loader.state_dict()
        assert (state["epoch"], state["segments"]) == (0, [{"ranks": 2, "workers": 2, "micro_batch": 4,
                                                            "batches": plan.batches_per_rank, "length_group": 0}])
        # Checkpoints keep it with torch.save and read it back with weights_only=True.
        saved = io.BytesIO()
        torch.save(state, saved)
        assert torch.load(io.BytesIO(saved.getvalue()), weights_only=True) == json.loads(json.dumps(state)) == state
        assert all(len(b) == micro for b in batches)
        seen += [k for b in batches for k in b]
    assert len(seen) == len(set(seen)), "a sample was read by two ranks"
    assert set(seen) <= set(keys)
    # Every rank stops at the same count: the minimum over ranks of what its workers can produce.
    assert plan.batches_per_rank == min(sum(plan.worker_batches(r)) for r in range(ranks))


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_resume_replays_the_same_batches_and_collate_randomness(tmp_path, workers):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    per_epoch = plan_epoch(load_shards(url), 0, 3, 2, workers, 3).batches_per_rank
    total = per_epoch + 6  # into epoch 1
    for rank in range(2):
        args = dict(rank=rank, ranks=2, micro_batch=3, seed=3, loader_workers=workers, shuffle_buffer=8)
        straight, states = consume(ShardLoader(url, collate=NoisyCollate(), **args), total)
        # Mid-shard (and not at the DataLoader's first worker), mid-epoch, at the end of the epoch, in the next one.
        for k in (5, per_epoch // 2 + 1, per_epoch, per_epoch + 3):
            resumed = ShardLoader(url, collate=NoisyCollate(), **args)
            resumed.load_state_dict(states[k - 1])
            torch.manual_seed(k)  # a resumed training process's RNG is anywhere
            assert same_batches(consume(resumed, total - k)[0], straight[k:]), (rank, k)


def test_bundles_change_nothing_but_the_transfer(tmp_path):
    """A loader worker sends its batches in bundles; the trainer must hand them out exactly as single batches
    would come: the same batches, collate draws and positions, in the same order, through workers running dry
    at different points, and a resume from a position inside a bundle must continue as the straight run."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    args = dict(rank=0, ranks=1, micro_batch=3, seed=1, loader_workers=3, shuffle_buffer=8)
    per_epoch = plan_epoch(load_shards(url), 0, 1, 1, 3, 3).batches_per_rank
    total = per_epoch + 4
    loader = ShardLoader(url, collate=NoisyCollate(), bundle=1, **args)
    # The workers run dry apart, two of them inside a bundle of 5: after 27 × 3 batches, after 81 + 2 × 11.
    assert [piece.batches for piece in loader.layout(loader.state).pieces[0]] == [50, 38, 27]
    single, single_states = consume(loader, total)
    for bundle in (2, 5):
        bundled, states = consume(ShardLoader(url, collate=NoisyCollate(), bundle=bundle, **args), total)
        assert same_batches(bundled, single) and states == single_states, bundle
    for k in (3, 7, 90, per_epoch - 2):  # inside bundles of 5: of the first worker, another's, two left, one left
        resumed = ShardLoader(url, collate=NoisyCollate(), bundle=5, **args)
        resumed.load_state_dict(single_states[k - 1])
        assert same_batches(consume(resumed, total - k)[0], single[k:]), k


def heavy_collate(samples):
    return {"noise": torch.rand(100_000)}  # 400 KB: a bundle larger than a default pipe (64 KiB)


def test_a_bundle_made_while_the_trainer_is_busy_is_there_whole(tmp_path):
    """The worker's batches are made while the trainer steps; when it asks for one it must be in the pipe
    whole, not 64 KiB of it with the rest waiting for the worker's queue thread to be scheduled (a few ms
    a bundle on busy cores). Nobody reads here: the pipe must come to hold the worker's prefetched bundles."""
    import fcntl
    import termios

    from clsys.data.batch_transport import RESULT_PIPE_BYTES, grow_result_pipe
    from clsys.data.streaming import SegmentReader

    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [40])
    loader = ShardLoader(url, rank=0, ranks=1, micro_batch=4, collate=heavy_collate, seed=1, bundle=1)
    reader = SegmentReader(loader, loader.state)
    try:
        pipe = reader.bundles._worker_result_queue._reader.fileno()  # torch's private queue: see grow_result_pipe
        waiting, deadline = 0, time.monotonic() + 15
        while waiting < 2 * 400_000 and time.monotonic() < deadline:  # the DataLoader's prefetch: two batches
            time.sleep(0.05)
            waiting = int.from_bytes(fcntl.ioctl(pipe, termios.FIONREAD, b"\0" * 4), sys.byteorder)
        assert waiting >= 2 * 400_000, f"{waiting} bytes in the pipe: the bundles did not fit"
        assert grow_result_pipe(reader.bundles) == RESULT_PIPE_BYTES
        assert next(iter(reader))["noise"].shape == (100_000,)
    finally:
        reader.close()


@pytest.mark.parametrize("counts, bundle, turn", [([23, 5, 14], 2, 0), ([23, 5, 14], 3, 1), ([12, 12], 4, 1),
                                                  ([30, 0, 7, 18], 4, 2), ([9], 2, 0)])
def test_one_at_a_time_hands_out_the_single_batch_order_holding_a_bundle_a_worker(counts, bundle, turn):
    """What the DataLoader delivers (each worker's bundles, taken in turn from ``turn``, exhausted workers passed
    over) → the order single batches would have: each worker in turn, an exhausted one passed over
    (``round_robin_position``'s order). It may not read ahead to learn who ran dry: at every batch handed out
    it holds at most one bundle a worker."""
    from clsys.data.batch_transport import WORKER_KEY, one_at_a_time

    workers, pulled = len(counts), [0]

    def delivered():
        left = [[{WORKER_KEY: w, "i": i} for i in range(n)] for w, n in enumerate(counts)]
        w = turn
        while any(left):
            if left[w]:
                chunk, left[w] = left[w][:bundle], left[w][bundle:]
                pulled[0] += len(chunk)
                yield chunk
            w = (w + 1) % workers

    expected, produced, w = [], [0] * workers, turn
    while len(expected) < sum(counts):
        if produced[w] < counts[w]:
            expected.append((w, produced[w]))
            produced[w] += 1
        w = (w + 1) % workers
    got = []
    for batch in one_at_a_time(delivered(), workers, turn):
        got.append((batch[WORKER_KEY], batch["i"]))
        assert pulled[0] - len(got) <= workers * bundle, (len(got), pulled[0])
    assert got == expected


def test_the_loader_leaves_the_training_process_rngs_alone(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    torch.manual_seed(0)
    random.seed(0)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    take(ShardLoader(url, 0, 1, 4, NoisyCollate(), seed=0, loader_workers=2, shuffle_buffer=8), 5)
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == python_state


def test_a_rank_resumes_only_its_own_state(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    first = ShardLoader(url, 0, 2, 3, collate, seed=0, loader_workers=2, shuffle_buffer=8)
    take(first, 3)
    with pytest.raises(ValueError, match="state of rank 0 cannot resume rank 1"):
        ShardLoader(url, 1, 2, 3, collate, seed=0, loader_workers=2).load_state_dict(first.state_dict())


def test_a_position_saved_before_geometries_were_recorded_resumes(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    args = dict(rank=1, ranks=2, micro_batch=3, collate=collate, seed=3, loader_workers=2, shuffle_buffer=8)
    straight = take(ShardLoader(url, **args), 12)
    resumed = ShardLoader(url, **args)
    resumed.load_state_dict({"epoch": 0, "batches": 7})
    assert take(resumed, 5) == straight[7:]


GLOBAL_BATCH = 12


def geometry_run(url, ranks, workers, state, batches):
    """Every rank of a geometry resumes from ``state`` (None: fresh) and reads ``batches`` batches (None:
    to the end of the epoch). Returns the keys read, rank 0's loader and (to the end) the keys of rank
    0's first batch of the next epoch."""
    keys = []
    for rank in reversed(range(ranks)):
        loader = ShardLoader(url, rank, ranks, GLOBAL_BATCH // ranks, collate, seed=5, loader_workers=workers,
                             shuffle_buffer=8)
        if state is not None:
            loader.load_state_dict(state)
        if batches is None:
            read, following = rest_of_epoch(loader)
        else:
            read, following = [k for b in take(loader, batches) for k in b], None
        keys += read
    return keys, loader, following


@pytest.mark.parametrize("old_ranks,new_ranks", [(2, 1), (2, 3), (3, 2)])
@pytest.mark.parametrize("workers", [1, 2])
def test_resume_with_other_ranks_continues_the_epoch(tmp_path, old_ranks, new_ranks, workers):
    url = f"file://{tmp_path}/stream"
    every_key = write_stream(url, tmp_path, SIZES)
    per_epoch = plan_epoch(load_shards(url), 0, 5, old_ranks, workers, GLOBAL_BATCH // old_ranks).batches_per_rank
    before, old, _ = geometry_run(url, old_ranks, workers, None, per_epoch // 2)
    # Every new rank gets rank 0's state, as clsys.engine.checkpoint hands it out.
    after, new, next_batch = geometry_run(url, new_ranks, workers, old.state_dict(), None)
    assert len(before + after) == len(set(before + after)), "a sample was read twice in the epoch"
    # Of what the old ranks left, only what fills no batch of every new rank goes unread.
    assert len(set(every_key) - set(before) - set(after)) < new_ranks * (GLOBAL_BATCH // new_ranks)

    # The next epoch is the new geometry's own plan.
    fresh = ShardLoader(url, 0, new_ranks, GLOBAL_BATCH // new_ranks, collate, seed=5, loader_workers=workers,
                        shuffle_buffer=8)
    fresh.load_state_dict({**fresh.state_dict(), "epoch": 1})
    assert [next_batch] + take(new, 3) == take(fresh, 4)


def test_an_elastic_state_resumes_exactly_and_elastically_again(tmp_path):
    url = f"file://{tmp_path}/stream"
    every_key = write_stream(url, tmp_path, SIZES)
    first, two, _ = geometry_run(url, 2, 2, None, 5)
    second, three, _ = geometry_run(url, 3, 2, two.state_dict(), 4)

    # Exactly: a rank of the second geometry stopped mid-way and resumed replays the same batches.
    args = dict(rank=1, ranks=3, micro_batch=4, seed=5, loader_workers=2, shuffle_buffer=8)
    straight = ShardLoader(url, collate=NoisyCollate(), **args)
    straight.load_state_dict(two.state_dict())
    batches, states = consume(straight, 9)
    resumed = ShardLoader(url, collate=NoisyCollate(), **args)
    resumed.load_state_dict(states[3])
    assert same_batches(consume(resumed, 5)[0], batches[4:])

    # Elastically again, within the same epoch: 2 ranks → 3 → 1.
    third, _, _ = geometry_run(url, 1, 2, three.state_dict(), None)
    read = first + second + third
    assert len(read) == len(set(read))
    assert len(set(every_key) - set(read)) < GLOBAL_BATCH


def test_loader_workers_do_not_share_the_trainers_memory(tmp_path, monkeypatch):
    """Loader workers start from a clean process (a forkserver), not forked from the training process: a
    worker forked from it shares its memory copy-on-write and keeps, as its own, every page the trainer
    writes afterwards (weights, gradients, optimizer state; ~5 GB per worker with multilingual-e5-small on
    CPU). They still see the trainer's environment of when the epoch began, as forked workers would."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    monkeypatch.setenv("CLSYS_TEST_LOADER_ENV", "set after the forkserver may have started")
    state = bytearray(64 * 2**20)  # stands for the training state, in memory before the workers start
    address = ctypes.addressof((ctypes.c_char * len(state)).from_buffer(state))
    batches = iter(ShardLoader(url, 0, 1, 4, worker_environment, seed=0, loader_workers=2, shuffle_buffer=8))
    assert [next(batches)["env"] for _ in range(2)] == ["set after the forkserver may have started"] * 2  # both workers
    workers = [p for p in psutil.Process().children(recursive=True) if p.name() == "pt_data_worker"]
    assert len(workers) == 2

    def maps_state(worker: psutil.Process) -> bool:
        # A forked worker has the trainer's mappings at the same addresses; a clean process has its own.
        spans = (m.addr.split("-") for m in worker.memory_maps(grouped=False))
        return any(int(start, 16) <= address < int(end, 16) for start, end in spans)

    assert not any(maps_state(w) for w in workers)
    assert all(w.ppid() != os.getpid() for w in workers)


def test_loader_workers_yield_the_cores_to_the_trainer(tmp_path):
    """Both workers run LOADER_WORKER_NICENESS nicer than the trainer, so that on shared cores the trainer's
    thread gets a core as soon as it asks for a batch; the trainer's own priority is left as it was."""
    from clsys.data.streaming import LOADER_WORKER_NICENESS

    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [40, 40])
    trainer = os.nice(0)
    batches = iter(ShardLoader(url, 0, 1, 4, worker_niceness, seed=0, loader_workers=2, shuffle_buffer=8))
    assert {next(batches)["niceness"] for _ in range(4)} == {min(19, trainer + LOADER_WORKER_NICENESS)}
    assert os.nice(0) == trainer and LOADER_WORKER_NICENESS > 0


def test_loader_workers_leave_their_imports_out_of_garbage_collection(tmp_path):
    """A loader worker holds torch's and transformers' objects (its forkserver imported them), and a full collection
    of Python's garbage collector, which the chunk tokenizer's growing dictionary set off within each new worker's
    first 150 batches, walked all of them: measured, a quarter of a tokenizing worker's time there. The worker freezes
    what it starts with, so a collection walks only what the worker made."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [40, 40])
    batches = iter(ShardLoader(url, 0, 1, 4, worker_collector, seed=0, loader_workers=2, shuffle_buffer=8))
    seen = [next(batches) for _ in range(4)]
    assert all(b["frozen"] > 100_000 for b in seen)  # the imports: torch's alone are more
    assert all(b["traversed"] < 0.1 * b["frozen"] for b in seen)


# A trainer in miniature: the loader over the shards at argv[1], two workers, ``argv[2]`` batches taken, then a step
# that lasts until the process is killed. One batch a transfer: a worker that has made its whole piece of the epoch
# ends, and with bundles of 16 both of this epoch's did before half-epoch.
TRAINER = """
import sys, time
from clsys.data.streaming import ShardLoader
from test_streaming import collate
batches = iter(ShardLoader(sys.argv[1], 0, 1, 4, collate, seed=0, loader_workers=2, shuffle_buffer=8, bundle=1))
for _ in range(int(sys.argv[2])):
    next(batches)
time.sleep(600)
"""


def session_processes(session: int) -> dict[int, str]:
    """The processes of ``session`` that are still running (zombies are over): pid -> what it is, for messages."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, _, fields = stat.read_text().partition("(")[2].rpartition(")")
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        state, parent, _, sid = fields.split()[:4]
        if int(sid) == session and state not in "ZX":
            found[int(stat.parent.name)] = f"{comm} (parent {parent}): {command[:100]}"
    return found


def alive_pipe_writers(processes: dict[int, str]) -> set[int]:
    """Of ``processes`` (``session_processes``), those holding the write end of the loader workers' forkserver's
    "alive" pipe, whose read end is the forkserver's second argument: the forkserver exits once no process has it."""
    forkserver, alive = next((pid, int(found[1])) for pid, what in processes.items()
                             if not what.startswith("pt_data_worker")
                             and (found := re.search(r"multiprocessing.forkserver import main; main\(\d+, (\d+)", what)))
    pipe = os.readlink(f"/proc/{forkserver}/fd/{alive}")  # "pipe:[inode]", as each end of it reads
    holders = set()
    for pid in processes.keys() - {forkserver}:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # closed meanwhile
                if os.readlink(fd) == pipe:
                    holders.add(pid)
    return holders


def test_killing_the_trainer_ends_its_loader_processes(tmp_path):
    """Ray restarting a rank, the OOM killer and scancel past its grace period kill the trainer's process alone, with
    SIGKILL: its loader workers (~200 MB each), the next epoch's reading ahead among them, and their forkserver
    (~285 MB) must end with it, or every restart leaks a full set. Killed mid-epoch, and while the next epoch's
    workers read ahead, within seconds no process the trainer started is left (all are in its session)."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    per_epoch = plan_epoch(load_shards(url), 0, 0, 1, 2, 4).batches_per_rank
    # Batches taken before the kill, and the loader workers seen by then: this epoch's two, or those and the next
    # epoch's first (its second may still be starting when the trainer is killed: a case of its own to clean up).
    cases = {"mid-epoch": (1, 2), "reading ahead": (per_epoch // 2 + 2, 3)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    logs = {case: tmp_path / f"{case}.log" for case in cases}
    trainers = {}
    for case, (taken, _) in cases.items():  # both at once: each takes seconds to start its forkserver
        with logs[case].open("w") as log:
            trainers[case] = subprocess.Popen([sys.executable, "-c", TRAINER, url, str(taken)], env=env,
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Workers seen, in both trainers from their start, not workers running: a worker that has made its whole
        # piece of the epoch ends, which under load can come before the next epoch's second worker starts (the next
        # epoch's wait for the trainer's step).
        deadline, seen = time.monotonic() + 60, {case: set() for case in cases}
        while any(len(seen[case]) < workers for case, (_, workers) in cases.items()):
            for case, trainer in trainers.items():
                seen[case] |= {pid for pid, what in session_processes(trainer.pid).items()
                               if what.startswith("pt_data_worker")}
                assert trainer.poll() is None, logs[case].read_text()
                assert time.monotonic() < deadline, f"{case}: workers never started: seen {seen[case]}, now " \
                    f"{session_processes(trainer.pid)}; {logs[case].read_text()}"
            time.sleep(0.1)
        for case, trainer in trainers.items():
            # Once the workers have started (a worker just forked may not be there yet), the write end of the
            # forkserver's alive pipe is the trainer's alone: no worker keeps the forkserver running without it.
            deadline = time.monotonic() + 5
            while (writers := alive_pipe_writers(started := session_processes(trainer.pid))) != {trainer.pid} \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            assert writers == {trainer.pid}, f"{case}: the forkserver's alive pipe is held by {writers} of {started}"
            trainer.kill()
            trainer.wait()
            deadline = time.monotonic() + 5
            while (left := session_processes(trainer.pid)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not left, f"{case}: left running after the trainer was killed: {left}; started: {started}"
    finally:
        for trainer in trainers.values():
            trainer.kill()
            trainer.wait()
            for pid in session_processes(trainer.pid):
                os.kill(pid, signal.SIGKILL)


def test_epochs_reshuffle(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    plan = plan_epoch(load_shards(url), 0, 1, 1, 1, 5)
    loader = ShardLoader(url, 0, 1, 5, collate, seed=1, loader_workers=1, shuffle_buffer=8)
    both = take(loader, 2 * plan.batches_per_rank)
    assert both[:plan.batches_per_rank] != both[plan.batches_per_rank:]


def test_too_few_shards_is_an_error_naming_both_numbers(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [10, 10, 10])
    with pytest.raises(ValueError, match=r"3 shard\(s\) for 2 rank\(s\) × 2 loader worker\(s\)"):
        ShardLoader(url, 0, 2, 2, collate, seed=0, loader_workers=2)


def test_round_robin_position_skips_exhausted_workers():
    assert round_robin_position([3, 1, 2], 0) == ([0, 0, 0], 0)
    assert round_robin_position([3, 1, 2], 4) == ([2, 1, 1], 1)
    assert round_robin_position([3, 1, 2], 5) == ([2, 1, 2], 0)
    assert round_robin_position([3, 1, 2], 6) == ([3, 1, 2], 1)


def test_checksum_mismatch_and_pickles_are_refused(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [5])
    shard = load_shards(url)[0]
    bad = dataclasses.replace(shard, sha256="0" * 64)
    with pytest.raises(ShardError, match="sha256"):
        list(read_shard(bad))

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("k1.txt", b"hello"), ("k1.pyd", b"\x80\x04K\x01.")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    evil = f"file://{tmp_path}/evil.tar"
    storage.write_bytes(evil, buf.getvalue())
    with pytest.raises(ShardError, match=r"'\.pyd' member"):
        list(read_shard(type(shard)(evil, 1, ""), verify=False))


def test_streams_from_s3(s3_bucket, tmp_path):
    url = f"{s3_bucket}/stream"
    keys = write_stream(url, tmp_path, [12, 9])
    loader = ShardLoader(url, 0, 1, 3, collate, seed=0, loader_workers=2, shuffle_buffer=4)
    got = [k for b in take(loader, 7) for k in b]
    assert sorted(got) == sorted(keys)
