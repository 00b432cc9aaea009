"""Embedding models from (query, positive, hard negatives) pairs, as E5, GTE, BGE, Nomic Embed and Arctic-Embed
fine-tune theirs: a bi-encoder trained with InfoNCE over in-batch and hard negatives.

Data: the ``pairs/<source>`` streams ``python -m data_prep pairs`` writes under ``data.url``, those ``data.sources``
names or every one found there (``pairs_streams``), each batch drawn from one of them (``clsys.data.mixing``:
``mix_sources``); a record's text is the query, its json ``{positive, negatives, source, instruction}``.
Each pair becomes ``2 + k`` encoder rows (k = ``negatives``), all read by one encoder forward:
  rows [0, B)           the queries, each after its prefix: the record's own ``instruction`` when it has one
                        (written into ``instruction_format``), else its source's entry in ``source_prefixes``,
                        else ``query_prefix``: the most specific wins, and only one is used;
  rows [B, 2B)          the positives, after ``passage_prefix``;
  rows [2B, 2B + B·k)   k hard negatives of each pair in turn, after ``passage_prefix``: a pair with more than k
                        has k of them drawn at random, one with fewer has its missing ones as empty rows that the
                        loss leaves out (``negative_present``). Repeating a negative instead would count it twice.
The draw comes from Python's ``random``, which the loader seeds before every batch from (seed, epoch, rank,
worker, batch) (``clsys.data.streaming``): the same negatives again on a resumed run, others in the next epoch.

Loss, per query i of this rank, over the global batch (every rank's pairs, gathered with gradient through the
objective's ``ranks``):
    ℓ_i = −log e^{s(q_i,p_i)/τ} / (Σ_j e^{s(q_i,p_j)/τ} + Σ_{j,m} e^{s(q_i,n_jm)/τ}),   s = cosine,
the mean over the rank's queries (``clsys.objectives.contrastive.info_nce``: the gradient after the data-parallel
average is that of one process holding the whole global batch). Candidates that are no negatives of q_i leave the
sums: a missing negative's empty row, and a copy of what is relevant to q_i, i.e. another pair's positive when that
pair has the same query (``data_prep pairs`` writes a pair per positive) or the same positive (SQuAD-style data has
several questions a paragraph), and a hard negative equal to q_i's positive. Texts are compared by a 32-bit
digest of the text as encoded; a collision, about one in 2^32 comparisons, leaves one negative out.
``symmetric: true`` adds the document→query term, each positive p_i over all queries of the global batch (the same
copies left out), and the loss is the mean of the two directions, as in CLIP (Radford et al., 2021) and cpt-text
(Neelakantan et al., 2022). ``matryoshka_dims``: the loss is summed, with weight 1 each, over the embeddings cut to
each of those leading dimensions (cosine renormalises them), as Matryoshka Representation Learning (Kusupati et
al., 2022) and sentence-transformers' ``MatryoshkaLoss`` do.

τ = 0.02 by default: FlagEmbedding's fine-tuning of BGE (cross-device negatives, normalised embeddings) uses it;
sentence-transformers' ``MultipleNegativesRankingLoss`` has scale 20, i.e. τ = 0.05.

GradCache (``objective.grad_cache.chunk_size``): ``embed`` pools each row alone, ``embedding_loss`` is the loss
above from the cached embeddings. Export: the encoder with the training pooling, and the prefixes as
sentence-transformers prompts ``query`` and ``passage`` (and one per ``source_prefixes`` entry, named after its
source), no default prompt, and the Matryoshka dimensions in the model card.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from clsys import storage
from clsys.config import Config, ObjectiveConfig
from clsys.data.batch_tokenizer import BatchTokenizer
from clsys.data.spec import DataSpec
from clsys.data.transport import uses_fast_path
from clsys.data.mixing import mix_sources, source_streams
from clsys.model.encoder import Pooling, build_encoder, pool
from clsys.model.folder import ExportSpec
from clsys.objectives.base import LossOutput, Objective
from clsys.objectives.contrastive import alignment_uniformity, info_nce
from clsys.objectives.ranks import Ranks
from clsys.shards.manifest import MANIFEST

INSTRUCTION = "{instruction}"  # where instruction_format puts a record's instruction
ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass
class PairsConfig(ObjectiveConfig):
    temperature: float = 0.02  # τ of the InfoNCE loss (FlagEmbedding's BGE fine-tuning: 0.02)
    # k: hard negatives per pair in a batch; a pair with more has k drawn at random, one with fewer leaves the rest out
    negatives: int = 1
    # add the document→query term (each positive over the global batch's queries) and average the two directions
    symmetric: bool = False
    pooling: Pooling = "mean"  # sentence embedding of the encoder's last layer, in training and in the export
    query_prefix: str = ""  # put before every query (E5: "query: "); exported as the prompt "query"
    passage_prefix: str = ""  # put before every positive and negative (E5: "passage: "); exported as "passage"
    # source → the prefix of that source's queries, in place of query_prefix; each exported as a prompt of its name
    source_prefixes: dict[str, str] = field(default_factory=dict)
    # a record's own instruction, when it has one, as its query's prefix in place of the two above: "{instruction}"
    # is replaced by it (E5-Mistral's form); "" = records' instructions are not used
    instruction_format: str = "Instruct: {instruction}\nQuery: "
    # the loss summed over the embeddings cut to each of these leading dimensions (Matryoshka); [] = the full one only
    matryoshka_dims: list[int] = field(default_factory=list)


def pairs_streams(url: str) -> list[str]:
    """The ``pairs/<source>`` streams under the data root ``url``: its folders ``pairs/*`` that hold a manifest
    (``data_prep pairs`` writes it last), sorted; ValueError naming the folder when there is none."""
    root = storage.join(url, "pairs")
    sources = sorted({rel.split("/")[0] for _, rel in storage.list_relative(root)
                      if rel.count("/") == 1 and rel.endswith(f"/{MANIFEST}")})
    if not sources:
        raise ValueError(f"{storage.redact(root)}: no pairs/<source> stream (a folder with a {MANIFEST}) to train on: "
                         f"write them with python -m data_prep pairs --out {storage.redact(url)}")
    return [f"pairs/{source}" for source in sources]


def text_digest(text: str) -> int:
    """A 32-bit digest of ``text``, signed (an int32 tensor holds it): what tells copies apart across ranks. Not
    int64: a batch's integers travel from the loader workers in one buffer per dtype, narrowed to its widest value
    (``clsys.data.batch_transport``), and 64-bit digests beside the token ids would keep those 64-bit too."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=4).digest(), "little", signed=True)


class PairsData(DataSpec):
    """Pairs → the rows of their queries, positives and k hard negatives each (the module docstring's layout), with
    the digests and presence of those rows that the loss needs to leave copies and missing negatives out."""

    def __init__(self, cfg: Config, tokenizer, streams: list[str], reads_ids: bool):
        super().__init__(cfg, tokenizer, streams, reads_ids)
        self.oc: PairsConfig = cfg.objective
        self.texts = BatchTokenizer(tokenizer, cfg.data.max_length, fast=uses_fast_path(cfg.data.transport))

    def combine(self, loaders: dict[str, Any]):
        """The sources' batches in ``data.sources``' schedule, each tagged with its stream (``mix_sources``)."""
        return mix_sources(self.cfg, loaders)

    def query_prefix(self, record: dict[str, Any]) -> str:
        """The text put before a record's query: its own instruction, else its source's prefix, else the
        query prefix (the most specific wins)."""
        oc, instruction = self.oc, record.get("instruction", "")
        if instruction and oc.instruction_format:
            return oc.instruction_format.replace(INSTRUCTION, instruction)
        return oc.source_prefixes.get(record["source"], oc.query_prefix)

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        k, passage = self.oc.negatives, self.oc.passage_prefix
        rng = random.Random(random.getrandbits(64))  # the loader seeded `random` for this batch
        queries, positives, negatives, present = [], [], [], []
        for sample in samples:
            record = sample["json"]
            queries.append(self.query_prefix(record) + sample["txt"])
            positives.append(passage + record["positive"])
            offered = record["negatives"]
            chosen = rng.sample(offered, k) if len(offered) > k else list(offered)
            negatives += [passage + text for text in chosen] + [""] * (k - len(chosen))
            present += [True] * len(chosen) + [False] * (k - len(chosen))
        batch = self.texts(queries + positives + negatives)
        for name, texts in (("query", queries), ("positive", positives), ("negative", negatives)):
            batch[f"{name}_digest"] = torch.tensor([text_digest(t) for t in texts], dtype=torch.int32)
        batch["negative_present"] = torch.tensor(present, dtype=torch.bool)
        return batch

    def sample_lengths(self, samples: list[dict[str, Any]]) -> list[int]:
        """Tokens of each pair's longest text (query, positive or negative): what its rows pad a batch to."""
        texts = [[s["txt"], s["json"]["positive"], *s["json"]["negatives"]] for s in samples]
        ids = iter(self.tokenizer([t for row in texts for t in row], add_special_tokens=False)["input_ids"])
        return [max(len(next(ids)) for _ in row) for row in texts]


def pairs_loss(queries: torch.Tensor, positives: torch.Tensor, negatives: torch.Tensor,
               labels: dict[str, torch.Tensor], temperature: float, symmetric: bool, dims: list[int],
               ranks: Ranks) -> LossOutput:
    """The loss of the module docstring for this rank's B pairs: ``queries`` and ``positives`` [B, d], ``negatives``
    [B·k, d] (pair j's at rows [j·k, (j+1)·k)); ``labels`` the batch's ``query_digest``, ``positive_digest``,
    ``negative_digest`` and ``negative_present`` (``PairsData.collate``); the embeddings cut to each of ``dims``."""
    rows, k = queries.shape[0], negatives.shape[0] // max(queries.shape[0], 1)
    every = {name: torch.cat(ranks.all_gather(labels[name].to(torch.int32 if name.endswith("digest") else torch.uint8)))
             for name in ("query_digest", "positive_digest", "negative_digest", "negative_present")}
    own_query, own_positive = labels["query_digest"][:, None], labels["positive_digest"][:, None]
    # Pairs of the same query or the same positive: each one's positive and query are relevant to the other.
    copies = (every["query_digest"][None] == own_query) | (every["positive_digest"][None] == own_positive)
    local = torch.arange(rows, device=queries.device)
    copies[local, local + ranks.rank * rows] = False  # every rank holds B pairs: the gather needs equal rows
    excluded = copies
    if k:
        not_negative = (every["negative_present"][None] == 0) | (every["negative_digest"][None] == own_positive)
        excluded = torch.cat([copies, not_negative], dim=1)
    query_loss = document_loss = loss = 0.0
    metrics: dict[str, torch.Tensor] = {}
    for dim in dims:
        q, p = queries[:, :dim], positives[:, :dim]
        term = info_nce(q, p, temperature, negatives[:, :dim] if k else None, ranks=ranks, excluded=excluded)
        query_loss = query_loss + term
        if symmetric:
            backward = info_nce(p, q, temperature, ranks=ranks, excluded=copies)
            document_loss = document_loss + backward
            term = (term + backward) / 2
        loss = loss + term
        if len(dims) > 1:
            metrics[f"matryoshka_{dim}_loss"] = term.detach()
    metrics["loss"] = loss.detach()
    if symmetric:
        metrics.update(query_loss=query_loss.detach(), document_loss=document_loss.detach())
    # In-batch copies left out per query: a share of the batch's negatives that would have taught the wrong thing.
    metrics["copies_left_out"] = copies.sum(1).float().mean()
    metrics.update(alignment_uniformity(queries.detach(), positives.detach()))
    return LossOutput(loss, metrics)


class Pairs(Objective):
    config_class = PairsConfig
    data_class = PairsData

    @classmethod
    def streams(cls, cfg: Config) -> list[str]:
        """The sources ``data.sources`` names, or every ``pairs/<source>`` stream under ``data.url``."""
        return source_streams(cfg, pairs_streams(cfg.data.url))

    def __init__(self, cfg: Config, tokenizer):
        super().__init__(cfg, tokenizer)
        oc: PairsConfig = cfg.objective
        self.oc = oc
        self.model = build_encoder(cfg.model, tokenizer)
        width = self.model.config.hidden_size
        reserved = sorted({"query", "passage"} & set(oc.source_prefixes))
        checks = [("temperature", oc.temperature > 0, "> 0"),
                  ("negatives", oc.negatives >= 0, ">= 0 (hard negatives per pair)"),
                  ("matryoshka_dims", all(1 <= d <= width for d in oc.matryoshka_dims)
                   and len(set(oc.matryoshka_dims)) == len(oc.matryoshka_dims),
                   f"distinct dimensions from 1 to the encoder's {width}, got {oc.matryoshka_dims}"),
                  ("source_prefixes", not reserved, f"sources other than {' and '.join(reserved)}, the names of "
                                                     "the query and passage prompts"),
                  ("instruction_format", not oc.instruction_format or INSTRUCTION in oc.instruction_format,
                   f"a text holding {INSTRUCTION}, or \"\" to leave records' instructions unused")]
        for key, ok, expected in checks:
            if not ok:
                raise ValueError(f"objective.{key}: expected {expected}")
        self.dims = list(oc.matryoshka_dims) or [width]

    def embed(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {key: batch[key] for key in ENCODER_INPUTS if key in batch}
        if self.oc.pooling == "cls":  # [CLS] alone: the last layer skips the other tokens' work
            return self.encode_first(self.model, inputs)
        return pool(self.encode(self.model, inputs).last_hidden_state, batch["attention_mask"], self.oc.pooling)

    def embedding_loss(self, embeddings: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        rows = batch["query_digest"].shape[0]
        queries, positives, negatives = embeddings[:rows], embeddings[rows:2 * rows], embeddings[2 * rows:]
        return pairs_loss(queries, positives, negatives, batch, self.oc.temperature, self.oc.symmetric, self.dims,
                          self.ranks)

    def forward(self, batch: dict[str, torch.Tensor], part: str = "loss",
                whole: dict[str, torch.Tensor] | None = None) -> LossOutput | torch.Tensor | tuple:
        if part != "loss":
            return self.grad_cache_part(batch, part, whole)
        return self.embedding_loss(self.embed(batch), batch)

    def encoder(self) -> nn.Module:
        return self.model

    def prompts(self) -> dict[str, str]:
        """sentence-transformers' prompts of the export: the query and passage prefixes, and each source's."""
        return {"query": self.oc.query_prefix, "passage": self.oc.passage_prefix, **self.oc.source_prefixes}

    def export_spec(self) -> ExportSpec:
        return ExportSpec(self.oc.pooling, self.encoder_prefix(), prompts=self.prompts(),
                          matryoshka_dims=tuple(self.oc.matryoshka_dims))
