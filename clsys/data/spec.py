"""An objective's data side, ``DataSpec``: what the loader's worker processes run for it.

The objective (``clsys.objectives.base.Objective``) holds one as ``data``, of its class's ``data_class``; the loader
(``clsys.data.streaming``) reads its streams with it.
"""
from __future__ import annotations

from typing import Any

import torch

from clsys.config import Config


class DataSpec:
    """An objective's data side: the shard streams it reads, how samples become a batch (``collate``) and how long
    each sample is (``sample_lengths``, the sort key of length-grouped batches). The loader's worker processes run
    it, pickled to them (``clsys.data.streaming.rank_loader`` builds the loader from it), so it holds configuration,
    tokenizer, masker and collate state only: no tensors, modules or training state."""

    def __init__(self, cfg: Config, tokenizer, streams: list[str], reads_ids: bool):
        """``streams`` and ``reads_ids``: the objective's (``Objective.streams``, ``Objective.reads_ids``)."""
        self.cfg, self.tokenizer, self.streams, self.reads_ids = cfg, tokenizer, streams, reads_ids

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Decoded shard samples (``txt``/``json`` fields, ``ids`` if pre-tokenized) → model inputs."""
        raise NotImplementedError

    def sample_lengths(self, samples: list[dict[str, Any]]) -> list[int]:
        """Tokens of each sample's ``txt``. Characters are a poor proxy: a batch's padding follows its longest row,
        and tokens per character vary several-fold across scripts, numbers and rare words."""
        if self.reads_ids and all("ids" in s for s in samples):
            # Pre-tokenized by the training tokenizer (checked at start-up); cut at max_tokens, which is at
            # least what collate keeps, so longer rows pad alike anyway.
            return [len(s["ids"]) for s in samples]
        return [len(ids) for ids in self.tokenizer([s["txt"] for s in samples], add_special_tokens=False)["input_ids"]]

    def combine(self, loaders: dict[str, Any]):
        """This rank's batch iterator from one loader per stream (``streams``' keys, in order): the one loader.
        A spec that mixes streams returns their schedule."""
        (loader,) = loaders.values()
        return loader
