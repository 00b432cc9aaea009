"""Retrieval evaluation in the BEIR / MTEB folder layout: nDCG@10 (MTEB's main retrieval score), MRR@10 and
Recall@100, as BEIR and MTEB compute them.

A folder (BEIR's ``GenericDataLoader`` layout, which MTEB's retrieval tasks export too):
  corpus.jsonl    one JSON object a line: ``_id``, ``text``, optional ``title`` (other fields are ignored)
  queries.jsonl   ``_id``, ``text``
  qrels/test.tsv  the header ``query-id<TAB>corpus-id<TAB>score``, then one (query, document, 32-bit integer grade) a
                  line; ``qrels/dev.tsv`` (``train.tsv``, ...) for the other splits
The queries evaluated are the ones the split's qrels name, in queries.jsonl order (BEIR and MTEB keep only those).

Ranking: a query's score for a document is the cosine of their pooled embeddings. A document is embedded as
``passage_prefix + (title + " " + text).strip()`` (``text.strip()`` without a title), the text BEIR's and MTEB's
sentence-transformers wrappers join; a query as ``query_prefix + text``. Documents rank by score, equal scores
by document id, the greater first (byte order): trec_eval's order, so pytrec_eval given the same scores ranks
the same way. A NaN score ranks last. The corpus is embedded in chunks, and only each query's best ``TOP_K``
documents are kept between chunks: no query x corpus matrix is ever held, nor the corpus text (``Corpus``: its
ids, the text read again from the file a chunk at a time, each document cut to what ``max_length`` tokens read).

Metrics, x 100, mean over the evaluated queries. A document's grade is its qrels score (0 where the qrels do not
name it); relevant means grade >= 1 (trec_eval's relevance level 1):
  ndcg@10     pytrec_eval's ndcg_cut_10: sum over the top 10 of gain / log2(rank + 1), gain = grade (a negative
              grade: 0), divided by the same sum over the query's qrels grades in descending order (0 where
              there is no relevant document)
  mrr@10      MTEB's MRR@10: 1 / rank of the first relevant document when it is in the top 10, else 0 (pytrec_eval's
              recip_rank cut at 10; MTEB's own code breaks ties by its results' insertion order instead)
  recall@100  pytrec_eval's recall_100: the relevant documents in the top 100 / those in the qrels (0 if none)
A query whose qrels name only documents graded <= 0 scores 0 on each, as pytrec_eval scores it in BEIR and MTEB.
``ignore_identical_ids`` leaves out of each query's ranking the document whose id is the query's own, as BEIR does
by default (``EvaluateRetrieval.evaluate``) and MTEB does for the tasks that ask for it (ArguAna, Quora, ...); off
by default, as in MTEB: in other folders a query and a document sharing an id is a coincidence.

    data = load_beir(resolve_beir("xquad-en"), split="dev")
    evaluate_beir(encoder, tokenizer, data, "mean")  # {"ndcg@10", "mrr@10", "recall@100", "n"}
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from clsys.data.labeled import jsonl_records
from clsys.eval.retrieval import embed_by_length
from clsys.model.encoder import cut_for_tokens
from clsys.shards.names import clip

# Bundled BEIR folders (xquad-en, xquad-de), built by build.py there; origin and licence in LICENSE.md there.
BEIR_ASSETS = Path(__file__).parents[1] / "assets" / "beir"

TOP_K = 100  # the deepest cut of the metrics (recall@100): how much of each query's ranking is kept
NDCG_CUTOFF = MRR_CUTOFF = 10
CORPUS_CHUNK = 8192  # documents read and embedded at a time
SCORE_BLOCK = 1 << 22  # query x document scores held at a time (with their sort keys: 48 MiB)
QRELS_HEADER = ["query-id", "corpus-id", "score"]
GRADE = re.compile(r"[+-]?[0-9]+")  # a qrels score: ASCII digits alone
LAYOUT = "a BEIR folder holds corpus.jsonl, queries.jsonl and qrels/<split>.tsv"


class CorpusChanged(ValueError):
    """A corpus.jsonl that no longer holds the documents it held when it was loaded."""


@dataclass
class Corpus:
    """A corpus.jsonl's documents without their text (a corpus of 8.8M passages holds ~5 GB of it): iterating
    reads the file again and gives each document's text, title and text joined as BEIR and MTEB join them."""
    path: Path
    ids: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[str]:
        """The texts in file order; a file whose documents are no longer the ones loaded is a CorpusChanged."""
        count = 0
        for count, (number, doc_id, text) in enumerate(_records(self.path, with_title=True), 1):
            if count > len(self.ids) or doc_id != self.ids[count - 1]:
                expected = f"'{self.ids[count - 1]}'" if count <= len(self.ids) else "none"
                raise CorpusChanged(f"{self.path}:{number}: changed since it was read: document '{doc_id}' where "
                                    f"{expected} was")
            yield text
        if count != len(self.ids):
            raise CorpusChanged(f"{self.path}: changed since it was read: {count} documents, not {len(self.ids)}")


