"""Contrastive building blocks shared by every objective.

Cross-rank negatives: the losses take the objective's ``ranks`` (``clsys.objectives.ranks``) and gather their
candidates from every rank through it; anchors stay local and the loss is the mean over local anchors, so the
parameter gradient is that of one process with the whole global batch (scale 1, independent of the number of ranks:
``clsys.engine.ranks`` says why, ``tests/test_contrastive.py`` checks it in a real 2-process gloo group).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from clsys.objectives.ranks import ONE_PROCESS, Ranks


def cosine_logits(anchors: torch.Tensor, candidates: torch.Tensor, temperature: float) -> torch.Tensor:
    """cos(anchor_i, candidate_j) / τ for every pair: [..., n_anchors, n_candidates] (leading dims batched).

    Always in float32 at least, autocast off. Under bf16 autocast the product would come out in bf16,
    whose 8-bit mantissa rounds a cosine near 0.9 by up to 0.002, i.e. a logit by up to 0.04 at τ 0.05:
    noise of the size of the margins the loss learns from. The product is tiny next to the encoder, so
    float32 costs nothing measurable; gradients flow back into the encoder's dtype through the cast.
    """
    dtype = torch.promote_types(anchors.dtype, torch.float32)
    with torch.autocast(anchors.device.type, enabled=False):
        anchors = F.normalize(anchors.to(dtype), dim=-1)
        candidates = F.normalize(candidates.to(dtype), dim=-1)
        return anchors @ candidates.transpose(-1, -2) / temperature


def info_nce(anchors: torch.Tensor, positives: torch.Tensor, temperature: float,
             hard_negatives: torch.Tensor | None = None, hard_negative_weight: float = 0.0,
             ranks: Ranks = ONE_PROCESS, excluded: torch.Tensor | None = None) -> torch.Tensor:
    """Asymmetric InfoNCE: anchor i against all positives (and all hard negatives) of the batch.

    ℓ_i = −log exp(s(a_i,p_i)/τ) / (Σ_j exp(s(a_i,p_j)/τ) + Σ_j w_ij exp(s(a_i,n_j)/τ)),
    with w_ii = e^α (α = ``hard_negative_weight``, a log-offset on the logit) and w_ij = 1 otherwise.
    Candidates are gathered from every one of ``ranks``; anchors stay local and the loss is the mean over
    local anchors (see the module docstring for the resulting gradient scale).
    ``excluded``: [local anchors, gathered positives + gathered hard negatives], True where a candidate is no
    negative of the anchor (a padding row, a copy of its own positive) and leaves the sum; never its positive.
    """
    candidates, offset = ranks.gather_with_grad(positives)
    logits = cosine_logits(anchors, candidates, temperature)
    local = torch.arange(anchors.shape[0], device=anchors.device)
    if hard_negatives is not None:
        negatives, _ = ranks.gather_with_grad(hard_negatives)
        neg_logits = cosine_logits(anchors, negatives, temperature)
        if hard_negative_weight:
            neg_logits = neg_logits.index_put((local, local + offset),
                                              neg_logits[local, local + offset] + hard_negative_weight)
        logits = torch.cat([logits, neg_logits], dim=1)
    if excluded is not None:
        logits = logits.masked_fill(excluded, float("-inf"))
    return F.cross_entropy(logits, local + offset)


@torch.no_grad()
def alignment_uniformity(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Wang & Isola's health metrics on L2-normalised positive pairs (x_i, y_i).

    alignment = E‖x−y‖² (lower is better); uniformity = log E exp(−2‖u−v‖²) over distinct pairs of x
    (lower is better; a collapsed encoder approaches 0).
    """
    x, y = F.normalize(x.float(), dim=-1), F.normalize(y.float(), dim=-1)
    alignment = (x - y).pow(2).sum(-1).mean()
    if x.shape[0] < 2:
        return {"alignment": alignment}
    sq_dists = torch.pdist(x).pow(2)
    uniformity = sq_dists.mul(-2).exp().mean().log()
    return {"alignment": alignment, "uniformity": uniformity}
