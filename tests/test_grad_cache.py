"""GradCache against the plain step, in a real 2-process gloo group with cross-rank negatives.

- float64, plain torch autograd (DeepSpeed reduces only fp16/bf16/fp32 gradients): the GradCache
  gradient equals the full-batch gradient with dropout off; with dropout on (and SG's sampled layer
  views) it equals the gradient of the same loss computed with graph over the same chunked forwards (the
  RNG replay gives every chunk its first-pass draws). SimCSE and self-guided CL (SG-OPT and SG, with
  BERT_T moved off BERT_F so that L_reg has a gradient: it must be added exactly once), and SimCSE with
  the MLM auxiliary (a row loss: every chunk adds its share, normalised over the whole batch's masks);
- real DeepSpeed ZeRO-1 and ZeRO-2 engines (float32): ``grad_cache_backward`` through ``engine.backward``
  per chunk gives the plain engine step's gradient to float32 rounding, also over two accumulation
  micro-steps (a lost chunk, a chunk counted twice or a wrong 1/accumulation scale would be off by tens
  of percent); and an objective without an in-batch loss refuses the setting.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port

SENTENCES = ["A cat sits on the mat.", "Stocks fell sharply on Monday.", "The river floods every spring.",
             "She plays the violin.", "Rain is expected tomorrow.", "He fixed the old bicycle.",
             "The museum opens at nine.", "Bread rises in a warm kitchen.", "Trains run late in snow.",
             "The choir sang at dawn.", "Paint peeled off the wall.", "A hawk circled the field."]
CHUNK = 5  # rows; SimCSE has 12 rows per rank (6 sentences × 2 views) → chunks of 5, 5, 2; SG 6 → 5, 1
OBJECTIVE_KEYS = {"simcse": [],
                  "simcse_mlm": ["objective.mlm_weight=0.1"],  # a row loss: the MLM on masked copies
                  "sg_opt": ["objective.name=self_guided", "objective.loss=sg_opt", "objective.gather=true",
                             "objective.projection_dim=16"],
                  "sg": ["objective.name=self_guided", "objective.loss=sg", "objective.gather=true",
                         "objective.projection_dim=16"]}


def _rank(rank: int, world: int, port: int, tiny: str, objective_kind: str, engine_kind: str, zero: int,
          grad_accum: int, dropout: float, ways: list[str], out: dict) -> None:
    """Each of ``ways`` from the same initial weights, batches and random state, one after the other in
    one process group (a process pair per way would cost a start-up of torch and DeepSpeed each)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    from clsys.recipes import OBJECTIVES, load_config
    from clsys.engine.grad_cache import grad_cache, grad_cache_backward, split_rows
    from clsys.model.encoder import load_tokenizer
    from clsys.objectives.base import add_losses, add_row_loss

    if engine_kind == "torch":
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        from deepspeed.utils import safe_get_full_grad

        from clsys.engine.deepspeed import build_engine, init_distributed

        init_distributed()
    for way in ways:
        cfg = load_config(None, ["objective.name=simcse", *OBJECTIVE_KEYS[objective_kind], f"model.name={tiny}",
                                 "model.init=scratch", "model.tokenizer=all-MiniLM-L6-v2", f"model.dropout={dropout}",
                                 f"cluster.num_workers={world}", f"train.batch_size={12 * grad_accum}",
                                 f"train.grad_accum={grad_accum}", f"train.zero_stage={zero}", "train.precision=fp32",
                                 f"objective.grad_cache.chunk_size={CHUNK if way == 'grad_cache' else 0}"])
        torch.manual_seed(0)
        objective = OBJECTIVES[cfg.objective.name](cfg, load_tokenizer(cfg.model.tokenizer))
        if objective_kind != "simcse":
            with torch.no_grad():  # BERT_T away from BERT_F: L_reg and its gradient are no longer 0
                for p in objective.model.parameters():
                    p.add_(0.1 * torch.randn_like(p))
        micro_batches = [objective.collate([{"txt": s} for s in sentences[rank * 6:(rank + 1) * 6]])
                         for sentences in (SENTENCES, SENTENCES[::-1])[:grad_accum]]

        if engine_kind == "torch":
            objective.double().train()
            torch.manual_seed(100 + rank)
            batch = micro_batches[0]
            if way == "grad_cache":
                loss = grad_cache(objective, batch, CHUNK,
                                  lambda chunk, part: objective.grad_cache_part(chunk, part, batch),
                                  lambda surrogate, last: surrogate.backward()).loss
            else:
                chunks = split_rows(batch, objective.embedding_rows(batch), CHUNK)
                z = torch.cat([objective.embed(c) for c in chunks]) if way == "chunked" else objective.embed(batch)
                terms = add_row_loss(objective.embedding_loss(z, batch), objective.row_loss(batch, batch))
                loss = add_losses(terms, objective.regularisation()).loss
                loss.backward()
            grads = {}
            for name, p in objective.named_parameters():
                if p.requires_grad:
                    dist.all_reduce(p.grad)  # the data-parallel average DeepSpeed/DDP perform
                    grads[name] = p.grad / world
        else:
            engine = build_engine(objective, cfg)
            engine.train()
            torch.manual_seed(100 + rank)
            for i, batch in enumerate(micro_batches):
                if way == "grad_cache":
                    loss = grad_cache_backward(engine, batch, CHUNK, grad_accum).loss
                else:
                    loss = engine(batch).loss
                    engine.backward(loss)
                if i < grad_accum - 1:
                    engine.step()  # not a boundary: DeepSpeed only counts the micro-step
            # At the boundary the gradients are reduced (and, ZeRO-2, partitioned): read them before the step.
            grads = {n: safe_get_full_grad(p).double() for n, p in engine.module.named_parameters() if p.requires_grad}
            engine.destroy()
        if rank == 0:
            out[way] = (loss.item(), {k: v.detach().clone() for k, v in grads.items()})
    # Leaving with the gloo group alive can abort the process at exit ("terminate called without an
    # active exception") once the other rank has gone.
    dist.barrier()
    dist.destroy_process_group()