@dataclass
class BeirSet:
    """The corpus and the evaluated queries of one qrels split; ``qrels[i]``: query i's graded documents,
    as document index -> grade."""
    name: str
    doc_ids: list[str]
    documents: Corpus | list[str]  # title and text joined as BEIR and MTEB join them
    query_ids: list[str]
    queries: list[str]
    qrels: list[dict[int, int]]
    note: str = ""  # what was left out or counts as 0, for the console


def bundled_beir() -> list[str]:
    return sorted(p.parent.name for p in BEIR_ASSETS.glob("*/corpus.jsonl"))


def resolve_beir(name_or_path: str) -> Path:
    """A folder path as is, or a bundled set name (``xquad-en``) -> its folder."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path in bundled_beir():
        return BEIR_ASSETS / name_or_path
    raise FileNotFoundError(f"retrieval set '{name_or_path}' is neither a folder nor a bundled set "
                            f"({', '.join(bundled_beir())}); {LAYOUT}")


def _decoded(path: Path) -> Iterator[str]:
    """Every line of a UTF-8 file without its end, blank ones too (so that lines count as an editor does); split on
    "\\n" only."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file ({LAYOUT})")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{number}: not UTF-8 ({e.reason} at byte {e.start})") from None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line without its end) of a UTF-8 file, blank lines left out."""
    return ((number, line) for number, line in enumerate(_decoded(path), 1) if line.strip())


def _records(path: Path, with_title: bool) -> Iterator[tuple[int, str, str]]:
    """(line number, id, text) of each record of a corpus.jsonl (``with_title``: title and text joined) or
    queries.jsonl."""
    for number, record in jsonl_records(path, _decoded(path)):
        doc_id, text, title = record.get("_id"), record.get("text"), record.get("title") or ""
        if isinstance(doc_id, int) and not isinstance(doc_id, bool):  # MTEB reads numeric ids as strings
            doc_id = str(doc_id)
        if not isinstance(doc_id, str) or not doc_id:
            raise ValueError(f"{path}:{number}: _id: expected a non-empty string, got {doc_id!r}")
        if not isinstance(text, str):
            raise ValueError(f"{path}:{number}: text: expected a string, got {text!r}")
        if with_title and not isinstance(title, str):
            raise ValueError(f"{path}:{number}: title: expected a string, got {title!r}")
        yield number, doc_id, (f"{title} {text}" if with_title and title else text).strip()


def _read_jsonl(path: Path, with_title: bool, keep_texts: bool = True) -> tuple[list[str], list[str]]:
    """(ids, texts) of a corpus.jsonl (``with_title``: title and text joined) or queries.jsonl, every record
    checked; ``keep_texts`` False: no texts (a ``Corpus`` reads them again)."""
    ids, texts, first_line = [], [], {}
    for number, doc_id, text in _records(path, with_title):
        if doc_id in first_line:
            raise ValueError(f"{path}:{number}: _id '{doc_id}' is given twice (first on line {first_line[doc_id]})")
        first_line[doc_id] = number
        ids.append(doc_id)
        if keep_texts:
            texts.append(text)
    if not ids:
        raise ValueError(f"{path}: holds no records")
    return ids, texts


