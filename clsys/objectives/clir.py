"""Cross-lingual retrieval pretraining (Yu, Fei, Li, WWW 2021): QLM + RR, docs/training/objectives.md#clir.

Data: ``data_prep align`` writes one ``clir/<A>-<B>`` stream per language pair; a record is an
aligned pair of Wikipedia sections with both sides' sentences and hard negatives. Each time a
record is used it becomes one query/document example: the direction is drawn with p = 0.5,
the query is one random sentence of the query side, the document is the whole aligned section in
the other language. Both tasks read ``[CLS] query [SEP] document [SEP]`` (token types 0 / 1).

The query/document split comes from the tokenizer's sequence ids (``document_side``), not from
token type ids: XLM-R-style tokenizers (multilingual-e5, XLM-R) give every token type 0, which would
let QLM mask the document too and make a BertLong's whole row global.

QLM: only query tokens are masked (each with p = 0.30, 80/10/10) and predicted with the
document fully visible, so predicting them pulls in the other language. The MLM head comes from the
checkpoint when it has one, else it is new with its decoder tied to the word embeddings (the
original loaded it under the wrong name and trained a random, untied head: docs/training/objectives.md#clir-original).

RR: a pointwise 2-class cross-entropy on W·dropout(pooler([CLS])) over the positive and
``rr_negatives`` negatives per query. A negative is one of the record's hard negatives with
probability 1 − (3/4)^|hard|, else a random section of the document language from a pool of
recently seen sections (the streaming stand-in for the original's "random section of the sampled
subset"). ``rr_in_batch: true`` adds the batch's other documents of the same language as
negatives, a documented extension; the original has none.

Keeping the bi-encoder (an extension, off by default): QLM and RR train a cross-encoder, and on a
base that is already a sentence encoder (multilingual-e5) their gradients move its embedding
geometry; bench/clir_recipe.py measured −26 to −44 MRR@10 of the bi-encoder after 300 steps.
``keep_weight: λ`` adds λ·mean(1 − cos(e, e₀)) to every step, e and e₀ being the trained and the
starting encoder's pooled (``export_pooling``) embeddings of the batch's queries and positive
documents, each read alone as the bi-encoder reads them; e₀ comes from a frozen copy taken at the start.

Schedule: faithful by default, every task × language pair is its own optimizer step (QLM on
each pair in shuffled order, then RR on each pair); ``schedule: sum`` instead adds
λ_qlm·QLM + λ_rr·RR in one step. Pairs are drawn per round with ``pair_temperature`` (see
``clsys.data.mixing``). BertLong models (``python -m clsys.model.long``) get their local/global
attention (global = the query segment) from ``clsys.model.long.long_attention_inputs``.
"""
from __future__ import annotations

import collections
import copy
import functools
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from clsys.config import Config, ObjectiveConfig
from clsys.data.batch_tokenizer import BatchTokenizer
from clsys.data.spec import DataSpec
from clsys.data.transport import uses_fast_path
from clsys.data.masking import Masker, masked_lm_loss
from clsys.model.encoder import Pooling, build_bert_pretraining, pool
from clsys.model.folder import ExportSpec
from clsys.objectives.base import LossOutput, Objective



@dataclass
class CLIRConfig(ObjectiveConfig):
    pairs: list[str] = field(default_factory=lambda: ["en-de"])  # streams clir/<pair> of data_prep align
    # [qlm], [rr] are the single-task ablations
    tasks: list[Literal["qlm", "rr"]] = field(default_factory=lambda: ["qlm", "rr"])
    # alternate: one optimizer step per task × pair (faithful); sum: one step, losses added
    schedule: Literal["alternate", "sum"] = "alternate"
    pair_temperature: float = 0.0  # 0: each pair once per round, shuffled (faithful); T > 0: p ∝ pair size^(1/T)
    qlm_weight: float = 1.0  # λ of the QLM loss
    rr_weight: float = 1.0  # λ of the RR loss
    mask_probability: float = 0.30  # per query token, independently
    # query (faithful default), document or mixed: the paper's ablations
    mask_mode: Literal["query", "document", "mixed"] = "query"
    rr_negatives: int = 1  # negatives per positive (num_neg)
    rr_in_batch: bool = False  # extension: the batch's other same-language documents as extra negatives
    random_pool: int = 1024  # recent sections kept per language for random negatives
    rr_dropout: float = 0.1  # dropout before the RR classifier (BERT's hidden dropout)
    export_pooling: Pooling = "mean"  # bi-encoder pooling of the exported encoder
    keep_weight: float = 0.0  # extension: λ of the pull of the pooled embeddings to the starting encoder's; 0: off


