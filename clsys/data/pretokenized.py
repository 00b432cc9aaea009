"""Pre-tokenized streams (``python -m data_prep tokenize``): the tokenizer fingerprint and batches from ids.

A pre-tokenized stream's samples carry an ``ids`` member, the tokens of their ``txt`` without special
tokens, and its manifest names the tokenizer: ``{"name", "fingerprint", "max_tokens"}``. Collate then
only frames, pads and stacks ids, producing exactly the tensors the tokenizer would for the same text,
and training refuses a stream whose fingerprint is not its tokenizer's, ids in a stream whose manifest names
no tokenizer, and ids outside the tokenizer's vocabulary (the loader's reader, ``Shard.ids_vocab``).
"""
from __future__ import annotations

import collections
import hashlib
import json
from typing import Any

import torch

from clsys.data.batch_tokenizer import BatchTokenizer
from clsys.shards.reader import Shard, read_shard

# The parts of a fast tokenizer's backend JSON that decide the ids of a text. Left out: the version,
# the decoder (ids -> text only), and truncation/padding, which every call with truncation=True or
# padding=True overwrites.
_ID_PARTS = ("added_tokens", "normalizer", "pre_tokenizer", "model", "post_processor")


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over what turns text into ids: vocabulary, merges, normalisation, pre-tokenisation, specials."""
    if not tokenizer.is_fast:
        raise ValueError(f"{type(tokenizer).__name__}: pre-tokenized streams need a fast (tokenizers) tokenizer")
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    parts = {key: backend.get(key) for key in _ID_PARTS}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def check_stream_tokenizer(stream: str, recorded: dict, name: str, tokenizer, max_length: int) -> None:
    """Refuse (ValueError) a pre-tokenized stream whose ids are not what ``tokenizer`` gives at ``max_length``."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if recorded["fingerprint"] != fingerprint:
        raise ValueError(f"{stream}: pre-tokenized with tokenizer {recorded['name']} (fingerprint "
                         f"{recorded['fingerprint']}), but training uses {name} (fingerprint {fingerprint}); "
                         f"re-run python -m data_prep tokenize --tokenizer {name}, or train on the text stream")
    needed = max_length - tokenizer.num_special_tokens_to_add()
    if recorded["max_tokens"] < needed:
        raise ValueError(f"{stream}: ids are cut at {recorded['max_tokens']} tokens, but data.max_length "
                         f"{max_length} keeps up to {needed}; re-run data_prep tokenize with --max-tokens {needed}")


def refuse_unvouched_ids(stream: str, first: Shard) -> None:
    """Refuse (ValueError) a stream whose manifest names no tokenizer when its first sample has token ids: no
    fingerprint vouches for them, and collate would train on them whatever the text says. Only the first shard is
    read here, at start-up; the loader refuses such ids in any shard (``Shard.ids_vocab``)."""
    # Bad data is left for the loader to report or skip, as data.on_bad_sample says.
    sample = next(read_shard(first, verify=False, skipped=collections.Counter()), None)
    if sample is not None and "ids" in sample:
        raise ValueError(f"{stream}: its samples have token ids ({first.url}, sample {sample['__key__']}), but its "
                         f"manifest names no tokenizer (data_prep tokenize records one, with its fingerprint): ids "
                         f"that no fingerprint vouches for are not trained on; re-run python -m data_prep tokenize, "
                         f"or train on the text stream")


class SentenceBatcher:
    """``txt`` samples -> encoder inputs: from their ``ids`` when every sample has them, else by tokenizing.
    Either way exactly the tensors of ``tokenizer(texts, padding=True, truncation=True, max_length=max_length,
    return_tensors="pt")``, built without a Python step per token (texts: ``fast``, ``BatchTokenizer``'s)."""

    def __init__(self, tokenizer, max_length: int, fast: bool = True):
        self.encode = BatchTokenizer(tokenizer, max_length, fast=fast)

    def __call__(self, samples: list[dict[str, Any]], copies: int = 1) -> dict[str, torch.Tensor]:
        """The batch of ``samples`` repeated ``copies`` times (rows [0, B) the first copy, and so on)."""
        if all("ids" in s for s in samples):
            return self.encode.frame_and_pad([s["ids"] for s in samples], copies)
        return self.encode([s["txt"] for s in samples], copies)
