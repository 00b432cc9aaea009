"""A mining worker: one slice of the corpus, embedded and held, and each query batch's best candidates in it.

``python -m clsys.mine`` runs ``MiningWorker`` as a Ray actor per worker (the class knows nothing of Ray: the
tests also call it directly). Worker ``rank`` of ``world`` holds the texts that ``clsys.retrieval.corpus.owner``
gives it, never the whole corpus: its memory grows with its slice (``report``: rows, bytes of embeddings and
texts, peak RSS). Its life:

1. ``load_slice``: the slice a first run of the command saved (``clsys.retrieval.work``), if there is one;
2. else ``bucket``: the texts of its share of the corpus's shards, by owner (one map per worker, which Ray hands to
   the owners), and ``build``: the maps made for it merged, embedded and saved;
3. per query batch, ``embed_queries`` for its share of the batch's queries, then ``search`` for the whole batch
   (every worker's share of the embeddings): its slice's best candidates of each query (``clsys.retrieval.topk``,
   chunk by chunk), their texts, and the score of each pair's positive where the slice holds it. The driver
   merges the workers' candidates into the corpus's best.

A text is embedded in a batch of texts of its own number of tokens (no padding), in ``batch_size`` at most: its
vector then depends on the text alone, not on the texts it was batched with (tested on CPU,
``tests/test_mine.py``), so any number of workers gives the same vectors, and so the same negatives. Vectors are
unit length: a score is a cosine.
"""
from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from clsys.model.encoder import cut_for_tokens, embed, load_encoder, load_tokenizer
from clsys.retrieval import topk
from clsys.retrieval.corpus import CorpusShard, bucket_texts, corpus_texts, merge_buckets
from clsys.retrieval.work import Slice, load_slice, save_slice

SCORE_CHUNK = 1 << 13  # corpus rows scored against a query batch at a time: [batch, chunk] float32 scores
LENGTH_CHUNK = 1 << 10  # texts tokenized at a time to learn their token counts (~300 bytes a token while held)


@dataclass(frozen=True)
class Encoding:
    """How texts become vectors (every worker's, and the driver's settings): the model folder, its pooling, the
    tokens per text, the queries' and passages' prefixes; the texts per forward pass, the threads of the worker,
    and the device ("cpu" or "cuda")."""

    model: str
    pooling: str
    max_length: int
    query_prefix: str
    passage_prefix: str
    batch_size: int
    threads: int
    device: str


@dataclass
class Found:
    """A worker's answer to ``search``: per query [B], its slice's best ``scores`` and ``ids`` [B, n], the texts of
    those ids, and the score of each pair's positive (NaN where another worker holds it)."""

    scores: torch.Tensor
    ids: torch.Tensor
    texts: dict[int, str]
    positive_scores: torch.Tensor


