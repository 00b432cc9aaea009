"""CSS-LM building blocks against naive float64 references: relevance scoring, chunked and 2-rank top-k,
bank storage (local and S3), rank positions, the retrieved group and the pairwise same-label loss."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from clsys import storage
from clsys.engine.ranks import ProcessGroupRanks
from clsys.recipes.css_lm.pair_heads import pair_logits, pairwise_same_label_loss
from clsys.recipes.css_lm.bank import (GroupLayout, RetrievalBank, distributed_top_k, gather_texts, load_all, load_shard,
                                  relevance_scores, retrieved_group, sample_rank_positions, save_shard, top_k,
                                  two_views)
from conftest import free_port

D = 6  # hidden size of the toy views


def _scorers(seed: int, dyadic: bool = False) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """Two different pair scorers (class, domain), float64."""
    torch.manual_seed(seed)
    scorers = torch.nn.Linear(2 * D, 2).double(), torch.nn.Linear(2 * D, 2).double()
    if dyadic:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in (p for scorer in scorers for p in scorer.parameters()):
                p.copy_(_dyadic(g, *p.shape))
    return scorers


def _dyadic(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Multiples of 1/4 in [−1, 1]: every sum and product here is exact in float64, so equal rows
    score exactly equal wherever and in whatever chunk they are scored, and ties are real ties."""
    return torch.randint(-4, 5, shape, generator=g).double() / 4


def naive_relevance(qu, qv, bu, bv, class_scorer, domain_scorer, w=0.5) -> list[list[float]]:
    """s(q, d), one pair at a time: literally C([u_q; u_d]) and D([v_q; v_d]), then −log softmax[0]."""
    scores = []
    for q in range(qu.shape[0]):
        row = []
        for d in range(bu.shape[0]):
            s_c = -torch.log_softmax(class_scorer(torch.cat([qu[q], bu[d]])), dim=0)[0]
            s_d = -torch.log_softmax(domain_scorer(torch.cat([qv[q], bv[d]])), dim=0)[0]
            row.append((s_c + w * s_d).item())
        scores.append(row)
    return scores


def naive_top_k(scores: list[list[float]], k: int, offset: int = 0) -> list[list[int]]:
    return [[offset + d for d in sorted(range(len(row)), key=lambda d: (-row[d], d))[:k]] for row in scores]


def _bank(n: int, seed: int, offset: int = 0, dyadic: bool = True) -> RetrievalBank:
    g = torch.Generator().manual_seed(seed)
    make = (lambda: _dyadic(g, n, D)) if dyadic else (lambda: torch.randn(n, D, generator=g, dtype=torch.float64))
    return RetrievalBank(make(), make(), [f"sentence {offset + i}" for i in range(n)], offset)


def _with_ties(bank: RetrievalBank, queries: tuple[torch.Tensor, torch.Tensor], scorers, copies: list[int]) -> int:
    """Copy query 0's best row over ``copies`` so that its top list starts with a tie; returns that row."""
    scores = naive_relevance(*queries, bank.u, bank.v, *scorers)
    best = max(range(len(bank)), key=lambda d: scores[0][d])
    for row in copies:
        assert row != best
        bank.u[row], bank.v[row] = bank.u[best], bank.v[best]
    return best


# ---------------------------------------------------------------------------------------------
# Relevance and top-k


