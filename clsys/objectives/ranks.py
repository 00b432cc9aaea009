"""The data-parallel ranks as an objective sees them: the collectives it needs, handed to it by the engine.

An objective calls no ``torch.distributed`` function itself. It reaches the other ranks through ``Objective.ranks``:
``ONE_PROCESS`` (this class: rank 0 of 1, every collective the identity) until the engine hands it the process
group's (``clsys.engine.ranks.ProcessGroupRanks``, set by ``build_engine``). So an objective built alone (a test,
an evaluation) runs as one process, and one inside training gathers across the ranks it trains with.
"""
from __future__ import annotations

from typing import Any

import torch


class Ranks:
    """One process alone. The engine's ``ProcessGroupRanks`` implements the same calls over a process group."""

    rank = 0
    world = 1

    def gather_with_grad(self, local: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every rank's ``local`` rows concatenated in rank order (every rank passes the same number of rows), and
        where this rank's rows start; its backward hands each rank the sum over ranks of its rows' gradients."""
        return local, 0

    def gather_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every rank's ``rows`` [B_r, …] concatenated in rank order (B_r may differ), and where this rank's start;
        no gradient."""
        return rows, 0

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (the same shape on every rank), in rank order."""
        return [tensor]

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place; returns it."""
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        return [obj]


ONE_PROCESS = Ranks()
