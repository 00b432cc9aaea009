"""STS scores of a text encoder: Spearman (and Pearson) × 100 of the cosine similarity of each pair's two sentence
embeddings against the human scores (0-5), as papers report them.

    sts = load_sts(resolve_sts("stsb-en-dev"))  # clsys.eval.sts_data
    evaluate_sts(hf_encoder, tokenizer, sts, pooling="cls")  # {"spearman", "pearson", "n"}

What the trainer's dev evaluation (rank 0), the driver's before/after table and ``python -m clsys.evaluate`` call.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch.nn.functional as F
from scipy.stats import pearsonr, spearmanr
from torch import nn

from clsys.eval.sts_data import StsSet
from clsys.model.encoder import embed


def correlations(pred: list[float], gold: list[float]) -> tuple[float, float]:
    """(Spearman, Pearson) x 100; scipy ranks ties by their average rank."""
    return 100 * float(spearmanr(pred, gold).statistic), 100 * float(pearsonr(pred, gold).statistic)


def evaluate_sts(model: nn.Module, tokenizer, sts: StsSet, pooling: str, batch_size: int = 64,
                 max_length: int = 128) -> dict[str, Any]:
    """Spearman/Pearson x 100 of cosine(embedding(sent1), embedding(sent2)) against the gold scores."""
    # STS sets repeat sentences across pairs, so each distinct sentence is embedded once; longest
    # first so that every batch pads to a similar length (``embed`` pads to the batch's longest).
    unique = sorted(dict.fromkeys(sts.sent1 + sts.sent2), key=len, reverse=True)
    index = {s: i for i, s in enumerate(unique)}
    emb = embed(model, tokenizer, unique, pooling, batch_size, max_length).double()
    a = emb[[index[s] for s in sts.sent1]]
    b = emb[[index[s] for s in sts.sent2]]
    # A NaN embedding (e.g. a diverged checkpoint) counts as "unrelated" instead of poisoning the ranks.
    cosine = F.cosine_similarity(a, b, dim=-1).nan_to_num(0.0)
    spearman, pearson = correlations(cosine.tolist(), sts.scores)
    result = {"spearman": spearman, "pearson": pearson, "n": len(sts.scores)}
    if len(sts.subsets) > 1:
        # A SentEval year: "all" (above, SimCSE's figure) and the per-subset averages other papers report.
        counts = [count for _, count in sts.subsets]
        bounds = list(itertools.accumulate(counts, initial=0))
        per_subset = [correlations(cosine[a:b].tolist(), sts.scores[a:b])[0] for a, b in itertools.pairwise(bounds)]
        result["spearman_mean"] = sum(per_subset) / len(per_subset)
        result["spearman_wmean"] = sum(r * c for r, c in zip(per_subset, counts)) / sum(counts)
    return result
