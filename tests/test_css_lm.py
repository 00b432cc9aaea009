"""CSS-LM objective (docs/training/objectives.md#css-lm): both stages' losses against float64 loop references, stage A's
detach switch (and its resume), stage C's frozen heads, retrieval against a naive scoring loop,
rank positions, one-time bank tokenisation, 2-rank retrieval equal to one process, config checks."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from clsys.config import Config
from clsys.engine.ranks import ProcessGroupRanks
from clsys.model.encoder import load_tokenizer
from clsys.recipes import OBJECTIVES
from clsys.recipes.css_lm.config import CSSLMConfig
from clsys.recipes.css_lm.objective import CSSLM
from clsys.recipes.css_lm.bank import RetrievalBank, retrieved_group
from conftest import free_port

D = 32  # hidden size of the tiny BERT
TEXTS = ["the movie was great fun", "a dull and boring film", "it is fine i guess", "what a wonderful cast",
         "the plot made no sense at all", "an average evening"]
LABELS = [2, 0, 1, 2, 0, 1]
CORPUS = [f"corpus sentence number {i} about topic {i % 3}" for i in range(40)]


def make(tiny: str, seed: int = 0, **objective) -> CSSLM:
    cfg = Config(objective=CSSLMConfig(name="css_lm", **{"num_labels": 3, "classifier_dropout": 0.0, **objective}))
    # Dropout off everywhere: training-mode forwards are then deterministic and comparable to references.
    cfg.model.name, cfg.model.init, cfg.model.dropout = tiny, "scratch", 0.0
    cfg.data.max_length = 24
    torch.manual_seed(seed)
    return CSSLM(cfg, load_tokenizer("all-MiniLM-L6-v2"))


def corpus_batch(objective: CSSLM, texts: list[str]) -> dict[str, torch.Tensor]:
    return objective.collate([{"txt": t} for t in texts])


def nll(logits: torch.Tensor, target: int) -> torch.Tensor:
    return -torch.log_softmax(logits, 0)[target]


def mean(terms: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(terms).mean()


def naive_pairwise(scorer, labels: list[int], *views: torch.Tensor) -> torch.Tensor:
    """CE of the scorer on [x_1[a]; x_1[b]; x_2[a]; x_2[b]; …] for every ordered pair, one pair at a time."""
    m = len(labels)
    return mean([nll(scorer(torch.cat([x[i] for x in views for i in (a, b)])), int(labels[a] == labels[b]))
                 for a in range(m) for b in range(m)])


def naive_ce(head, u: torch.Tensor, v: torch.Tensor, labels: list[int]) -> torch.Tensor:
    return mean([nll(head(torch.cat([u[i], v[i]])), y) for i, y in enumerate(labels)])


def grad_norm(module: torch.nn.Module) -> float:
    return sum(float(p.grad.abs().sum()) for p in module.parameters() if p.grad is not None)


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("override,key", [({"stage": "finetune"}, "objective.stage"),
                                          ({"num_labels": 1}, "objective.num_labels"),
                                          ({"num_labels": 0}, "objective.num_labels"),
                                          ({"k": 0}, "objective.k"),
                                          ({"detach_after_micro_steps": -1}, "objective.detach_after_micro_steps")])
def test_config_errors_name_the_key(tiny, override, key):
    with pytest.raises(ValueError, match=key):
        make(tiny, **override)


def test_zero3_is_refused(tiny):
    cfg = Config(objective=CSSLMConfig(name="css_lm", num_labels=3))
    cfg.model.name, cfg.model.init, cfg.train.zero_stage = tiny, "scratch", 3
    with pytest.raises(ValueError, match="train.zero_stage 0-2"):
        CSSLM(cfg, load_tokenizer("all-MiniLM-L6-v2"))


def test_registered_and_interface(tiny):
    assert OBJECTIVES["css_lm"] is CSSLM and CSSLM.config_class is CSSLMConfig
    objective = make(tiny)
    assert CSSLM.streams(objective.cfg) == ["sentences"] and objective.export_spec().pooling == "cls"
    assert objective.encoder() is objective.model
    corpus = objective.collate([{"txt": t, "__key__": str(i)} for i, t in enumerate(CORPUS[:3])])
    assert torch.equal(corpus["corpus_input_ids"], objective.collate_corpus(CORPUS[:3])["input_ids"])
    batch = objective.collate_labeled(TEXTS[:2], LABELS[:2])
    logits = objective.classify(batch["input_ids"], batch["attention_mask"])
    assert logits.shape == (2, 3) and not logits.requires_grad and objective.training
    u, v = objective.encode_views(**objective.collate_corpus(CORPUS[:3]))
    assert u.shape == v.shape == (3, D) and not u.requires_grad


def test_classify_finds_the_recipe_that_exported_a_classifier(tmp_path, monkeypatch):
    """``python -m clsys.classify`` loads a folder with the loader of the recipe named in its classifier.json; a
    folder exported before the recipe was recorded goes to the one recipe that exports classifiers; a recipe
    that exports none is refused by name. (The loaders here stand in for the real one, which the CSS-LM
    pipeline test runs on a trained export.)"""
    import json

    import clsys.classify as classify
    from clsys.recipes import HOMES
    from clsys.recipes.home import RecipeHome

    assert HOMES["css_lm"].objective is CSSLM and HOMES["css_lm"].load_classifier is not None
    monkeypatch.setattr(classify, "HOMES", {
        "css_lm": RecipeHome(CSSLM, HOMES["css_lm"].drive, load_classifier=lambda folder: ("css_lm", folder)),
        "simcse": RecipeHome(CSSLM, HOMES["css_lm"].drive)})
    meta = tmp_path / "classifier.json"
    meta.write_text(json.dumps({"labels": ["a", "b"], "max_length": 32, "recipe": "css_lm"}))
    assert classify.load(str(tmp_path)) == ("css_lm", str(tmp_path))
    meta.write_text(json.dumps({"labels": ["a", "b"], "max_length": 32}))
    assert classify.load(f"file://{tmp_path}") == ("css_lm", str(tmp_path))
    meta.write_text(json.dumps({"labels": ["a", "b"], "max_length": 32, "recipe": "simcse"}))
    with pytest.raises(ValueError, match=r"classifier.json: recipe 'simcse' exports no classifier clsys knows "
                                         r"\(recipes that do: css_lm\)"):
        classify.load(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Stage A


@pytest.mark.parametrize("detach", [False, True])
def test_warmup_loss_matches_naive_reference(tiny, detach):
    objective = make(tiny).double()
    g = torch.Generator().manual_seed(1)
    b, n = 4, 3
    u, v = torch.randn(b, D, generator=g, dtype=torch.float64), torch.randn(b, D, generator=g, dtype=torch.float64)
    v_corpus = torch.randn(b * n, D, generator=g, dtype=torch.float64)
    labels = [0, 2, 0, 1]
    out = objective.warmup_loss(u, v, v_corpus, torch.tensor(labels), detach)

    ce = naive_ce(objective.task_head, u, v, labels)
    c_in = naive_pairwise(objective.class_scorer, labels, u)
    dc_in = naive_pairwise(objective.dc_scorer, labels, v, u)
    # L_D^init: (query i, query B−1−i) in-domain, (query i, each of its own n corpus sentences) not.
    pairs = [(v[i], v[b - 1 - i], 1) for i in range(b)] + [(v[i], v_corpus[i * n + j], 0)
                                                             for i in range(b) for j in range(n)]
    d_init = mean([nll(objective.domain_scorer(torch.cat([x, y])), target) for x, y, target in pairs])
    want = {"ce": ce, "c_in": c_in, "dc_in": dc_in, "d_init": d_init, "loss": ce + dc_in + d_init + c_in}
    for name, value in want.items():
        torch.testing.assert_close(out.metrics[name], value.detach(), rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(out.loss, want["loss"], rtol=1e-12, atol=1e-12)
    assert all(not m.requires_grad for m in out.metrics.values())


def test_warmup_forward_trains_encoder_and_every_head(tiny):
    objective = make(tiny, domain_negatives=2)
    objective.train()
    batch = objective.collate_labeled(TEXTS[:4], LABELS[:4], corpus_batch(objective, CORPUS[:8]))
    # The views sit on [CLS] and on the final [SEP] of every (right-padded) row.
    last = batch["attention_mask"].sum(1) - 1
    assert (batch["input_ids"][:, 0] == objective.tokenizer.cls_token_id).all()
    assert (batch["input_ids"][torch.arange(4), last] == objective.tokenizer.sep_token_id).all()
    out = objective(batch)
    assert torch.isfinite(out.loss) and set(out.metrics) == {"loss", "ce", "dc_in", "c_in", "d_init", "accuracy"}
    # The forward wires the same views and corpus rows into the loss as the reference above assumes.
    views = objective.encode_views(batch["input_ids"], batch["attention_mask"])
    _, v_corpus = objective.encode_views(batch["corpus_input_ids"], batch["corpus_attention_mask"])
    torch.testing.assert_close(out.loss, objective.warmup_loss(*views, v_corpus, batch["labels"]).loss)
    out.loss.backward()
    for module in (objective.model, objective.task_head, objective.class_scorer, objective.domain_scorer,
                   objective.dc_scorer):
        assert grad_norm(module) > 0
    with pytest.raises(ValueError, match="domain_negatives"):
        objective(objective.collate_labeled(TEXTS[:4], LABELS[:4], corpus_batch(objective, CORPUS[:6])))


def test_detach_switch_after_micro_steps_and_across_resume(tiny):
    objective = make(tiny, domain_negatives=2, detach_after_micro_steps=2)
    # With the task head's output layer and DC zeroed, L_CE and L_DC^in pass no gradient to the
    # encoder: whatever reaches it comes from L_C^in and L_D^init.
    with torch.no_grad():
        for p in (*objective.task_head[-1].parameters(), *objective.dc_scorer.parameters()):
            p.zero_()
    batch = objective.collate_labeled(TEXTS[:4], LABELS[:4], corpus_batch(objective, CORPUS[:8]))

    def step(model: CSSLM) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        model(batch).loss.backward()
        return grad_norm(model.model), grad_norm(model.class_scorer) + grad_norm(model.domain_scorer)

    objective.train()
    assert [step(objective)[0] > 0 for _ in range(2)] == [True, True]  # forwards 0 and 1
    encoder, heads = step(objective)  # forward 2: detached
    assert encoder == 0 and heads > 0
    assert int(objective.forwards) == 3
    objective.eval()
    objective(batch)  # evaluation forwards do not count
    assert int(objective.forwards) == 3

    resumed = make(tiny, seed=5, domain_negatives=2, detach_after_micro_steps=2)
    resumed.load_state_dict(objective.state_dict())
    resumed.train()
    assert int(resumed.forwards) == 3
    encoder, heads = step(resumed)
    assert encoder == 0 and heads > 0


# ---------------------------------------------------------------------------------------------
# Stage C


class CountingTokenizer:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def random_bank(rows: int, seed: int) -> RetrievalBank:
    g = torch.Generator().manual_seed(seed)
    return RetrievalBank(torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g), CORPUS[:rows])


def naive_top_k(objective: CSSLM, qu: torch.Tensor, qv: torch.Tensor, bank: RetrievalBank, k: int) -> list[list[int]]:
    """s = −log softmax(C([u_q; u_d]))[0] + w·(−log softmax(D([v_q; v_d]))[0]), one pair at a time, float64."""
    c, d, w = (copy.deepcopy(objective.class_scorer).double(), copy.deepcopy(objective.domain_scorer).double(),
               objective.oc.domain_weight)
    qu, qv, bu, bv = qu.double(), qv.double(), bank.u.double(), bank.v.double()
    result = []
    for q in range(qu.shape[0]):
        scores = [float(nll(c(torch.cat([qu[q], bu[r]])), 0) + w * nll(d(torch.cat([qv[q], bv[r]])), 0))
                  for r in range(len(bank))]
        result.append([bank.offset + r for r in sorted(range(len(bank)), key=lambda r: (-scores[r], r))[:k]])
    return result


def unpadded(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


def test_rank_positions_depend_only_on_seed_and_count(tiny):
    a, b = make(tiny, stage="css"), make(tiny, seed=3, stage="css")
    assert torch.equal(a.rank_positions(7), b.rank_positions(7))
    draws = [a.rank_positions(count).tolist() for count in range(10)]
    assert len({tuple(d) for d in draws}) > 1 and all(0 <= p < 16 for d in draws for p in d)
    other_seed = make(tiny, stage="css")
    other_seed.cfg.train.seed += 1
    assert [other_seed.rank_positions(count).tolist() for count in range(10)] != draws
    permutation = make(tiny, stage="css", positives_with_replacement=False)
    assert sorted(permutation.rank_positions(0).tolist()) == list(range(16))


def encoder_rows(kwargs: dict) -> int:
    """How many rows an encoder call ran: a packed call (model.packed) gets one sequence and their layout."""
    packing = kwargs.get("packing")
    return packing.rows if packing is not None else kwargs["input_ids"].shape[0]


def test_css_step_retrieves_naive_top_k_and_matches_loss_reference(tiny):
    k, b = 3, 4
    objective = make(tiny, stage="css", k=k)
    objective.train()
    batch = objective.collate_labeled(TEXTS[:b], LABELS[:b])
    with pytest.raises(RuntimeError, match="attach_bank"):
        objective(batch)
    bank = random_bank(10, seed=2)
    counting = objective.tokenizer = CountingTokenizer(objective.tokenizer)
    objective.attach_bank(bank)
    assert counting.calls == 1  # the whole bank, once

    positions = objective.rank_positions(int(objective.forwards))
    u, v = objective.encode_views(batch["input_ids"], batch["attention_mask"])
    topk, docs = objective.retrieve(u, v, positions)
    naive = naive_top_k(objective, u, v, bank, k)
    assert topk.tolist() == naive
    rows = [naive[i][j] for i in range(b) for j in positions.tolist()]
    reference_docs = objective.collate_corpus([bank.texts[r] for r in rows])
    assert unpadded(docs) == unpadded(reference_docs)
    assert docs["input_ids"].shape == reference_docs["input_ids"].shape
    doc_indices, group_labels, layout = retrieved_group(batch["labels"], topk, positions)
    assert doc_indices.tolist() == rows
    assert group_labels.tolist() == [LABELS[i] for i in range(b) for _ in range(k + 1)]  # the query's label

    calls, encodings = counting.calls, []
    hook = objective.model.register_forward_hook(
        lambda module, args, kwargs, output: encodings.append((encoder_rows(kwargs), torch.is_grad_enabled())),
        with_kwargs=True)
    out = objective(batch)  # forward number 0: the positions drawn above
    hook.remove()
    assert counting.calls == calls  # no tokenisation per step
    assert encodings == [(b, True), (b * k, True)]  # queries, then the retrieved rows, both with gradient
    assert int(objective.forwards) == 1

    # Reference: float64 loops over the group G (each query's K retrieved rows, then the query).
    ud, vd = objective.encode_views(reference_docs["input_ids"], reference_docs["attention_mask"])
    u, v, ud, vd = u.double(), v.double(), ud.double(), vd.double()
    head, dc = copy.deepcopy(objective.task_head).double(), copy.deepcopy(objective.dc_scorer).double()
    group = [(ud[i * k + j], vd[i * k + j]) for i in range(b) for j in range(k)]
    group = [x for i in range(b) for x in [*group[i * k:(i + 1) * k], (u[i], v[i])]]
    g_labels = [LABELS[i] for i in range(b) for _ in range(k + 1)]
    ce = naive_ce(head, u, v, LABELS[:b])
    dc_out = naive_pairwise(dc, g_labels, torch.stack([x[1] for x in group]), torch.stack([x[0] for x in group]))
    dc_in = naive_pairwise(dc, LABELS[:b], v, u)
    want = {"ce": ce, "dc_out": dc_out, "dc_in": dc_in, "loss": ce + 0.5 * (dc_out + dc_in)}
    for name, value in want.items():
        torch.testing.assert_close(out.metrics[name].double(), value.detach(), rtol=1e-5, atol=1e-5, msg=name)

    out.loss.backward()
    for frozen in (objective.class_scorer, objective.domain_scorer):
        assert all(not p.requires_grad and p.grad is None for p in frozen.parameters())
    for module in (objective.model, objective.task_head, objective.dc_scorer):
        assert grad_norm(module) > 0


# ---------------------------------------------------------------------------------------------
# Data parallel: 2 ranks, each with its own micro-batch and bank shard

BANK_ROWS, SHARDS, QUERY_SPLIT, K = 11, [(0, 4), (4, 11)], [(0, 2), (2, 5)], 5  # k > rank 0's 4 rows


def _queries() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return torch.randn(5, D, generator=g), torch.randn(5, D, generator=g)


def _rank_css(rank: int, world: int, port: int, tiny: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    objective = make(tiny, stage="css", k=K)
    objective.ranks = ProcessGroupRanks()  # what build_engine hands it in training
    bank = random_bank(BANK_ROWS, seed=4)
    start, stop = SHARDS[rank]
    objective.attach_bank(RetrievalBank(bank.u[start:stop], bank.v[start:stop], bank.texts[start:stop], start))
    first, last = QUERY_SPLIT[rank]
    u, v = _queries()
    topk, docs = objective.retrieve(u[first:last], v[first:last], objective.rank_positions(3))
    # A whole training step too: its collectives run inside forward.
    objective.train()
    loss = objective(objective.collate_labeled(TEXTS[first:last], LABELS[first:last])).loss
    loss.backward()
    torch.save({"topk": topk, "docs": unpadded(docs), "loss": loss.detach()}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_ranks_retrieve_what_one_process_with_the_whole_bank_retrieves(tiny, tmp_path):
    mp.spawn(_rank_css, args=(2, free_port(), tiny, str(tmp_path)), nprocs=2, join=True)
    objective = make(tiny, stage="css", k=K)
    bank = random_bank(BANK_ROWS, seed=4)
    objective.attach_bank(bank)
    u, v = _queries()
    topk, docs = objective.retrieve(u, v, objective.rank_positions(3))
    assert topk.tolist() == naive_top_k(objective, u, v, bank, K)
    docs = unpadded(docs)
    for rank, (first, last) in enumerate(QUERY_SPLIT):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["topk"].tolist() == topk[first:last].tolist()
        assert got["docs"] == docs[first * K:last * K]
        assert torch.isfinite(got["loss"])
