"""What a mining run reads: its pairs streams, the texts its corpus is made of, and which worker holds each text.

The pairs streams are the ``pairs/<source>`` streams under a root (what ``data_prep pairs`` writes): a record's
txt is the query, its json ``{positive, negatives, source, instruction}`` (``clsys/shards/fields.py``). The corpus
is a set of distinct texts, drawn from shards (``CorpusShard``: a shard, and what of each of its records is a
passage):

- ``passages``: a pairs record's positive and its given negatives;
- ``positives``: a pairs record's positive alone;
- ``text``: a record's txt (a ``documents`` or ``sentences`` stream, a foreign stream ``data_prep manifest``
  indexed: anything whose records are passages).

A text's id is its digest (``text_id``: BLAKE2b-64 of its UTF-8, cut to 63 bits, so that it is a non-negative
int64 below ``topk.NO_ID``, 2^63 - 1), the same in every process and run. A mining worker holds the texts whose id is its
rank modulo the number of workers (``owner``): which worker holds a text depends on the text alone, and equal
texts, wherever they come from, are one text of one worker. Ids break ties between equal scores
(``clsys.retrieval.topk``), so the result depends on neither the order the texts were read in nor the number of
workers. Two different texts with one id (a chance of about n² / 2^64 among n texts: 5 × 10^-8 for a million)
land on the same worker, which refuses them (``bucket_texts``, ``merge_buckets``) rather than take one for the other.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

from clsys import storage
from clsys.retrieval.topk import NO_ID
from clsys.shards.manifest import MANIFEST
from clsys.shards.reader import Shard, load_shards, read_shard
from clsys.storage import StorageError

WHAT = ("passages", "positives", "text")  # what of a record a corpus shard gives (the module docstring)
PAIRS = "pairs"  # the folder of the pairs streams under a root, and their stream kind


def text_id(text: str) -> int:
    """The id of a text: its 8-byte BLAKE2b digest as a little-endian integer, modulo 2^63 - 1 (``NO_ID``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % NO_ID


def owner(text: int, workers: int) -> int:
    """The worker (0..workers-1) that holds the text of id ``text``."""
    return text % workers


@dataclass(frozen=True)
class CorpusShard:
    """A shard, and what of each of its records is a passage (``WHAT``)."""

    shard: Shard
    what: str


def pair_streams(root: str) -> dict[str, str]:
    """``pairs/<source>`` → its URL, for every stream with a manifest directly under ``root/pairs/``; sorted."""
    streams = {}
    for _, name in storage.list_relative(storage.join(root, PAIRS)):
        match = re.fullmatch(rf"([^/]+)/{re.escape(MANIFEST)}", name)
        if match:
            streams[f"{PAIRS}/{match[1]}"] = storage.join(root, PAIRS, match[1])
    return dict(sorted(streams.items()))


def corpus_shards(data: dict[str, list[Shard]], corpus: str | None) -> list[CorpusShard]:
    """The shards of a run's corpus: the positives and given negatives of the pairs streams ``data`` (name →
    shards), or, given ``corpus``, the passages it holds (a stream's records' txt, or the positives and negatives
    of the pairs streams under a root) and the positives of ``data``, whose scores the false-negative filter
    needs (``clsys.retrieval.negatives``). ``StorageError`` when ``corpus`` is neither a stream nor a root of
    pairs streams."""
    def of(shards: list[Shard], what: str) -> list[CorpusShard]:
        return [CorpusShard(shard, what) for shard in shards]

    if corpus is None:
        return [item for shards in data.values() for item in of(shards, "passages")]
    if storage.exists(storage.join(corpus, MANIFEST)):
        items = of(load_shards(corpus), "text")
    else:
        streams = pair_streams(corpus)
        if not streams:
            raise StorageError(f"{corpus}: neither a stream (no {MANIFEST}) nor a root of pairs streams "
                               f"(no {PAIRS}/<source>/{MANIFEST} under it)")
        items = [item for url in streams.values() for item in of(load_shards(url, PAIRS), "passages")]
    return items + [item for shards in data.values() for item in of(shards, "positives")]


def passages(record: dict, what: str) -> list[str]:
    """The passages of one record (a ``read_shard`` sample) that a ``what`` shard gives."""
    if what == "text":
        return [record["txt"]]
    meta = record["json"]
    return [meta["positive"], *meta["negatives"]] if what == "passages" else [meta["positive"]]


def corpus_texts(shards: Iterable[CorpusShard]) -> Iterator[str]:
    """Every passage of ``shards``, in order, repeats included."""
    for item in shards:
        for record in read_shard(item.shard):
            yield from passages(record, item.what)


def bucket_texts(texts: Iterable[str], workers: int) -> list[dict[int, str]]:
    """The distinct ``texts`` by owner: one id → text map per worker."""
    buckets: list[dict[int, str]] = [{} for _ in range(workers)]
    for text in texts:
        key = text_id(text)
        _add(buckets[owner(key, workers)], key, text)
    return buckets


def merge_buckets(buckets: Iterable[dict[int, str]]) -> dict[int, str]:
    """One worker's texts from the buckets that the readers of the corpus made for it."""
    merged: dict[int, str] = {}
    for bucket in buckets:
        for key, text in bucket.items():
            _add(merged, key, text)
    return merged


def _add(bucket: dict[int, str], key: int, text: str) -> None:
    """``text`` under its id ``key``; ``ValueError`` when the id is another text's."""
    known = bucket.setdefault(key, text)
    if known != text:
        raise ValueError(f"two different texts have the id {key} (a 63-bit digest): {known[:60]!r} and "
                         f"{text[:60]!r}; change one of them to tell them apart")
