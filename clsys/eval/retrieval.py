"""Cross-lingual retrieval evaluation of a text encoder: XQuAD question -> paragraph, and Tatoeba bitext.

XQuAD: 48 Wikipedia articles, 240 paragraphs and 1190 questions, professionally translated, so the
same in every language. A question in language A retrieves, among the paragraphs of the selected
articles in language B, the paragraph it was asked about. Articles 0-23 build training data elsewhere;
24-47 (``HELD_OUT_ARTICLES``, ``parse_articles("24:48")``) are the held-out evaluation set.

Tatoeba: 1000 sentences and their English translations; every sentence retrieves its translation among
the 1000 sentences of the other side, in both directions.

A query's score for a document is the cosine of their pooled embeddings (bi-encoder). A ``Reranker``
(cross-encoder) can re-score each query's bi-encoder top documents.

Metrics, x 100 as papers report them, from the gold document's rank: 1 + the number of documents with
a strictly higher score, so a tie counts in the gold's favour (and rank does not depend on how a sort
breaks ties). A NaN gold score (a diverged model) ranks last.
  mrr@10    mean over queries of 1/rank if rank <= 10, else 0
  recall@k  share of queries with rank <= k
  Tatoeba accuracy is recall@1: the nearest neighbour is the translation.

Library use (the trainer calls these on rank 0):
    evaluate_xquad(encoder, tokenizer, "en", "de", "mean", articles=HELD_OUT_ARTICLES)
        # {"mrr@10", "recall@1", "recall@10", "n"} (+ "rerank_..." with a reranker)
    evaluate_tatoeba(encoder, tokenizer, "deu-eng", "mean")  # {"xxx->eng", "eng->xxx", "n"}
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from clsys import storage
from clsys.model.encoder import embed, load_tokenizer
from clsys.model.loading import checked_model_path

# Unmodified XQuAD (en, de, es, ru, zh) and Tatoeba (LASER v1) files; origin and licences in LICENSE.md there.
XQUAD_ASSETS = Path(__file__).parents[1] / "assets" / "xquad"
TATOEBA_ASSETS = Path(__file__).parents[1] / "assets" / "tatoeba"

HELD_OUT_ARTICLES = slice(24, 48)
MRR_CUTOFF = 10

# Scores (query, document) pairs, given as two equally long lists: one score per pair, higher = more relevant.
Reranker = Callable[[list[str], list[str]], torch.Tensor]


# -----------------------------------------------------------------------------
# XQuAD

@dataclass
class XquadSet:
    """Questions and paragraphs of some articles; question i was asked about paragraph ``gold[i]``."""
    name: str
    paragraphs: list[str]
    article: list[int]  # each paragraph's article: its index in the whole file
    questions: list[str]
    question_ids: list[str]
    gold: list[int]


def bundled_xquad() -> list[str]:
    return sorted(p.name.split(".")[1] for p in XQUAD_ASSETS.glob("xquad.*.json"))


def parse_articles(spec: str) -> slice:
    """``"24:48"`` -> ``slice(24, 48)``, Python slice rules; either bound may be left out (``"24:"``)."""
    bounds = spec.split(":")
    try:
        if len(bounds) != 2:
            raise ValueError
        start, stop = (int(b) if b.strip() else None for b in bounds)
    except ValueError:
        raise ValueError(f"bad article range '{spec}' (expected START:STOP, e.g. 24:48)") from None
    return slice(start, stop)


def _bundled_xquad_path(lang: str) -> Path:
    path = XQUAD_ASSETS / f"xquad.{lang}.json"
    if not path.is_file():
        raise ValueError(f"no bundled XQuAD language '{lang}' (bundled: {', '.join(bundled_xquad())}; "
                         "others from a folder of xquad.<lang>.json files)")
    return path


def load_xquad(lang: str, articles: slice | None = None, path: str | Path | None = None) -> XquadSet:
    """The paragraphs and questions of ``articles`` (default: all) of a SQuAD-format JSON file: ``path``,
    else the bundled XQuAD file of ``lang``."""
    path = _bundled_xquad_path(lang) if path is None else Path(path).expanduser()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        squad = storage.loads_json(text)
    except ValueError as err:  # JSONDecodeError, nested too deeply
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    xs = XquadSet(f"xquad.{lang}", [], [], [], [], [])
    try:
        data = squad["data"]
        selected = range(len(data))[articles or slice(None)]
        if not selected:
            raise ValueError(f"{path}: the article range selects none of its {len(data)} articles")
        for a in selected:
            for paragraph in data[a]["paragraphs"]:
                for qa in paragraph["qas"]:
                    xs.questions.append(qa["question"])
                    xs.question_ids.append(qa["id"])
                    xs.gold.append(len(xs.paragraphs))
                xs.paragraphs.append(paragraph["context"])
                xs.article.append(a)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not SQuAD-format JSON ({type(e).__name__}: {e})") from None
    return xs


def xquad_pair(query_lang: str, doc_lang: str, articles: slice | None = None,
               directory: str | Path | None = None) -> XquadSet:
    """Questions in ``query_lang``, paragraphs in ``doc_lang``, from the bundled files or from
    ``directory``/xquad.<lang>.json. Fails unless both files hold the same questions (by id) under
    the same paragraphs, since only then does a question's gold index point into the other file."""
    def load(lang: str) -> XquadSet:
        return load_xquad(lang, articles, None if directory is None else Path(directory) / f"xquad.{lang}.json")

    q, d = load(query_lang), load(doc_lang)
    for i, (a, b) in enumerate(zip(zip(q.question_ids, q.gold), zip(d.question_ids, d.gold))):
        if a != b:
            raise ValueError(f"{q.name} and {d.name} are not parallel: question {i} is {a[0]} (paragraph {a[1]}) "
                             f"in one and {b[0]} (paragraph {b[1]}) in the other")
    if (len(q.questions), q.article) != (len(d.questions), d.article):
        raise ValueError(f"{q.name} and {d.name} are not parallel: {len(q.questions)} questions in "
                         f"{len(q.paragraphs)} paragraphs vs {len(d.questions)} in {len(d.paragraphs)}")
    return XquadSet(f"xquad-{query_lang}-{doc_lang}", d.paragraphs, d.article, q.questions, q.question_ids, q.gold)