def _read_qrels(path: Path, query_index: dict[str, int], doc_index: dict[str, int],
                queries_path: Path, corpus_path: Path) -> dict[int, dict[int, int]]:
    """query index -> {document index: grade}; every id must be in the queries and the corpus."""
    if not path.is_file():
        found = sorted(p.stem for p in path.parent.glob("*.tsv"))
        raise FileNotFoundError(f"{path}: no such file (qrels splits in {path.parent}: {', '.join(found) or 'none'})")
    qrels: dict[int, dict[int, int]] = {}
    first_line: dict[tuple[int, int], int] = {}
    lines = _lines(path)
    number, header = next(lines, (1, ""))
    # BEIR's loader skips the first line whatever it holds: a file without the header would lose a judgement.
    if [field.strip() for field in header.split("\t")] != QRELS_HEADER:
        raise ValueError(f"{path}:{number}: expected the header '{chr(9).join(QRELS_HEADER)}' (tab-separated), "
                         f"got {header!r}")
    for number, line in lines:
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(f"{path}:{number}: expected 3 tab-separated fields (query-id, corpus-id, score), "
                             f"got {len(fields)}")
        query_id, doc_id, score = fields
        grade = _grade(score, f"{path}:{number}")
        if query_id not in query_index:
            raise ValueError(f"{path}:{number}: query-id '{query_id}' is not in {queries_path}")
        if doc_id not in doc_index:
            raise ValueError(f"{path}:{number}: corpus-id '{doc_id}' is not in {corpus_path}")
        q, d = query_index[query_id], doc_index[doc_id]
        if (q, d) in first_line:
            raise ValueError(f"{path}:{number}: query '{query_id}' and document '{doc_id}' are graded twice "
                             f"(first on line {first_line[q, d]})")
        first_line[q, d] = number
        qrels.setdefault(q, {})[d] = grade
    if not qrels:
        raise ValueError(f"{path}: holds no judgements")
    return qrels


def _grade(score: str, where: str) -> int:
    """A qrels score as a grade: ASCII digits with an optional sign (``int`` would also take ``1_0`` and other
    scripts' digits), within 32 bits, as trec_eval's grades are (a larger one passed here and ended the run in
    an OverflowError once the whole corpus had been embedded)."""
    text = score.strip(" ")
    if not GRADE.fullmatch(text):
        raise ValueError(f"{where}: score: expected an integer grade, got {clip(score)!r}")
    # Digits counted first: int() refuses more than 4,300 of them with a message of its own.
    if len(text.lstrip("+-").lstrip("0")) > 10 or not -2**31 <= int(text) < 2**31:
        raise ValueError(f"{where}: score: {clip(text)} is outside 32 bits (-2147483648 to 2147483647)")
    return int(text)


def load_beir(folder: str | Path, split: str = "test") -> BeirSet:
    """The corpus, and the queries that ``qrels/<split>.tsv`` grades, of a BEIR folder; a malformed line or an
    id the qrels name but the corpus or queries lack is a ValueError naming file and line."""
    folder = Path(folder)
    corpus_path, queries_path = folder / "corpus.jsonl", folder / "queries.jsonl"
    doc_ids, _ = _read_jsonl(corpus_path, with_title=True, keep_texts=False)
    all_query_ids, all_queries = _read_jsonl(queries_path, with_title=False)
    qrels = _read_qrels(folder / "qrels" / f"{split}.tsv", {q: i for i, q in enumerate(all_query_ids)},
                        {d: i for i, d in enumerate(doc_ids)}, queries_path, corpus_path)
    graded = sorted(qrels)
    without_relevant = sum(1 for q in graded if max(qrels[q].values()) < 1)
    notes = [f"{len(graded)} of {len(all_query_ids)} queries graded in qrels/{split}.tsv"] \
        if len(graded) < len(all_query_ids) else []
    if without_relevant:
        notes.append(f"{without_relevant} of them with no relevant document (grade >= 1): they score 0, as in "
                     "BEIR and MTEB")
    return BeirSet(folder.name, doc_ids, Corpus(corpus_path, doc_ids), [all_query_ids[q] for q in graded],
                   [all_queries[q] for q in graded], [qrels[q] for q in graded], "; ".join(notes))


