"""TaCL: token-aware contrastive continual pretraining (Su et al., 2022), docs/training/objectives.md#tacl.

A frozen teacher (a copy of the starting encoder) reads the clean sequence; the trained student reads
the masked one. At every masked position i the student's last-layer vector must pick out the
teacher's vector at the same position among the teacher vectors of all positions of the same
sequence (cosine / τ, τ = 0.01). Added to the student's MLM loss (both with weight 1).

Departures from the original code, each a deliberate fix (docs/training/objectives.md#tacl-original):
- the teacher runs under no-grad in eval mode (the original ran it in train mode, with dropout,
  and kept its activations); ``teacher_dropout: true`` restores train-mode dropout;
- batches are padded dynamically and pad positions are left out of the softmax; the original padded
  to a fixed 256 and kept the pads as negatives: ``pad_negatives: true`` pads to ``data.max_length``
  and keeps them, which is the faithful denominator;
- NSP is off by default (``nsp_weight: 0``); the original code adds it with weight 1,
  which ``nsp_weight: 1`` restores. Pairs are built per batch from the ``documents`` passages (below),
  not once at load time as the original does.
"""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from clsys.config import Config, ObjectiveConfig
from clsys.data.batch_tokenizer import BatchTokenizer
from clsys.data.spec import DataSpec
from clsys.data.transport import uses_fast_path
from clsys.data.masking import Masker, masked_lm_loss
from clsys.model.encoder import Pooling, build_bert_pretraining, build_masked_lm
from clsys.model.folder import ExportSpec
from clsys.objectives.base import LossOutput, Objective
from clsys.objectives.contrastive import cosine_logits


@dataclass
class TaCLConfig(ObjectiveConfig):
    temperature: float = 0.01  # τ of the token-level InfoNCE
    mask_probability: float = 0.15  # share of tokens masked
    mask_cap: int = 64  # at most this many masked positions per sequence (0.25 · 256 in the original)
    mlm_weight: float = 1.0  # weight of the student's MLM loss
    contrastive_weight: float = 1.0  # weight of the token-level contrastive loss
    pad_negatives: bool = False  # fixed-length padding with pads in the denominator (faithful)
    teacher_dropout: bool = False  # run the frozen teacher in train mode (faithful) instead of eval
    export_pooling: Pooling = "cls"  # pooling written to the exported sentence-transformers folder
    nsp_weight: float = 0.0  # > 0: add next-sentence prediction on sentence pairs (original: 1.0)


def nsp_pairs(samples: list[dict[str, Any]], rng: random.Random) -> tuple[list[str], list[str], list[int]]:
    """BERT sentence-pair instances from passages: segment A is the passage's first k sentences;
    segment B is the rest of it (label 0) or, with probability 0.5, sentences of another page's passage
    in the batch (label 1, BERT's convention). Sentences are re-split with the language-aware splitter
    that built the passages; a one-sentence passage is cut between words."""
    from clsys.data.sentences import SplitStats, split_sentences

    split = [split_sentences(s["json"].get("lang", "en"), s["txt"], SplitStats()) or [s["txt"]] for s in samples]
    split = [parts if len(parts) > 1 else _halves(parts[0]) for parts in split]
    firsts, seconds, labels = [], [], []
    for i, parts in enumerate(split):
        k = rng.randrange(1, len(parts))
        others = [j for j in range(len(samples)) if samples[j]["json"].get("page_id") != samples[i]["json"].get("page_id")]
        if others and rng.random() < 0.5:
            other = split[rng.choice(others)]
            start = rng.randrange(len(other))
            firsts.append(" ".join(parts[:k]))
            seconds.append(" ".join(other[start:start + len(parts) - k]))
            labels.append(1)
        else:
            firsts.append(" ".join(parts[:k]))
            seconds.append(" ".join(parts[k:]))
            labels.append(0)
    return firsts, seconds, labels


