"""Shard format 2 (``clsys-shards/2``): a tar sample is a *block* of many records (sentences, passages).

Format 1 stored each sentence as a sample of its own: two tar members, ~2 KiB of headers and padding around
~140 bytes of text (15× the text). A block stores up to ``ShardWriter.block_records`` records (at most
``MAX_BLOCK_RECORDS``) in three members, still a plain WebDataset sample that any tar reader opens:

- ``KEY.txt``: the records' texts, one per line (UTF-8). A text never holds a line feed: the writer refuses one.
- ``KEY.json``: ``{"records": N, "constant": {field: value}, "columns": {field: [N values]}}``: a record's
  metadata is every ``constant`` field plus its own value of every column (a field equal in all N records is
  stored once); a pre-tokenized block adds ``"ids_lengths": [N counts]``.
- ``KEY.ids`` (pre-tokenized only): every record's token ids, concatenated, as raw little-endian int32.

Block keys are the writer's block numbers (``000000042``); record ``i`` of block ``KEY`` is ``KEY/i`` to the
loader, which splits blocks into records before its shuffle buffer, so every guarantee counted in samples
(plans, exact and elastic resume, batch diversity) is counted in records. A format 2 manifest lists each
shard's ``samples`` (records) and ``blocks`` (tar samples).
"""
from __future__ import annotations

import array
import json
import struct
import sys
from typing import Any, Iterator, NamedTuple

from clsys.shards.names import clip

FORMAT_V2 = "clsys-shards/2"
# The most records a block may hold: 64 times data_prep's 256 (data_prep wiki --block-records). A record can
# take a single byte of a block (an empty text is a line feed), so a block's size does not bound its records
# while they are built: an 8 KB .tar.gz counting 4,000,000 records took 1.86 GiB of a loader worker.
MAX_BLOCK_RECORDS = 1 << 14
RECORD_OVERHEAD = 16  # bytes a record adds to its block besides its text and metadata values, roughly


def encode_ids(ids: list[int]) -> bytes:
    """Token ids as an ``ids`` member (either format): raw little-endian int32, whatever the machine's byte order."""
    return struct.pack(f"<{len(ids)}i", *ids)


