"""BERT-style dynamic masking and the masked-LM loss, shared by every objective with a masked-LM part (TaCL, the SimCSE MLM
auxiliary, cross-lingual QLM): docs/training/objectives.md#masking.

For a sequence of n real tokens (special tokens included in n), m = min(cap, max(1, round(p·n)))
positions are chosen uniformly among the *non-special* ones ([CLS], [SEP], [PAD], [UNK], [MASK]
and any other special token are never chosen). Each chosen position becomes [MASK] with
probability 0.8, a uniformly random non-special vocabulary token with 0.1, and stays as it is
with 0.1; all three count as "masked" (they are the MLM targets and the TaCL anchors).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Masker:
    mask_id: int
    special_ids: tuple[int, ...]
    vocab_size: int
    probability: float = 0.15
    cap: int = 64  # at most this many positions per sequence (TaCL: 0.25 · max_len)
    bernoulli: bool = False  # independent draws per candidate instead of exactly m per sequence

    @classmethod
    def for_tokenizer(cls, tokenizer, probability: float = 0.15, cap: int = 64, bernoulli: bool = False) -> "Masker":
        return cls(tokenizer.mask_token_id, tuple(sorted(set(tokenizer.all_special_ids))), len(tokenizer),
                   probability, cap, bernoulli)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 eligible: torch.Tensor | None = None, generator: torch.Generator | None = None):
        """Returns (corrupted input_ids, bool mask of the chosen positions).

        ``eligible`` optionally narrows the candidates further (QLM masks the query segment only);
        n is then the number of eligible tokens.
        """
        special = torch.isin(input_ids, torch.tensor(self.special_ids, dtype=input_ids.dtype))
        candidates = attention_mask.bool() & ~special
        lengths = attention_mask.sum(1)
        if eligible is not None:
            candidates &= eligible
            lengths = eligible.sum(1)
        # A random order of the candidates per row; the first m of it are chosen.
        scores = torch.rand(input_ids.shape, generator=generator).masked_fill(~candidates, -1.0)
        rank = scores.argsort(dim=1, descending=True).argsort(dim=1)
        if self.bernoulli:
            chosen = candidates & (torch.rand(input_ids.shape, generator=generator) < self.probability)
            empty = ~chosen.any(1, keepdim=True)
            chosen |= empty & candidates & (rank == 0)
        else:
            m = (lengths.double() * self.probability).round().long().clamp(min=1, max=self.cap)
            chosen = candidates & (rank < m.unsqueeze(1))

        action = torch.rand(input_ids.shape, generator=generator)
        corrupted = input_ids.clone()
        corrupted[chosen & (action < 0.8)] = self.mask_id
        randomise = chosen & (action >= 0.8) & (action < 0.9)
        picks = torch.randint(len(self.random_pool), (int(randomise.sum()),), generator=generator)
        corrupted[randomise] = self.random_pool[picks].to(input_ids.dtype)
        return corrupted, chosen

    @functools.cached_property
    def random_pool(self) -> torch.Tensor:
        """Ids a "random token" replacement draws from: the whole vocabulary but special tokens."""
        keep = torch.ones(self.vocab_size, dtype=torch.bool)
        keep[list(self.special_ids)] = False
        return keep.nonzero().squeeze(1)


def masked_lm_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chosen: torch.Tensor,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the original tokens at the chosen positions, and the accuracy there.

    The head runs on the chosen rows only (M vectors instead of B·L), which is what makes the
    vocabulary projection affordable. ``positions``: divide the sums by this count instead of the
    chosen positions here (GradCache: a chunk's share of the whole batch's mean).
    """
    logits = head(hidden[chosen])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 → fp32; float64 stays
    labels = targets[chosen]
    correct = (logits.argmax(-1) == labels).float()
    if positions is None:
        return torch.nn.functional.cross_entropy(logits, labels), correct.mean()
    return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / positions, correct.sum() / positions
