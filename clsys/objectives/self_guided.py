"""Self-Guided Contrastive Learning (SG / SG-OPT; Kim, Yoo & Lee, 2021),
docs/training/objectives.md#self-guided.

Two copies of the encoder see the same sentences:
  BERT_T (tuned)  c_i = last-layer ``[CLS]``; its embedding layer ("layer 0") is frozen;
  BERT_F (fixed)  a frozen copy taken at the start; h_{i,k} = its layer-k hidden states
                  (k = 0 is the embedding output) max- or mean-pooled over non-pad tokens.
Both go through one shared projection head f; similarities are cos(f(u), f(v)) / τ with τ = 0.01.
BERT_T's ``[CLS]`` is the exported sentence embedding; f is discarded.

Loss variants (``objective.loss``, docs/training/objectives.md#sg-losses), all plus λ·L_reg (squared L2 distance BERT_T ↔ BERT_F):
  sg      NT-Xent over the 2b views {c_i} ∪ {h_i}, h_i from one uniformly sampled layer per sentence;
          every view is an anchor, its partner is the positive, all other 2b−2 views are negatives.
  opt1    only c_i are anchors; negatives {c_j, h_j}_{j≠i}.
  opt2    only c_i are anchors; negatives {h_j}_{j≠i}.
  sg_opt  every layer view h_{i,k} is a positive of c_i, each with its own term whose denominator
          holds that positive and h_{j,m} for all j ≠ i and all layers m — not the anchor's other
          positives h_{i,m≠k}, not any c_j.
The original code's SG (2b logits, b labels, /b) and OPT2 (one h_j negative dropped) are buggy
(docs/training/objectives.md#sg-original); this file implements the formulas, and the tests check them against loop references.

Cross-rank negatives (``gather``, off by default: the original trains b = 16 on one GPU):
every candidate view (h, and c for sg/opt1) is all-gathered (``Ranks.gather_with_grad``); anchors stay
local and each rank averages over its own anchors, so W ranks × B sentences give exactly the
gradient of one process × W·B sentences (contrastive.py). Off, each rank contrasts its micro-batch
alone: the per-rank negatives shrink to B−1 sentences and the gradient is the average of W
independent B-sentence losses.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from clsys.config import Config, ObjectiveConfig
from clsys.data.pretokenized import SentenceBatcher
from clsys.data.spec import DataSpec
from clsys.data.transport import uses_fast_path
from clsys.model.encoder import build_encoder, pool
from clsys.model.folder import ExportSpec
from clsys.objectives.base import LossOutput, Objective, add_losses
from clsys.objectives.contrastive import cosine_logits, info_nce
from clsys.objectives.ranks import ONE_PROCESS, Ranks


@dataclass
class SelfGuidedConfig(ObjectiveConfig):
    loss: Literal["sg", "opt1", "opt2", "sg_opt"] = "sg_opt"  # which loss
    temperature: float = 0.01  # τ
    # BERT_F layers over non-pad tokens: max (the paper's) or mean (the original code's default)
    layer_pooling: Literal["max", "mean"] = "max"
    projection_dim: int = 4096  # width of the shared head f
    reg_weight: float = 0.1  # λ of the L2 regulariser
    freeze_embeddings: bool = True  # BERT_T's embedding layer stays fixed (`--freeze` in the original)
    frozen_dropout: bool = False  # BERT_F in train mode (dropout on), as the original code runs it
    gather: bool = False  # candidates from all ranks (see the module docstring)


class ProjectionHead(nn.Module):
    """f: Linear(d→P) → GELU → Linear(P→P) → GELU, weights ~ N(0, 0.02), biases 0."""

    def __init__(self, dim: int, proj_dim: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, proj_dim), nn.GELU(), nn.Linear(proj_dim, proj_dim), nn.GELU())
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def pool_layers(hidden_states: tuple[torch.Tensor, ...], attention_mask: torch.Tensor, kind: str) -> torch.Tensor:
    """Every layer's hidden states [b, seq, d] pooled over non-pad tokens: [b, layers, d]."""
    return torch.stack([pool(h, attention_mask, kind) for h in hidden_states], dim=1)


