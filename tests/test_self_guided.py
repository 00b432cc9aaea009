"""Self-guided CL (docs/training/objectives.md#self-guided): losses vs loop references, frozen parts, 2-rank gradient scale."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from clsys.config import Config, ModelConfig, TrainConfig
from clsys.engine.ranks import ProcessGroupRanks
from clsys.objectives.ranks import ONE_PROCESS
from clsys.objectives.self_guided import LOSS_FNS, ProjectionHead, SelfGuided, SelfGuidedConfig, pool_layers
from conftest import free_port

TAU = 0.05  # larger than the recipe's 0.01 so that no term underflows in the references


def _phi(u, v, tau):
    return torch.exp(torch.dot(u, v) / (u.norm() * v.norm()) / tau)


def ref_sg(c, h, tau):
    """(1/2b) Σ_{x∈X} −log φ(x, μ(x)) / Σ_{y∈X, y≠x} φ(x, y), X = {c_i} ∪ {h_i}."""
    b = len(c)
    views = [c[i] for i in range(b)] + [h[i] for i in range(b)]
    total = 0.0
    for x in range(2 * b):
        partner = (x + b) % (2 * b)
        denom = sum(_phi(views[x], views[y], tau) for y in range(2 * b) if y != x)
        total = total - torch.log(_phi(views[x], views[partner], tau) / denom)
    return total / (2 * b)


def ref_opt(c, h, tau, with_c_negatives):
    """OPT1 (negatives c_j and h_j) / OPT2 (negatives h_j), j ≠ i, anchors c_i only."""
    b = len(c)
    total = 0.0
    for i in range(b):
        pos = _phi(c[i], h[i], tau)
        denom = pos + sum(_phi(c[i], h[j], tau) for j in range(b) if j != i)
        if with_c_negatives:
            denom = denom + sum(_phi(c[i], c[j], tau) for j in range(b) if j != i)
        total = total - torch.log(pos / denom)
    return total / b


def ref_sg_opt(c, h, tau):
    """(1/(b(l+1))) Σ_i Σ_k −log φ(c_i,h_ik) / (φ(c_i,h_ik) + Σ_m Σ_{j≠i} φ(c_i,h_jm))."""
    b, views = h.shape[0], h.shape[1]
    total = 0.0
    for i in range(b):
        negatives = sum(_phi(c[i], h[j, m], tau) for j in range(b) if j != i for m in range(views))
        for k in range(views):
            pos = _phi(c[i], h[i, k], tau)
            total = total - torch.log(pos / (pos + negatives))
    return total / (b * views)


REFERENCES = {"sg": ref_sg, "opt1": lambda c, h, t: ref_opt(c, h, t, True),
              "opt2": lambda c, h, t: ref_opt(c, h, t, False), "sg_opt": ref_sg_opt}


def _views(loss: str, b: int, seed: int, dim: int = 6, layers: int = 4):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(b, dim, generator=g, dtype=torch.float64)
    h = torch.randn(*((b, layers, dim) if loss == "sg_opt" else (b, dim)), generator=g, dtype=torch.float64)
    return c, h


@pytest.mark.parametrize("b", [1, 2, 5])
@pytest.mark.parametrize("loss", ["sg", "opt1", "opt2", "sg_opt"])
def test_loss_matches_loop_reference_value_and_gradient(loss, b):
    c, h = _views(loss, b, seed=b)
    c1, h1 = c.clone().requires_grad_(), h.clone().requires_grad_()
    got = LOSS_FNS[loss](c1, h1, TAU)
    got.backward()
    c2, h2 = c.clone().requires_grad_(), h.clone().requires_grad_()
    want = REFERENCES[loss](c2, h2, TAU)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(c1.grad, c2.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-9, atol=1e-12)


def test_sg_opt_denominator_excludes_the_anchors_other_positives():
    """SG-OPT's denominator: moving h_{i,m≠k} must not change ℓ_{i,k}; a plain softmax over all views would."""
    c, h = _views("sg_opt", 1, seed=3)
    other = h.clone()
    other[0, 1:] = torch.randn(3, 6, dtype=torch.float64)
    # b = 1: no negatives, every term is −log(φ/φ) = 0 whatever the other positives are.
    assert LOSS_FNS["sg_opt"](c, h, TAU).item() == 0.0 == LOSS_FNS["sg_opt"](c, other, TAU).item()