# -----------------------------------------------------------------------------
# Ranking

EXCLUDED = torch.iinfo(torch.long).min  # the sort key of a document left out of a ranking: below every real key


def sort_keys(scores: torch.Tensor, tie_rank: torch.Tensor) -> torch.Tensor:
    """int64 keys that order (query, document) pairs as trec_eval ranks them, the greater first: the float32
    score's bits made order-preserving in the high 32 bits (NaN as -inf, -0.0 as 0.0), the document's place
    among the ids in ascending order (``tie_rank``, < 2**32) in the low 32. Distinct per query, so a
    ``topk`` of them has one answer."""
    scores = scores.float().nan_to_num(nan=-math.inf) + 0.0  # -0.0 + 0.0 is 0.0: the two tie, as in trec_eval
    bits = scores.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()  # negative floats: greater bits are smaller
    return ordered * (1 << 32) + tie_rank


def key_scores(keys: torch.Tensor) -> torch.Tensor:
    """The float32 scores ``sort_keys`` encoded (NaN back as -inf)."""
    ordered = torch.div(keys, 1 << 32, rounding_mode="floor").int()
    return torch.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).view(torch.float32)


@dataclass
class Ranking:
    """Each query's best documents in rank order: ``docs`` [queries, k] document indices (-1 where a
    document was left out: only at the end), ``scores`` their scores."""
    docs: torch.Tensor
    scores: torch.Tensor


