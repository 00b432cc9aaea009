"""The process group's collectives as objectives use them (``clsys.objectives.ranks.Ranks``), over torch.distributed.

``build_engine`` hands a ``ProcessGroupRanks`` to the objective it wraps; so does anything else that trains an
objective across processes (a recipe's own driver, a test's gloo group).

Cross-rank negatives and the gradient scale: ``gather_with_grad`` all-gathers embeddings from every rank; its
backward sums the incoming gradients over ranks (an all-reduce) and hands each rank the slice of its own rows.
Each rank then computes the loss of its *local* anchors against the *global* candidates, averaged over its local
anchors. After the data-parallel gradient average that DeepSpeed (like DDP) performs, the parameter gradient with W
ranks × B rows equals the gradient of one process running the same loss on all W·B rows: **scale 1, independent of
W** (``tests/test_contrastive.py`` checks it in a real 2-process gloo group, in float64). The original SimCSE code
computes the whole N×N loss on every rank with gradient only through the local rows, which after DDP averaging gives
1/W of that gradient (the learning rate divided by W) at O(N²) instead of O(B·N) cost per rank.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from clsys.objectives.ranks import Ranks


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.rank, ctx.rows, ctx.group = rank, local.shape[0], group
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Every rank's loss depends on our rows; their gradient w.r.t. our rows is the sum over ranks.
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


class ProcessGroupRanks(Ranks):
    """The ranks of ``group`` (None: the default process group, which must exist)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def gather_with_grad(self, local: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.world == 1:
            return local, 0
        return _GatherWithGrad.apply(local, self.group), self.rank * local.shape[0]

    def gather_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        counts = [int(n) for n in self.all_gather(torch.tensor([rows.shape[0]], device=rows.device))]
        # all_gather needs equal shapes, so pad to the largest and cut the padding off again.
        padded = rows.new_zeros(max(counts), *rows.shape[1:])
        padded[:rows.shape[0]] = rows
        parts = self.all_gather(padded)
        return torch.cat([part[:n] for part, n in zip(parts, counts)]), sum(counts[:self.rank])

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return parts

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, obj, group=self.group)
        return parts