# -----------------------------------------------------------------------------
# Tatoeba

@dataclass
class Bitext:
    """Line-aligned sentences: ``english[i]`` translates ``source[i]``."""
    name: str
    source: list[str]
    english: list[str]


def bundled_tatoeba() -> list[str]:
    return sorted({p.name.split(".")[1] for p in TATOEBA_ASSETS.glob("tatoeba.*-eng.*")})


def _read_lines(path: Path) -> list[str]:
    # Split on "\n" only: str.splitlines would also split inside a sentence at U+2028 and the like.
    return path.read_text(encoding="utf-8").removesuffix("\n").split("\n")


TATOEBA_PREFIX = "DIR/tatoeba.xxx-eng, the prefix of two files DIR/tatoeba.xxx-eng.xxx and DIR/tatoeba.xxx-eng.eng"


def tatoeba_files(prefix: Path) -> tuple[Path, Path] | None:
    """The (xxx, eng) files of a pair's path prefix ``DIR/tatoeba.xxx-eng``; None unless both are there."""
    lang, _, eng = prefix.name.removeprefix("tatoeba.").partition("-")
    source, english = Path(f"{prefix}.{lang}"), Path(f"{prefix}.eng")
    return (source, english) if lang and eng == "eng" and source.is_file() and english.is_file() else None


