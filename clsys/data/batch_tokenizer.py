"""Texts (or their ids) -> padded encoder inputs at the loader's rate: exactly what the Hugging Face tokenizer
call ``tokenizer(texts, padding=True, truncation=True, max_length=L, return_tensors="pt")`` returns, built faster.

The HF call reconfigures the tokenizer's shared Rust backend, runs ``encode_batch`` (which also computes
character offsets, unused here), frames, pads, and copies every token of every key through Python lists into
``torch.tensor``. Here a copy of the backend, configured once, runs ``encode_batch_fast`` (no offsets) for the
texts' own tokens, already cut to what truncation keeps (for BERT's WordPiece pipeline, ``ChunkTokenizer``
answers for the chunks of text it has met before and asks the backend for the others), and ``frame_and_pad``
does the rest in numpy: the tokenizer's special tokens around each row (``Framing``, read off its own output),
its padding side and ids, token types and attention mask, all in [batch, width] arrays without a Python step per
token. Pre-tokenized
ids (``data_prep tokenize``) take the same path from their second half. A tokenizer without a Rust backend (a
slow, pure-Python one), or one whose class adds steps to the HF call (LayoutLM, LUKE, mBART's language modes,
…), keeps the HF call, and so does every tokenizer under ``data.transport: plain`` (``fast=False``): the backend copy
is the fast transport's (``clsys.data.transport``).
"""
from __future__ import annotations

import copy
import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from clsys.data.chunk_tokenizer import ChunkTokenizer
from clsys.data.transport import tokenizer_call_is_the_backends

_PROBE = "clsys probe"  # any text that tokenizes to at least one token


@dataclass(frozen=True)
class Framing:
    """What a tokenizer puts around one text's tokens, read off its own output for a probe text, so BERT's
    [CLS] … [SEP], a SentencePiece template or <s> … </s> are all mirrored exactly."""

    prefix: list[int]
    suffix: list[int]
    types: tuple[list[int], int, list[int]]  # token types: the prefix's, the text's, the suffix's

    @classmethod
    def of(cls, tokenizer) -> Framing:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        saved = (backend.truncation, backend.padding) if backend is not None else None
        framed = tokenizer(_PROBE, return_token_type_ids=True)
        content = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        if saved is not None:  # the HF calls reset the shared backend's truncation and padding: as they were
            truncation, padding = saved
            backend.no_truncation()
            backend.no_padding()
            if truncation is not None:
                backend.enable_truncation(**truncation)
            if padding is not None:
                backend.enable_padding(**padding)
        ids = framed["input_ids"]
        start = next((i for i in range(len(ids) - len(content) + 1) if ids[i:i + len(content)] == content), None)
        if start is None:
            raise ValueError(f"{type(tokenizer).__name__}: its output for {_PROBE!r} does not contain the tokens "
                             "of the text without special tokens; cannot frame a text's own tokens")
        end = start + len(content)
        types = framed["token_type_ids"]
        return cls(ids[:start], ids[end:], (types[:start], types[start], types[end:]))