def _excluding(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``logits`` with the entries at (rows[i], cols[i]) set to −inf: removed from the softmax."""
    return logits.index_put((rows, cols), torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def sg_loss(c: torch.Tensor, h: torch.Tensor, temperature: float, ranks: Ranks = ONE_PROCESS) -> torch.Tensor:
    """SG: NT-Xent over the 2b anchors {c_i} ∪ {h_i}, each against all views but itself, mean over 2b."""
    b = c.shape[0]
    cands_c, offset = ranks.gather_with_grad(c)
    cands_h, _ = ranks.gather_with_grad(h)
    n = cands_c.shape[0]
    local = torch.arange(b, device=c.device)
    rows = torch.arange(2 * b, device=c.device)
    # Candidate columns: [c_0..c_{n-1}, h_0..h_{n-1}]; anchor c_i sits at column i+offset, h_i at n+i+offset.
    own = torch.cat([local + offset, local + n + offset])
    partner = torch.cat([local + n + offset, local + offset])
    logits = cosine_logits(torch.cat([c, h]), torch.cat([cands_c, cands_h]), temperature)
    return F.cross_entropy(_excluding(logits, rows, own), partner)


def opt1_loss(c: torch.Tensor, h: torch.Tensor, temperature: float, ranks: Ranks = ONE_PROCESS) -> torch.Tensor:
    """OPT1: anchors c_i only; positive h_i; negatives c_j and h_j, j ≠ i."""
    cands_c, offset = ranks.gather_with_grad(c)
    cands_h, _ = ranks.gather_with_grad(h)
    local = torch.arange(c.shape[0], device=c.device)
    logits = cosine_logits(c, torch.cat([cands_c, cands_h]), temperature)
    return F.cross_entropy(_excluding(logits, local, local + offset), local + cands_c.shape[0] + offset)


def opt2_loss(c: torch.Tensor, h: torch.Tensor, temperature: float, ranks: Ranks = ONE_PROCESS) -> torch.Tensor:
    """OPT2: anchors c_i only; positive h_i; negatives h_j, j ≠ i (plain InfoNCE)."""
    return info_nce(c, h, temperature, ranks=ranks)


def sg_opt_loss(c: torch.Tensor, h: torch.Tensor, temperature: float, ranks: Ranks = ONE_PROCESS) -> torch.Tensor:
    """SG-OPT: c [b, P] against every layer view h [b, V, P]; mean over the b·V (anchor, layer) terms.

    ℓ_{i,k} = −log φ(c_i, h_{i,k}) / (φ(c_i, h_{i,k}) + Σ_m Σ_{j≠i} φ(c_i, h_{j,m})).
    """
    b, views, dim = h.shape
    cands, row_offset = ranks.gather_with_grad(h.reshape(b * views, dim))
    logits = cosine_logits(c, cands, temperature).view(b, -1, views)  # [anchor i, sentence j, layer m]
    local = torch.arange(b, device=c.device)
    own = local + row_offset // views
    positives = logits[local, own]  # [b, V]
    # log Σ_{j≠i} Σ_m φ(c_i, h_{j,m}): the anchor's own sentence (all its layers) leaves the denominator.
    negatives = _excluding(logits, local, own).flatten(1).logsumexp(dim=1, keepdim=True)
    return (torch.logaddexp(positives, negatives) - positives).mean()


LOSS_FNS: dict[str, Callable[..., torch.Tensor]] = {"sg": sg_loss, "opt1": opt1_loss, "opt2": opt2_loss,
                                                   "sg_opt": sg_opt_loss}


class SelfGuidedData(DataSpec):
    """One copy of each sentence: BERT_T and BERT_F read the same tokens."""

    def __init__(self, cfg: Config, tokenizer, streams: list[str], reads_ids: bool):
        super().__init__(cfg, tokenizer, streams, reads_ids)
        self.sentences = SentenceBatcher(tokenizer, cfg.data.max_length, fast=uses_fast_path(cfg.data.transport))

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self.sentences(samples)


class SelfGuided(Objective):
    config_class = SelfGuidedConfig
    data_class = SelfGuidedData

    @classmethod
    def streams(cls, cfg: Config) -> list[str]:
        return ["sentences"]

    @classmethod
    def reads_ids(cls, cfg: Config) -> bool:
        return True

    def __init__(self, cfg: Config, tokenizer):
        super().__init__(cfg, tokenizer)
        oc: SelfGuidedConfig = cfg.objective
        if cfg.train.zero_stage == 3:
            # L_reg reads whole parameter tensors outside their modules' forward; ZeRO-3 partitions them.
            raise ValueError("objective self_guided: train.zero_stage 3 is not supported (use 0-2)")
        self.model = build_encoder(cfg.model, tokenizer)  # BERT_T
        self.frozen = copy.deepcopy(self.model)  # BERT_F: the starting point, never updated
        self.frozen.requires_grad_(False)
        if oc.freeze_embeddings:
            self.model.embeddings.requires_grad_(False)
        self.head = ProjectionHead(self.model.config.hidden_size, oc.projection_dim)
        self.oc = oc
        self.train(self.training)  # from_pretrained left both copies in eval mode: apply the mode rule now

    def train(self, mode: bool = True) -> SelfGuided:
        # The loop calls train() on everything; BERT_F keeps dropout off unless asked.
        super().train(mode)
        self.frozen.train(mode and self.oc.frozen_dropout)
        return self

    def regularisation(self) -> LossOutput:
        """λ·L_reg, L_reg = Σ_p ‖θ_T,p − θ_F,p‖² (docs/training/objectives.md#sg-losses): squared, summed, no ½, no averaging.

        Frozen tensors of BERT_T equal BERT_F's bitwise and add exactly 0, so only trainable ones are summed.
        BERT_T has no NSP pooler here (build_encoder drops it); it is unused by [CLS] pooling anyway.
        """
        frozen = dict(self.frozen.named_parameters())
        reg = torch.stack([(p.float() - frozen[name].float()).pow(2).sum()
                           for name, p in self.model.named_parameters() if p.requires_grad]).sum()
        return LossOutput(self.oc.reg_weight * reg, {"reg": reg.detach()})

    def embed(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per sentence [1 + V, P]: f(c) of BERT_T's [CLS], then f of its V layer views of BERT_F."""
        c = self.head(self.encode_first(self.model, batch))
        with torch.no_grad():
            hidden_states = self.encode(self.frozen, batch, output_hidden_states=True).hidden_states
            views = pool_layers(hidden_states, batch["attention_mask"], self.oc.layer_pooling)  # [b, L+1, d]
        if self.oc.loss != "sg_opt":
            # σ: one layer per sentence, uniform over 0..L; only the sampled views are projected.
            layers = torch.randint(0, views.shape[1], (views.shape[0],), device=views.device)
            views = views[torch.arange(views.shape[0], device=views.device), layers].unsqueeze(1)
        return torch.cat([c.unsqueeze(1), self.head(views)], dim=1)

    def embedding_loss(self, z: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        c, h = z[:, 0], (z[:, 1:] if self.oc.loss == "sg_opt" else z[:, 1])  # sg_opt: every layer view
        ranks = self.ranks if self.oc.gather else ONE_PROCESS
        contrastive = LOSS_FNS[self.oc.loss](c, h, self.oc.temperature, ranks)
        return LossOutput(contrastive, {"loss": contrastive.detach(), "contrastive": contrastive.detach()})

    def forward(self, batch: dict[str, torch.Tensor], part: str = "loss",
                whole: dict[str, torch.Tensor] | None = None) -> LossOutput | torch.Tensor | tuple:
        if part != "loss":
            return self.grad_cache_part(batch, part, whole)
        return add_losses(self.embedding_loss(self.embed(batch), batch), self.regularisation())

    def encoder(self) -> nn.Module:
        return self.model

    def export_spec(self) -> ExportSpec:
        # SG-BERT's inference embedding is BERT_T's last-layer [CLS].
        return ExportSpec("cls", self.encoder_prefix())
