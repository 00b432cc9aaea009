"""CSS-LM's "contrastive" terms: a learned linear classifier over every ordered pair
(docs/training/objectives.md#css-lm-model).

A pair scorer is an ``nn.Linear(2·Σd → 2)`` applied to the concatenated features of two inputs a and
b, e.g. DC on ``[v_a; v_b; u_a; u_b]``. Forming all pairs would cost M²·2Σd memory; but a Linear
on a concatenation is the sum of one matmul per concatenated part,

    W [x_a; x_b] + c = W_a x_a + W_b x_b + c,

so each side is projected once (M·2 numbers per view and side) and the pair logits are a
broadcast sum, [M, N, 2]. The same decomposition scores a query batch against a retrieval bank
(``clsys.recipes.css_lm.bank``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def pair_logits(scorer: nn.Linear, left: tuple[torch.Tensor, ...], right: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``scorer`` applied to every pair (a, b) of a left row and a right row: [A, B, out_features].

    The pair feature is, for views ``left = (x_1, x_2, …)`` and ``right = (y_1, y_2, …)``,

        [x_1[a]; y_1[b]; x_2[a]; y_2[b]; …]

    i.e. per view, left row first, views in the order given. ``x_i`` is [A, d_i], ``y_i`` is [B, d_i].
    """
    if len(left) != len(right) or not left:
        raise ValueError(f"need the same number (≥ 1) of left and right views, got {len(left)} and {len(right)}")
    widths = [x.shape[-1] for x in left]
    if 2 * sum(widths) != scorer.in_features:
        raise ValueError(f"the scorer takes {scorer.in_features} features, the views give 2·{widths}")
    # Column blocks of W in feature order: [x_1 | y_1 | x_2 | y_2 | …].
    blocks = scorer.weight.split([w for w in widths for _ in range(2)], dim=1)
    left_logits = sum(F.linear(x, w) for x, w in zip(left, blocks[0::2]))
    right_logits = sum(F.linear(y, w) for y, w in zip(right, blocks[1::2]))
    logits = left_logits[:, None, :] + right_logits[None, :, :]
    return logits if scorer.bias is None else logits + scorer.bias


def pairwise_same_label_loss(scorer: nn.Linear, labels: torch.Tensor, *views: torch.Tensor) -> torch.Tensor:
    """Mean over all M² ordered pairs (a, b), self-pairs included, of CE(scorer(pair), 1[y_a = y_b]).

    The pair feature is ``[x_1[a]; x_1[b]; x_2[a]; x_2[b]; …]`` for ``views = (x_1, x_2, …)``, each [M, d_i]:
    - DC: ``pairwise_same_label_loss(dc, y, v, u)`` → [v_a; v_b; u_a; u_b] (Linear(4d → 2));
    - C:  ``pairwise_same_label_loss(c, y, u)``    → [u_a; u_b]           (Linear(2d → 2));
    - D:  ``pairwise_same_label_loss(d, y, v)``    → [v_a; v_b]           (Linear(2d → 2)).
    Class 1 means "same (pseudo-)label". Memory is M²·2 logits, never M² features.
    """
    logits = pair_logits(scorer, views, views)
    same = (labels[:, None] == labels[None, :]).long()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), same.reshape(-1))