def run(tiny: str, objective_kind: str, engine_kind: str, ways: list[str], zero: int = 0, grad_accum: int = 1,
        dropout: float = 0.0) -> dict[str, tuple[float, dict]]:
    """(loss, gradients) of each way, by way."""
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(2, free_port(), tiny, objective_kind, engine_kind, zero, grad_accum, dropout, ways, out),
             nprocs=2, join=True)
    return dict(out)


def assert_same(result: tuple[float, dict], reference: tuple[float, dict], rtol: float, rel_atol: float,
                atol: float) -> None:
    """Losses equal and every gradient tensor equal within rtol, plus rel_atol × its largest entry (float32
    sums of terms far larger than the result cancel to ~1e-3 of it; float64 ones to ~1e-12), plus atol
    (the key biases' gradient is zero in exact arithmetic: softmax ignores a shift of every logit)."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    assert loss == pytest.approx(ref_loss, rel=rtol)
    assert set(grads) == set(ref_grads)
    assert sum(g.abs().max() > 1e-6 for g in ref_grads.values()) > len(ref_grads) // 2  # not all ~0
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=rtol, atol=atol + rel_atol * g.abs().max().item(),
                                   msg=name)


@pytest.mark.parametrize("objective_kind", ["simcse", "sg_opt", "simcse_mlm"])
def test_float64_gradient_equals_the_full_batch_gradient(tiny, objective_kind):
    got = run(tiny, objective_kind, "torch", ["grad_cache", "plain"])
    assert_same(got["grad_cache"], got["plain"], rtol=1e-10, rel_atol=1e-10, atol=1e-14)


@pytest.mark.parametrize("objective_kind", ["simcse", "sg"])
def test_float64_random_draws_are_replayed(tiny, objective_kind):
    got = run(tiny, objective_kind, "torch", ["grad_cache", "chunked", "plain"], dropout=0.1)
    assert_same(got["grad_cache"], got["chunked"], rtol=1e-10, rel_atol=1e-10, atol=1e-14)
    # and the draws matter: the full-batch forward draws others, so its loss differs
    assert got["plain"][0] != pytest.approx(got["chunked"][0], rel=1e-9)


@pytest.mark.parametrize("objective_kind,zero,grad_accum", [("simcse", 1, 1), ("simcse", 2, 2), ("sg_opt", 2, 1),
                                                                 ("simcse_mlm", 2, 2)])
def test_deepspeed_zero_gradient_equals_the_plain_step(tiny, objective_kind, zero, grad_accum):
    got = run(tiny, objective_kind, "deepspeed", ["grad_cache", "plain"], zero, grad_accum)
    assert_same(got["grad_cache"], got["plain"], rtol=1e-4, rel_atol=1e-2, atol=1e-9)


def test_objectives_without_an_in_batch_loss_refuse_grad_cache(tiny):
    from clsys.recipes import OBJECTIVES, load_config
    from clsys.model.encoder import load_tokenizer

    cfg = load_config(None, ["objective.name=tacl", f"model.name={tiny}", "model.init=scratch",
                             "model.tokenizer=all-MiniLM-L6-v2", "objective.grad_cache.chunk_size=8"])
    with pytest.raises(ValueError, match="objective.grad_cache: tacl has no in-batch-negative loss"):
        OBJECTIVES["tacl"](cfg, load_tokenizer(cfg.model.tokenizer))