class MiningWorker:
    """Worker ``rank`` of ``world`` (the module docstring); its slice is saved at ``slice_stem``."""

    def __init__(self, encoding: Encoding, rank: int, world: int, slice_stem: str):
        torch.set_num_threads(encoding.threads)
        self.encoding, self.rank, self.world, self.stem = encoding, rank, world, slice_stem
        self.model = load_encoder(encoding.model).to(encoding.device).eval()
        self.tokenizer = load_tokenizer(encoding.model)
        self.slice = Slice(torch.empty(0, dtype=torch.long), torch.empty(0, 0), [])
        # Per phase, wall seconds and this process's CPU seconds (what a loaded machine does not inflate).
        self.seconds = {"corpus": 0.0, "queries": 0.0, "search": 0.0}
        self.cpu_seconds = dict.fromkeys(self.seconds, 0.0)
        self.queries = {"embedded": 0, "searched": 0}

    @contextlib.contextmanager
    def _timed(self, phase: str):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - wall
            self.cpu_seconds[phase] += time.process_time() - cpu

    # -- the slice ----------------------------------------------------------------------------

    def load_slice(self) -> bool:
        """Take up the slice a first run saved; False when there is none to take."""
        found = load_slice(self.stem)
        if found is not None:
            self._hold(found)
        return found is not None

    def bucket(self, shards: Iterable[CorpusShard]) -> tuple[dict[int, str], ...] | dict[int, str]:
        """The distinct passages of ``shards`` (this worker's share of the corpus's), one map per owner (Ray keeps
        each of several returned values apart; with one worker, the one map is the value)."""
        with self._timed("corpus"):
            buckets = bucket_texts(corpus_texts(shards), self.world)
        return tuple(buckets) if self.world > 1 else buckets[0]

    def build(self, *buckets: dict[int, str]) -> None:
        """Embed the texts that the readers' ``buckets`` hold for this worker, hold and save them."""
        with self._timed("corpus"):
            texts = merge_buckets(buckets)
            ids = sorted(texts)
            ordered = [texts[i] for i in ids]
            del texts  # the map's ~100 bytes a text; ``ordered`` holds the texts
            embeddings = self.embed(ordered, self.encoding.passage_prefix)
            built = Slice(torch.tensor(ids, dtype=torch.long), embeddings, ordered)
            save_slice(self.stem, built)
            self._hold(built)

    def _hold(self, part: Slice) -> None:
        self.slice = Slice(part.ids, part.embeddings.to(self.encoding.device), part.texts)

    # -- queries ------------------------------------------------------------------------------

    def embed_queries(self, queries: list[str]) -> torch.Tensor:
        """This worker's share of a query batch, embedded (on CPU, to be sent to every worker)."""
        with self._timed("queries"):
            vectors = self.embed(queries, self.encoding.query_prefix)
        self.queries["embedded"] += len(queries)
        return vectors

    @torch.no_grad()
    def search(self, depth: int, positives: list[int], *queries: torch.Tensor) -> Found:
        """The slice's ``depth`` best candidates (fewer if it holds fewer) of each query of a batch, given as every
        worker's share of its vectors in order, and the scores of the pairs' ``positives`` (ids) that it holds."""
        with self._timed("search"):
            return self._search(depth, positives, torch.cat(queries).to(self.encoding.device))

    def _search(self, depth: int, positives: list[int], batch: torch.Tensor) -> Found:
        ids, vectors = self.slice.ids, self.slice.embeddings
        chunks = ((batch @ vectors[s:s + SCORE_CHUNK].T, ids[s:s + SCORE_CHUNK]) for s in range(0, len(ids), SCORE_CHUNK))
        scores, found = topk.scan(chunks, depth, len(batch), batch)
        scores, found = scores.cpu(), found.cpu()
        rows = torch.searchsorted(ids, found.flatten())
        texts = {i: self.slice.texts[r] for i, r in zip(found.flatten().tolist(), rows.tolist())}
        wanted = torch.tensor(positives, dtype=torch.long)
        at = torch.searchsorted(ids, wanted).clamp(max=max(len(ids) - 1, 0))
        held = (ids[at] == wanted) if len(ids) else torch.zeros(len(wanted), dtype=torch.bool)
        positive_scores = torch.full((len(wanted),), float("nan"))
        if held.any():
            on_device = held.to(batch.device)
            positive_scores[held] = (batch[on_device] * vectors[at[held].to(batch.device)]).sum(1).float().cpu()
        self.queries["searched"] += len(batch)
        return Found(scores, found, texts, positive_scores)

    # -- embedding ----------------------------------------------------------------------------

    def embed(self, texts: list[str], prefix: str) -> torch.Tensor:
        """Unit vectors [n, d] of ``prefix + text``, on CPU, batched by token count (the module docstring). What
        it holds besides them is bounded: the token lists of ``LENGTH_CHUNK`` texts, 4 bytes of length and 8 of
        order a text, one batch's prefixed texts and vectors; each batch's vectors are normalized and written into
        the rows made for them."""
        e = self.encoding
        vectors = torch.empty(len(texts), self.model.config.hidden_size)
        lengths = np.empty(len(texts), np.int32)
        for start in range(0, len(texts), LENGTH_CHUNK):
            # cut as embed cuts them (a long text is not read whole), so that a batch holds texts of one count
            chunk = [cut_for_tokens(prefix + text, e.max_length) for text in texts[start:start + LENGTH_CHUNK]]
            tokens = self.tokenizer(chunk, truncation=True, max_length=e.max_length)["input_ids"]
            lengths[start:start + len(chunk)] = [len(ids) for ids in tokens]
        order = np.argsort(lengths, kind="stable")  # by length, then as given
        groups = np.flatnonzero(np.diff(lengths[order])) + 1  # where a token count starts, after the first
        for group in np.split(order, groups):
            for start in range(0, len(group), e.batch_size):
                rows = torch.from_numpy(group[start:start + e.batch_size])
                batch = embed(self.model, self.tokenizer, [prefix + texts[i] for i in rows.tolist()], e.pooling,
                              e.batch_size, e.max_length)
                vectors[rows] = F.normalize(batch, dim=-1)
        return vectors

    # -- what it did --------------------------------------------------------------------------

    def report(self) -> dict:
        """Its slice (rows, bytes of embeddings and texts), its work (queries, seconds) and its peak memory."""
        return {"rank": self.rank, "rows": len(self.slice.texts),
                "embedding_bytes": self.slice.embeddings.numel() * self.slice.embeddings.element_size(),
                "text_bytes": sum(len(t.encode()) for t in self.slice.texts),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
                **self.queries, "seconds": dict(self.seconds), "cpu_seconds": dict(self.cpu_seconds)}
