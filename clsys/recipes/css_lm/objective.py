"""CSS-LM (Su et al., 2021): few-shot fine-tuning with retrieval from an unlabeled corpus,
docs/training/objectives.md#css-lm.

This is the objective core: the model, both stages' losses, the per-step retrieval and
classification. Running stage A, building the bank (stage B), stage C and the per-epoch dev/test
evaluation belong to the pipeline that drives it (``clsys.recipes.css_lm.pipeline``). ``method:
finetune`` is the plain fine-tuning baseline: stage A with the CE loss alone.

Model. Every input ``[CLS] x [SEP]`` (``<s> x </s>``) gives two views from the last layer
(``two_views``): the class view u at the first token and the domain view v at the final separator.
The task head classifies [u; v]; three pair scorers say "same class" / "same domain" (class 1):
C on [u_a; u_b], D on [v_a; v_b], DC on [v_a; v_b; u_a; u_b]. Their losses are pairwise CE over
all ordered pairs (``clsys.recipes.css_lm.pair_heads``), not InfoNCE: the released code has no temperature.

Stage A, ``stage: warmup``:  L_A = L_CE + L_DC^in + L_D^init + L_C^in.
L_D^init is one CE averaged over all its pairs together: the B in-batch pairs [v_i; v_{B−1−i}]
labelled 1 and the B·n pairs of query i with its own n = ``domain_negatives`` random corpus
sentences labelled 0. The original also drew "1" pairs from the first |train| corpus lines,
because its corpus file began with the few-shot texts; our corpus is Wikipedia shards, so the
task's own texts (the in-batch pairs) are the in-domain side. After ``detach_after_micro_steps``
training forwards, C and D see detached views, so from then on only those heads learn from
L_C^in and L_D^init (the original detaches from epoch 1). The count is a persistent buffer, so it
survives checkpoint and resume.

Stage C, ``stage: css``: every step retrieves the top-K bank sentences of each query by
s = s_C + w·s_D with stage A's C and D (frozen here; the bank is static too), draws
K rank positions shared by every query, re-encodes the retrieved sentences with gradient, and
trains on L_CE + ½(L_DC^out + L_DC^in), where L_DC^out runs over the group G of every query's K
retrieved sentences (pseudo-labelled with the query's label) and the query itself.

Data parallel. Each rank holds one shard of the bank and its own micro-batch. Retrieval all-gathers
the (detached) query views, runs ``distributed_top_k`` for the global batch and keeps this rank's
rows, so a rank retrieves exactly what one process with the whole bank would. Query u is scored
against bank u and v against bank v (the original's swapped bank views are not reproduced, see
``clsys.recipes.css_lm.bank``). The group G, and so L_DC^out, spans this rank's micro-batch only
(|G| = B_local·(K + 1)): pairs across ranks would need views gathered with gradient. Labels are
therefore not gathered: a pseudo-label is always one of this rank's own queries' labels.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from clsys.config import Config
from clsys.data.batch_tokenizer import BatchTokenizer
from clsys.data.spec import DataSpec
from clsys.data.transport import uses_fast_path
from clsys.recipes.css_lm.pair_heads import pairwise_same_label_loss
from clsys.model.encoder import build_encoder
from clsys.model.folder import ExportSpec
from clsys.objectives.base import LossOutput, Objective
from clsys.recipes.css_lm.config import CSSLMConfig
from clsys.recipes.css_lm.bank import (GroupLayout, RetrievalBank, distributed_top_k, retrieved_group,
                                  sample_rank_positions, two_views)


def task_head(hidden_size: int, num_labels: int, dropout: float) -> nn.Sequential:
    """The classifier over [u; v]: dropout → Linear(2d→2d) → tanh → dropout → Linear(2d→C)."""
    d2 = 2 * hidden_size
    return nn.Sequential(nn.Dropout(dropout), nn.Linear(d2, d2), nn.Tanh(), nn.Dropout(dropout), nn.Linear(d2, num_labels))


def _float32(scorer: nn.Linear) -> nn.Linear:
    """A float32 copy of a pair scorer: retrieval scores in float32 even when training in bf16, where
    many distinct bank rows would tie."""
    return copy.deepcopy(scorer).float().requires_grad_(False)


class CSSLMData(DataSpec):
    """Corpus sentences (``sentences`` shard samples) → stage A's domain negatives, one text a row."""

    def __init__(self, cfg: Config, tokenizer, streams: list[str], reads_ids: bool):
        super().__init__(cfg, tokenizer, streams, reads_ids)
        self.texts = BatchTokenizer(tokenizer, cfg.data.max_length, token_type_ids=False,
                                    fast=uses_fast_path(cfg.data.transport))

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        corpus = self.texts([s["txt"] for s in samples])
        return {"corpus_input_ids": corpus["input_ids"], "corpus_attention_mask": corpus["attention_mask"]}


