"""The interface between the training engine and an objective.

An objective is an ``nn.Module`` that owns everything trainable (encoder, heads) and anything frozen (teacher
copies) and returns a ``LossOutput``; its ``data`` (a ``DataSpec``, ``clsys.data.spec``) declares which shard
streams it reads and how samples become a batch, and is all the loader's worker processes get; its
``export_spec()`` says what export writes; it reaches the other ranks only through the ``ranks`` the engine hands
it. The engine never knows which objective it runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from clsys.config import Config, ObjectiveConfig, check_closed_sets
from clsys.data.spec import DataSpec
from clsys.model import packing
from clsys.model.folder import ExportSpec
from clsys.objectives.ranks import ONE_PROCESS, Ranks


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # scalars, detached; logged every N steps


def add_losses(out: LossOutput, term: LossOutput | None) -> LossOutput:
    """``out`` plus another loss term: losses summed, metrics merged, ``loss`` the total."""
    if term is None:
        return out
    loss = out.loss + term.loss
    return LossOutput(loss, {**out.metrics, **term.metrics, "loss": loss.detach()})


def add_row_loss(out: LossOutput, row_loss: LossOutput | None) -> LossOutput:
    """``embedding_loss``'s output plus a row loss (``Objective.row_loss``); the in-batch loss stays
    visible as ``contrastive_loss``."""
    if row_loss is None:
        return out
    return add_losses(out, LossOutput(row_loss.loss, {**row_loss.metrics, "contrastive_loss": out.loss.detach()}))


class Objective(nn.Module):
    config_class: ClassVar[type[ObjectiveConfig]] = ObjectiveConfig
    data_class: ClassVar[type[DataSpec]] = DataSpec  # its data side's class
    # The data-parallel ranks and their collectives (clsys.objectives.ranks): one process until the engine hands
    # the objective its process group's (build_engine).
    ranks: Ranks = ONE_PROCESS

    def __init__(self, cfg: Config, tokenizer):
        super().__init__()
        check_closed_sets(cfg.objective, "objective")  # a config built in Python was not checked as it was read
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.data = self.data_class(cfg, tokenizer, self.streams(cfg), self.reads_ids(cfg))
        if cfg.objective.grad_cache.chunk_size and type(self).embed is Objective.embed:
            raise ValueError(f"objective.grad_cache: {cfg.objective.name} has no in-batch-negative loss that "
                             "GradCache can chunk; set objective.grad_cache.chunk_size: 0")

    @classmethod
    def streams(cls, cfg: Config) -> list[str]:
        """The shard streams under ``data.url`` this objective reads (``sentences``, ``documents``, …)."""
        raise NotImplementedError

    @classmethod
    def reads_ids(cls, cfg: Config) -> bool:
        """Whether ``collate`` uses the ``ids`` of a pre-tokenized stream (``data_prep tokenize``) when its
        samples have them; then training refuses a stream tokenized by another tokenizer. Others tokenize ``txt``."""
        return False

    # Its data side's answers, in this process (the loader's workers run ``data`` itself).
    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self.data.collate(samples)

    def sample_lengths(self, samples: list[dict[str, Any]]) -> list[int]:
        return self.data.sample_lengths(samples)

    def encode(self, model: nn.Module, inputs: dict[str, torch.Tensor], output_hidden_states: bool = False):
        """``model``'s output for the padded ``inputs`` (``input_ids``, ``attention_mask``, ``token_type_ids``),
        run without the pad tokens when ``model.packed`` (clsys/model/packing.py); padded layout either way."""
        return packing.encode(model, inputs, self.cfg.model.packed, output_hidden_states,
                              self.cfg.model.packed_attention)

    def encode_first(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, d]: ``model``'s last-layer ``[CLS]`` vectors; packed, its last layer computes those alone."""
        return packing.encode_first(model, inputs, self.cfg.model.packed, self.cfg.model.packed_attention)

    def reranker(self):
        """A (queries, documents) → relevance scores function for retrieval evaluation, or None."""
        return None

    def forward(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        raise NotImplementedError

    # GradCache (clsys/engine/grad_cache.py) needs the loss split in two. An objective supports
    # ``objective.grad_cache.chunk_size`` when its ``forward(batch, part, whole)`` returns
    # ``grad_cache_part(batch, part, whole)`` for parts other than "loss", and it implements these:
    def embedding_rows(self, batch: dict[str, torch.Tensor]) -> int:
        """How many encoder rows the batch has (the dimension GradCache cuts into chunks)."""
        return batch["input_ids"].shape[0]

    def embed(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rows → the embeddings the loss compares, row by row independent (dropout aside)."""
        raise NotImplementedError(f"{type(self).__name__} does not support objective.grad_cache")

    def embedding_loss(self, embeddings: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        """The loss from every row's embedding; no trainable parameter may enter it here."""
        raise NotImplementedError(f"{type(self).__name__} does not support objective.grad_cache")

    def regularisation(self) -> LossOutput | None:
        """A loss term of the parameters alone, no rows (SG's L_reg), added to ``embedding_loss``'s."""
        return None

    def row_loss(self, chunk: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> LossOutput | None:
        """A loss term that is a sum of row-independent terms (SimCSE's MLM auxiliary), for the rows of
        ``chunk`` but normalised over the batch ``whole`` they come from: the shares of a batch's chunks, loss
        and metrics alike, add up to the batch's term. GradCache adds each to its chunk's surrogate."""
        return None

    def grad_cache_part(self, batch: dict[str, torch.Tensor], part: str, whole: dict[str, torch.Tensor] | None):
        """What ``forward`` returns to GradCache: ``embed`` for part "embed" (the pass without a graph), and
        (``embed``, ``row_loss``) for part "chunk" (the pass with one); one call, so one engine forward."""
        embeddings = self.embed(batch)
        return embeddings if part == "embed" else (embeddings, self.row_loss(batch, whole))

    def encoder(self) -> nn.Module:
        """The Hugging Face model that export saves and evaluation embeds with."""
        raise NotImplementedError

    def head_modules(self) -> list[nn.Module]:
        """The task heads trained on top of the encoder, which ``optim.head_lr`` applies to."""
        return []

    def head_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters of ``head_modules`` that are not the encoder's own (an MLM decoder
        tied to the word embeddings stays with the encoder)."""
        encoder = {id(p) for p in self.encoder().parameters()}
        seen, params = set(), []
        for module in self.head_modules():
            for p in module.parameters():
                if p.requires_grad and id(p) not in encoder and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def export_spec(self) -> ExportSpec:
        """What export writes of the trained weights: the inference pooling and the heads that ship with the
        encoder or as its reranker (``clsys.model.folder.ExportSpec``), recorded in every checkpoint."""
        raise NotImplementedError

    def encoder_prefix(self) -> str:
        """Where ``encoder()``'s weights sit in this objective's state dict."""
        return next(name for name, module in self.named_modules() if module is self.encoder())