def test_pool_layers_ignores_padding():
    g = torch.Generator().manual_seed(4)
    hidden = tuple(torch.randn(3, 5, 4, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    # Pad positions carry huge values: they must not leak into max or mean.
    hidden = tuple(x.masked_fill(mask.unsqueeze(-1) == 0, 1e6) for x in hidden)
    for kind in ("max", "mean"):
        got = pool_layers(hidden, mask, kind)
        assert got.shape == (3, 3, 4)
        for i in range(3):
            for k in range(3):
                tokens = [hidden[k][i, t] for t in range(5) if mask[i, t]]
                want = torch.stack(tokens).amax(0) if kind == "max" else sum(tokens) / len(tokens)
                torch.testing.assert_close(got[i, k], want)


def test_projection_head_architecture():
    head = ProjectionHead(32, 4096)
    linears = [m for m in head.net if isinstance(m, torch.nn.Linear)]
    assert [type(m).__name__ for m in head.net] == ["Linear", "GELU", "Linear", "GELU"]
    assert [tuple(m.weight.shape) for m in linears] == [(4096, 32), (4096, 4096)]
    assert all(m.bias.abs().sum() == 0 for m in linears)
    assert linears[1].weight.std().item() == pytest.approx(0.02, rel=0.01)


# --- the objective on a tiny BERT -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> str:
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(folder)
    return str(folder)


def _objective(path: str, **overrides) -> SelfGuided:
    torch.manual_seed(0)
    cfg = Config(model=ModelConfig(name=path), train=TrainConfig(zero_stage=2),
                 objective=SelfGuidedConfig(name="self_guided", projection_dim=16, **overrides))
    return SelfGuided(cfg, tokenizer=None)


def _batch(b: int = 4, seq: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, seq, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    return {"input_ids": torch.randint(1, 100, (b, seq), generator=g) * mask, "attention_mask": mask,
            "token_type_ids": torch.zeros(b, seq, dtype=torch.long)}


@pytest.mark.parametrize("loss", ["sg", "opt1", "opt2", "sg_opt"])
def test_frozen_parts_stay_frozen(tiny_bert, loss):
    obj = _objective(tiny_bert, loss=loss)
    obj.train()
    frozen_before = {k: v.clone() for k, v in obj.frozen.state_dict().items()}
    embeddings_before = {k: v.clone() for k, v in obj.model.embeddings.state_dict().items()}
    trainable = [p for p in obj.parameters() if p.requires_grad]
    trainable_ids = {id(p) for p in trainable}
    assert not any(id(p) in trainable_ids for p in obj.frozen.parameters())
    assert not any(id(p) in trainable_ids for p in obj.model.embeddings.parameters())
    assert obj.regularisation().metrics["reg"].item() == 0.0

    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    for step in range(3):
        out = obj(_batch(seed=step))
        assert set(out.metrics) == {"loss", "contrastive", "reg"}
        if step == 0:
            assert out.metrics["reg"].item() == 0.0
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()

    for k, v in obj.frozen.state_dict().items():
        assert torch.equal(v, frozen_before[k]), k
    for k, v in obj.model.embeddings.state_dict().items():
        assert torch.equal(v, embeddings_before[k]), k
    # BERT_T did move, and L_reg is exactly Σ_p ‖θ_T,p − θ_F,p‖² over all its tensors.
    frozen = dict(obj.frozen.named_parameters())
    want = sum(((p - frozen[n]) ** 2).sum().item() for n, p in obj.model.named_parameters())
    assert want > 0
    assert obj.regularisation().metrics["reg"].item() == pytest.approx(want, rel=1e-5)


def test_frozen_copy_mode_switch(tiny_bert):
    eval_mode = _objective(tiny_bert)
    eval_mode.train()
    assert eval_mode.model.training and not eval_mode.frozen.training
    assert not any(m.training for m in eval_mode.frozen.modules())
    dropout_mode = _objective(tiny_bert, frozen_dropout=True)
    dropout_mode.train()
    assert dropout_mode.frozen.training
    dropout_mode.eval()
    assert not dropout_mode.frozen.training and not dropout_mode.model.training


def test_collate_export_and_config_checks(tiny_bert):
    from clsys.model.encoder import load_tokenizer

    cfg = Config(objective=SelfGuidedConfig(name="self_guided", projection_dim=16))
    cfg.model.name = tiny_bert
    obj = SelfGuided(cfg, tokenizer=load_tokenizer("all-MiniLM-L6-v2"))
    batch = obj.collate([{"txt": "a short sentence."}, {"txt": "a somewhat longer sentence than that."}])
    assert batch["input_ids"].shape[0] == 2  # one copy per sentence, not two views
    assert obj.encoder() is obj.model and obj.export_spec().pooling == "cls"
    assert SelfGuided.streams(cfg) == ["sentences"]
    for bad in ({"loss": "opt3"}, {"layer_pooling": "cls"}):
        with pytest.raises(ValueError):
            _objective(tiny_bert, **bad)
    cfg.train.zero_stage = 3
    with pytest.raises(ValueError, match="zero_stage"):
        SelfGuided(cfg, tokenizer=None)


# --- cross-rank gathering -----------------------------------------------------------------------------

def _head() -> torch.nn.Module:
    torch.manual_seed(0)
    return ProjectionHead(6, 8).double()


def _inputs(rows: int):
    """Raw (pre-head) views for every variant: c [rows, 6], h [rows, 6] and h_layers [rows, 3, 6]."""
    g = torch.Generator().manual_seed(5)
    return tuple(torch.randn(rows, *shape, generator=g, dtype=torch.float64) for shape in ((6,), (6,), (3, 6)))


def _grads(loss: str, rows: slice, gather: bool, total: int) -> list[torch.Tensor]:
    head = _head()
    c, h, h_layers = (x[rows] for x in _inputs(total))
    ranks = ProcessGroupRanks() if gather else ONE_PROCESS
    LOSS_FNS[loss](head(c), head(h_layers if loss == "sg_opt" else h), TAU, ranks).backward()
    return [p.grad for p in head.parameters()]


def _rank_grads(rank: int, world: int, port: int, rows: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {}
    for loss in LOSS_FNS:
        grads = _grads(loss, slice(rank * rows, (rank + 1) * rows), gather=True, total=world * rows)
        for g in grads:
            dist.all_reduce(g)  # what DeepSpeed / DDP do with per-rank gradients: average over ranks
            g /= world
        result[loss] = grads
    torch.save(result, f"{out}.{rank}")
    dist.destroy_process_group()


def test_two_rank_gather_equals_single_process_global_batch(tmp_path):
    """Documented scale: 2 ranks × B with gather give the gradient of 1 process × 2B (scale 1)."""
    world, rows = 2, 3
    out = str(tmp_path / "grads")
    mp.spawn(_rank_grads, args=(world, free_port(), rows, out), nprocs=world, join=True)
    for loss in LOSS_FNS:
        reference = _grads(loss, slice(None), gather=False, total=world * rows)
        for rank in range(world):
            got = torch.load(f"{out}.{rank}", weights_only=True)[loss]
            for g, r in zip(got, reference):
                torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)
        # The check can fail: rank-local contrast (gather off) gives a different gradient.
        local = [(a + b) / 2 for a, b in zip(_grads(loss, slice(0, rows), False, world * rows),
                                             _grads(loss, slice(rows, 2 * rows), False, world * rows))]
        assert not torch.allclose(local[0], reference[0])