class CSSLM(Objective):
    config_class = CSSLMConfig
    data_class = CSSLMData

    @classmethod
    def streams(cls, cfg: Config) -> list[str]:
        return ["sentences"]  # the unlabeled corpus (data_prep wiki shards); labelled data comes from the pipeline

    def __init__(self, cfg: Config, tokenizer):
        super().__init__(cfg, tokenizer)
        oc: CSSLMConfig = cfg.objective
        checks = [("num_labels", oc.num_labels >= 2, ">= 2 (the pipeline sets it from the task's training data)"),
                  ("k", oc.k >= 1, ">= 1"),
                  ("domain_negatives", oc.domain_negatives >= 1, ">= 1"),
                  ("detach_after_micro_steps", oc.detach_after_micro_steps >= 0, ">= 0 (0 = never detach)"),
                  ("classifier_dropout", 0.0 <= oc.classifier_dropout < 1.0, "in [0, 1)"),
                  ("bank_chunk_rows", oc.bank_chunk_rows >= 1, ">= 1"),
                  ("bank_refresh_every", oc.bank_refresh_every >= 0, ">= 0 (0 = a static bank)")]
        for key, ok, expected in checks:
            if not ok:
                raise ValueError(f"objective.{key}: expected {expected}, got {getattr(oc, key)!r}")
        if cfg.train.zero_stage == 3:
            # The pair scorers' weights are read outside their own forward (pair_logits splits them per
            # view), where ZeRO-3 would hand out empty partitions. Fine-tuning fits ZeRO-2 anyway.
            raise ValueError("objective.name: css_lm needs train.zero_stage 0-2, got 3")
        self.oc = oc
        self.model = build_encoder(cfg.model, tokenizer)
        d = self.model.config.hidden_size
        self.task_head = task_head(d, oc.num_labels, oc.classifier_dropout)
        self.class_scorer = nn.Linear(2 * d, 2)  # C on [u_a; u_b]
        self.domain_scorer = nn.Linear(2 * d, 2)  # D on [v_a; v_b]
        self.dc_scorer = nn.Linear(4 * d, 2)  # DC on [v_a; v_b; u_a; u_b]
        if oc.stage == "css":
            # Stage A's retrieval heads score the static bank; training them would move the queries'
            # notion of relevance away from the bank they were built with.
            self.class_scorer.requires_grad_(False)
            self.domain_scorer.requires_grad_(False)
        # Training forwards done so far: drives stage A's detach switch and seeds stage C's rank positions.
        # It is model state: stage C, loading stage A's weights, continues stage A's count.
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))
        self.bank: RetrievalBank | None = None
        self._bank_tokens = torch.empty(0, dtype=torch.long)  # every bank row's ids, concatenated
        self._bank_starts = torch.zeros(1, dtype=torch.long)  # row i is _bank_tokens[starts[i]:starts[i + 1]]

    # ---- batches ------------------------------------------------------------------------------

    def collate_labeled(self, texts: list[str], labels: list[int],
                        corpus: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """A training batch. Stage A also needs ``domain_negatives`` corpus sentences per text, query
        after query (query i's are rows i·n … (i+1)·n − 1 of ``corpus``, a ``collate`` output)."""
        if len(texts) != len(labels):
            raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
        batch = {**self.data.texts(texts), "labels": torch.tensor(labels, dtype=torch.long)}
        if corpus is not None:
            batch.update(corpus_input_ids=corpus["corpus_input_ids"], corpus_attention_mask=corpus["corpus_attention_mask"])
        return batch

    def collate_corpus(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Unlabeled sentences for ``encode_views`` (the bank builder) and for classification."""
        return self.data.texts(texts)

    # ---- views and classification -------------------------------------------------------------

    def _views(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.encode(self.model, {"input_ids": input_ids, "attention_mask": attention_mask}).last_hidden_state
        return two_views(hidden, attention_mask)

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        was_training = self.training
        self.eval()
        try:
            yield
        finally:
            self.train(was_training)

    @torch.no_grad()
    def encode_views(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(u, v), each [B, d], in eval mode (dropout off) and without gradient: what the bank stores."""
        with self._eval_mode():
            return self._views(input_ids, attention_mask)

    def classify_train(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Task logits [B, num_labels] from the head over [u; v]."""
        u, v = self._views(input_ids, attention_mask)
        return self.task_head(torch.cat([u, v], -1))

    @torch.no_grad()
    def classify(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Task logits in eval mode (dropout off), for dev/test accuracy."""
        with self._eval_mode():
            return self.classify_train(input_ids, attention_mask)

    # ---- training -----------------------------------------------------------------------------

    def forward(self, batch: dict[str, torch.Tensor]) -> LossOutput:
        count = int(self.forwards)
        forward = self._warmup_forward if self.oc.stage == "warmup" else self._css_forward
        out = forward(batch, count)
        if self.training:  # evaluation forwards, and ones that raised, do not count
            self.forwards += 1
        return out

    def detached(self, count: int) -> bool:
        """Whether stage A's forward number ``count`` (from 0) gives C and D detached views."""
        return 0 < self.oc.detach_after_micro_steps <= count

    def _warmup_forward(self, batch: dict[str, torch.Tensor], count: int) -> LossOutput:
        labels = batch["labels"]
        if self.oc.method == "finetune":
            logits = self.classify_train(batch["input_ids"], batch["attention_mask"])
            ce = F.cross_entropy(logits, labels)
            return LossOutput(ce, {"loss": ce.detach(), "accuracy": (logits.argmax(-1) == labels).float().mean()})
        expected = labels.shape[0] * self.oc.domain_negatives
        if batch["corpus_input_ids"].shape[0] != expected:
            raise ValueError(f"stage A needs objective.domain_negatives = {self.oc.domain_negatives} corpus "
                             f"sentences per query: {expected} rows, got {batch['corpus_input_ids'].shape[0]}")
        detach = self.detached(count)
        u, v = self._views(batch["input_ids"], batch["attention_mask"])
        # Detached, the corpus sentences only reach D: no graph needed for them.
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
            _, v_corpus = self._views(batch["corpus_input_ids"], batch["corpus_attention_mask"])
        return self.warmup_loss(u, v, v_corpus, labels, detach)

    def warmup_loss(self, u: torch.Tensor, v: torch.Tensor, v_corpus: torch.Tensor, labels: torch.Tensor,
                    detach: bool = False) -> LossOutput:
        """L_A from the views of the labelled batch (u, v [B, d]) and of its corpus sentences
        (v_corpus [B·n, d], query i's at rows i·n … i·n + n − 1)."""
        logits = self.task_head(torch.cat([u, v], -1))
        ce = F.cross_entropy(logits, labels)
        dc_in = pairwise_same_label_loss(self.dc_scorer, labels, v, u)
        u_c, v_d, v_corpus = (u.detach(), v.detach(), v_corpus.detach()) if detach else (u, v, v_corpus)
        c_in = pairwise_same_label_loss(self.class_scorer, labels, u_c)
        # L_D^init: in-domain pairs (query i, query B−1−i) → 1, (query i, its corpus sentences) → 0,
        # one mean over all B + B·n pairs.
        n = v_corpus.shape[0] // v_d.shape[0]
        pairs = torch.cat([torch.cat([v_d, v_d.flip(0)], -1), torch.cat([v_d.repeat_interleave(n, 0), v_corpus], -1)])
        targets = torch.cat([labels.new_ones(v_d.shape[0]), labels.new_zeros(v_corpus.shape[0])])
        d_init = F.cross_entropy(self.domain_scorer(pairs), targets)
        loss = ce + dc_in + d_init + c_in
        metrics = {"loss": loss, "ce": ce, "dc_in": dc_in, "c_in": c_in, "d_init": d_init,
                   "accuracy": (logits.argmax(-1) == labels).float().mean()}
        return LossOutput(loss, {name: value.detach() for name, value in metrics.items()})

    # ---- stage C: the bank and retrieval ------------------------------------------------------

    def attach_bank(self, local_bank: RetrievalBank, token_ids: list[list[int]] | None = None) -> None:
        """Use ``local_bank`` (this rank's shard; the whole bank in one process) for stage C retrieval.

        The texts are tokenised here, once, truncated to ``data.max_length`` (or ``token_ids`` is
        that tokenisation, e.g. from the bank builder): never per step (the original re-tokenised every step). The bank
        stays on the device it is on; ``top_k`` moves one chunk at a time to the queries' device.
        """
        if token_ids is None:
            token_ids = self.tokenizer(local_bank.texts, truncation=True, max_length=self.cfg.data.max_length,
                                       return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        if len(token_ids) != len(local_bank):
            raise ValueError(f"token_ids has {len(token_ids)} rows, the bank {len(local_bank)}")
        lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)
        if len(local_bank) and not 0 < int(lengths.min()) <= int(lengths.max()) <= self.cfg.data.max_length:
            raise ValueError(f"bank token_ids need 1..{self.cfg.data.max_length} (data.max_length) ids a row, "
                             f"got {int(lengths.min())}..{int(lengths.max())}")
        self.bank = local_bank
        # One flat array without an intermediate Python list: a million-row shard has tens of millions of ids.
        self._bank_tokens = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64,
                                                         count=int(lengths.sum())))
        self._bank_starts = F.pad(lengths.cumsum(0), (1, 0))

    def rank_positions(self, count: int) -> torch.Tensor:
        """The K rank positions of stage C's forward number ``count``: a function of (train.seed, count)
        only, so every rank, and a resumed run, draws the same ones."""
        # Hashed: torch's CPU generator keeps only the low 32 bits of a seed, so (seed, count) must mix into them.
        digest = hashlib.sha256(f"css_lm/{self.cfg.train.seed}/{count}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))
        return sample_rank_positions(self.oc.k, generator, self.oc.positives_with_replacement)

    @torch.no_grad()
    def retrieve(self, u: torch.Tensor, v: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Stage C steps 2-4 for this rank's queries (views u, v [B, d]): their top-k global bank rows
        [B, k] and the token batch of the rows at ``positions``, query after query ([B·K, T],
        ``retrieved_group``'s ``doc_indices`` order). Collective in data-parallel training."""
        if self.bank is None:
            raise RuntimeError("stage C retrieves from a bank: call attach_bank before training")
        class_scorer, domain_scorer = _float32(self.class_scorer), _float32(self.domain_scorer)
        queries, u, v = u.shape[0], u.float(), v.float()
        # distributed_top_k needs the same queries on every rank: score the global batch (one process: its own).
        views, start = self.ranks.gather_rows(torch.cat([u, v], -1))
        u, v = views.chunk(2, -1)
        _, topk = distributed_top_k(u, v, self.bank, class_scorer, domain_scorer, self.oc.k, self.ranks,
                                    domain_weight=self.oc.domain_weight, chunk_rows=self.oc.bank_chunk_rows)
        # Every rank knows every query's rows: fetch them all in one exchange, then keep this rank's.
        per_query = positions.numel()
        rows = topk[:, positions.to(topk.device)].flatten()
        ids, lengths = self._token_rows(rows)
        keep = slice(start * per_query, (start + queries) * per_query)
        ids, lengths = ids[keep], lengths[keep]
        ids = ids[:, :int(lengths.max())]
        attention_mask = (torch.arange(ids.shape[1], device=ids.device) < lengths[:, None]).long()
        ids = ids.masked_fill(attention_mask == 0, self.tokenizer.pad_token_id)
        return topk[start:start + queries], {"input_ids": ids, "attention_mask": attention_mask}

    def _token_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached token ids of global bank ``rows`` [N]: ids [N, data.max_length] (zero-padded) and lengths [N].

        Each rank writes the rows its shard owns into a zero tensor (column 0 the length, then the
        ids) and an all_reduce sum assembles them: shards are disjoint, so every row is written by
        exactly one rank. Ids, not texts, are exchanged, so no rank re-tokenises another's rows.
        """
        table = torch.zeros(rows.shape[0], 1 + self.cfg.data.max_length, dtype=torch.long)
        first, end = self.bank.offset, self.bank.offset + len(self.bank)
        for n, row in enumerate(rows.tolist()):
            if first <= row < end:
                start, stop = int(self._bank_starts[row - first]), int(self._bank_starts[row - first + 1])
                table[n, 0] = stop - start
                table[n, 1:1 + stop - start] = self._bank_tokens[start:stop]
        table = table.to(rows.device)
        self.ranks.all_reduce_sum(table)
        missing = (table[:, 0] == 0).nonzero().flatten()
        if missing.numel():
            raise ValueError(f"no bank shard holds the rows {rows[missing][:10].tolist()}")
        return table[:, 1:], table[:, 0]

    def _css_forward(self, batch: dict[str, torch.Tensor], count: int) -> LossOutput:
        labels = batch["labels"]
        u, v = self._views(batch["input_ids"], batch["attention_mask"])
        positions = self.rank_positions(count)
        topk, docs = self.retrieve(u.detach(), v.detach(), positions)
        _, group_labels, layout = retrieved_group(labels, topk, positions)
        # The retrieved sentences are encoded by the current model, with gradient.
        u_docs, v_docs = self._views(docs["input_ids"], docs["attention_mask"])
        return self.css_loss(u, v, labels, u_docs, v_docs, group_labels, layout)

    def css_loss(self, u: torch.Tensor, v: torch.Tensor, labels: torch.Tensor, u_docs: torch.Tensor,
                 v_docs: torch.Tensor, group_labels: torch.Tensor, layout: GroupLayout) -> LossOutput:
        """L_CE + ½(L_DC^out + L_DC^in) from the queries' views (u, v [B, d]), the retrieved rows' views
        (u_docs, v_docs [B·K, d], ``doc_indices`` order) and ``retrieved_group``'s labels and layout."""
        logits = self.task_head(torch.cat([u, v], -1))
        ce = F.cross_entropy(logits, labels)
        u_group, v_group = layout.assemble(u_docs, u), layout.assemble(v_docs, v)
        dc_out = pairwise_same_label_loss(self.dc_scorer, group_labels, v_group, u_group)
        dc_in = pairwise_same_label_loss(self.dc_scorer, labels, v, u)
        loss = ce + 0.5 * (dc_out + dc_in)
        metrics = {"loss": loss, "ce": ce, "dc_in": dc_in, "dc_out": dc_out,
                   "accuracy": (logits.argmax(-1) == labels).float().mean()}
        return LossOutput(loss, {name: value.detach() for name, value in metrics.items()})

    # ---- export -------------------------------------------------------------------------------

    def encoder(self) -> nn.Module:
        return self.model

    def export_spec(self) -> ExportSpec:
        return ExportSpec("cls", self.encoder_prefix())  # the class view u
