"""Reading one shard of a stream, safely: whole, checked, and only txt/json/ids decoded.

A shard is read whole into memory (64 MiB with data_prep's default shard size); its size and
sha256 are compared with the manifest and its tar structure is parsed before any sample is
yielded, so no sample of a bad shard is ever used. Only ``txt``, ``json`` and ``ids`` (token ids of a
pre-tokenized stream: raw little-endian int32, see ``clsys.shards.blocks.encode_ids``) members are decoded, as UTF-8,
JSON and int32: nothing is ever unpickled.

- A ``data_prep`` stream has no other member: a shard with one (a pickle, say) is bad (``unsafe``).
- A foreign stream (shards written by other tools, indexed by ``python -m data_prep manifest``)
  keeps its text in the member its manifest names (``foreign.text_member``: ``txt``, ``caption``, …),
  read as the sample's ``txt``; every other member (images, labels, other tools' json, pickles) is
  skipped unread, and ``json`` is empty. ``.tar.gz``/``.tgz`` shards are decompressed in memory, after
  their size and sha256 are checked.

A shard's tar may take at most ``max_bytes`` in memory (``data.max_shard_mb``, 1 GiB by default: 16 times
data_prep's 64 MiB shards): a compressed one is decompressed as a stream that stops just past it (a few
hundred KiB of gzip can hold a GiB of zeros). Members must be plain regular files: tarfile counts GNU
sparse members as regular, at sizes that reach into the members after them. A sample's ``json`` must
hold what its stream kind's objective reads (``clsys.shards.fields``).

A format 2 shard's samples are blocks of records (``clsys.shards.blocks``), which ``read_shard`` yields record
by record: their number (the manifest's ``blocks``) and the records their json counts (its ``samples``) are
checked with the rest of the shard. A block whose members disagree is one bad sample (``undecodable``), a
record whose metadata lacks its stream kind's fields one more (``missing_fields``).

Reasons a shard or sample is bad (what ``data.on_bad_sample: skip`` counts): ``checksum``,
``truncated``, ``corrupt``, ``unsafe``, ``too_large`` (a whole shard), ``undecodable``, ``missing_fields``
(one sample: a member, or a json field its stream kind needs, is missing or of the wrong type).
"""
from __future__ import annotations

import collections
import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from typing import Any, Iterator

from clsys import storage
from clsys.shards.blocks import FORMAT_V2, BlockError, decode_ids, record_count, split_block
from clsys.shards.fields import fields_problem
from clsys.shards.manifest import read_manifest, shard_url


SAFE_EXTENSIONS = {"txt": lambda b: b.decode("utf-8"), "json": lambda b: json.loads(b), "ids": decode_ids}
FIELDS = ("json", "txt")  # the members every sample of a data_prep stream has (ids is optional)
COMPRESSED = (".tar.gz", ".tgz")  # shard names read as gzip-compressed tars
MAX_SHARD_BYTES = 1 << 30  # data.max_shard_mb's default
_GUNZIP_CHUNK = 1 << 20  # bytes decompressed at a time
# What tar members may be: regular files alone (tarfile's isfile() also takes CONTTYPE and GNU sparse ones).
_PLAIN_FILE = (tarfile.REGTYPE, tarfile.AREGTYPE)
_MEMBER_TYPES = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link", tarfile.DIRTYPE: "a folder",
                 tarfile.CHRTYPE: "a device", tarfile.BLKTYPE: "a device", tarfile.FIFOTYPE: "a FIFO",
                 tarfile.CONTTYPE: "a contiguous file"}


class ShardError(RuntimeError):
    """Bad data: a shard or sample that cannot be trusted; the message names the shard, the member or
    sample, and the reason."""


