"""CSS-LM's retrieval bank: encoded unlabeled sentences, relevance scoring, top-k, the retrieved group.

Views (docs/training/objectives.md#css-lm-model). Every input ``<s> x </s>`` has two vectors from the last hidden layer:
the class view u(x) at the first token and the domain view v(x) at the final separator
(``two_views``). Taking the last attended position finds that separator without rewriting literal
``</s>`` strings in the text, as the original code had to.

Relevance (docs/training/objectives.md#css-lm-stage-c). With the frozen pair scorers C and D (``nn.Linear(2d → 2)``),

    s(q, d) = −log softmax(C([u_q; u_d]))[0] + w · −log softmax(D([v_q; v_d]))[0],   w = 0.5,

higher meaning more related (class 1 of a scorer is "same class" / "same domain"). Query u is
paired with bank u and query v with bank v; the original bank files held the two views swapped
(docs/training/objectives.md#css-lm-original), which we deliberately do not reproduce. ``clsys.recipes.css_lm.pair_heads.pair_logits``
scores a query batch against a bank chunk without forming pairs: memory is B × chunk_rows × 2 logits.
Score in float32 (queries and scorers): in bf16 many distinct rows would tie.

Ties are broken by the lower global row index everywhere (chunked, sharded or not), so every
rank of a distributed job retrieves the same rows: the chunked scan and the merge of the ranks' lists are
``clsys.retrieval.topk``'s, the bank's rows its ids.

Storage (file:// or s3://, no pickle). One shard per rank under a folder:

    shard-RRRRR-of-WWWWW.safetensors   tensors "u" and "v", [rows, d]
    shard-RRRRR-of-WWWWW.jsonl         the texts, one JSON string a line, row order
    shard-RRRRR-of-WWWWW.json          {"format", "rank", "world", "offset", "rows", "dim", "dtype"}

The ``.json`` is written last, so a shard without it is incomplete. ``offset`` is the global index
of the shard's first row; shards in rank order cover 0..N−1 without gaps.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from clsys import storage
from clsys.objectives.ranks import ONE_PROCESS, Ranks
from clsys.recipes.css_lm.pair_heads import pair_logits
from clsys.retrieval import topk

FORMAT = "clsys-retrieval-bank/1"


def two_views(hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, v), each [B, d], from the last hidden states [B, T, d] of ``<s> x </s>`` inputs: u at the
    first attended position (``<s>``), v at the last (the final ``</s>``), for left or right padding."""
    positions = torch.arange(hidden.shape[1], device=hidden.device)
    first = attention_mask.long().argmax(dim=1)  # argmax returns the first of the equal maxima
    last = (attention_mask.long() * positions).argmax(dim=1)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, first], hidden[rows, last]


@dataclass
class RetrievalBank:
    u: torch.Tensor  # [N, d] class views
    v: torch.Tensor  # [N, d] domain views
    texts: list[str]  # N sentences, row order
    offset: int = 0  # global index of row 0 (a rank's shard of a larger bank)

    def __post_init__(self) -> None:
        if self.u.dim() != 2 or self.u.shape != self.v.shape or len(self.texts) != self.u.shape[0]:
            raise ValueError(f"a bank needs u and v of one shape [N, d] and N texts; got u {tuple(self.u.shape)}, "
                             f"v {tuple(self.v.shape)}, {len(self.texts)} texts")

    def __len__(self) -> int:
        return len(self.texts)


# ---------------------------------------------------------------------------------------------
# Scoring and top-k


def relevance_scores(query_u: torch.Tensor, query_v: torch.Tensor, bank_u: torch.Tensor, bank_v: torch.Tensor,
                     class_scorer: nn.Linear, domain_scorer: nn.Linear, domain_weight: float = 0.5) -> torch.Tensor:
    """s(q, d) for every query row and bank row: [B, N] (see the module docstring)."""
    s_class = -F.log_softmax(pair_logits(class_scorer, (query_u,), (bank_u,)), dim=-1)[..., 0]
    s_domain = -F.log_softmax(pair_logits(domain_scorer, (query_v,), (bank_v,)), dim=-1)[..., 0]
    return s_class + domain_weight * s_domain