def clir_example(record: dict, rng: random.Random) -> dict[str, Any]:
    """One query/document example from a symmetric aligned-sections record: the direction and the
    query sentence are drawn here, at training time."""
    query_side, doc_side = record["sides"] if rng.random() < 0.5 else reversed(record["sides"])
    return {"query_lang": query_side["lang"], "doc_lang": doc_side["lang"],
            "query": rng.choice(query_side["sentences"]), "positive": " ".join(doc_side["sentences"]),
            "hard_negatives": list(doc_side["hard_negatives"]), "pair_id": record["pair_id"]}


def document_side(encoding) -> torch.Tensor:
    """[B, L]: 1 on the document side of each tokenized (query, document) row, from the first
    document token through the row's end (BERT's token type 1 span: the closing [SEP] included).

    Fast tokenizers know which sequence each token came from; a slow one only has token type ids.
    """
    if not encoding.encodings:
        return encoding["token_type_ids"]
    rows = []
    for row, mask in enumerate(encoding["attention_mask"].tolist()):
        ids = encoding.sequence_ids(row)
        start = ids.index(1) if 1 in ids else len(ids)
        rows.append([int(i >= start and real) for i, real in enumerate(mask)])
    return torch.tensor(rows)


def hard_negative_probability(hard: int) -> float:
    """Easy (random) with probability (3/4)^|hard|, hard otherwise."""
    return 1.0 - 0.75 ** hard


def sample_negative(hard: list[str], pool: Iterable[str], positive: str, rng: random.Random) -> str | None:
    """A hard negative with probability 1 − (3/4)^|hard|, else a random pool section (never the
    positive); None when neither kind is available."""
    if hard and rng.random() < hard_negative_probability(len(hard)):
        return rng.choice(hard)
    candidates = [p for p in pool if p != positive]
    if candidates:
        return rng.choice(candidates)
    return rng.choice(hard) if hard else None


class CLIRData(DataSpec):
    """Aligned section pairs → QLM's masked (query, document) pairs and RR's (query, positive or negative) pairs,
    one stream per language pair, mixed by task and pair (``clsys.data.mixing.StreamMixer``). A pool of each document
    language's recent positives, kept across batches, supplies RR's random negatives."""

    def __init__(self, cfg: Config, tokenizer, streams: list[str], reads_ids: bool):
        super().__init__(cfg, tokenizer, streams, reads_ids)
        self.oc: CLIRConfig = cfg.objective
        self.masker = Masker.for_tokenizer(tokenizer, self.oc.mask_probability, bernoulli=True)
        self.keep_texts = BatchTokenizer(tokenizer, cfg.data.max_length, token_type_ids=True,
                                         fast=uses_fast_path(cfg.data.transport))  # e₀'s single texts
        self.pools: dict[str, collections.deque] = collections.defaultdict(  # picklable: loader workers get it
            functools.partial(collections.deque, maxlen=self.oc.random_pool))

    def combine(self, loaders: dict[str, Any]):
        from clsys.data.mixing import StreamMixer, size_weights

        cfg, temperature = self.cfg, self.oc.pair_temperature
        by_pair = {pair: loaders[stream] for pair, stream in zip(self.oc.pairs, self.streams)}
        weights = size_weights(by_pair, 1.0 / temperature) if temperature else None  # None: each pair once a round
        return StreamMixer(by_pair, cfg.train.grad_accum, cfg.train.seed, weights, self.oc.tasks,
                           alternate=self.oc.schedule == "alternate")

    def pair_encoding(self, queries: list[str], documents: list[str], padding=True) -> dict[str, torch.Tensor]:
        # longest_first trims the longer side (nearly always the document) first, as the original does.
        encoding = self.tokenizer(queries, documents, truncation="longest_first", max_length=self.cfg.data.max_length,
                                  padding=padding, return_tensors="pt", return_token_type_ids=True)
        return {**encoding, "document": document_side(encoding)}

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rng = random.Random(random.getrandbits(64))
        examples = [clir_example(s["json"], rng) for s in samples]
        for e in examples:
            self.pools[e["doc_lang"]].append(e["positive"])
        queries, positives = [e["query"] for e in examples], [e["positive"] for e in examples]
        batch: dict[str, torch.Tensor] = {}
        if "qlm" in self.oc.tasks:
            qlm = self.pair_encoding(queries, positives)
            document = qlm["document"].bool()
            eligible = {"query": ~document, "document": document, "mixed": torch.ones_like(document)}[self.oc.mask_mode]
            masked, chosen = self.masker(qlm["input_ids"], qlm["attention_mask"], eligible)
            batch.update({f"qlm_{k}": v for k, v in qlm.items()})
            batch.update(qlm_masked_input_ids=masked, qlm_chosen=chosen)
        if "rr" in self.oc.tasks:
            rr_queries, rr_docs, labels = [], [], []
            for e in examples:
                pool = self.pools[e["doc_lang"]]  # only scanned when a random negative is drawn
                negatives = [sample_negative(e["hard_negatives"], pool, e["positive"], rng)
                             for _ in range(self.oc.rr_negatives)]
                if self.oc.rr_in_batch:
                    negatives += [o["positive"] for o in examples if o is not e and o["doc_lang"] == e["doc_lang"]]
                negatives = [n for n in negatives if n is not None]
                rr_queries += [e["query"]] * (1 + len(negatives))
                rr_docs += [e["positive"], *negatives]
                labels += [1] + [0] * len(negatives)
            batch.update({f"rr_{k}": v for k, v in self.pair_encoding(rr_queries, rr_docs).items()})
            batch["rr_labels"] = torch.tensor(labels)
        if self.oc.keep_weight:
            for side, texts in (("query", queries), ("document", positives)):
                batch.update({f"keep_{side}_{k}": v for k, v in self.keep_texts(texts).items()})
        return batch


