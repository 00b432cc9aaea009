"""Unsupervised SimCSE (Gao et al., 2021), as specified in shared/spec/OBJECTIVES.md §2.1-2.4.

Each sentence is fed twice in one forward pass, so the two copies get independent dropout
masks; the copies are the positive pair. Training pools ``[CLS]`` through a fresh MLP
(Linear + tanh); inference uses the raw ``[CLS]`` vector (``export_pooling: cls``).
Loss: asymmetric InfoNCE (view 1 anchors, view 2 candidates) with τ = 0.05 over the global batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from clsys.config import Config, ObjectiveConfig
from clsys.model.encoder import POOLINGS, load_encoder, pool
from clsys.objectives.base import LossOutput, Objective
from clsys.objectives.contrastive import alignment_uniformity, info_nce


@dataclass
class SimCSEConfig(ObjectiveConfig):
    temperature: float = 0.05
    pooler: str = "cls_mlp"  # training pooling: cls_mlp (fresh Linear+tanh on CLS) or cls/mean/max
    export_pooling: str = "cls"  # inference pooling of the exported encoder (SimCSE: raw CLS)
    gather: bool = True  # negatives from the global batch (all ranks) rather than the local one


class MLPPooler(nn.Module):
    """SimCSE's training-only projection: Linear(d→d) + tanh on the ``[CLS]`` vector."""

    def __init__(self, dim: int):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.activation = nn.Tanh()

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(cls))


class SimCSE(Objective):
    config_class = SimCSEConfig

    @classmethod
    def stream(cls, cfg: Config) -> str:
        return "sentences"

    def __init__(self, cfg: Config, tokenizer):
        super().__init__(cfg, tokenizer)
        oc: SimCSEConfig = cfg.objective
        if oc.pooler not in ("cls_mlp", *POOLINGS):
            raise ValueError(f"objective.pooler: unknown pooling '{oc.pooler}'")
        if oc.export_pooling not in POOLINGS:
            raise ValueError(f"objective.export_pooling: unknown pooling '{oc.export_pooling}'")
        overrides = {}
        if cfg.model.dropout is not None:
            overrides = {"hidden_dropout_prob": cfg.model.dropout, "attention_probs_dropout_prob": cfg.model.dropout}
        self.model = load_encoder(cfg.model.name, **overrides)
        self.mlp = MLPPooler(self.model.config.hidden_size) if oc.pooler == "cls_mlp" else None
        self.temperature, self.pooler, self.gather = oc.temperature, oc.pooler, oc.gather

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        texts = [s["txt"] for s in samples]
        # Duplicate every sentence: rows [0, B) are view 1 and rows [B, 2B) view 2 of the same sentences.
        return dict(self.tokenizer(texts + texts, padding=True, truncation=True,
                                   max_length=self.cfg.data.max_length, return_tensors="pt"))

    def forward(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        hidden = self.model(**batch).last_hidden_state
        if self.mlp is not None:
            z = self.mlp(hidden[:, 0])
        else:
            z = pool(hidden, batch["attention_mask"], self.pooler)
        z1, z2 = z.chunk(2)
        loss = info_nce(z1, z2, self.temperature, gather=self.gather)
        return LossOutput(loss, {"loss": loss.detach(), **alignment_uniformity(z1.detach(), z2.detach())})

    def encoder(self) -> nn.Module:
        return self.model

    def export_pooling(self) -> str:
        return self.cfg.objective.export_pooling