def load_tatoeba(pair: str) -> Bitext:
    """A bundled pair (``deu-eng``) or a path prefix ``DIR/tatoeba.xxx-eng`` of the files
    ``DIR/tatoeba.xxx-eng.xxx`` and ``DIR/tatoeba.xxx-eng.eng``."""
    prefix = TATOEBA_ASSETS / f"tatoeba.{pair}" if pair in bundled_tatoeba() else Path(pair).expanduser()
    files = tatoeba_files(prefix)
    if files is None:
        raise ValueError(f"Tatoeba pair '{pair}' is neither bundled ({', '.join(bundled_tatoeba())}) nor a path "
                         f"{TATOEBA_PREFIX}")
    source, english = files
    bitext = Bitext(f"tatoeba-{prefix.name.removeprefix('tatoeba.')}", _read_lines(source), _read_lines(english))
    if len(bitext.source) != len(bitext.english):
        raise ValueError(f"{source} has {len(bitext.source)} lines but {english} has {len(bitext.english)}")
    return bitext


# -----------------------------------------------------------------------------
# Scoring and metrics

def gold_ranks(scores: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """1-based rank of each query's gold document in ``scores`` [n_queries, n_docs]: 1 + the number of
    documents scored strictly higher. NaN scores never compare higher; a NaN gold ranks last."""
    gold_scores = scores.gather(1, gold[:, None])
    ranks = (scores > gold_scores).sum(1) + 1
    return torch.where(gold_scores[:, 0].isnan(), scores.shape[1], ranks)


def retrieval_metrics(scores: torch.Tensor, gold: torch.Tensor | list[int],
                      ks: tuple[int, ...] = (1, 10)) -> dict[str, float]:
    """MRR@10 and recall@k (x 100) of the gold document indices ``gold`` [n_queries] under ``scores``."""
    ranks = gold_ranks(scores, torch.as_tensor(gold, device=scores.device)).double()
    metrics = {f"mrr@{MRR_CUTOFF}": 100 * torch.where(ranks <= MRR_CUTOFF, 1 / ranks, 0.0).mean().item()}
    metrics.update({f"recall@{k}": 100 * (ranks <= k).double().mean().item() for k in ks})
    return metrics | {"n": len(ranks)}


def cosine_scores(queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """[n_queries, n_docs] cosine similarities of two embedding matrices."""
    return F.normalize(queries, dim=-1) @ F.normalize(docs, dim=-1).T


def embed_by_length(model: nn.Module, tokenizer, texts: list[str], pooling: str, batch_size: int,
                    max_length: int) -> torch.Tensor:
    """``embed``, longest text first so that each batch pads to a similar length; rows in input order."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]), reverse=True)
    sorted_emb = embed(model, tokenizer, [texts[i] for i in order], pooling, batch_size, max_length)
    emb = torch.empty_like(sorted_emb)
    emb[order] = sorted_emb
    return emb


def rerank(scores: torch.Tensor, queries: list[str], documents: list[str], reranker: Reranker,
           top: int = 20) -> torch.Tensor:
    """``scores`` [n_queries, n_docs] (float64) after ``reranker`` re-scored each query's ``top`` best documents.

    The re-scored documents rank first, in the reranker's order; the others keep their bi-encoder
    scores and so their order behind them. Done by shifting each query's reranker scores to start 1
    above its best bi-encoder score: a shift keeps their order and ties, which ``gold_ranks`` counts.
    """
    top = min(top, scores.shape[1])
    # topk would take NaN scores (a diverged encoder) as the best; they are the worst.
    best = scores.nan_to_num(nan=-torch.inf).topk(top, dim=1).indices
    new = reranker([q for q in queries for _ in range(top)], [documents[d] for d in best.flatten().tolist()])
    new = new.double().cpu().view(len(queries), top)
    merged = scores.double().clone()
    floor = merged.nan_to_num(nan=-torch.inf).amax(1, keepdim=True).nan_to_num(neginf=0.0)
    return merged.scatter(1, best, new - new.amin(1, keepdim=True) + floor + 1)


def hf_reranker(folder: str, max_length: int | None = None, batch_size: int = 32) -> Reranker:
    """A cross-encoder: the 2-label ``AutoModelForSequenceClassification`` and tokenizer in ``folder``.

    A pair is tokenized as ``tokenizer(query, document, truncation="longest_first")`` to at most
    ``max_length`` tokens (default: 512, or the model's position limit where that is less); its score is
    the raw logit of label 1 ("relevant"), which is what the original CLIR code ranks by.
    """
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(checked_model_path(folder),
                                                               trust_remote_code=False)
    if model.config.num_labels != 2:
        raise ValueError(f"{folder}: a reranker has 2 labels (irrelevant, relevant), not {model.config.num_labels}")
    tokenizer = load_tokenizer(folder)
    max_length = max_length or min(512, model.config.max_position_embeddings)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).eval()

    @torch.no_grad()
    def score(queries: list[str], documents: list[str]) -> torch.Tensor:
        if len(queries) != len(documents):
            raise ValueError(f"{len(queries)} queries but {len(documents)} documents")
        # Longest pairs first, so that each batch pads to a similar length.
        order = sorted(range(len(queries)), key=lambda i: len(queries[i]) + len(documents[i]), reverse=True)
        scores = torch.empty(len(queries))
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            batch = tokenizer([queries[i] for i in rows], [documents[i] for i in rows], padding=True,
                              truncation="longest_first", max_length=max_length, return_tensors="pt").to(device)
            scores[rows] = model(**batch).logits[:, 1].float().cpu()
        return scores

    return score


# -----------------------------------------------------------------------------
# Evaluations

def evaluate_retrieval(model: nn.Module, tokenizer, data: XquadSet, pooling: str, batch_size: int = 64,
                       max_length: int = 512, reranker: Reranker | None = None,
                       rerank_top: int = 20) -> dict[str, float]:
    """Question -> paragraph retrieval metrics of the bi-encoder and, with ``reranker``, the same
    metrics ("rerank_" prefixed) after re-ranking each question's ``rerank_top`` best paragraphs."""
    scores = cosine_scores(embed_by_length(model, tokenizer, data.questions, pooling, batch_size, max_length),
                           embed_by_length(model, tokenizer, data.paragraphs, pooling, batch_size, max_length))
    metrics = retrieval_metrics(scores, data.gold)
    if reranker is not None:
        reranked = retrieval_metrics(rerank(scores, data.questions, data.paragraphs, reranker, rerank_top), data.gold)
        metrics |= {f"rerank_{k}": v for k, v in reranked.items() if k != "n"}
    return metrics


def evaluate_xquad(encoder: nn.Module, tokenizer, query_lang: str, doc_lang: str, pooling: str,
                   articles: slice | None = None, reranker: Reranker | None = None, rerank_top: int = 20,
                   batch_size: int = 64, max_length: int = 512) -> dict[str, float]:
    """XQuAD retrieval of ``doc_lang`` paragraphs for ``query_lang`` questions over ``articles`` (default all)."""
    data = xquad_pair(query_lang, doc_lang, articles)
    return evaluate_retrieval(encoder, tokenizer, data, pooling, batch_size, max_length, reranker, rerank_top)


def evaluate_bitext(model: nn.Module, tokenizer, bitext: Bitext, pooling: str, batch_size: int = 64,
                    max_length: int = 128) -> dict[str, float]:
    """Bitext retrieval accuracy x 100 in both directions: the share of sentences whose nearest
    neighbour (cosine) among all sentences of the other side is their own translation."""
    scores = cosine_scores(embed_by_length(model, tokenizer, bitext.source, pooling, batch_size, max_length),
                           embed_by_length(model, tokenizer, bitext.english, pooling, batch_size, max_length))
    gold = torch.arange(len(bitext.source))
    return {"xxx->eng": retrieval_metrics(scores, gold, ks=(1,))["recall@1"],
            "eng->xxx": retrieval_metrics(scores.T, gold, ks=(1,))["recall@1"],
            "n": len(gold)}


def evaluate_tatoeba(encoder: nn.Module, tokenizer, pair: str, pooling: str, batch_size: int = 64,
                     max_length: int = 128) -> dict[str, float]:
    """Tatoeba accuracy of a bundled pair (``deu-eng``) or a path prefix (see ``load_tatoeba``)."""
    return evaluate_bitext(encoder, tokenizer, load_tatoeba(pair), pooling, batch_size, max_length)