def _halves(text: str) -> list[str]:
    words = text.split()
    if len(words) < 2:
        return [text, text]
    return [" ".join(words[:len(words) // 2]), " ".join(words[len(words) // 2:])]


def token_contrastive_loss(student: torch.Tensor, teacher: torch.Tensor, chosen: torch.Tensor,
                           candidates: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over chosen (b, i) of −log softmax_j(cos(s_bi, t_bj)/τ)[i], j over candidates[b].

    ``student``/``teacher``: [B, L, d]; ``chosen``: [B, L] anchors; ``candidates``: [B, L] columns
    allowed in each row's softmax. Returns (loss, accuracy of picking position i).
    """
    sims = cosine_logits(student, teacher, temperature)  # [B, L, L]
    rows, positions = chosen.nonzero(as_tuple=True)
    logits = sims[rows, positions].masked_fill(~candidates[rows], float("-inf"))
    loss = F.cross_entropy(logits, positions)
    accuracy = (logits.argmax(-1) == positions).float().mean()
    return loss, accuracy


class TaCLData(DataSpec):
    """Passages (or NSP pairs of their sentences) with BERT-style masked copies for the student."""

    def __init__(self, cfg: Config, tokenizer, streams: list[str], reads_ids: bool):
        super().__init__(cfg, tokenizer, streams, reads_ids)
        self.oc: TaCLConfig = cfg.objective
        self.masker = Masker.for_tokenizer(tokenizer, self.oc.mask_probability, self.oc.mask_cap)
        self.texts = BatchTokenizer(tokenizer, cfg.data.max_length, pad_to_max_length=self.oc.pad_negatives,
                                    fast=uses_fast_path(cfg.data.transport))

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        extra = {}
        if self.oc.nsp_weight:
            # [CLS] A [SEP] B [SEP] with segment ids; truncation trims the longer segment first.
            firsts, seconds, labels = nsp_pairs(samples, random.Random(random.getrandbits(64)))
            batch = self.tokenizer(firsts, seconds, padding="max_length" if self.oc.pad_negatives else True,
                                   truncation="longest_first", max_length=self.cfg.data.max_length, return_tensors="pt")
            extra["nsp_labels"] = torch.tensor(labels)
        else:
            batch = self.texts([s["txt"] for s in samples])
        masked_ids, chosen = self.masker(batch["input_ids"], batch["attention_mask"])
        return {**batch, "masked_input_ids": masked_ids, "chosen": chosen, **extra}


class TaCL(Objective):
    config_class = TaCLConfig
    data_class = TaCLData

    @classmethod
    def streams(cls, cfg: Config) -> list[str]:
        return ["documents"]

    def __init__(self, cfg: Config, tokenizer):
        super().__init__(cfg, tokenizer)
        oc: TaCLConfig = cfg.objective
        if oc.pad_negatives and cfg.model.packed:
            raise ValueError("objective.pad_negatives: contrasts the pad tokens' representations, which a packed "
                             "forward does not compute; set model.packed: false")
        # The student: encoder + MLM head (new and tied to the word embeddings when the checkpoint
        # has none); works from scratch too (model.init: scratch with a SentencePiece tokenizer).
        if oc.nsp_weight:
            self.model, self.mlm_head, self.nsp_head = build_bert_pretraining(cfg.model, tokenizer)
        else:
            (self.model, self.mlm_head), self.nsp_head = build_masked_lm(cfg.model, tokenizer), None
        self.teacher = copy.deepcopy(self.model)
        self.teacher.requires_grad_(False)
        self.oc = oc

    def train(self, mode: bool = True) -> "TaCL":
        super().train(mode)
        self.teacher.train(mode and self.oc.teacher_dropout)
        return self

    def forward(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        clean, chosen = batch["input_ids"], batch["chosen"]
        inputs = {k: v for k, v in batch.items() if k not in ("input_ids", "masked_input_ids", "chosen", "nsp_labels")}
        hidden = self.encode(self.model, {"input_ids": batch["masked_input_ids"], **inputs}).last_hidden_state
        with torch.no_grad():
            target = self.encode(self.teacher, {"input_ids": clean, **inputs}).last_hidden_state

        mlm, mlm_accuracy = masked_lm_loss(self.mlm_head, hidden, clean, chosen)
        candidates = torch.ones_like(chosen) if self.oc.pad_negatives else batch["attention_mask"].bool()
        tcl, tcl_accuracy = token_contrastive_loss(hidden, target, chosen, candidates, self.oc.temperature)
        loss = self.oc.mlm_weight * mlm + self.oc.contrastive_weight * tcl
        metrics = {"mlm_loss": mlm.detach(), "token_cl_loss": tcl.detach(),
                   "token_cl_accuracy": tcl_accuracy, "mlm_accuracy": mlm_accuracy}
        if self.nsp_head is not None:
            # NSP from the student's pooled [CLS] of the masked pair, as BertForPreTraining does.
            nsp_logits = self.nsp_head(hidden).float()
            nsp = F.cross_entropy(nsp_logits, batch["nsp_labels"])
            metrics["nsp_loss"] = nsp.detach()
            metrics["nsp_accuracy"] = (nsp_logits.argmax(-1) == batch["nsp_labels"]).float().mean()
            loss = loss + self.oc.nsp_weight * nsp
        return LossOutput(loss, {"loss": loss.detach(), **metrics})

    def encoder(self) -> nn.Module:
        return self.model

    def export_spec(self) -> ExportSpec:
        return ExportSpec(self.oc.export_pooling, self.encoder_prefix())