class CLIR(Objective):
    config_class = CLIRConfig
    data_class = CLIRData

    @classmethod
    def streams(cls, cfg: Config) -> list[str]:
        return [f"clir/{pair}" for pair in cfg.objective.pairs]

    def __init__(self, cfg: Config, tokenizer):
        super().__init__(cfg, tokenizer)
        oc: CLIRConfig = cfg.objective
        checks = [("tasks", bool(oc.tasks), "qlm, rr or both"),
                  ("pairs", bool(oc.pairs), "at least one language pair"),
                  ("rr_negatives", oc.rr_negatives >= 1, ">= 1"),
                  ("pair_temperature", oc.pair_temperature >= 0, ">= 0 (0 = each pair once a round)"),
                  ("keep_weight", oc.keep_weight >= 0, ">= 0 (0 = off)")]
        for key, ok, expected in checks:
            if not ok:
                raise ValueError(f"objective.{key}: expected {expected}")
        self.oc = oc
        self.model, self.mlm_head, nsp_head = build_bert_pretraining(cfg.model, tokenizer)
        if cfg.model.packed and getattr(self.model.config, "attention_window", None):
            raise ValueError("model.packed: BertLong's local/global attention mask needs padded batches; "
                             "set model.packed: false")
        pooler = nsp_head[0]  # BERT's pretrained dense + tanh on [CLS]; its NSP classifier is not used
        self.rr_head = nn.Sequential(pooler, nn.Dropout(oc.rr_dropout), nn.Linear(pooler.dense.out_features, 2))
        self.latest: dict[str, torch.Tensor] = {}  # newest value of every metric, so logs show all tasks
        self.start_encoder = None
        if oc.keep_weight:
            self.start_encoder = copy.deepcopy(self.model)  # e₀'s encoder: the starting point, never updated
            self.start_encoder.requires_grad_(False)
            self.train(self.training)

    def train(self, mode: bool = True) -> CLIR:
        # The loop calls train() on everything; the starting encoder gives e₀ without dropout.
        super().train(mode)
        if self.start_encoder is not None:
            self.start_encoder.eval()
        return self

    # ---- losses -------------------------------------------------------------------------------

    def _hidden(self, input_ids, attention_mask, token_type_ids, document) -> torch.Tensor:
        # Imported here, not with the module: clsys.model.long imports transformers' BERT modelling code (2 s),
        # and every loader worker's process imports this module (clsys.data.streaming's forkserver preload)
        # without ever computing a loss.
        from clsys.model.long import long_attention_inputs

        attention = long_attention_inputs(self.model.config, attention_mask, document, self.model.dtype)
        return self.encode(self.model, {"input_ids": input_ids, "token_type_ids": token_type_ids,
                                        **attention}).last_hidden_state

    def qlm_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self._hidden(batch["qlm_masked_input_ids"], batch["qlm_attention_mask"], batch["qlm_token_type_ids"],
                              batch["qlm_document"])
        return masked_lm_loss(self.mlm_head, hidden, batch["qlm_input_ids"], batch["qlm_chosen"])

    def rr_logits(self, input_ids, attention_mask, token_type_ids, document) -> torch.Tensor:
        return self.rr_head(self._hidden(input_ids, attention_mask, token_type_ids, document)).float()

    def rr_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.rr_logits(batch["rr_input_ids"], batch["rr_attention_mask"], batch["rr_token_type_ids"],
                                batch["rr_document"])
        labels = batch["rr_labels"]
        return F.cross_entropy(logits, labels), (logits.argmax(-1) == labels).float().mean()

    def keep_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """mean(1 − cos(e, e₀)) over the batch's queries and positive documents, each embedded alone."""
        distances = []
        for side in ("query", "document"):
            inputs = {k: batch[f"keep_{side}_{k}"] for k in ("input_ids", "attention_mask", "token_type_ids")}
            mask, pooling = inputs["attention_mask"], self.oc.export_pooling
            trained = pool(self.encode(self.model, inputs).last_hidden_state, mask, pooling)
            with torch.no_grad():
                start = pool(self.encode(self.start_encoder, inputs).last_hidden_state, mask, pooling)
            distances.append(1 - F.cosine_similarity(trained.float(), start.float(), dim=-1))
        return torch.cat(distances).mean()

    def forward(self, batch: dict[str, Any]) -> LossOutput:
        tasks, pair = batch["task"].split("+"), batch["source"]
        loss = 0.0
        for task in tasks:
            value, accuracy = self.qlm_loss(batch) if task == "qlm" else self.rr_loss(batch)
            loss = loss + (self.oc.qlm_weight if task == "qlm" else self.oc.rr_weight) * value
            self.latest.update({f"{task}_loss": value.detach(), f"{task}_accuracy": accuracy.detach(),
                                f"{task}_loss_{pair}": value.detach()})
        if self.oc.keep_weight:
            keep = self.keep_loss(batch)
            loss = loss + self.oc.keep_weight * keep
            self.latest["keep_loss"] = keep.detach()
        return LossOutput(loss, {"loss": loss.detach(), **self.latest})

    # ---- inference ----------------------------------------------------------------------------

    def encoder(self) -> nn.Module:
        return self.model

    def head_modules(self) -> list[nn.Module]:
        return [self.mlm_head, self.rr_head]

    def export_spec(self) -> ExportSpec:
        """The bi-encoder's pooling, and the RR head as a ``BertForSequenceClassification`` (pooler + 2-way
        classifier) → our keys."""
        reranker = {}
        if "rr" in self.oc.tasks:
            names = {"pooler.dense.weight": "rr_head.0.dense.weight", "pooler.dense.bias": "rr_head.0.dense.bias",
                     "classifier.weight": "rr_head.2.weight", "classifier.bias": "rr_head.2.bias"}
            prefix = self.model.base_model_prefix
            reranker = {(k if k.startswith("classifier") else f"{prefix}.{k}"): v for k, v in names.items()}
        return ExportSpec(self.oc.export_pooling, self.encoder_prefix(), reranker_map=reranker)

    def reranker(self):
        """Scores (query, document) pairs with the RR head's "relevant" logit (how the original ranks)."""
        if "rr" not in self.oc.tasks:
            return None

        @torch.no_grad()
        def score(queries: list[str], documents: list[str]) -> torch.Tensor:
            was_training = self.training
            self.eval()
            device = next(self.parameters()).device
            out = []
            size = self.cfg.eval.batch_size
            for start in range(0, len(queries), size):
                enc = self.data.pair_encoding(queries[start:start + size], documents[start:start + size])
                enc = {k: v.to(device) for k, v in enc.items()}
                out.append(self.rr_logits(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"],
                                          enc["document"])[:, 1].cpu())
            self.train(was_training)
            return torch.cat(out) if out else torch.empty(0)

        return score