def decode_ids(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes is not a whole number of int32 ids")
    return list(struct.unpack(f"<{len(data) // 4}i", data))


class Record(NamedTuple):
    """One record of a block: its text, its metadata (the same fields in every record of a block) and, in a
    pre-tokenized stream, its token ids."""

    text: str
    meta: dict[str, Any]
    ids: list[int] | None = None


def record_bytes(record: Record) -> int:
    """What a writer's shuffle window counts a record as: every character of its text and of its metadata's
    strings (lists of strings too: a pair's negatives), 8 a number, 4 a token id, and ``RECORD_OVERHEAD``.
    Counting the text alone let a window of short queries hold their long positives without bound."""
    size = len(record.text) + RECORD_OVERHEAD + 4 * len(record.ids or ())
    for value in record.meta.values():
        if isinstance(value, str):
            size += len(value)
        elif isinstance(value, list):
            size += sum(len(item) if isinstance(item, str) else 8 for item in value)
        else:
            size += 8
    return size


class BlockError(ValueError):
    """A block's members disagree (counts, columns, ids): the block cannot be split into records."""


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # JSON's 1 and true are equal in Python, not in a shard


def block_members(records: list[Record]) -> dict[str, bytes]:
    """A block's members (extension → data) for ``encode_members``; ``ValueError`` names the record (its
    position in the block) that a block cannot hold."""
    if not records:
        raise ValueError("a block holds at least one record")
    if len(records) > MAX_BLOCK_RECORDS:
        raise ValueError(f"a block holds at most {MAX_BLOCK_RECORDS:,} records, not {len(records):,}")
    fields = records[0].meta.keys()
    for i, record in enumerate(records):
        if "\n" in record.text:
            raise ValueError(f"record {i} of the block: its text holds a line feed (a block's txt has one text "
                             f"per line): {record.text[:60]!r}")
        if record.meta.keys() != fields:
            raise ValueError(f"record {i} of the block: metadata fields {sorted(record.meta)}, the block's first "
                             f"record has {sorted(fields)} (a block's records share their fields)")
        if (record.ids is None) != (records[0].ids is None):
            raise ValueError(f"record {i} of the block: token ids on some records of a block and not on others")
    constant, columns = {}, {}
    for name in fields:
        first = records[0].meta[name]
        if all(_same(r.meta[name], first) for r in records):
            constant[name] = first
        else:
            columns[name] = [r.meta[name] for r in records]
    meta: dict[str, Any] = {"records": len(records), "constant": constant, "columns": columns}
    members = {"txt": "\n".join(r.text for r in records).encode()}
    if records[0].ids is not None:
        meta["ids_lengths"] = [len(r.ids) for r in records]
        members["ids"] = encode_ids([i for r in records for i in r.ids])
    members["json"] = json.dumps(meta, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()
    return members


def record_count(meta: Any) -> int:
    """The records a block's json says it holds; ``BlockError`` when it is not a block's json, or counts more
    records than a block holds."""
    count = meta.get("records") if isinstance(meta, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise BlockError("its json is not a block's: 'records' must be a whole number >= 1")
    if count > MAX_BLOCK_RECORDS:
        raise BlockError(f"its json counts {count:,} records, more than a block holds ({MAX_BLOCK_RECORDS:,})")
    return count


def decoded_bytes(meta: dict, count: int, stored: int) -> int:
    """What the ``count`` records of a block whose members take ``stored`` bytes take decoded: each record
    gets its own copy of the block's constant fields (a column's values are shared out, a text or ids row
    is one record's), so a few bytes of json can make every record of a block a large object."""
    constant = meta.get("constant")
    if not isinstance(constant, dict) or count == 1:
        return stored  # not a block's json (split_block says why) or a block of one record: nothing copied
    return stored + (count - 1) * len(json.dumps(constant, ensure_ascii=False, separators=(",", ":")))


def split_block(key: str, text: str, meta: Any, ids: bytes | None) -> Iterator[dict[str, Any]]:
    """The records of block ``key`` (its decoded txt and json, its ids member's bytes or None) as the loader's
    samples: ``{"__key__": "KEY/i", "txt", "json"[, "ids"]}``. The block is checked whole here (``BlockError``
    says what disagrees); its records are then built one at a time, as they are read: a block's decoded
    records can take many times its bytes (``decoded_bytes``)."""
    count = record_count(meta)
    constant, columns = meta.get("constant"), meta.get("columns")
    if not isinstance(constant, dict) or not isinstance(columns, dict):
        raise BlockError("its json needs 'constant' and 'columns' objects")
    for name, column in columns.items():
        if not isinstance(column, list) or len(column) != count:
            raise BlockError(f"column '{clip(name)}' is not a list of {count} values, one per record")
    texts = text.split("\n")
    if len(texts) != count:
        raise BlockError(f"its txt has {len(texts)} lines, its json says {count} records")
    lengths = _ids_lengths(meta, ids, count)
    return _records(key, texts, constant, columns, None if lengths is None else _int32s(ids), lengths)


def _records(key: str, texts: list[str], constant: dict, columns: dict, ids: array.array | None,
             ids_lengths: list[int] | None) -> Iterator[dict[str, Any]]:
    start = 0  # the next record's first id in ``ids``
    for i, line in enumerate(texts):
        record_meta = dict(constant)
        for name, column in columns.items():
            record_meta[name] = column[i]
        record = {"__key__": f"{key}/{i}", "txt": line, "json": record_meta}
        if ids_lengths is not None:
            record["ids"] = ids[start:start + ids_lengths[i]].tolist()
            start += ids_lengths[i]
        yield record


def _int32s(data: bytes) -> array.array:
    """An ids member's int32s in one array: 4 bytes an id until a record's are taken out, where a list of all
    of a block's ids would take ~9 times that (a pointer and an int object each)."""
    values = array.array("i", data)  # C int: 32 bits wherever clsys runs
    if sys.byteorder == "big":
        values.byteswap()  # the member is little-endian (encode_ids)
    return values


def _ids_lengths(meta: dict, ids: bytes | None, count: int) -> list[int] | None:
    """Each record's number of token ids, once checked against the block's ids member; None: no ids."""
    lengths = meta.get("ids_lengths")
    if ids is None and lengths is None:
        return None
    if ids is None or lengths is None:
        raise BlockError("an ids member needs 'ids_lengths' in the json, and 'ids_lengths' an ids member")
    if (not isinstance(lengths, list) or len(lengths) != count
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in lengths)):
        raise BlockError(f"'ids_lengths' is not a list of {count} whole numbers >= 0")
    if len(ids) != 4 * sum(lengths):
        raise BlockError(f"its ids member holds {len(ids)} bytes, 'ids_lengths' says {sum(lengths)} int32 ids")
    return lengths