class BadData(Exception):
    """Bad data found in a shard (internal to reading; callers see ShardError or a skip count);
    ``reason`` is what ``data_skipped`` counts it under."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Shard:
    url: str
    samples: int
    sha256: str
    size: int = 0  # bytes, as the manifest lists them (0: not listed)
    text_member: str | None = None  # a foreign stream's text member (read as ``txt``); None: a data_prep stream
    kind: str = ""  # the stream kind whose json fields each sample must have (clsys.shards.fields); "": an object
    max_bytes: int = MAX_SHARD_BYTES  # the most bytes its tar may take in memory, decompressed
    blocks: int | None = None  # format 2: its tar samples, blocks of ``samples`` records in all; None: format 1


def load_shards(stream_url: str, kind: str = "", max_bytes: int = MAX_SHARD_BYTES) -> list[Shard]:
    """The shards a stream's manifest lists (``read_manifest`` checked every field), to be read as a ``kind``
    stream with tars of at most ``max_bytes``."""
    manifest = read_manifest(stream_url)
    text_member = manifest["foreign"]["text_member"] if "foreign" in manifest else None
    blocked = manifest["format"] == FORMAT_V2
    return [Shard(shard_url(stream_url, s["name"]), s["samples"], s["sha256"], s.get("bytes", 0), text_member,
                  kind, max_bytes, s["blocks"] if blocked else None) for s in manifest["shards"]]


def _tar_members(data: bytes) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every member of a tar held in memory."""
    members: list[tuple[str, int, int]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for info in tar:
                if info.type not in _PLAIN_FILE or info.issparse():
                    what = "a sparse file" if info.issparse() else _MEMBER_TYPES.get(info.type, "of another type")
                    raise BadData("corrupt", f"member {info.name} is {what}, not a regular file")
                if info.offset_data + info.size > len(data):
                    raise BadData("truncated", f"member {info.name}: the shard ends inside it")
                members.append((info.name, info.offset_data, info.size))
            end = tar.offset
    except tarfile.TarError as err:
        raise BadData("corrupt", f"unreadable tar ({err})") from None
    # tarfile stops quietly at a header it cannot parse (a bad checksum, a cut), so check that only
    # the zero blocks of the end-of-archive marker follow the last member.
    if data[end:].strip(b"\0"):
        after = f"after member {members[-1][0]}" if members else "at the start"
        reason = "truncated" if len(data) - end < tarfile.BLOCKSIZE else "corrupt"
        raise BadData(reason, f"unreadable tar header at byte {end} ({after})")
    return members


def _check_shard(shard: Shard, data: bytes, verify: bool) -> tuple[bytes, list[tuple[str, dict[str, tuple[int, int]]]]]:
    """The shard's tar (gunzipped if need be) and its samples as (key, {extension: (offset, size)}), once
    the whole shard is known good."""
    if shard.size and len(data) != shard.size:
        reason = "truncated" if len(data) < shard.size else "corrupt"
        raise BadData(reason, f"{len(data)} bytes, the manifest says {shard.size}")
    if verify and (got := hashlib.sha256(data).hexdigest()) != shard.sha256:
        raise BadData("checksum", f"sha256 {got} does not match the manifest ({shard.sha256})")
    tar = untar_bytes(shard.url, data, shard.max_bytes)
    samples = sample_members(tar, shard.text_member)
    if shard.blocks is None:
        if len(samples) != shard.samples:
            raise BadData("corrupt", f"{len(samples)} samples, the manifest says {shard.samples}")
        return tar, samples
    if len(samples) != shard.blocks:
        raise BadData("corrupt", f"{len(samples)} blocks, the manifest says {shard.blocks}")
    records = sum(_block_records(key, members, tar) for key, members in samples)
    if records != shard.samples:
        raise BadData("corrupt", f"its blocks hold {records} records, the manifest says {shard.samples}")
    return tar, samples


def _block_records(key: str, members: dict[str, tuple[int, int]], tar: bytes) -> int:
    """The records a format 2 block's json counts; a block without a readable count makes its shard bad."""
    if "json" not in members:
        raise BadData("corrupt", f"block {key} has no .json member")
    offset, size = members["json"]
    try:
        return record_count(json.loads(tar[offset:offset + size]))
    except (ValueError, BlockError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadData("corrupt", f"block {key}: {err}") from None


def untar_bytes(url: str, data: bytes, max_bytes: int = MAX_SHARD_BYTES) -> bytes:
    """The tar inside a shard as stored, of at most ``max_bytes``: gunzipped for a ``.tar.gz``/``.tgz`` name,
    a chunk at a time, stopping at the first byte past the limit."""
    if not url.endswith(COMPRESSED):
        if len(data) > max_bytes:
            raise BadData("too_large", f"{len(data)} bytes, more than {_limit(max_bytes)}")
        return data
    chunks: list[bytes] = []
    size = 0
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as stream:
            while chunk := stream.read(min(_GUNZIP_CHUNK, max_bytes + 1 - size)):
                chunks.append(chunk)
                size += len(chunk)
    except EOFError as err:
        raise BadData("truncated", f"the gzip stream ends early ({err})") from None
    except OSError as err:  # gzip.BadGzipFile, zlib.error
        raise BadData("corrupt", f"unreadable gzip ({err})") from None
    if size > max_bytes:
        raise BadData("too_large", f"the tar inside is larger than {_limit(max_bytes)}")
    return b"".join(chunks)


def _limit(max_bytes: int) -> str:
    size = f"{max_bytes >> 20} MiB" if max_bytes % (1 << 20) == 0 else f"{max_bytes} bytes"
    return f"{size} (data.max_shard_mb)"


def sample_members(tar: bytes, text_member: str | None = None, extensions: collections.Counter | None = None
                   ) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """The samples of a tar held in memory as (key, {extension: (offset, size)}) of the members clsys
    reads, after checking its structure and member types. ``text_member`` None: a data_prep stream (any
    member but txt/json/ids is unsafe); else a foreign one (members but the text are skipped).
    ``extensions`` counts every member by extension, skipped ones included."""
    read = {text_member} if text_member else None
    samples: list[tuple[str, dict[str, tuple[int, int]]]] = []
    seen: set[str] = set()  # the current sample's extensions, skipped ones included
    for name, offset, size in _tar_members(tar):
        # WebDataset's convention: the key is the path up to the first dot of the file name, and
        # consecutive members with the same key make one sample.
        folder, slash, base = name.rpartition("/")
        stem, dot, ext = base.partition(".")
        key = folder + slash + stem
        if read is None and not dot:
            raise BadData("corrupt", f"member {name} has no extension")
        if read is None and ext not in SAFE_EXTENSIONS:
            raise BadData("unsafe", f"sample {key} has a '.{ext}' member; only {', '.join(SAFE_EXTENSIONS)} "
                                   f"are decoded (never pickles)")
        if not samples or samples[-1][0] != key:
            samples.append((key, {}))
            seen = set()
        if ext in seen:
            raise BadData("corrupt", f"member {name} appears twice in its sample")
        seen.add(ext)
        if extensions is not None:
            extensions[ext] += 1
        if read is None or ext in read:
            samples[-1][1][ext] = (offset, size)
    return samples


def _decode(key: str, members: dict[str, tuple[int, int]], data: bytes, shard: Shard) -> list[dict[str, Any]]:
    """The samples of one tar sample: itself (format 1), or its block's records (format 2)."""
    text_member = shard.text_member
    required = (text_member,) if text_member else FIELDS
    missing = [f".{f}" for f in required if f not in members]
    if missing:
        raise BadData("missing_fields", f"sample {key} has no {', '.join(missing)} member")
    # A foreign sample's text is its txt; it has no metadata clsys knows (other tools' json means other things).
    decoded: dict[str, Any] = {"__key__": key} if text_member is None else {"__key__": key, "json": {}}
    for ext, (offset, size) in members.items():
        field = "txt" if ext == text_member else ext
        if shard.blocks is not None and ext == "ids":
            decoded["ids"] = data[offset:offset + size]  # the block's: split_block cuts it
            continue
        try:
            decoded[field] = SAFE_EXTENSIONS[field](data[offset:offset + size])
        except ValueError as err:  # UnicodeDecodeError, JSONDecodeError and decode_ids's all are
            raise BadData("undecodable", f"sample {key}: its .{ext} member cannot be decoded ({err})") from None
    if shard.blocks is None:
        return [decoded]
    try:
        return split_block(key, decoded["txt"], decoded["json"], decoded.get("ids"))
    except BlockError as err:
        raise BadData("undecodable", f"block {key}: {err}") from None


def _fields_fault(sample: dict[str, Any], shard: Shard) -> BadData | None:
    if problem := fields_problem(shard.kind, sample["json"]):
        foreign = " (a foreign stream's samples have no metadata: their json is {})" if shard.text_member else ""
        return BadData("missing_fields", f"sample {sample['__key__']}: {problem}{foreign}")
    return None


def read_shard(shard: Shard, verify: bool = True,
               skipped: collections.Counter | None = None) -> Iterator[dict[str, Any]]:
    """Decoded samples of one shard, read whole and checked before the first one is yielded.

    Bad data raises ShardError naming the shard, the member or sample and the reason; given a
    ``skipped`` counter, it is counted by reason instead and left out: a bad shard whole, a bad
    sample alone.
    """
    def bad(fault: BadData) -> None:
        if skipped is None:
            raise ShardError(f"{shard.url}: {fault}")
        skipped[fault.reason] += 1

    if shard.size > shard.max_bytes:  # never read
        bad(BadData("too_large", f"{shard.size} bytes, more than {_limit(shard.max_bytes)}"))
        return
    data = storage.read_bytes(shard.url)
    try:
        tar, samples = _check_shard(shard, data, verify)
    except BadData as fault:
        bad(fault)
        return
    for key, members in samples:
        try:
            decoded = _decode(key, members, tar, shard)
        except BadData as fault:
            bad(fault)
            continue
        for sample in decoded:
            if (fault := _fields_fault(sample, shard)) is not None:
                bad(fault)
                continue
            yield sample
