"""SimCSE (Gao et al., 2021), unsupervised and supervised: docs/training/objectives.md#simcse.

Unsupervised: each sentence is fed twice in one forward pass, so the two copies get independent
dropout masks; the copies are the positive pair. Training pools ``[CLS]`` through a fresh MLP
(Linear + tanh); inference uses the raw ``[CLS]`` vector (``export_pooling: cls``).

Supervised (``supervised: true``): NLI triplets (premise, entailment, contradiction) from the
``triplets`` stream are encoded as 3B rows in one forward pass; every contradiction is a hard
negative for every anchor, the own one weighted by e^α (α = ``hard_negative_weight``). The MLP is
kept at inference (``export_pooling: cls_mlp``; export turns it into the HF pooler).

Loss: asymmetric InfoNCE (anchors against the candidates of the global batch) with τ = 0.05.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from clsys.config import Config, ObjectiveConfig
from clsys.data.masking import Masker, masked_lm_loss
from clsys.data.pretokenized import SentenceBatcher
from clsys.data.spec import DataSpec
from clsys.data.transport import uses_fast_path
from clsys.model.encoder import Pooling, build_encoder, build_masked_lm, pool
from clsys.model.folder import ExportSpec
from clsys.model.loading import POOLER_MODEL_TYPES
from clsys.objectives.base import LossOutput, Objective, add_row_loss
from clsys.objectives.contrastive import alignment_uniformity, info_nce
from clsys.objectives.ranks import ONE_PROCESS


@dataclass
class SimCSEConfig(ObjectiveConfig):
    temperature: float = 0.05  # τ of the InfoNCE loss
    # training pooling: cls_mlp (fresh Linear+tanh on CLS) or cls/mean/max
    pooler: Literal["cls_mlp", Pooling] = "cls_mlp"
    export_pooling: Literal["cls_mlp", Pooling] = "cls"  # inference pooling of the exported encoder (SimCSE: raw CLS)
    gather: bool = True  # negatives from the global batch (all ranks) rather than the local one
    supervised: bool = False  # NLI triplets with hard negatives instead of dropout views of sentences
    hard_negative_weight: float = 0.0  # α, the log of the own hard negative's weight (supervised only)
    mlm_weight: float = 0.0  # > 0 adds the MLM auxiliary on a separate masked forward (the paper: 0.1 when on)
    mlm_probability: float = 0.15  # share of tokens masked for the MLM auxiliary


class MLPPooler(nn.Module):
    """SimCSE's training-only projection: Linear(d→d) + tanh on the ``[CLS]`` vector.

    Initialised as SimCSE's ``cl_init`` does (BERT's ``_init_weights``): weight ~ N(0, std²) with the
    encoder's ``initializer_range`` as std, bias zero; not PyTorch's default uniform with a non-zero bias.
    """

    def __init__(self, dim: int, std: float):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        nn.init.normal_(self.dense.weight, mean=0.0, std=std)
        nn.init.zeros_(self.dense.bias)
        self.activation = nn.Tanh()

    def forward(self, cls: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(cls))


class SimCSEData(DataSpec):
    """Unsupervised: every sentence twice (two dropout views); supervised: each triplet's three texts. With the MLM
    auxiliary, masked copies of every row."""

    def __init__(self, cfg: Config, tokenizer, streams: list[str], reads_ids: bool):
        super().__init__(cfg, tokenizer, streams, reads_ids)
        oc: SimCSEConfig = cfg.objective
        self.supervised = oc.supervised
        self.sentences = SentenceBatcher(tokenizer, cfg.data.max_length, fast=uses_fast_path(cfg.data.transport))
        self.masker = Masker.for_tokenizer(tokenizer, oc.mlm_probability, cap=cfg.data.max_length) \
            if oc.mlm_weight else None

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.supervised:
            # Rows [0, B) anchors, [B, 2B) their entailments, [2B, 3B) their contradictions.
            texts = [s["json"][part] for part in ("anchor", "positive", "negative") for s in samples]
            batch = self.sentences.encode(texts)
        else:
            # Every sentence twice: rows [0, B) are view 1 and rows [B, 2B) view 2 of the same sentences.
            batch = self.sentences(samples, copies=2)
        if self.masker is not None:
            # Masked copies of every row, for the MLM auxiliary's separate forward pass.
            batch["masked_input_ids"], batch["chosen"] = self.masker(batch["input_ids"], batch["attention_mask"])
        return batch


class SimCSE(Objective):
    config_class = SimCSEConfig
    data_class = SimCSEData

    @classmethod
    def streams(cls, cfg: Config) -> list[str]:
        return ["triplets" if cfg.objective.supervised else "sentences"]

    @classmethod
    def reads_ids(cls, cfg: Config) -> bool:
        return not cfg.objective.supervised  # triplets are three texts a sample: tokenized in collate

    def __init__(self, cfg: Config, tokenizer):
        super().__init__(cfg, tokenizer)
        oc: SimCSEConfig = cfg.objective
        if oc.export_pooling == "cls_mlp" and not (oc.supervised and oc.pooler == "cls_mlp"):
            # Unsupervised SimCSE drops the MLP at inference on purpose; supervised keeps it.
            raise ValueError("objective.export_pooling: cls_mlp keeps the training MLP at inference, which "
                             "needs objective.supervised: true and objective.pooler: cls_mlp")
        if oc.hard_negative_weight and not oc.supervised:
            raise ValueError("objective.hard_negative_weight: only supervised SimCSE has hard negatives "
                             "(set objective.supervised: true)")
        if oc.mlm_weight:
            # The auxiliary needs an MLM head: the checkpoint's, or a new one tied to the embeddings.
            self.model, self.mlm_head = build_masked_lm(cfg.model, tokenizer)
        else:
            self.model, self.mlm_head = build_encoder(cfg.model, tokenizer), None
        if oc.export_pooling == "cls_mlp" and self.model.config.model_type not in POOLER_MODEL_TYPES:
            raise ValueError(f"objective.export_pooling: cls_mlp is exported as the HF pooler, which "
                             f"{self.model.config.model_type} models lack (supported: {', '.join(POOLER_MODEL_TYPES)})")
        config = self.model.config
        # 0.02, BERT's default, for a config without initializer_range.
        std = getattr(config, "initializer_range", 0.02)
        self.mlp = MLPPooler(config.hidden_size, std) if oc.pooler == "cls_mlp" else None
        self.temperature, self.pooler, self.gather = oc.temperature, oc.pooler, oc.gather
        self.supervised, self.hard_negative_weight = oc.supervised, oc.hard_negative_weight

    @staticmethod
    def _encoder_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch without the MLM auxiliary's masked copies and positions."""
        return {k: v for k, v in batch.items() if k not in ("masked_input_ids", "chosen")}

    def embed(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = self._encoder_inputs(batch)
        if self.pooler in ("cls_mlp", "cls"):  # [CLS] alone: the last layer skips the other tokens' work
            cls = self.encode_first(self.model, inputs)
            return cls if self.mlp is None else self.mlp(cls)
        return pool(self.encode(self.model, inputs).last_hidden_state, batch["attention_mask"], self.pooler)

    def embedding_loss(self, z: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        if self.supervised:
            z1, z2, z3 = z.chunk(3)
        else:
            (z1, z2), z3 = z.chunk(2), None
        loss = info_nce(z1, z2, self.temperature, hard_negatives=z3,
                        hard_negative_weight=self.hard_negative_weight,
                        ranks=self.ranks if self.gather else ONE_PROCESS)
        return LossOutput(loss, {"loss": loss.detach(), **alignment_uniformity(z1.detach(), z2.detach())})

    def row_loss(self, chunk: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> LossOutput | None:
        """The MLM auxiliary (weighted) on ``chunk``'s rows, as its share of the mean over ``whole``'s masked
        positions. The contrastive views see clean text; the MLM sees masked copies with the same attention."""
        if self.mlm_head is None:
            return None
        inputs = {**self._encoder_inputs(chunk), "input_ids": chunk["masked_input_ids"]}
        mlm, mlm_accuracy = masked_lm_loss(self.mlm_head, self.encode(self.model, inputs).last_hidden_state,
                                           chunk["input_ids"], chunk["chosen"], positions=whole["chosen"].sum())
        return LossOutput(self.cfg.objective.mlm_weight * mlm, {"mlm_loss": mlm.detach(),
                                                                "mlm_accuracy": mlm_accuracy.detach()})

    def forward(self, batch: dict[str, torch.Tensor], part: str = "loss",
                whole: dict[str, torch.Tensor] | None = None) -> LossOutput | torch.Tensor | tuple:
        if part != "loss":
            return self.grad_cache_part(batch, part, whole)
        return add_row_loss(self.embedding_loss(self.embed(batch), batch), self.row_loss(batch, batch))

    def encoder(self) -> nn.Module:
        return self.model

    def export_spec(self) -> ExportSpec:
        pooling = self.cfg.objective.export_pooling
        # cls_mlp: the MLP is exactly BERT's pooler (dense + tanh on [CLS]), so it is exported as one.
        pooler = {f"pooler.dense.{p}": f"mlp.dense.{p}" for p in ("weight", "bias")} if pooling == "cls_mlp" else {}
        return ExportSpec(pooling, self.encoder_prefix(), head_map=pooler)
