"""Contrastive building blocks shared by every objective.

Cross-rank negatives and the gradient scale
--------------------------------------------
``gather_with_grad`` all-gathers embeddings from every data-parallel rank; its backward sums the
incoming gradients over ranks (an all-reduce) and hands each rank the slice of its own rows.
Each rank then computes the loss of its *local* anchors against the *global* candidates,
averaged over its local anchors. After the data-parallel gradient average that DeepSpeed (like
DDP) performs, the parameter gradient with W ranks × B rows equals the gradient of one process
running the same loss on all W·B rows: **scale 1, independent of W**.

(The original SimCSE code computes the whole N×N loss on every rank with gradient only through the
local rows, which after DDP averaging gives 1/W of that gradient — the same as dividing the learning
rate by W — at O(N²) instead of O(B·N) cost per rank. ``tests/test_contrastive.py`` checks our scale
in a real 2-process gloo group against a single process with the concatenated batch, in float64.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        world, rank = dist.get_world_size(), dist.get_rank()
        ctx.rank, ctx.rows = rank, local.shape[0]
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # Every rank's loss depends on our rows; their gradient w.r.t. our rows is the sum over ranks.
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def gather_with_grad(local: torch.Tensor) -> tuple[torch.Tensor, int]:
    """All ranks' rows concatenated in rank order, and the offset of this rank's rows in it.

    Every rank must pass the same number of rows (the loader guarantees equal batch sizes).
    Without a process group this is the identity with offset 0.
    """
    if not _distributed():
        return local, 0
    return _GatherWithGrad.apply(local), dist.get_rank() * local.shape[0]


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
             gather: bool = True) -> torch.Tensor:
    """Asymmetric InfoNCE: anchor i against all positives (and all hard negatives) of the batch.

    ℓ_i = −log exp(s(a_i,p_i)/τ) / (Σ_j exp(s(a_i,p_j)/τ) + Σ_j w_ij exp(s(a_i,n_j)/τ)),
    with w_ii = e^α (α = ``hard_negative_weight``, a log-offset on the logit) and w_ij = 1 otherwise.
    Candidates are gathered from every rank when ``gather`` is set; anchors stay local and the loss is
    the mean over local anchors (see the module docstring for the resulting gradient scale).
    """
    candidates, offset = gather_with_grad(positives) if gather else (positives, 0)
    logits = cosine_logits(anchors, candidates, temperature)
    local = torch.arange(anchors.shape[0], device=anchors.device)
    if hard_negatives is not None:
        negatives, _ = gather_with_grad(hard_negatives) if gather else (hard_negatives, 0)
        neg_logits = cosine_logits(anchors, negatives, temperature)
        if hard_negative_weight:
            neg_logits = neg_logits.index_put((local, local + offset),
                                              neg_logits[local, local + offset] + hard_negative_weight)
        logits = torch.cat([logits, neg_logits], dim=1)
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
