"""Pre-tokenized streams (``python -m data_prep tokenize``): the tokenizer fingerprint and batches from ids.

A pre-tokenized stream's samples carry an ``ids`` member, the tokens of their ``txt`` without special
tokens, and its manifest names the tokenizer: ``{"name", "fingerprint", "max_tokens"}``. Collate then
only frames, pads and stacks ids, producing exactly the tensors the tokenizer would for the same text,
and training refuses a stream whose fingerprint is not its tokenizer's.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from clsys.data.batch_tokenizer import BatchTokenizer

# The parts of a fast tokenizer's backend JSON that decide the ids of a text. Left out: the version,
# the decoder (ids -> text only), and truncation/padding, which every call with truncation=True or
# padding=True overwrites.
_ID_PARTS = ("added_tokens", "normalizer", "pre_tokenizer", "model", "post_processor")
_PROBE = "clsys probe"  # any text that tokenizes to at least one token


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


@dataclass(frozen=True)
class Framing:
    """What a tokenizer puts around one sentence's tokens, read off its own output for a probe text, so
    BERT's [CLS] … [SEP], a SentencePiece template or <s> … </s> are all mirrored exactly."""

    prefix: list[int]
    suffix: list[int]
    types: tuple[list[int], int, list[int]] | None  # token types: the prefix's, the text's, the suffix's

    @classmethod
    def of(cls, tokenizer) -> Framing:
        framed = tokenizer(_PROBE)
        content = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        ids = framed["input_ids"]
        start = next((i for i in range(len(ids) - len(content) + 1) if ids[i:i + len(content)] == content), None)
        if start is None:
            raise ValueError(f"{type(tokenizer).__name__}: its output for {_PROBE!r} does not contain the tokens "
                             "of the text without special tokens; cannot frame pre-tokenized ids")
        end = start + len(content)
        types = framed.get("token_type_ids")  # present when the tokenizer returns token types
        return cls(ids[:start], ids[end:], None if types is None else (types[:start], types[start], types[end:]))


class SentenceBatcher:
    """``txt`` samples -> encoder inputs: from their ``ids`` when every sample has them, else by tokenizing.
    Either way exactly the tensors of ``tokenizer(texts, padding=True, truncation=True, max_length=max_length,
    return_tensors="pt")``, built without a Python step per token."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.encode = BatchTokenizer(tokenizer, max_length)

    @functools.cached_property
    def framing(self) -> Framing:
        return Framing.of(self.tokenizer)  # on first use: objectives are built without a tokenizer in tests

    def __call__(self, samples: list[dict[str, Any]], copies: int = 1) -> dict[str, torch.Tensor]:
        """The batch of ``samples`` repeated ``copies`` times (rows [0, B) the first copy, and so on)."""
        if all("ids" in s for s in samples):
            batch = self._from_ids([s["ids"] for s in samples])
        else:
            batch = self.encode([s["txt"] for s in samples])
        # Built once and repeated: padding=True pads to the longest row either way.
        return {k: v.repeat(copies, 1) for k, v in batch.items()}

    def _from_ids(self, ids: list) -> dict[str, torch.Tensor]:
        """The batch of the texts these ids (without special tokens; lists or int arrays) came from: framed, cut
        as truncation=True cuts, padded; [batch, width] arrays filled through masks, no Python step per token."""
        prefix, suffix, types = self.framing.prefix, self.framing.suffix, self.framing.types
        keep = self.max_length - len(prefix) - len(suffix)  # what truncation=True keeps of the text
        left_cut = self.tokenizer.truncation_side == "left"
        texts = [row[max(len(row) - keep, 0):] if left_cut else row[:keep] for row in ids]
        text_lengths = np.fromiter(map(len, texts), np.int64, len(texts))
        lengths = text_lengths + len(prefix) + len(suffix)
        width = int(lengths.max())
        # Row i fills columns [start_i, end_i): flush left, or flush right when the tokenizer pads left.
        starts = width - lengths if self.tokenizer.padding_side == "left" else np.zeros_like(lengths)
        ends = starts + lengths
        columns = np.arange(width)
        real = (columns >= starts[:, None]) & (columns < ends[:, None])
        text = (columns >= starts[:, None] + len(prefix)) & (columns < ends[:, None] - len(suffix))
        flat = np.fromiter(itertools.chain.from_iterable(texts), np.int64, int(text_lengths.sum()))  # row-major
        out = {"input_ids": self._framed(text, starts, ends, self.tokenizer.pad_token_id, (prefix, flat, suffix)),
               "attention_mask": real.astype(np.int64)}
        if types is not None:
            out["token_type_ids"] = self._framed(text, starts, ends, self.tokenizer.pad_token_type_id, types)
        return {key: torch.from_numpy(out[key]) for key in self.encode.keys}  # the HF call's keys, in its order

    @staticmethod
    def _framed(text: np.ndarray, starts: np.ndarray, ends: np.ndarray, pad: int, values: tuple) -> np.ndarray:
        """[batch, width] of ``pad`` but in each row's [start, end): ``values`` = (before, inside, after), ``before``
        at its start, ``after`` at its end, ``inside`` where ``text`` is (one value, or every row's in turn)."""
        before, inside, after = values
        out = np.full(text.shape, pad, np.int64)
        out[text] = inside
        every_row = np.arange(len(starts))[:, None]
        out[every_row, starts[:, None] + np.arange(len(before))] = before
        out[every_row, ends[:, None] - len(after) + np.arange(len(after))] = after
        return out
