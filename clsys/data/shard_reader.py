"""Reading one shard of a ``data_prep`` stream, safely: whole, checked, and only txt/json/ids decoded.

A shard is read whole into memory (64 MiB with data_prep's default shard size); its size and
sha256 are compared with the manifest and its tar structure is parsed before any sample is
yielded, so no sample of a bad shard is ever used. Only ``txt``, ``json`` and ``ids`` (token ids of a
pre-tokenized stream: raw little-endian int32, see ``encode_ids``) members are decoded: a shard with
any other member (a pickle, say) is bad, and nothing is ever unpickled. Reasons a shard
or sample is bad (what ``data.on_bad_sample: skip`` counts): ``checksum``, ``truncated``,
``corrupt``, ``unsafe`` (a whole shard), ``undecodable``, ``missing_fields`` (one sample).
"""
from __future__ import annotations

import collections
import hashlib
import io
import json
import struct
import tarfile
from dataclasses import dataclass
from typing import Any, Iterator

from clsys import storage


def encode_ids(ids: list[int]) -> bytes:
    """Token ids as an ``ids`` member: raw little-endian int32, whatever the machine's byte order."""
    return struct.pack(f"<{len(ids)}i", *ids)


def decode_ids(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes is not a whole number of int32 ids")
    return list(struct.unpack(f"<{len(data) // 4}i", data))


SAFE_EXTENSIONS = {"txt": lambda b: b.decode("utf-8"), "json": lambda b: json.loads(b), "ids": decode_ids}
FIELDS = ("json", "txt")  # the members every sample of a data_prep stream has (ids is optional)


class ShardError(RuntimeError):
    """Bad data: a shard or sample that cannot be trusted; the message names the shard, the member or
    sample, and the reason."""


class _Fault(Exception):
    """Bad data found in a shard; ``reason`` is what ``data_skipped`` counts it under."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Shard:
    url: str
    samples: int
    sha256: str
    size: int = 0  # bytes, as the manifest lists them (0: not listed)


def load_shards(stream_url: str) -> list[Shard]:
    from data_prep.shards import read_manifest

    manifest = read_manifest(stream_url)
    return [Shard(storage.join(stream_url, s["name"]), int(s["samples"]), s["sha256"], int(s.get("bytes", 0)))
            for s in manifest["shards"]]


def _tar_members(data: bytes) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every member of a tar held in memory."""
    members: list[tuple[str, int, int]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for info in tar:
                if not info.isfile():
                    raise _Fault("corrupt", f"member {info.name} is not a regular file")
                if info.offset_data + info.size > len(data):
                    raise _Fault("truncated", f"member {info.name}: the shard ends inside it")
                members.append((info.name, info.offset_data, info.size))
            end = tar.offset
    except tarfile.TarError as err:
        raise _Fault("corrupt", f"unreadable tar ({err})") from None
    # tarfile stops quietly at a header it cannot parse (a bad checksum, a cut), so check that only
    # the zero blocks of the end-of-archive marker follow the last member.
    if data[end:].strip(b"\0"):
        after = f"after member {members[-1][0]}" if members else "at the start"
        reason = "truncated" if len(data) - end < tarfile.BLOCKSIZE else "corrupt"
        raise _Fault(reason, f"unreadable tar header at byte {end} ({after})")
    return members


def _check_shard(shard: Shard, data: bytes, verify: bool) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """The samples of a shard as (key, {extension: (offset, size)}), once the whole shard is known good."""
    if shard.size and len(data) != shard.size:
        reason = "truncated" if len(data) < shard.size else "corrupt"
        raise _Fault(reason, f"{len(data)} bytes, the manifest says {shard.size}")
    if verify and (got := hashlib.sha256(data).hexdigest()) != shard.sha256:
        raise _Fault("checksum", f"sha256 {got} does not match the manifest ({shard.sha256})")
    samples: list[tuple[str, dict[str, tuple[int, int]]]] = []
    for name, offset, size in _tar_members(data):
        # WebDataset's convention: the key is the path up to the first dot of the file name, and
        # consecutive members with the same key make one sample.
        folder, slash, base = name.rpartition("/")
        stem, dot, ext = base.partition(".")
        key = folder + slash + stem
        if not dot:
            raise _Fault("corrupt", f"member {name} has no extension")
        if ext not in SAFE_EXTENSIONS:
            raise _Fault("unsafe", f"sample {key} has a '.{ext}' member; only {', '.join(SAFE_EXTENSIONS)} "
                                   f"are decoded (never pickles)")
        if not samples or samples[-1][0] != key:
            samples.append((key, {}))
        if ext in samples[-1][1]:
            raise _Fault("corrupt", f"member {name} appears twice in its sample")
        samples[-1][1][ext] = (offset, size)
    if len(samples) != shard.samples:
        raise _Fault("corrupt", f"{len(samples)} samples, the manifest says {shard.samples}")
    return samples


def _decode(key: str, members: dict[str, tuple[int, int]], data: bytes) -> dict[str, Any]:
    missing = [f".{f}" for f in FIELDS if f not in members]
    if missing:
        raise _Fault("missing_fields", f"sample {key} has no {', '.join(missing)} member")
    decoded = {"__key__": key}
    for ext, (offset, size) in members.items():
        try:
            decoded[ext] = SAFE_EXTENSIONS[ext](data[offset:offset + size])
        except ValueError as err:  # UnicodeDecodeError, JSONDecodeError and decode_ids's all are
            raise _Fault("undecodable", f"sample {key}: its .{ext} member cannot be decoded ({err})") from None
    return decoded


def read_shard(shard: Shard, verify: bool = True,
               skipped: collections.Counter | None = None) -> Iterator[dict[str, Any]]:
    """Decoded samples of one shard, read whole and checked before the first one is yielded.

    Bad data raises ShardError naming the shard, the member or sample and the reason; given a
    ``skipped`` counter, it is counted by reason instead and left out: a bad shard whole, a bad
    sample alone.
    """
    def bad(fault: _Fault) -> None:
        if skipped is None:
            raise ShardError(f"{shard.url}: {fault}")
        skipped[fault.reason] += 1

    data = storage.read_bytes(shard.url)
    try:
        samples = _check_shard(shard, data, verify)
    except _Fault as fault:
        bad(fault)
        return
    for key, members in samples:
        try:
            sample = _decode(key, members, data)
        except _Fault as fault:
            bad(fault)
            continue
        yield sample
