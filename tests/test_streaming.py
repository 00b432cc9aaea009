"""The shard loader: partitioning over ranks and loader workers, equal batch counts, exact and elastic
resume, safety. Bad data has its own file (test_streaming_faults.py), the worker processes' start and end theirs
(test_loader_workers.py)."""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import random
import sys
import tarfile
import time

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
    assert loader.plan(loader.state).worker_batches(0) == [50, 38, 27]
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

    from clsys.data.transport import RESULT_PIPE_BYTES, grow_result_pipe
    from clsys.data.streaming import SegmentReader

    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [40])
    loader = ShardLoader(url, rank=0, ranks=1, micro_batch=4, collate=heavy_collate, seed=1, bundle=1)
    reader = SegmentReader(loader, loader.state)
    try:
        bundles = reader.delivery.bundles  # the fast transport's DataLoader iterator
        pipe = bundles._worker_result_queue._reader.fileno()  # torch's private queue: see grow_result_pipe
        waiting, deadline = 0, time.monotonic() + 15
        while waiting < 2 * 400_000 and time.monotonic() < deadline:  # the DataLoader's prefetch: two batches
            time.sleep(0.05)
            waiting = int.from_bytes(fcntl.ioctl(pipe, termios.FIONREAD, b"\0" * 4), sys.byteorder)
        assert waiting >= 2 * 400_000, f"{waiting} bytes in the pipe: the bundles did not fit"
        assert grow_result_pipe(bundles) == RESULT_PIPE_BYTES
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