def _scan(query_u: torch.Tensor, query_v: torch.Tensor, bank: RetrievalBank, class_scorer: nn.Linear,
          domain_scorer: nn.Linear, k: int, domain_weight: float, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Running top-k (at most k, fewer for a small bank) over the bank, chunk by chunk (``clsys.retrieval.topk``)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    device = query_u.device

    def chunks():
        for start in range(0, len(bank), chunk_rows):
            stop = min(start + chunk_rows, len(bank))
            # The bank may live elsewhere (CPU memory, half precision): bring one chunk at a time.
            bank_u = bank.u[start:stop].to(device, query_u.dtype)
            bank_v = bank.v[start:stop].to(device, query_v.dtype)
            yield (relevance_scores(query_u, query_v, bank_u, bank_v, class_scorer, domain_scorer, domain_weight),
                   torch.arange(bank.offset + start, bank.offset + stop, device=device))

    return topk.scan(chunks(), k, query_u.shape[0], query_u)


@torch.no_grad()
def top_k(query_u: torch.Tensor, query_v: torch.Tensor, bank: RetrievalBank, class_scorer: nn.Linear,
          domain_scorer: nn.Linear, k: int, domain_weight: float = 0.5,
          chunk_rows: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most related bank rows of every query: (scores [B, k], global row indices [B, k]).

    Best first; equal scores in index order. Memory is bounded by B × ``chunk_rows`` scores.
    """
    if not 0 < k <= len(bank):
        raise ValueError(f"k must be in 1..{len(bank)} (the bank's rows), got {k}")
    return _scan(query_u, query_v, bank, class_scorer, domain_scorer, k, domain_weight, chunk_rows)


@torch.no_grad()
def distributed_top_k(query_u: torch.Tensor, query_v: torch.Tensor, local_bank: RetrievalBank,
                      class_scorer: nn.Linear, domain_scorer: nn.Linear, k: int, ranks: Ranks = ONE_PROCESS,
                      domain_weight: float = 0.5, chunk_rows: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_k`` over a bank sharded across ``ranks``; the same result on every rank.

    Every rank must pass the same queries (in data-parallel training, all-gather the query views
    first and keep your own rows of the result) and its own shard. Each rank keeps its shard's
    top-k, the candidates are all-gathered ((scores, global indices), W × B × k each) and the global
    top-k taken with the same tie-breaking as ``top_k`` over the whole bank in one process.
    """
    if ranks.world == 1:
        return top_k(query_u, query_v, local_bank, class_scorer, domain_scorer, k, domain_weight, chunk_rows)
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    scores, indices = _scan(query_u, query_v, local_bank, class_scorer, domain_scorer, k, domain_weight, chunk_rows)
    # all_gather needs equal shapes: a shard with fewer than k rows pads with rows that lose every comparison.
    scores, indices = topk.pad(scores, indices, k)
    scores, indices = topk.merge(list(zip(ranks.all_gather(scores), ranks.all_gather(indices))), k)
    if (indices == topk.NO_ID).any():
        raise ValueError(f"k={k} exceeds the rows of the bank over all ranks")
    return scores, indices


def gather_texts(indices: torch.Tensor, local_bank: RetrievalBank, ranks: Ranks = ONE_PROCESS) -> list[str]:
    """The texts of global row ``indices`` (any shape), flattened in row-major order.

    Each rank contributes the rows its shard owns; the rows are few (B × k), so an all_gather_object
    of {index: text} is cheap. Every one of ``ranks`` must call this with the same indices.
    """
    wanted = indices.flatten().tolist()
    first, end = local_bank.offset, local_bank.offset + len(local_bank)
    found = {i: local_bank.texts[i - first] for i in set(wanted) if first <= i < end}
    found = {i: text for part in ranks.all_gather_object(found) for i, text in part.items()}
    unowned = sorted(set(wanted) - found.keys())
    if unowned:
        raise ValueError(f"no shard holds the rows {unowned[:10]}{' …' if len(unowned) > 10 else ''}")
    return [found[i] for i in wanted]


# ---------------------------------------------------------------------------------------------
# Storage


def _stem(url: str, rank: int, world: int) -> str:
    return storage.join(url, f"shard-{rank:05d}-of-{world:05d}")


def save_shard(url: str, rank: int, world: int, bank: RetrievalBank) -> None:
    """Write this rank's shard under ``url`` (see the module docstring for the files)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in 0..{world - 1}")
    stem = _stem(url, rank, world)
    # safetensors refuses tensors that share storage (u and v are often views of one hidden-state
    # tensor), hence the copies.
    tensors = {"u": bank.u.detach().to("cpu", copy=True).contiguous(),
               "v": bank.v.detach().to("cpu", copy=True).contiguous()}
    storage.write_bytes(f"{stem}.safetensors", safetensors.torch.save(tensors))
    storage.write_bytes(f"{stem}.jsonl", "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in bank.texts).encode())
    storage.write_json(f"{stem}.json", {"format": FORMAT, "rank": rank, "world": world, "offset": bank.offset,
                                        "rows": len(bank), "dim": bank.u.shape[1], "dtype": str(bank.u.dtype)})


def _shards(url: str) -> tuple[set[int], int]:
    """The ranks of the complete shards (those with their ``.json``) directly under ``url``, and the world size."""
    base = storage.join(url, "")
    found: set[tuple[int, int]] = set()
    for obj in storage.list_prefix(url):
        match = re.fullmatch(r"shard-(\d{5})-of-(\d{5})\.json", obj[len(base):])
        if match:
            found.add((int(match[1]), int(match[2])))
    worlds = sorted({world for _, world in found})
    if not worlds:
        raise storage.StorageError(f"{url}: no retrieval bank shards (shard-RRRRR-of-WWWWW.json) found")
    if len(worlds) > 1:
        raise storage.StorageError(f"{url}: shards of different world sizes {worlds} (left over from an earlier bank?)")
    return {rank for rank, _ in found}, worlds[0]


def load_shard(url: str, rank: int) -> RetrievalBank:
    """Read one rank's shard (on CPU), checking that its files agree on the number of rows."""
    ranks, world = _shards(url)
    if rank not in ranks:
        raise storage.StorageError(f"{url}: shard {rank} of {world} is missing ({_stem(url, rank, world)}.json)")
    return _read_shard(url, rank, world)


def _read_shard(url: str, rank: int, world: int) -> RetrievalBank:
    stem = _stem(url, rank, world)
    meta = storage.read_json(f"{stem}.json")
    if meta.get("format") != FORMAT:
        raise storage.StorageError(f"{stem}.json: format {meta.get('format')!r}, expected {FORMAT!r}")
    tensors = safetensors.torch.load(storage.read_bytes(f"{stem}.safetensors"))
    lines = storage.read_bytes(f"{stem}.jsonl").decode().split("\n")
    texts = [json.loads(line) for line in lines if line]
    u, v = tensors.get("u"), tensors.get("v")
    if u is None or v is None:
        raise storage.StorageError(f"{stem}.safetensors: needs tensors 'u' and 'v', has {sorted(tensors)}")
    if not meta["rows"] == u.shape[0] == v.shape[0] == len(texts) or u.shape != v.shape:
        raise storage.StorageError(f"{stem}: the files disagree: the .json says {meta['rows']} rows, u is "
                                   f"{tuple(u.shape)}, v is {tuple(v.shape)}, the .jsonl has {len(texts)} texts")
    return RetrievalBank(u, v, texts, meta["offset"])


def load_all(url: str) -> RetrievalBank:
    """The whole bank (offset 0): every shard, in rank order, which must cover 0..N−1 without gaps."""
    ranks, world = _shards(url)
    parts = []
    for rank in range(world):
        if rank not in ranks:
            raise storage.StorageError(f"{url}: shard {rank} of {world} is missing ({_stem(url, rank, world)}.json)")
        part = _read_shard(url, rank, world)
        expected = sum(len(p) for p in parts)
        if part.offset != expected:
            raise storage.StorageError(f"{_stem(url, rank, world)}.json: offset {part.offset}, but the shards "
                                       f"before it end at row {expected}")
        parts.append(part)
    return RetrievalBank(torch.cat([p.u for p in parts]), torch.cat([p.v for p in parts]),
                         [t for p in parts for t in p.texts], 0)


# ---------------------------------------------------------------------------------------------
# The retrieved group (stage C)


def sample_rank_positions(k: int, generator: torch.Generator, with_replacement: bool = True) -> torch.Tensor:
    """k rank positions in 0..k−1, drawn once per step and applied to every query's own top-k list.

    With replacement (the original; duplicates are common) or, if not, a permutation of 0..k−1.
    In data-parallel training seed ``generator`` the same on every rank, so that the whole global
    batch shares the positions as in the original (one DataParallel batch).
    """
    if with_replacement:
        return torch.randint(k, (k,), generator=generator)
    return torch.randperm(k, generator=generator)


@dataclass(frozen=True)
class GroupLayout:
    """Where the rows of the group G sit: B blocks of K + 1 rows, block i being the K sentences that
    query i retrieved (in sampled-position order) followed by query i itself.

        G[i·(K+1) + j] = retrieved doc_indices[i·K + j]   for j < K
        G[i·(K+1) + K] = query i
    """
    queries: int  # B
    per_query: int  # K

    @property
    def query_rows(self) -> torch.Tensor:
        """[B]: the rows of G that are queries."""
        return torch.arange(self.queries) * (self.per_query + 1) + self.per_query

    @property
    def doc_rows(self) -> torch.Tensor:
        """[B·K]: the row of G of each retrieved sentence, in ``doc_indices`` order."""
        block = torch.arange(self.queries)[:, None] * (self.per_query + 1)
        return (block + torch.arange(self.per_query)[None, :]).flatten()

    def assemble(self, docs: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """G's features [B·(K+1), …] from the retrieved sentences' [B·K, …] (``doc_indices`` order)
        and the queries' [B, …]; differentiable in both."""
        b, k = self.queries, self.per_query
        blocks = torch.cat([docs.reshape(b, k, *docs.shape[1:]), queries.reshape(b, 1, *queries.shape[1:])], 1)
        return blocks.reshape(b * (k + 1), *docs.shape[1:])


def retrieved_group(query_labels: torch.Tensor, topk_indices: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, GroupLayout]:
    """The group G of stage C for queries with labels [B], top-k lists [B, k] and positions [K].

    Returns ``doc_indices`` [B·K] (global bank rows to fetch and re-encode: query i's
    ``topk_indices[i, positions]``, query after query), ``group_labels`` [B·(K+1)] and the layout.
    A retrieved sentence's pseudo-label is the label of the query that retrieved it, so block i of
    ``group_labels`` is K + 1 copies of ``query_labels[i]``; a sentence retrieved by two queries
    appears twice, once with each query's label.
    """
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < topk_indices.shape[1]:
        raise ValueError(f"positions must be in 0..{topk_indices.shape[1] - 1}, got {positions.tolist()}")
    doc_indices = topk_indices[:, positions.to(topk_indices.device)].flatten()
    layout = GroupLayout(queries=topk_indices.shape[0], per_query=positions.numel())
    return doc_indices, query_labels.repeat_interleave(layout.per_query + 1), layout
