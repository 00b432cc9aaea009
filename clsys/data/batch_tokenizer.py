"""Texts -> padded encoder inputs at the loader's rate: exactly what the Hugging Face tokenizer call
``tokenizer(texts, padding=True, truncation=True, max_length=L, return_tensors="pt")`` returns, built faster.

The HF call reconfigures the tokenizer's shared Rust backend, runs ``encode_batch`` (which also computes
character offsets, unused here) and copies every token through Python lists into ``torch.tensor``. Here a
copy of the backend, configured once as the call configures it, runs ``encode_batch_fast`` (no offsets), and
each key's rows become one numpy array. A tokenizer without a Rust backend (a slow, pure-Python one), or
one whose class adds steps to the HF call (LayoutLM, LUKE, mBART's language modes, …), keeps the HF call.
"""
from __future__ import annotations

import copy
import functools

import numpy as np
import torch

# The HF methods between ``tokenizer(texts, ...)`` and the backend's ``encode_batch``, as of transformers 5.
_CALL_PATH = ("__call__", "_encode_plus", "set_truncation_and_padding", "_convert_encoding")
# The backend Encoding's attribute behind each key of the HF call's output.
_ENCODING_FIELDS = {"input_ids": "ids", "token_type_ids": "type_ids", "attention_mask": "attention_mask"}


def _call_is_the_backends(tokenizer) -> bool:
    """Whether the HF call on a batch of texts is the Rust backend's ``encode_batch`` and nothing more."""
    from transformers import PreTrainedTokenizerFast  # transformers 5: the base of every Rust-backed tokenizer

    base = PreTrainedTokenizerFast
    return (isinstance(tokenizer, base) and tokenizer.pad_token is not None  # else the HF call refuses to pad
            and all(getattr(type(tokenizer), name) is getattr(base, name) for name in _CALL_PATH)
            and not hasattr(tokenizer, "_switch_to_input_mode"))  # seq2seq tokenizers switch templates per call


class BatchTokenizer:
    """``tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")``;
    ``pad_to_max_length`` means ``padding="max_length"``, ``token_type_ids`` is ``return_token_type_ids``
    (None: the tokenizer's default, whether ``token_type_ids`` is among its ``model_input_names``)."""

    def __init__(self, tokenizer, max_length: int, pad_to_max_length: bool = False,
                 token_type_ids: bool | None = None):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.pad_to_max_length, self.token_type_ids = pad_to_max_length, token_type_ids

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        """The HF call's keys, in its order. On first use, like ``backend``: objectives are built without a
        tokenizer in tests."""
        names = self.tokenizer.model_input_names
        types = "token_type_ids" in names if self.token_type_ids is None else self.token_type_ids
        return tuple(key for key, returned in (("input_ids", True), ("token_type_ids", types),
                                               ("attention_mask", "attention_mask" in names)) if returned)

    @functools.cached_property
    def backend(self):
        """The backend, copied and configured as the HF call configures its own; None where the HF call must do
        the work. Built on first use, in the process that uses it."""
        tokenizer = self.tokenizer
        if not _call_is_the_backends(tokenizer):
            return None
        backend = copy.deepcopy(tokenizer.backend_tokenizer)  # the tokenizer's own is left as it is
        backend.enable_truncation(self.max_length, stride=0, strategy="longest_first",
                                  direction=tokenizer.truncation_side)
        backend.enable_padding(length=self.max_length if self.pad_to_max_length else None,
                               direction=tokenizer.padding_side, pad_id=tokenizer.pad_token_id,
                               pad_type_id=tokenizer.pad_token_type_id, pad_token=tokenizer.pad_token)
        backend.encode_special_tokens = tokenizer.split_special_tokens
        return backend

    def __getstate__(self) -> dict:
        # The copy does not travel (to loader workers, into data_side's deep copy): the tokenizer does, and each
        # process builds its own copy from it, instead of unpickling both (~1 s each for XLM-R's 250k pieces).
        return {k: v for k, v in self.__dict__.items() if k != "backend"}

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        if self.backend is None:
            return dict(self.tokenizer(texts, padding="max_length" if self.pad_to_max_length else True,
                                       truncation=True, max_length=self.max_length, return_tensors="pt",
                                       return_token_type_ids=self.token_type_ids))
        encodings = self.backend.encode_batch_fast(texts)
        # Padded, the rows have one length: each key is one [batch, length] array.
        return {key: torch.from_numpy(np.array([getattr(e, _ENCODING_FIELDS[key]) for e in encodings], np.int64))
                for key in self.keys}