def rank_chunks(queries: torch.Tensor, chunks: Iterable[tuple[torch.Tensor, torch.Tensor]], doc_ids: list[str],
                k: int = TOP_K, exclude: torch.Tensor | None = None, score_block: int = SCORE_BLOCK) -> Ranking:
    """The ``k`` best documents of each query by ``queries @ chunk.T`` (unit vectors: the cosine), over
    ``chunks`` of (document indices, their embeddings); each chunk's scores are held ``score_block`` at a time
    and merged into the best so far, on ``queries``' device. ``exclude`` [queries]: a document index (or -1)
    to leave out of each query's ranking."""
    n_queries, device = len(queries), queries.device
    by_id = sorted(range(len(doc_ids)), key=doc_ids.__getitem__)
    tie_rank = torch.empty(len(doc_ids), dtype=torch.long)
    tie_rank[by_id] = torch.arange(len(doc_ids))
    tie_rank = tie_rank.to(device)
    exclude = None if exclude is None else exclude.to(device)
    best = torch.empty(n_queries, 0, dtype=torch.long, device=device)
    for docs, embeddings in chunks:
        docs, embeddings = docs.to(device), embeddings.to(device, queries.dtype)
        rows = max(1, score_block // max(1, len(docs)))
        merged = []
        for start in range(0, n_queries, rows):
            block = slice(start, start + rows)
            keys = sort_keys(queries[block] @ embeddings.T, tie_rank[docs])
            if exclude is not None:
                keys[docs[None, :] == exclude[block, None]] = EXCLUDED
            keys = torch.cat([best[block], keys], dim=1)
            merged.append(keys.topk(min(k, keys.shape[1]), dim=1).values)  # sorted, the greatest first
        best = torch.cat(merged)
    best = best.cpu()
    by_id_tensor = torch.tensor(by_id, dtype=torch.long)
    docs = by_id_tensor[best & 0xFFFFFFFF]
    left_out = best == EXCLUDED
    return Ranking(docs.masked_fill(left_out, -1), key_scores(best).masked_fill(left_out, -math.inf))


# -----------------------------------------------------------------------------
# Metrics

def ranking_metrics(docs: torch.Tensor, qrels: list[dict[int, int]]) -> dict[str, float]:
    """nDCG@10, MRR@10 and Recall@100 x 100 (see the module docstring) of rankings ``docs`` [queries, k]
    (document indices in rank order, -1 for none) against each query's graded documents ``qrels``."""
    n_queries, width = docs.shape
    # Each ranked (query, document)'s grade, looked up among the judged pairs numbered query * n + document.
    n = max([int(docs.max()) + 1 if docs.numel() else 0] + [d + 1 for graded in qrels for d in graded])
    judged = sorted((q * n + d, grade) for q, graded in enumerate(qrels) for d, grade in graded.items())
    pairs = torch.tensor([pair for pair, _ in judged], dtype=torch.long)
    ranked = torch.arange(n_queries)[:, None] * n + docs
    at = torch.searchsorted(pairs, ranked).clamp(max=len(pairs) - 1)
    found = (pairs[at] == ranked) & (docs >= 0)
    grades = torch.where(found, torch.tensor([g for _, g in judged], dtype=torch.float64)[at], 0.0)
    relevant = grades >= 1
    discount = 1 / torch.log2(torch.arange(2, NDCG_CUTOFF + 2, dtype=torch.float64))[:width]
    dcg = (grades[:, :NDCG_CUTOFF].clamp(min=0) * discount).sum(1)
    ideal = torch.tensor([sum(g / math.log2(i + 2) for i, g in enumerate(sorted(
        (g for g in graded.values() if g > 0), reverse=True)[:NDCG_CUTOFF])) for graded in qrels],
        dtype=torch.float64)
    ndcg = torch.where(ideal > 0, dcg / ideal.clamp(min=1e-300), 0.0)
    top = relevant[:, :MRR_CUTOFF]
    first = top.double().argmax(1)  # the first relevant rank (0 where there is none: masked below)
    mrr = torch.where(top.any(1), 1 / (first + 1).double(), 0.0)
    n_relevant = torch.tensor([sum(g >= 1 for g in graded.values()) for graded in qrels], dtype=torch.float64)
    recall = torch.where(n_relevant > 0, relevant[:, :TOP_K].sum(1) / n_relevant.clamp(min=1), 0.0)
    return {f"ndcg@{NDCG_CUTOFF}": 100 * ndcg.mean().item(), f"mrr@{MRR_CUTOFF}": 100 * mrr.mean().item(),
            f"recall@{TOP_K}": 100 * recall.mean().item(), "n": n_queries}


# -----------------------------------------------------------------------------
# Evaluation

def rank_corpus(model: nn.Module, tokenizer, data: BeirSet, pooling: str, batch_size: int = 64,
                max_length: int = 512, query_prefix: str = "", passage_prefix: str = "",
                ignore_identical_ids: bool = False, chunk: int = CORPUS_CHUNK) -> Ranking:
    """Each query's ``TOP_K`` best documents of ``data``, the corpus read and embedded ``chunk`` documents at a
    time in file order (each chunk longest first, so that each batch pads to a similar length), scored on the
    model's device. A document is held cut (``cut_for_tokens``) to what ``max_length`` tokens read."""
    queries = F.normalize(embed_by_length(model, tokenizer, [query_prefix + q for q in data.queries], pooling,
                                          batch_size, max_length), dim=-1).to(next(model.parameters()).device)

    def chunks() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        documents, start = iter(data.documents), 0
        while texts := [cut_for_tokens(passage_prefix + text, max_length) for text in islice(documents, chunk)]:
            embeddings = embed_by_length(model, tokenizer, texts, pooling, batch_size, max_length)
            yield torch.arange(start, start + len(texts)), F.normalize(embeddings, dim=-1)
            start += len(texts)

    exclude = None
    if ignore_identical_ids:
        doc_index = {d: i for i, d in enumerate(data.doc_ids)}
        exclude = torch.tensor([doc_index.get(q, -1) for q in data.query_ids], dtype=torch.long)
    return rank_chunks(queries, chunks(), data.doc_ids, exclude=exclude)


def evaluate_beir(model: nn.Module, tokenizer, data: BeirSet, pooling: str, batch_size: int = 64,
                  max_length: int = 512, query_prefix: str = "", passage_prefix: str = "",
                  ignore_identical_ids: bool = False) -> dict[str, float]:
    """nDCG@10, MRR@10 and Recall@100 x 100 of ``data``'s queries over its corpus, and ``n``, the queries."""
    ranking = rank_corpus(model, tokenizer, data, pooling, batch_size, max_length, query_prefix, passage_prefix,
                          ignore_identical_ids)
    return ranking_metrics(ranking.docs, data.qrels)
