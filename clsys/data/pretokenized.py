"""Pre-tokenized streams (``python -m data_prep tokenize``): the tokenizer fingerprint and batches from ids.

A pre-tokenized stream's samples carry an ``ids`` member, the tokens of their ``txt`` without special
tokens, and its manifest names the tokenizer: ``{"name", "fingerprint", "max_tokens"}``. Collate then
only frames, pads and stacks ids, producing exactly the tensors the tokenizer would for the same text,
and training refuses a stream whose fingerprint is not its tokenizer's.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

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
    """``txt`` samples -> encoder inputs: from their ``ids`` when every sample has them, else by tokenizing."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    @functools.cached_property
    def framing(self) -> Framing:
        return Framing.of(self.tokenizer)  # on first use: objectives are built without a tokenizer in tests

    def __call__(self, samples: list[dict[str, Any]], copies: int = 1) -> dict[str, torch.Tensor]:
        """The batch of ``samples`` repeated ``copies`` times (rows [0, B) the first copy, and so on)."""
        if not all("ids" in s for s in samples):
            # Tokenized once and repeated: padding=True pads to the longest row either way.
            batch = self.tokenizer([s["txt"] for s in samples], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt")
            return {k: v.repeat(copies, 1) for k, v in batch.items()}
        prefix, suffix, types = self.framing.prefix, self.framing.suffix, self.framing.types
        keep = self.max_length - len(prefix) - len(suffix)  # what truncation=True keeps of the text
        rows = [prefix + s["ids"][:keep] + suffix for s in samples]
        width = max(map(len, rows))
        out = {"input_ids": self._pad(rows, self.tokenizer.pad_token_id, width),
               "attention_mask": self._pad([[1] * len(r) for r in rows], 0, width)}
        if types is not None:
            before, text, after = types
            type_rows = [before + [text] * (len(r) - len(before) - len(after)) + after for r in rows]
            out["token_type_ids"] = self._pad(type_rows, self.tokenizer.pad_token_type_id, width)
        return {k: v.repeat(copies, 1) for k, v in out.items()}

    def _pad(self, rows: list[list[int]], value: int, width: int) -> torch.Tensor:
        fill = [[value] * (width - len(r)) for r in rows]
        left = self.tokenizer.padding_side == "left"
        return torch.tensor([f + r if left else r + f for f, r in zip(fill, rows)], dtype=torch.long)
