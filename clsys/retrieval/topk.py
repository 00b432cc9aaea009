"""The exact top-k of a corpus held in parts: chunks scanned one after another, or slices held by other processes.

A candidate is a (score, id) pair; ids are int64 and unique in the corpus. Candidates rank by score, the higher
first, then by id, the lower first: one total order, so the k best of the whole corpus do not depend on how it was
cut into chunks or slices, or on which process held which. Both steps keep that order:

- ``scan`` runs over chunks of scores (a query batch against a chunk of the corpus) and keeps the k best of
  each query between chunks: memory is bounded by the chunk, not by the corpus;
- ``merge`` takes the k best lists of several slices and gives the k best of their union (the slices are
  disjoint; ``pad`` fills a list of a slice with fewer than k rows with candidates that lose to every other,
  where the lists must be of one shape, as an all-gather needs).

A recipe's retrieval bank (rows numbered 0..N-1, its slices held by the training ranks and gathered through them,
under ``clsys/recipes/``) and hard-negative mining (texts numbered by their digest, the slices on Ray workers and
merged on the driver, ``clsys.mine``) both rank through these functions.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

NO_ID = torch.iinfo(torch.int64).max  # the id of padding (score -inf): after every real candidate


def _order(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k first of every row in the candidates' order, by sorting the whole row."""
    # Order by id first; the stable sort by score then keeps equal scores in id order.
    by_id = ids.argsort(dim=1)
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    by_score = scores.argsort(dim=1, descending=True, stable=True)[:, :k]
    return scores.gather(1, by_score), ids.gather(1, by_score)


def select(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best candidates of every row of ``scores`` [B, n] with ``ids`` [B, n], best first (fewer when
    n < k). ``topk`` finds them without sorting the row; only a row whose k-th score is shared by a candidate
    ``topk`` left out (a tie across the cut, where it picks among equals as it likes) is sorted whole."""
    if scores.shape[1] <= k:
        return _order(scores, ids, k)
    values, columns = scores.topk(k, dim=1)
    best_scores, best_ids = scores.gather(1, columns), ids.gather(1, columns)
    # topk takes NaN as the greatest score (and so does the sort): count it among those at or above the cut.
    tied = (((scores >= values[:, -1:]) | scores.isnan()).sum(1) > k).nonzero().flatten()
    if len(tied):
        best_scores[tied], best_ids[tied] = _order(scores[tied], ids[tied], k)
    return _order(best_scores, best_ids, k)


def scan(chunks: Iterable[tuple[torch.Tensor, torch.Tensor]], k: int, rows: int,
         like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best (fewer for a smaller corpus) of each of ``rows`` queries over ``chunks`` of (scores [rows, c],
    ids [rows, c] or [c]), taken one after another; on the device and in the dtype of ``like``."""
    best_scores = like.new_empty(rows, 0)
    best_ids = torch.empty(rows, 0, dtype=torch.long, device=like.device)
    for scores, ids in chunks:
        best_scores, best_ids = select(torch.cat([best_scores, scores], 1),
                                       torch.cat([best_ids, ids.to(like.device).expand(rows, -1)], 1), k)
    return best_scores, best_ids


def pad(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A slice's lists [B, n <= k] filled up to k columns with candidates (-inf, ``NO_ID``) that rank last."""
    missing = k - scores.shape[1]
    return (torch.cat([scores, scores.new_full((scores.shape[0], missing), float("-inf"))], 1),
            torch.cat([ids, ids.new_full((ids.shape[0], missing), NO_ID)], 1))


def merge(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of the union of disjoint slices, from each slice's best (scores [B, n_i], ids [B, n_i]) for the
    same B queries: equal to ``scan`` over the whole corpus, as each slice's k best hold every candidate of it
    that can be among the k best of all."""
    return select(torch.cat([s for s, _ in parts], 1), torch.cat([i for _, i in parts], 1), k)
