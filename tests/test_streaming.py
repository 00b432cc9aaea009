"""The shard loader: partitioning over ranks and loader workers, equal batch counts, resume, safety."""
from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from clsys import storage
from clsys.data.streaming import ShardError, ShardLoader, load_shards, plan_epoch, read_shard, round_robin_position
from data_prep.shards import ShardWriter


def write_stream(url: str, tmp_path, sizes: list[int]) -> list[str]:
    """Shards with the given sample counts; returns every key written."""
    keys = []
    for n, size in enumerate(sizes):
        writer = ShardWriter(storage.join(url, f"part{n}"), str(tmp_path), max_bytes=1 << 30)
        for i in range(size):
            keys.append(f"s{n:02d}-{i:04d}")
            writer.write(keys[-1], f"sentence {n} {i}", {"lang": "en"})
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
        assert loader.state_dict() == {"epoch": 0, "batches": plan.batches_per_rank}
        assert all(len(b) == micro for b in batches)
        seen += [k for b in batches for k in b]
    assert len(seen) == len(set(seen)), "a sample was read by two ranks"
    assert set(seen) <= set(keys)
    # Every rank stops at the same count: the minimum over ranks of what its workers can produce.
    assert plan.batches_per_rank == min(sum(plan.worker_batches(r)) for r in range(ranks))


def test_resume_mid_epoch_continues_exactly(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    args = dict(rank=1, ranks=2, micro_batch=3, collate=collate, seed=3, loader_workers=2, shuffle_buffer=8)
    straight = take(ShardLoader(url, **args), 40)  # crosses into epoch 1
    first = ShardLoader(url, **args)
    head = take(first, 13)
    resumed = ShardLoader(url, **args)
    resumed.load_state_dict(first.state_dict())
    assert head + take(resumed, 27) == straight


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
    bad = type(shard)(shard.url, shard.samples, "0" * 64)
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
