"""GradCache (Gao et al., 2021): contrastive batches far beyond memory, with the exact gradient.

An in-batch-negative loss couples every row of the batch through the similarity matrix, so plain
training keeps every row's activations alive until backward: memory grows with the batch. GradCache
splits the step in three (``objective.grad_cache.chunk_size`` rows at a time):
  1. embed the batch chunk by chunk without a graph, remembering each chunk's RNG state;
  2. compute the loss on the cached embeddings (a leaf tensor) and backpropagate to them only: ∂L/∂e;
  3. embed each chunk again, with a graph, replaying its RNG state so that dropout (and any sampling
     inside ``embed``) draws the same values, and backpropagate ∂L/∂e through it: the surrogate
     Σ_rows ⟨e_r, ∂L/∂e_r⟩ has exactly the parameter gradient of L.
Peak memory: one chunk's graph plus the batch's embeddings; cost: one more forward per step.
A loss term of the parameters alone (``Objective.regularisation``, SG's L_reg) joins the last chunk's
surrogate, so it is backpropagated once; a sum of row-independent terms (``Objective.row_loss``,
SimCSE's MLM auxiliary) is computed per chunk in pass 3, each chunk's share normalised over the whole
batch, and joins that chunk's surrogate.

Under DeepSpeed every chunk's backward goes through ``engine.backward`` (ZeRO-2 reduces and partitions
the gradients as they arrive, as for gradient accumulation), with the accumulation boundary held off
until the last chunk of the last micro-step; the loop's one ``engine.step`` per micro-step is unchanged.
The loss of step 2 may gather embeddings across ranks (``Ranks.gather_with_grad``): its backward's all-reduce
then runs on every rank in the same order, before any chunk's backward.
"""
from __future__ import annotations

from typing import Callable

import torch

from clsys.objectives.base import LossOutput, Objective, add_losses, add_row_loss


def split_rows(batch: dict, rows: int, chunk_size: int) -> list[dict]:
    """The batch cut into chunks of ``chunk_size`` rows: every tensor whose first dimension is ``rows``
    is sliced; anything else (a task tag, a per-batch tensor) goes whole with every chunk."""
    return [{k: v[start:start + chunk_size] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v
             for k, v in batch.items()} for start in range(0, rows, chunk_size)]


def _rng_state() -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def _set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _add_shares(total: LossOutput | None, share: LossOutput | None) -> LossOutput | None:
    """Chunks' shares of a row loss summed, loss and metrics alike (detached: only totals are reported)."""
    if share is None:
        return total
    if total is None:
        return LossOutput(share.loss.detach(), dict(share.metrics))
    return LossOutput(total.loss + share.loss.detach(), {k: v + share.metrics[k] for k, v in total.metrics.items()})


def grad_cache(objective: Objective, batch: dict, chunk_size: int, run: Callable[[dict, str], object],
               backward: Callable[[torch.Tensor, bool], None]) -> LossOutput:
    """The three GradCache passes over ``batch``: ``run(chunk, part)`` is the objective's
    ``grad_cache_part(chunk, part, batch)``, possibly through an engine: a chunk's embeddings for part
    "embed", and (embeddings, row loss share) for part "chunk"; ``backward(surrogate, last_chunk)``
    backpropagates a chunk's surrogate into the parameters. Returns the loss output (already
    backpropagated)."""
    chunks = split_rows(batch, objective.embedding_rows(batch), chunk_size)
    states, cached = [], []
    with torch.no_grad():
        for chunk in chunks:
            states.append(_rng_state())
            cached.append(run(chunk, "embed"))
    after = _rng_state()
    # The loss in float32 at least, whatever the encoder computes in (bf16 autocast).
    embeddings = torch.cat(cached)
    embeddings = embeddings.to(torch.promote_types(embeddings.dtype, torch.float32)).requires_grad_()
    out = objective.embedding_loss(embeddings, batch)
    out.loss.backward()  # only into the leaf `embeddings` (and through cross-rank gathers)
    grads = embeddings.grad.split([len(c) for c in cached])
    row_loss = regularisation = None
    for i, (chunk, state, grad) in enumerate(zip(chunks, states, grads)):
        _set_rng_state(state)  # the same dropout masks as in the first pass
        embedded, share = run(chunk, "chunk")
        surrogate = (embedded * grad.to(embedded.dtype)).sum()
        if share is not None:
            surrogate = surrogate + share.loss
            row_loss = _add_shares(row_loss, share)
        last = i == len(chunks) - 1
        if last and (regularisation := objective.regularisation()) is not None:
            surrogate = surrogate + regularisation.loss
        backward(surrogate, last)
    _set_rng_state(after)
    return add_losses(add_row_loss(out, row_loss), regularisation)


def grad_cache_backward(engine, batch: dict, chunk_size: int, grad_accum: int) -> LossOutput:
    """One micro-batch's forward and backward through a DeepSpeed engine, in chunks of ``chunk_size`` rows;
    the caller then calls ``engine.step()`` as usual. ``engine(chunk, part=…)`` runs the objective's
    ``grad_cache_part`` inside the engine (autocast, ZeRO-3 parameter gathering)."""
    engine.set_gradient_accumulation_boundary(None)  # DeepSpeed's own counter decides, as without chunks
    boundary = engine.is_gradient_accumulation_boundary()

    def backward(surrogate: torch.Tensor, last: bool) -> None:
        engine.set_gradient_accumulation_boundary(boundary and last)
        # The loss is a mean over the micro-batch already; 1/grad_accum is what engine.backward would apply.
        engine.backward(surrogate / grad_accum, scale_wrt_gas=False)

    return grad_cache(engine.module, batch, chunk_size, lambda chunk, part: engine(chunk, part=part, whole=batch),
                      backward)
