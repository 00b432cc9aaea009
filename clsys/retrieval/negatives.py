"""Hard negatives from a query's ranked candidates, false negatives left out as NV-Retriever leaves them out.

Moreira et al. 2024, "NV-Retriever: Improving text embedding models with effective hard-negative mining"
(arXiv:2407.15831), compare ways to keep false negatives (passages that answer the query but are not its labelled
positive) out of mined negatives, and find TopK-PercPos best: a candidate whose score is above a fraction
(``max_score_ratio``, 0.95 there) of the positive's score is dropped. So here, in rank order (score descending,
then id ascending: ``clsys.retrieval.topk``), a candidate is dropped, and counted under the first reason that holds:

  positive        it is the pair's positive (the same text: the corpus holds each text once, so its exact
                  duplicates are this one candidate)
  other_positive  it is a positive of another pair of the same query (a query with several positives)
  above_ratio     its score is above ``max_score_ratio`` × the positive's score
  given           it is one of the pair's given negatives, which the pair keeps (``--keep-given``)

and the first ``k`` candidates that are not dropped are the pair's mined negatives. Only the candidates ranked
above the k-th kept one are looked at, so the counts say what was passed over to find the k, not what lies deeper
in the ranking.
"""
from __future__ import annotations

import collections
from collections.abc import Collection, Sequence

DROP_REASONS = ("positive", "other_positive", "above_ratio", "given")


def choose_negatives(candidates: Sequence[tuple[float, int]], positive: int, positive_score: float,
                     other_positives: Collection[int], given: Collection[int], k: int, max_score_ratio: float,
                     dropped: collections.Counter) -> list[int]:
    """The ids of the first ``k`` of ``candidates`` ((score, id), best first) that are not false negatives of a
    pair with positive ``positive`` scoring ``positive_score`` (the module docstring); the candidates dropped on
    the way are counted in ``dropped`` by reason. Fewer than ``k`` when the candidates run out."""
    threshold = max_score_ratio * positive_score
    chosen: list[int] = []
    for score, candidate in candidates:
        if len(chosen) == k:
            break
        reason = ("positive" if candidate == positive else "other_positive" if candidate in other_positives
                  else "above_ratio" if score > threshold else "given" if candidate in given else None)
        if reason is None:
            chosen.append(candidate)
        else:
            dropped[reason] += 1
    return chosen
