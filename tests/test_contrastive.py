"""The contrastive loss against a naive float64 reference, alone and across a real 2-process gloo group."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from clsys.engine.ranks import ProcessGroupRanks
from clsys.objectives.contrastive import alignment_uniformity, cosine_logits, info_nce
from clsys.objectives.ranks import ONE_PROCESS, Ranks
from conftest import free_port


def naive_info_nce(a, p, tau, n=None, alpha=0.0):
    """ℓ_i = −log e^{s(a_i,p_i)/τ} / (Σ_j e^{s(a_i,p_j)/τ} + Σ_j w_ij e^{s(a_i,n_j)/τ}), loops only."""
    def cos(u, v):
        return sum(x * y for x, y in zip(u, v)) / math.sqrt(sum(x * x for x in u) * sum(y * y for y in v))

    a, p = a.tolist(), p.tolist()
    n = n.tolist() if n is not None else []
    total = 0.0
    for i in range(len(a)):
        denom = sum(math.exp(cos(a[i], p[j]) / tau) for j in range(len(p)))
        denom += sum(math.exp(cos(a[i], n[j]) / tau + (alpha if i == j else 0.0)) for j in range(len(n)))
        total += -math.log(math.exp(cos(a[i], p[i]) / tau) / denom)
    return total / len(a)


@pytest.mark.parametrize("with_negatives,alpha", [(False, 0.0), (True, 0.0), (True, 0.7)])
def test_info_nce_matches_naive_reference(with_negatives, alpha):
    g = torch.Generator().manual_seed(0)
    a, p, n = (torch.randn(7, 5, generator=g, dtype=torch.float64) for _ in range(3))
    got = info_nce(a, p, 0.05, n if with_negatives else None, alpha)
    want = naive_info_nce(a, p, 0.05, n if with_negatives else None, alpha)
    assert got.item() == pytest.approx(want, rel=1e-10)


def test_logits_and_loss_in_float32_under_bf16_autocast():
    # bf16 embeddings (what an encoder under autocast returns): the logits are computed from them in
    # float32, autocast notwithstanding, so they match a float64 reference on the same values to float32's
    # precision; a bf16 product would be off by up to ~0.04 at τ 0.05. The gradient reaches the bf16 input.
    g = torch.Generator().manual_seed(3)
    a, p = (torch.randn(16, 64, generator=g).bfloat16().requires_grad_() for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = cosine_logits(a, p, 0.05)
        loss = info_nce(a, p, 0.05)
    assert logits.dtype == loss.dtype == torch.float32
    want = cosine_logits(a.detach().double(), p.detach().double(), 0.05)
    assert (logits.double() - want).abs().max().item() < 1e-4
    assert loss.item() == pytest.approx(naive_info_nce(a.detach().double(), p.detach().double(), 0.05), rel=1e-5)
    loss.backward()
    assert a.grad.dtype == torch.bfloat16 and a.grad.abs().sum() > 0


def test_alignment_uniformity_matches_definition():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    xn, yn = torch.nn.functional.normalize(x, dim=-1), torch.nn.functional.normalize(y, dim=-1)
    align = sum(((xn[i] - yn[i]) ** 2).sum().item() for i in range(6)) / 6
    pairs = [((xn[i] - xn[j]) ** 2).sum().item() for i in range(6) for j in range(i + 1, 6)]
    unif = math.log(sum(math.exp(-2 * d) for d in pairs) / len(pairs))
    got = alignment_uniformity(x, y)
    assert got["alignment"].item() == pytest.approx(align, rel=1e-5)
    assert got["uniformity"].item() == pytest.approx(unif, rel=1e-5)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()


def _batch(rows: int):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(rows, 6, generator=g, dtype=torch.float64) for _ in range(3)]


def _loss(model, x1, x2, x3, negatives: bool, ranks: Ranks = ONE_PROCESS):
    return info_nce(model(x1), model(x2), 0.05, model(x3) if negatives else None, 0.5, ranks)


def _rank_grads(rank: int, world: int, port: int, rows: int, negatives: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model()
    local = [x[rank * rows:(rank + 1) * rows] for x in _batch(world * rows)]
    _loss(model, *local, negatives, ProcessGroupRanks()).backward()
    grads = []
    for param in model.parameters():
        # What DeepSpeed (and DDP) do with the per-rank gradients: average them over ranks.
        dist.all_reduce(param.grad)
        grads.append(param.grad / world)
    torch.save(grads, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("negatives", [False, True])
def test_two_rank_gradient_equals_single_process_global_batch(tmp_path, negatives):
    """Documented scale: W ranks × B rows give the gradient of 1 process × W·B rows (scale 1)."""
    world, rows = 2, 5
    out = str(tmp_path / "grads")
    mp.spawn(_rank_grads, args=(world, free_port(), rows, negatives, out), nprocs=world, join=True)

    model = _model()
    _loss(model, *_batch(world * rows), negatives).backward()
    reference = [p.grad for p in model.parameters()]
    for rank in range(world):
        got = torch.load(f"{out}.{rank}", weights_only=True)
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    # The test can fail: without the gather the local-only loss gives a different gradient.
    local_only = _model()
    x = _batch(world * rows)
    info_nce(local_only(x[0][:rows]), local_only(x[1][:rows]), 0.05).backward()
    assert not torch.allclose(next(local_only.parameters()).grad, reference[0])