def test_relevance_scores_match_pairwise_reference():
    g = torch.Generator().manual_seed(0)
    qu, qv, bu, bv = (torch.randn(n, D, generator=g, dtype=torch.float64) for n in (3, 3, 11, 11))
    scorers = _scorers(1)
    got = relevance_scores(qu, qv, bu, bv, *scorers, domain_weight=0.7)
    want = torch.tensor(naive_relevance(qu, qv, bu, bv, *scorers, w=0.7), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_views_are_paired_u_with_u_and_v_with_v():
    """The original bank swapped the views; a swapped pairing retrieves other rows, ours the right ones."""
    g = torch.Generator().manual_seed(2)
    qu, qv = torch.randn(4, D, generator=g, dtype=torch.float64), torch.randn(4, D, generator=g, dtype=torch.float64)
    bank = _bank(30, seed=3, dyadic=False)
    scorers = _scorers(4)
    right = naive_top_k(naive_relevance(qu, qv, bank.u, bank.v, *scorers), 1)
    swapped = naive_top_k(naive_relevance(qu, qv, bank.v, bank.u, *scorers), 1)
    assert right != swapped  # the case discriminates
    _, indices = top_k(qu, qv, bank, *scorers, k=1)
    assert indices.tolist() == right


@pytest.mark.parametrize("k,chunk_rows,offset", [(7, 5, 0), (23, 4, 0), (1, 23, 0), (7, 65536, 100)])
def test_chunked_top_k_is_a_full_sort_with_ties_by_lower_index(k, chunk_rows, offset):
    g = torch.Generator().manual_seed(5)
    queries = _dyadic(g, 3, D), _dyadic(g, 3, D)
    bank = _bank(23, seed=6, offset=offset)
    scorers = _scorers(7, dyadic=True)
    best = _with_ties(bank, queries, scorers, copies=[21, 2, 13])  # in several chunks, not in index order
    scores, indices = top_k(*queries, bank, *scorers, k=k, chunk_rows=chunk_rows)
    naive = naive_relevance(*queries, bank.u, bank.v, *scorers)
    assert indices.tolist() == naive_top_k(naive, k, offset)
    want = [[naive[q][i - offset] for i in row] for q, row in enumerate(indices.tolist())]
    torch.testing.assert_close(scores, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    tied = sorted(offset + row for row in (best, 21, 2, 13))  # query 0's four best rows score equal
    assert indices[0, :min(k, 4)].tolist() == tied[:min(k, 4)]


def test_top_k_rejects_bad_k():
    bank = _bank(5, seed=0)
    q = torch.zeros(1, D, dtype=torch.float64)
    for k in (0, 6):
        with pytest.raises(ValueError, match=r"k must be in 1\.\.5"):
            top_k(q, q, bank, *_scorers(0), k=k)


def test_top_k_with_a_half_precision_bank_elsewhere():
    """The bank may be stored in another dtype (and device): chunks are cast to the queries'."""
    bank = _bank(20, seed=1)  # dyadic values are exact in float16 too
    half = RetrievalBank(bank.u.half(), bank.v.half(), bank.texts)
    g = torch.Generator().manual_seed(8)
    queries = _dyadic(g, 2, D), _dyadic(g, 2, D)
    scorers = _scorers(9, dyadic=True)
    assert torch.equal(top_k(*queries, half, *scorers, k=5, chunk_rows=6)[1], top_k(*queries, bank, *scorers, k=5)[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_top_k_on_gpu_with_the_bank_in_cpu_memory():
    g = torch.Generator().manual_seed(10)
    queries = _dyadic(g, 4, D), _dyadic(g, 4, D)
    bank = _bank(50, seed=11)
    scorers = _scorers(12, dyadic=True)
    _with_ties(bank, queries, scorers, copies=[40, 3])
    cpu = top_k(*queries, bank, *scorers, k=9, chunk_rows=7)
    gpu = top_k(*(q.cuda() for q in queries), bank, *(s.cuda() for s in scorers), k=9, chunk_rows=7)
    assert gpu[1].device.type == "cuda"
    assert torch.equal(gpu[1].cpu(), cpu[1])
    torch.testing.assert_close(gpu[0].cpu(), cpu[0])


# ---------------------------------------------------------------------------------------------
# Two ranks


def _problem():
    """Queries, scorers, a 23-row bank with ties across the shard boundary, and its uneven split 10 / 13."""
    g = torch.Generator().manual_seed(20)
    queries = _dyadic(g, 3, D), _dyadic(g, 3, D)
    scorers = _scorers(21, dyadic=True)
    bank = _bank(23, seed=22)
    _with_ties(bank, queries, scorers, copies=[17, 4, 12])
    bounds = [(0, 10), (10, 23)]
    return queries, scorers, bank, bounds


def _rank_retrieval(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ranks = ProcessGroupRanks()
    queries, scorers, bank, bounds = _problem()
    start, stop = bounds[rank]
    local = RetrievalBank(bank.u[start:stop], bank.v[start:stop], bank.texts[start:stop], offset=start)
    result = {}
    for k in (7, 12, 23):  # 12 and 23 exceed rank 0's 10 rows
        result[k] = distributed_top_k(*queries, local, *scorers, k=k, ranks=ranks, chunk_rows=4)
    result["texts"] = gather_texts(result[7][1], local, ranks)
    # Shards need not follow rank order: here rank 0 holds the later rows.
    start, stop = bounds[1 - rank]
    swapped = RetrievalBank(bank.u[start:stop], bank.v[start:stop], bank.texts[start:stop], offset=start)
    result["swapped"] = distributed_top_k(*queries, swapped, *scorers, k=7, ranks=ranks, chunk_rows=4)
    result["swapped_texts"] = gather_texts(result["swapped"][1], swapped, ranks)
    try:
        distributed_top_k(*queries, local, *scorers, k=24, ranks=ranks)
    except ValueError as err:
        result["error"] = str(err)
    save_shard(os.path.join(out, "bank"), rank, world, local)
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_two_rank_top_k_equals_single_process(tmp_path):
    mp.spawn(_rank_retrieval, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    queries, scorers, bank, _ = _problem()
    naive = naive_relevance(*queries, bank.u, bank.v, *scorers)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for k in (7, 12, 23):
            scores, indices = top_k(*queries, bank, *scorers, k=k)
            assert got[k][1].tolist() == indices.tolist() == naive_top_k(naive, k)
            assert torch.equal(got[k][0], scores)
        assert got["texts"] == [bank.texts[i] for i in got[7][1].flatten().tolist()]
        assert got["swapped"][1].tolist() == got[7][1].tolist() and got["swapped_texts"] == got["texts"]
        assert got["error"] == "k=24 exceeds the rows of the bank over all ranks"
    # What the ranks saved, loaded as one bank.
    whole = load_all(str(tmp_path / "bank"))
    assert torch.equal(whole.u, bank.u) and torch.equal(whole.v, bank.v) and whole.texts == bank.texts
    assert load_shard(str(tmp_path / "bank"), 1).offset == 10


def test_single_process_fallbacks():
    queries, scorers, bank, _ = _problem()
    assert torch.equal(distributed_top_k(*queries, bank, *scorers, k=5)[1], top_k(*queries, bank, *scorers, k=5)[1])
    shard = RetrievalBank(bank.u[10:], bank.v[10:], bank.texts[10:], offset=10)
    texts = gather_texts(torch.tensor([[12, 10], [12, 22]]), shard)
    assert texts == ["sentence 12", "sentence 10", "sentence 12", "sentence 22"]
    with pytest.raises(ValueError, match=r"no shard holds the rows \[3\]"):
        gather_texts(torch.tensor([3, 12]), shard)


# ---------------------------------------------------------------------------------------------
# Storage


def _odd_texts(n: int) -> list[str]:
    # Newlines, U+2028, quotes and non-ASCII must survive the JSON-lines file unchanged.
    return [f"row {i}: «quote\" \n line\u2028sep» 한국어" if i % 2 else f"row {i}" for i in range(n)]


def _round_trip(url: str) -> None:
    g = torch.Generator().manual_seed(30)
    hidden = torch.randn(9, 2 * D, generator=g)
    # u and v as views of one tensor, as they come out of an encoder.
    parts = [RetrievalBank(hidden[:4, :D], hidden[:4, D:], _odd_texts(4), 0),
             RetrievalBank(hidden[4:, :D], hidden[4:, D:], _odd_texts(5), 4)]
    for rank, part in enumerate(parts):
        save_shard(url, rank, 2, part)
    one = load_shard(url, 1)
    assert one.offset == 4 and one.texts == parts[1].texts and torch.equal(one.u, parts[1].u)
    whole = load_all(url)
    assert whole.offset == 0 and whole.texts == parts[0].texts + parts[1].texts
    assert torch.equal(whole.u, hidden[:, :D]) and torch.equal(whole.v, hidden[:, D:])
    assert whole.u.dtype == torch.float32


def test_bank_storage_round_trip_local(tmp_path):
    _round_trip(str(tmp_path / "bank"))
    assert sorted(p.name for p in (tmp_path / "bank").iterdir())[:3] == [
        "shard-00000-of-00002.json", "shard-00000-of-00002.jsonl", "shard-00000-of-00002.safetensors"]


def test_bank_storage_round_trip_s3(s3_bucket):
    _round_trip(f"{s3_bucket}/banks/sst5")


def test_bank_storage_errors(tmp_path):
    url = f"file://{tmp_path}/bank"
    with pytest.raises(storage.StorageError, match=f"{url}: no retrieval bank shards"):
        load_all(url)
    bank = _bank(6, seed=0)
    save_shard(url, 0, 3, RetrievalBank(bank.u[:2], bank.v[:2], bank.texts[:2], 0))
    save_shard(url, 2, 3, RetrievalBank(bank.u[4:], bank.v[4:], bank.texts[4:], 4))
    with pytest.raises(storage.StorageError, match=f"{url}: shard 1 of 3 is missing"):
        load_all(url)
    with pytest.raises(storage.StorageError, match=f"{url}: shard 1 of 3 is missing"):
        load_shard(url, 1)
    save_shard(url, 1, 3, RetrievalBank(bank.u[2:4], bank.v[2:4], bank.texts[2:4], 3))  # wrong offset
    with pytest.raises(storage.StorageError, match="shard-00001-of-00003.json: offset 3, but the shards before it end"):
        load_all(url)
    save_shard(url, 1, 3, RetrievalBank(bank.u[2:4], bank.v[2:4], bank.texts[2:4], 2))
    assert load_all(url).texts == bank.texts
    storage.write_bytes(f"{url}/shard-00002-of-00003.jsonl", b'"only one"\n')
    with pytest.raises(storage.StorageError, match=r"shard-00002-of-00003: the files disagree: the \.json says 2 rows"):
        load_shard(url, 2)
    save_shard(url, 0, 1, bank)
    with pytest.raises(storage.StorageError, match=r"shards of different world sizes \[1, 3\]"):
        load_all(url)


# ---------------------------------------------------------------------------------------------
# Rank positions and the group


def test_sample_rank_positions():
    g = torch.Generator().manual_seed(0)
    draws = [sample_rank_positions(8, g) for _ in range(50)]
    assert all(d.dtype == torch.long and d.shape == (8,) and 0 <= d.min() and d.max() < 8 for d in draws)
    assert any(len(set(d.tolist())) < 8 for d in draws)  # repeats happen (each draw: 1 − 8!/8⁸ ≈ 99.8 %)
    perms = [sample_rank_positions(8, g, with_replacement=False) for _ in range(50)]
    assert all(sorted(p.tolist()) == list(range(8)) for p in perms)
    assert len({tuple(p.tolist()) for p in perms}) > 40

    def sequence(seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return [sample_rank_positions(5, gen, w).tolist() for w in (True, False, True)]
    assert sequence(1) == sequence(1) and sequence(1) != sequence(2)

    # Uniform over positions: 20 000 draws × 8 = 160 000 samples, 20 000 expected per position,
    # σ = √(160 000 · 1/8 · 7/8) ≈ 132; allow 5σ.
    counts = torch.bincount(torch.stack([sample_rank_positions(8, g) for _ in range(20_000)]).flatten(), minlength=8)
    assert (counts - 20_000).abs().max() < 5 * 132
    # A permutation puts every position first equally often: 20 000 draws, 2 500 expected, σ ≈ 47.
    firsts = torch.bincount(torch.stack([sample_rank_positions(8, g, False)[0] for _ in range(20_000)]), minlength=8)
    assert (firsts - 2_500).abs().max() < 5 * 47


def test_retrieved_group_hand_example():
    labels = torch.tensor([1, 0])
    topk = torch.tensor([[10, 11, 12], [20, 21, 22]])
    docs, group_labels, layout = retrieved_group(labels, topk, torch.tensor([2, 0, 2]))
    assert docs.tolist() == [12, 10, 12, 22, 20, 22]
    assert group_labels.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert layout == GroupLayout(queries=2, per_query=3)
    assert layout.query_rows.tolist() == [3, 7] and layout.doc_rows.tolist() == [0, 1, 2, 4, 5, 6]
    doc_feats = docs.double()[:, None].repeat(1, 2).requires_grad_()
    query_feats = torch.tensor([[-1.0, -1.0], [-2.0, -2.0]], dtype=torch.float64, requires_grad=True)
    group = layout.assemble(doc_feats, query_feats)
    assert group[:, 0].tolist() == [12, 10, 12, -1, 22, 20, 22, -2]
    assert torch.equal(group[layout.doc_rows], doc_feats) and torch.equal(group[layout.query_rows], query_feats)
    group.sum().backward()
    assert torch.equal(doc_feats.grad, torch.ones_like(doc_feats))
    assert torch.equal(query_feats.grad, torch.ones_like(query_feats))
    with pytest.raises(ValueError, match=r"positions must be in 0\.\.2"):
        retrieved_group(labels, topk, torch.tensor([0, 3, 1]))


def test_two_views_first_token_and_final_separator():
    hidden = torch.randn(3, 5, D)
    mask = torch.tensor([[1, 1, 1, 0, 0],   # right padding
                         [1, 1, 1, 1, 1],   # no padding
                         [0, 0, 1, 1, 1]])  # left padding
    u, v = two_views(hidden, mask)
    assert torch.equal(u, torch.stack([hidden[0, 0], hidden[1, 0], hidden[2, 2]]))
    assert torch.equal(v, torch.stack([hidden[0, 2], hidden[1, 4], hidden[2, 4]]))


# ---------------------------------------------------------------------------------------------
# The pairwise same-label loss


def naive_pairwise_loss(scorer, labels, *views) -> torch.Tensor:
    """Every ordered pair (a, b), self-pairs included, with the literal feature [x1_a; x1_b; x2_a; x2_b; …]."""
    m = labels.shape[0]
    total = 0.0
    for a in range(m):
        for b in range(m):
            feature = torch.cat([part for x in views for part in (x[a], x[b])])
            target = torch.tensor([int(labels[a] == labels[b])])
            total = total + F.cross_entropy(scorer(feature)[None], target)
    return total / m ** 2


@pytest.mark.parametrize("n_views", [2, 1])  # DC on (v, u), C on u
def test_pairwise_loss_and_gradient_match_naive(n_views):
    g = torch.Generator().manual_seed(40)
    labels = torch.tensor([0, 2, 0, 1, 2, 2, 0])
    views = [torch.randn(7, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(n_views)]
    torch.manual_seed(41)
    scorer = torch.nn.Linear(2 * D * n_views, 2).double()
    inputs = [*views, scorer.weight, scorer.bias]

    got = pairwise_same_label_loss(scorer, labels, *views)
    want = naive_pairwise_loss(scorer, labels, *views)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g_got, g_want in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-12)
    if n_views == 2:
        # The order matters: [v_a; u_a; v_b; u_b] is another loss, so the check above discriminates.
        wrong = naive_pairwise_loss(scorer, labels, torch.cat(views, 1))
        assert abs(wrong.item() - want.item()) > 1e-3


def test_pair_logits_shapes_and_width_check():
    scorer = torch.nn.Linear(2 * D, 3)
    left, right = torch.randn(4, D), torch.randn(5, D)
    logits = pair_logits(scorer, (left,), (right,))
    assert logits.shape == (4, 5, 3)
    torch.testing.assert_close(logits[2, 3], scorer(torch.cat([left[2], right[3]])))
    with pytest.raises(ValueError, match=r"the scorer takes 12 features, the views give 2·\[6, 6\]"):
        pair_logits(scorer, (left, left), (right, right))