class BatchTokenizer:
    """``tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")``;
    ``pad_to_max_length`` means ``padding="max_length"``, ``token_type_ids`` is ``return_token_type_ids``
    (None: the tokenizer's default, whether ``token_type_ids`` is among its ``model_input_names``); ``fast``: through
    a copy of the backend where that gives the HF call's tensors, else the HF call itself
    (``clsys.data.transport.uses_fast_path(cfg.data.transport)``)."""

    def __init__(self, tokenizer, max_length: int, pad_to_max_length: bool = False,
                 token_type_ids: bool | None = None, fast: bool = True):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.pad_to_max_length, self.token_type_ids, self.fast = pad_to_max_length, token_type_ids, fast

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        """The HF call's keys, in its order. On first use, like ``backend``: objectives are built without a
        tokenizer in tests."""
        names = self.tokenizer.model_input_names
        types = "token_type_ids" in names if self.token_type_ids is None else self.token_type_ids
        return tuple(key for key, returned in (("input_ids", True), ("token_type_ids", types),
                                               ("attention_mask", "attention_mask" in names)) if returned)

    @functools.cached_property
    def framing(self) -> Framing:
        return Framing.of(self.tokenizer)

    @functools.cached_property
    def keep(self) -> int | None:
        """How many of a text's own tokens truncation=True keeps; None below the special tokens' count, where
        the HF call leaves rows whole."""
        keep = self.max_length - len(self.framing.prefix) - len(self.framing.suffix)
        return keep if keep >= 0 else None

    @functools.cached_property
    def backend(self):
        """The backend, copied and set to cut a text's own tokens as the HF call cuts them; None where the HF
        call does the work (not ``fast``, or a call that is more than the backend's). Built on first use, in the
        process that uses it."""
        tokenizer = self.tokenizer
        if not (self.fast and tokenizer_call_is_the_backends(tokenizer)):
            return None
        backend = copy.deepcopy(tokenizer.backend_tokenizer)  # the tokenizer's own is left as it is
        backend.no_padding()
        if self.keep:  # else frame_and_pad cuts (to nothing) or nothing is cut
            backend.enable_truncation(self.keep, stride=0, strategy="longest_first",
                                      direction=tokenizer.truncation_side)
        else:
            backend.no_truncation()
        backend.encode_special_tokens = tokenizer.split_special_tokens
        return backend

    @functools.cached_property
    def chunks(self) -> ChunkTokenizer | None:
        """The backend's ids remembered chunk by chunk, where the backend is BERT's WordPiece pipeline."""
        return ChunkTokenizer.of(self.backend) if self.backend is not None else None

    def __getstate__(self) -> dict:
        # The copy does not travel (to loader workers, in a deep copy): the tokenizer does, and each
        # process builds its own copy from it, instead of unpickling both (~1 s each for XLM-R's 250k pieces).
        # Nor does the chunk tokenizer's dictionary: each process learns its own.
        return {k: v for k, v in self.__dict__.items() if k not in ("backend", "chunks")}

    def __call__(self, texts: list[str], copies: int = 1) -> dict[str, torch.Tensor]:
        """The HF call's tensors for ``texts``, the batch repeated ``copies`` times (rows [0, B) the first)."""
        if self.backend is None:
            batch = self.tokenizer(texts, padding="max_length" if self.pad_to_max_length else True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt",
                                   return_token_type_ids=self.token_type_ids)
            return {key: value.repeat(copies, 1) for key, value in batch.items()}
        return self.frame_and_pad(self.text_ids(texts), copies)

    def text_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's own tokens (no special tokens), at least as many as truncation keeps: the backend's, through
        the chunk tokenizer where there is one."""
        if self.chunks is not None:
            return self.chunks(texts)
        return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def frame_and_pad(self, ids: list, copies: int = 1) -> dict[str, torch.Tensor]:
        """The HF call's tensors for the texts whose own tokens (no special tokens; lists or int arrays, cut or
        not) are ``ids``: cut as truncation=True cuts, framed, padded, in [batch, width] arrays filled through
        masks."""
        tokenizer, keep = self.tokenizer, self.keep
        prefix, suffix, types = self.framing.prefix, self.framing.suffix, self.framing.types
        if keep is not None and tokenizer.truncation_side == "left":
            ids = [row[max(len(row) - keep, 0):] for row in ids]
        elif keep is not None:
            ids = [row[:keep] for row in ids]
        text_lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        lengths = text_lengths + len(prefix) + len(suffix)
        width = int(lengths.max(initial=0))
        if self.pad_to_max_length:
            # Rows pad up to max_length; one left longer (max_length below the special tokens' count) stays so,
            # and rows of unequal lengths make no tensor: the HF call refuses them too.
            if width > self.max_length and lengths.min() < width:
                raise ValueError(f"rows of {lengths.min()} to {width} tokens do not pad to one length "
                                 f"(max_length {self.max_length})")
            width = max(width, self.max_length)
        # Row i fills columns [start_i, end_i): flush left, or flush right when the tokenizer pads left.
        starts = width - lengths if tokenizer.padding_side == "left" else np.zeros_like(lengths)
        ends = starts + lengths
        columns = np.arange(width)
        real = (columns >= starts[:, None]) & (columns < ends[:, None])
        text = (columns >= starts[:, None] + len(prefix)) & (columns < ends[:, None] - len(suffix))
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(text_lengths.sum()))  # row-major
        out = {"input_ids": lambda: _framed(text, starts, ends, tokenizer.pad_token_id, (prefix, flat, suffix)),
               "token_type_ids": lambda: _framed(text, starts, ends, tokenizer.pad_token_type_id, types),
               "attention_mask": lambda: real.astype(np.int64)}
        return {key: torch.from_numpy(np.tile(out[key](), (copies, 1))) for key in self.keys}


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
