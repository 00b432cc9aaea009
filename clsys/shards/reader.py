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
data_prep's 64 MiB shards), and so may what is stored: it is read as a stream that stops just past the limit
(a manifest need not list a shard's size, and may name what has none: ``file:///dev/zero``), and a compressed
one decompressed as another (a few hundred KiB of gzip can hold a GiB of zeros). Members must be plain regular
files: tarfile counts GNU sparse members as regular, at sizes that reach into the members after them. A
sample's ``json`` must hold what its stream kind's objective reads (``clsys.shards.fields``).

A format 2 shard's samples are blocks of records (``clsys.shards.blocks``), which ``read_shard`` yields record
by record: their number (the manifest's ``blocks``) and the records their json counts (its ``samples``) are
checked with the rest of the shard, and so is each block's count (at most ``MAX_BLOCK_RECORDS``) and what its
records take decoded (at most ``max_bytes``: each has its own copy of the block's constant fields); then a block's
records are built one at a time, as they are yielded. A block whose members disagree is one bad sample
(``undecodable``), a record whose metadata lacks its stream kind's fields one more (``missing_fields``). A format 1
manifest over format 2 shards (whose blocks it would read as samples of many texts) makes them ``corrupt``.

Reasons a shard or sample is bad (what ``data.on_bad_sample: skip`` counts): ``checksum``,
``truncated``, ``corrupt``, ``unsafe``, ``too_large`` (a whole shard), ``undecodable``, ``missing_fields``
(one sample: a member, or a json field its stream kind needs, is missing or of the wrong type), and where training
reads token ids (``Shard.ids_vocab``) ``unsafe`` for ids the manifest names no tokenizer for and ``ids_out_of_range``
(one sample, or a block: an id outside the training tokenizer's vocabulary).
"""
from __future__ import annotations

import collections
import gzip
import hashlib
import io
import tarfile
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator

from clsys import storage
from clsys.shards.blocks import FORMAT_V2, BlockError, decode_ids, decoded_bytes, record_count, split_block
from clsys.shards.fields import fields_problem
from clsys.shards.manifest import FORMAT, read_manifest, shard_url
from clsys.shards.names import clip


SAFE_EXTENSIONS = {"txt": lambda b: b.decode("utf-8"), "json": storage.loads_json, "ids": decode_ids}
FIELDS = ("json", "txt")  # the members every sample of a data_prep stream has (ids is optional)
COMPRESSED = (".tar.gz", ".tgz")  # shard names read as gzip-compressed tars
MAX_SHARD_BYTES = 1 << 30  # data.max_shard_mb's default
_READ_CHUNK = 1 << 20  # bytes read (or decompressed) at a time
# What tar members may be: regular files alone (tarfile's isfile() also takes CONTTYPE and GNU sparse ones).
_PLAIN_FILE = (tarfile.REGTYPE, tarfile.AREGTYPE)
_MEMBER_TYPES = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link", tarfile.DIRTYPE: "a folder",
                 tarfile.CHRTYPE: "a device", tarfile.BLKTYPE: "a device", tarfile.FIFOTYPE: "a FIFO",
                 tarfile.CONTTYPE: "a contiguous file"}


class ShardError(RuntimeError):
    """Bad data: a shard or sample that cannot be trusted; the message names the shard, the member or
    sample, and the reason, never a secret the shard's URL holds (as StorageError's)."""

    def __init__(self, message: str):
        super().__init__(storage.redact(message))


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
    # When training reads the samples' token ids: the number of ids of its tokenizer, each id must be below it.
    # 0: the manifest names no tokenizer whose fingerprint would vouch for the ids, so a sample with ids is bad.
    # None: ids are read as they are (nothing trains on them).
    ids_vocab: int | None = None


def load_shards(stream_url: str, kind: str = "", max_bytes: int = MAX_SHARD_BYTES,
                vocab_size: int | None = None) -> list[Shard]:
    """The shards a stream's manifest lists (``read_manifest`` checked every field), to be read as a ``kind``
    stream with tars of at most ``max_bytes``; ``vocab_size``: the training tokenizer's number of ids when training
    reads the samples' ids (``Shard.ids_vocab``), which only a manifest naming a tokenizer can vouch for."""
    manifest = read_manifest(stream_url)
    text_member = manifest["foreign"]["text_member"] if "foreign" in manifest else None
    blocked = manifest["format"] == FORMAT_V2
    ids_vocab = vocab_size if vocab_size is None or "tokenizer" in manifest else 0
    return [Shard(shard_url(stream_url, s["name"]), s["samples"], s["sha256"], s.get("bytes", 0), text_member,
                  kind, max_bytes, s["blocks"] if blocked else None, ids_vocab) for s in manifest["shards"]]


def _tar_members(data: bytes) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every member of a tar held in memory."""
    members: list[tuple[str, int, int]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for info in tar:
                if info.type not in _PLAIN_FILE or info.issparse():
                    what = "a sparse file" if info.issparse() else _MEMBER_TYPES.get(info.type, "of another type")
                    raise BadData("corrupt", f"member {clip(info.name)} is {what}, not a regular file")
                if info.offset_data + info.size > len(data):
                    raise BadData("truncated", f"member {clip(info.name)}: the shard ends inside it")
                members.append((info.name, info.offset_data, info.size))
            end = tar.offset
    except tarfile.TarError as err:
        raise BadData("corrupt", f"unreadable tar ({err})") from None
    # tarfile stops quietly at a header it cannot parse (a bad checksum, a cut), so check that only
    # the zero blocks of the end-of-archive marker follow the last member.
    if data[end:].strip(b"\0"):
        after = f"after member {clip(members[-1][0])}" if members else "at the start"
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
        if problem := format2_block(tar):
            raise BadData("corrupt", problem)
        if len(samples) != shard.samples:
            raise BadData("corrupt", f"{len(samples)} samples, the manifest says {shard.samples}")
        return tar, samples
    if len(samples) != shard.blocks:
        raise BadData("corrupt", f"{len(samples)} blocks, the manifest says {shard.blocks}")
    records = sum(_block_records(key, members, tar, shard.max_bytes) for key, members in samples)
    if records != shard.samples:
        raise BadData("corrupt", f"its blocks hold {records} records, the manifest says {shard.samples}")
    return tar, samples


def _block_records(key: str, members: dict[str, tuple[int, int]], tar: bytes, max_bytes: int) -> int:
    """The records a format 2 block's json counts; a block without a readable count, or whose records would
    take more than ``max_bytes`` decoded, makes its shard bad."""
    if "json" not in members:
        raise BadData("corrupt", f"block {clip(key)} has no .json member")
    offset, size = members["json"]
    try:
        meta = storage.loads_json(tar[offset:offset + size])
        count = record_count(meta)
    except (ValueError, BlockError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadData("corrupt", f"block {clip(key)}: {err}") from None
    decoded = decoded_bytes(meta, count, sum(size for _, size in members.values()))
    if decoded > max_bytes:
        raise BadData("too_large", f"block {clip(key)}: its {count:,} records take {decoded:,} bytes decoded (every "
                                   f"one its own copy of the block's constant fields), more than {_limit(max_bytes)}")
    return count


def format2_block(tar: bytes) -> str | None:
    """Why a tar read as format 1 (``clsys-shards/1``: a data_prep stream's or a foreign one's) cannot be, or
    None: its first sample is a format 2 block, a json that counts N records and a txt of N lines, which format 1
    would read as one sample of N texts. The first sample tells: shards of one stream are of one format, and a
    block read as a sample is a mistake (a manifest of the wrong format), not a danger."""
    first_key, first = None, {}  # the first sample's key and its txt and json members
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as archive:  # its structure is checked: sample_members
        for info in archive:
            key, ext = _key_ext(info.name)
            if first_key is not None and key != first_key:
                break
            first_key = key
            if ext in ("txt", "json"):
                first[ext] = tar[info.offset_data:info.offset_data + info.size]
    try:
        meta = storage.loads_json(first["json"])
        count = record_count(meta)
    except (KeyError, ValueError, BlockError):  # no json, or not a block's
        return None
    blocked = isinstance(meta.get("constant"), dict) and isinstance(meta.get("columns"), dict)
    if not blocked or "txt" not in first or first["txt"].count(b"\n") + 1 != count:
        return None
    return (f"sample {clip(first_key)} is a block of {count:,} records of {FORMAT_V2}, which a {FORMAT} manifest "
            f"reads as one sample: read these shards with the manifest data_prep wrote with them")


def read_stored(url: str, max_bytes: int = MAX_SHARD_BYTES) -> bytes:
    """A shard's bytes as stored, read as a stream that stops one chunk past ``max_bytes`` (``too_large``): a
    manifest need not list a shard's size, and what it names need not have one (``file:///dev/zero``)."""
    # No end for the stream: an S3 ranged GET that starts past an empty object's end fails (HTTP 416), and a
    # shard's bad bytes are bad data, not a storage error.
    with storage.open_read(url) as stream:
        data = _read_within(stream, max_bytes)
    if data is None:
        raise BadData("too_large", f"more than {_limit(max_bytes)} stored")
    return data


def untar_bytes(url: str, data: bytes, max_bytes: int = MAX_SHARD_BYTES) -> bytes:
    """The tar inside a shard as stored (``read_stored``), of at most ``max_bytes``: gunzipped for a
    ``.tar.gz``/``.tgz`` name, stopping at the first chunk past the limit."""
    if not url.endswith(COMPRESSED):
        return data  # read_stored held it to max_bytes
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as stream:
            tar = _read_within(stream, max_bytes)
    except EOFError as err:
        raise BadData("truncated", f"the gzip stream ends early ({err})") from None
    except OSError as err:  # gzip.BadGzipFile, zlib.error
        raise BadData("corrupt", f"unreadable gzip ({err})") from None
    if tar is None:
        raise BadData("too_large", f"the tar inside is larger than {_limit(max_bytes)}")
    return tar


def _read_within(stream: BinaryIO, max_bytes: int) -> bytes | None:
    """What ``stream`` holds, read a chunk at a time; None once it has given more than ``max_bytes``."""
    # A BytesIO hands back its own buffer, resized in place, where joining a list of chunks would copy them:
    # the data is held once at the end, not twice.
    out = io.BytesIO()
    while chunk := stream.read(min(_READ_CHUNK, max_bytes + 1 - out.tell())):
        out.write(chunk)
    return None if out.tell() > max_bytes else out.getvalue()


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
        # Consecutive members with the same key make one sample.
        key, ext = _key_ext(name)
        if read is None and "." not in name.rpartition("/")[2]:
            raise BadData("corrupt", f"member {clip(name)} has no extension")
        if read is None and ext not in SAFE_EXTENSIONS:
            raise BadData("unsafe", f"sample {clip(key)} has a '.{clip(ext)}' member; only "
                                   f"{', '.join(SAFE_EXTENSIONS)} are decoded (never pickles)")
        if not samples or samples[-1][0] != key:
            samples.append((key, {}))
            seen = set()
        if ext in seen:
            raise BadData("corrupt", f"member {clip(name)} appears twice in its sample")
        seen.add(ext)
        if extensions is not None:
            extensions[ext] += 1
        if read is None or ext in read:
            samples[-1][1][ext] = (offset, size)
    return samples


def _key_ext(name: str) -> tuple[str, str]:
    """A tar member's sample key and extension, by WebDataset's convention: the key is the path up to the first
    dot of the file name, the extension what follows it."""
    folder, slash, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return folder + slash + stem, ext


def _decode(key: str, members: dict[str, tuple[int, int]], data: bytes, shard: Shard) -> Iterable[dict[str, Any]]:
    """The samples of one tar sample: itself (format 1), or its block's records (format 2), each built as it
    is taken."""
    text_member = shard.text_member
    required = (text_member,) if text_member else FIELDS
    missing = [f".{f}" for f in required if f not in members]
    if missing:
        raise BadData("missing_fields", f"sample {clip(key)} has no {', '.join(missing)} member")
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
            raise BadData("undecodable", f"sample {clip(key)}: its .{ext} member cannot be decoded ({err})") from None
    if shard.blocks is None:
        samples = [decoded]
    else:
        try:
            samples = split_block(key, decoded["txt"], decoded["json"], decoded.get("ids"))
        except BlockError as err:
            raise BadData("undecodable", f"block {clip(key)}: {err}") from None
    if "ids" in members and shard.ids_vocab is not None:
        offset, size = members["ids"]
        _check_ids(samples, data[offset:offset + size], shard.ids_vocab)
    return samples


def _check_ids(samples: Iterable[dict[str, Any]], ids: bytes, vocab: int) -> None:
    """Refuse token ids that training would take as they are (``Shard.ids_vocab``) but cannot: ids that no
    tokenizer fingerprint vouches for, and ids outside the vocabulary, which the embedding lookup would fail on
    with no shard named (on a GPU, a device-side assert that ends the process). ``ids``: the member of the tar
    sample (one sample, or a block of records), checked at once; the first bad sample is named."""
    import numpy as np  # here: what reads shards without training on ids (data_prep manifest) does without it

    if vocab == 0:
        first = next(iter(samples))  # a block's records are built as they are taken: this one is raised with
        raise BadData("unsafe", f"sample {clip(first['__key__'])} has token ids, but the stream's manifest names no "
                                f"tokenizer (data_prep tokenize records its fingerprint): ids that no fingerprint "
                                f"vouches for are not trained on")
    values = np.frombuffer(ids, "<i4")  # whole int32s: decoding checked that
    if values.size == 0 or (values.min() >= 0 and values.max() < vocab):
        return
    sample = next(s for s in samples if any(not 0 <= i < vocab for i in s["ids"]))
    bad = next(i for i in sample["ids"] if not 0 <= i < vocab)
    raise BadData("ids_out_of_range", f"sample {clip(sample['__key__'])}: token id {bad} is outside the training "
                                      f"tokenizer's vocabulary (ids 0 to {vocab - 1})")


def _fields_fault(sample: dict[str, Any], shard: Shard) -> BadData | None:
    if problem := fields_problem(shard.kind, sample["json"]):
        foreign = " (a foreign stream's samples have no metadata: their json is {})" if shard.text_member else ""
        return BadData("missing_fields", f"sample {clip(sample['__key__'])}: {problem}{foreign}")
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
            raise ShardError(f"{clip(shard.url)}: {fault}")
        skipped[fault.reason] += 1

    if shard.size > shard.max_bytes:  # never read
        bad(BadData("too_large", f"{shard.size} bytes, more than {_limit(shard.max_bytes)}"))
        return
    try:
        tar, samples = _check_shard(shard, read_stored(shard.url, shard.max_bytes), verify)
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
