"""The unlabeled corpus CSS-LM retrieves from: ``data_prep wiki`` sentence shards read in corpus order.

The bank (docs/training/objectives.md#css-lm-bank) is "the first N corpus sentences with at least ``min_tokens``
tokens". Shards are read in manifest order and samples in shard order, never shuffled, so the
bank's rows are the same whatever the number of workers that encode them: worker r of W takes the
qualifying sentences numbered r·N/W … (r+1)·N/W − 1.
"""
from __future__ import annotations

import collections
import itertools
from typing import Iterator

from clsys import storage
from clsys.shards.reader import MAX_SHARD_BYTES, load_shards, read_shard

TOKENIZE_CHUNK = 1024  # sentences tokenised at once while counting tokens


def resolve_corpus_stream(url: str) -> str:
    """The sentences stream: ``url`` itself when it has a manifest, else ``url/sentences`` (a data_prep root)."""
    if not url:
        raise ValueError("objective.corpus.url: set it to the sentence shards of the unlabeled corpus "
                         "(the --out of `python -m data_prep wiki`, or its sentences/ folder)")
    for candidate in (url, storage.join(url, "sentences")):
        if storage.exists(storage.join(candidate, "manifest.json")):
            return candidate
    raise FileNotFoundError(f"objective.corpus.url: no manifest.json in {url} or in {storage.join(url, 'sentences')}")


def corpus_texts(stream: str, verify: bool = True, skipped: collections.Counter | None = None,
                 max_bytes: int = MAX_SHARD_BYTES) -> Iterator[str]:
    """Every sentence of the stream in corpus order (shards in manifest order). Bad data raises, or is
    counted in ``skipped`` and left out when given (``data.on_bad_sample: skip``); ``max_bytes``: the
    most a shard's tar may take (``data.max_shard_mb``)."""
    for shard in load_shards(stream, "sentences", max_bytes):
        for sample in read_shard(shard, verify, skipped):
            yield sample["txt"]


def bank_sentences(texts: Iterator[str], tokenizer, min_tokens: int, start: int, stop: int) -> tuple[list[str], int]:
    """The qualifying sentences (>= ``min_tokens`` tokens, special tokens not counted) numbered
    ``start`` … ``stop`` − 1, and how many qualifying sentences were seen: ``stop`` unless the corpus
    ran out first."""
    kept: list[str] = []
    seen = 0
    while seen < stop:
        chunk = list(itertools.islice(texts, TOKENIZE_CHUNK))
        if not chunk:
            break
        lengths = [len(ids) for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]]
        for text, length in zip(chunk, lengths):
            if length < min_tokens:
                continue
            if start <= seen < stop:
                kept.append(text)
            seen += 1
            if seen == stop:
                break
    return kept, seen
