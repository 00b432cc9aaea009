"""Bad data in shards: by default every fault stops the run naming the shard, the member or sample and
the reason; with ``on_bad_sample: skip`` it is left out (a bad shard whole), counted, and no rank waits."""
from __future__ import annotations

import collections
import hashlib
import io
import re
import tarfile

import pytest
from test_streaming import SIZES, collate, consume, same_batches, write_stream

from clsys import storage
from clsys.shards.reader import ShardError, load_shards, read_shard
from clsys.data.epoch_layout import plan_epoch
from clsys.data.streaming import ShardLoader


def shard_url(url: str, n: int) -> str:
    return storage.join(url, f"shard-{n:06d}.tar")


def members(data: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def tar_bytes(entries: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def replace_shard(url: str, n: int, data: bytes, manifest_agrees: bool = True) -> None:
    """New bytes for shard n; with ``manifest_agrees`` the manifest lists their size and sha256, so
    only parsing or decoding can find the fault."""
    storage.write_bytes(shard_url(url, n), data)
    if manifest_agrees:
        manifest = storage.read_json(storage.join(url, "manifest.json"))
        manifest["shards"][n].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        storage.write_json(storage.join(url, "manifest.json"), manifest)


# One function per fault, spoiling shard n of a stream written by write_stream (members key.json,
# key.txt per sample); FAULTS maps each reason to it and to what the error names besides the shard.

def wrong_checksum(url, n, tmp_path):
    manifest = storage.read_json(storage.join(url, "manifest.json"))
    # Another shard's wrong sum must differ: two entries holding one sha256 are one shard listed twice.
    manifest["shards"][n]["sha256"] = hashlib.sha256(f"not shard {n}".encode()).hexdigest()
    storage.write_json(storage.join(url, "manifest.json"), manifest)


def truncated(url, n, tmp_path):
    data = storage.read_bytes(shard_url(url, n))
    replace_shard(url, n, data[:len(data) // 2], manifest_agrees=False)


def corrupt_header(url, n, tmp_path):
    data = bytearray(storage.read_bytes(shard_url(url, n)))
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
        third = tar.getmembers()[2]
    data[third.offset] ^= 0x20  # the first byte of its name: the header checksum no longer matches
    replace_shard(url, n, bytes(data))


def pickle_member(url, n, tmp_path):
    # Unpickling this would create the marker file: the test checks that it never exists.
    payload = b"cbuiltins\nopen\n(S'" + str(tmp_path / "unpickled").encode() + b"'\nS'w'\ntR."
    entries = members(storage.read_bytes(shard_url(url, n)))
    entries[3] = (entries[3][0].replace(".txt", ".pyd"), payload)
    replace_shard(url, n, tar_bytes(entries))


def undecodable(url, n, tmp_path):
    entries = members(storage.read_bytes(shard_url(url, n)))
    entries[0] = (entries[0][0], b"{not json")  # s..-0000.json
    entries[3] = (entries[3][0], b"\xff\xfe not utf-8")  # s..-0001.txt
    replace_shard(url, n, tar_bytes(entries))


def missing_field(url, n, tmp_path):
    entries = members(storage.read_bytes(shard_url(url, n)))
    replace_shard(url, n, tar_bytes(entries[:4] + entries[5:]))  # s..-0002 without its .json


FAULTS = {
    "checksum": (wrong_checksum, "sha256"),
    "truncated": (truncated, "bytes, the manifest says"),
    "corrupt": (corrupt_header, r"unreadable tar header at byte \d+ \(after member s\d\d-0000\.txt\)"),
    "unsafe": (pickle_member, r"sample s\d\d-0001 has a '\.pyd' member"),
    "undecodable": (undecodable, r"sample s\d\d-0000: its \.json member"),
    "missing_fields": (missing_field, r"sample s\d\d-0002 has no \.json member"),
}
SHARD_FAULTS = ("checksum", "truncated", "corrupt", "unsafe")  # these spoil the whole shard


@pytest.mark.parametrize("reason", FAULTS)
def test_bad_data_stops_the_run_naming_shard_sample_and_reason(tmp_path, reason):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [20, 20, 20])
    tamper, names = FAULTS[reason]
    tamper(url, 1, tmp_path)
    loader = ShardLoader(url, 0, 1, 4, collate, seed=0, loader_workers=1, shuffle_buffer=4)
    with pytest.raises(ShardError, match=re.escape(f"{shard_url(url, 1)}: {reason}: ") + ".*" + names):
        list(zip(range(100), loader))
    assert not (tmp_path / "unpickled").exists()


def test_a_cut_or_broken_tar_is_found_without_the_manifest_size_or_checksum(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [20])
    shard = load_shards(url)[0]
    data = storage.read_bytes(shard.url)
    unlisted = type(shard)(shard.url, shard.samples, "")
    storage.write_bytes(shard.url, data[:2560 + 5])  # inside the data of the third member
    with pytest.raises(ShardError, match=r"truncated: member s00-0001\.json: the shard ends inside it"):
        list(read_shard(unlisted, verify=False))
    storage.write_bytes(shard.url, data[:1024] + b"\1" * 512 + data[1536:])  # the second member's header
    with pytest.raises(ShardError, match=r"corrupt: unreadable tar header at byte 1024 \(after member s00-0000\.json"):
        list(read_shard(unlisted, verify=False))


def faulty_stream(url, tmp_path) -> tuple[set[str], set[str]]:
    """Ten shards, shard n < 6 with the n-th fault of FAULTS (the whole-shard ones first); the keys that
    must never be yielded, and the rest."""
    keys = write_stream(url, tmp_path, [12] * 10)
    for n, (tamper, _) in enumerate(FAULTS.values()):
        tamper(url, n, tmp_path)
    bad = {k for k in keys if int(k[1:3]) < len(SHARD_FAULTS)}
    bad |= {f"s{n:02d}-{i:04d}" for n, i in [(4, 0), (4, 1), (5, 2)]}  # the undecodable and the incomplete samples
    return bad, set(keys) - bad


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_leaves_bad_data_out_and_counts_it(tmp_path, workers):
    url = f"file://{tmp_path}/stream"
    bad, good = faulty_stream(url, tmp_path)
    # One sample per batch: the epoch ends when the workers run dry, after every fault was counted.
    loader = ShardLoader(url, 0, 1, 1, collate, seed=0, loader_workers=workers, shuffle_buffer=4,
                         on_bad_sample="skip")
    yielded, counts = [], collections.Counter()
    for batch in loader:
        if loader.state_dict()["epoch"]:
            break
        assert all(type(n) is int for n in batch["data_skipped"].values())
        yielded += batch["keys"]
        counts.update(batch["data_skipped"])
    assert set(yielded) == good and len(yielded) == len(good)
    assert counts == {"checksum": 1, "truncated": 1, "corrupt": 1, "unsafe": 1, "undecodable": 2, "missing_fields": 1}
    assert not (tmp_path / "unpickled").exists()


def test_skip_resumes_exactly_after_a_worker_ran_short(tmp_path):
    url = f"file://{tmp_path}/stream"
    faulty_stream(url, tmp_path)
    args = dict(rank=0, ranks=1, micro_batch=2, collate=collate, seed=1, loader_workers=2, shuffle_buffer=4,
                on_bad_sample="skip")
    straight, states = consume(ShardLoader(url, **args), 40)  # into the second epoch (34 batches in the first)
    for k in (7, 24, 27):  # late in the epoch, one worker has run out of data before the other
        resumed = ShardLoader(url, **args)
        resumed.load_state_dict(states[k - 1])
        assert same_batches(consume(resumed, 40 - k)[0], straight[k:]), k


@pytest.mark.timeout(60)
def test_no_rank_waits_when_its_workers_lose_data(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    wrong_checksum(url, 0, tmp_path)
    wrong_checksum(url, 5, tmp_path)
    planned = [plan_epoch(load_shards(url), epoch, 2, 2, 2, 3).batches_per_rank for epoch in range(3)]
    cut_short = []
    for rank in range(2):
        loader = ShardLoader(url, rank, 2, 3, collate, seed=2, loader_workers=2, shuffle_buffer=8,
                             on_bad_sample="skip")
        batches, epochs = iter(loader), []
        while len(set(epochs)) < 4:  # across three epoch boundaries
            next(batches)
            epochs.append(loader.state_dict()["epoch"])
        per_epoch = collections.Counter(epochs)
        assert all(per_epoch[epoch] <= planned[epoch] for epoch in range(3))
        cut_short += [per_epoch[epoch] < planned[epoch] for epoch in range(3)]
    # A lost shard ended some rank's epoch early, and that rank went on with the next one.
    assert any(cut_short)


def test_a_rank_whose_data_is_all_bad_stops_instead_of_spinning(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [10, 10])
    wrong_checksum(url, 0, tmp_path)
    wrong_checksum(url, 1, tmp_path)
    loader = ShardLoader(url, 0, 1, 2, collate, seed=0, loader_workers=1, on_bad_sample="skip")
    with pytest.raises(ShardError, match="rank 0 got no batch in epoch 0"):
        next(iter(loader))


def test_on_bad_sample_is_checked(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [10])
    with pytest.raises(ValueError, match="data.on_bad_sample: expected error or skip, got 'ignore'"):
        ShardLoader(url, 0, 1, 2, collate, seed=0, on_bad_sample="ignore")
