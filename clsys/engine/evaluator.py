"""Periodic evaluation during training (``eval.*``): STS dev, XQuAD / Tatoeba retrieval, retrieval over a BEIR
folder (``eval.retrieval_dev``), the token-similarity heatmap, logged to TensorBoard and the console at step 0,
every ``eval.every`` steps and the last step.

Collective: every rank runs the same forwards (under ZeRO-3 each forward gathers the partitioned weights
collectively, so all ranks must run them in step; under ZeRO 0-2 the other ranks would only wait for rank 0
anyway); rank 0 logs.
"""
from __future__ import annotations

import dataclasses
import logging

from clsys.analysis.heatmap import Panel, render, token_similarity
from clsys.config import Config
from clsys.engine.selection import selected_metric
from clsys.metrics.health import TensorBoard
from clsys.objectives import Objective

log = logging.getLogger(__name__)


def dev_set(cfg: Config):
    """``eval.sts_dev`` (its dev split: SICK.txt's trial rows), cut to ``eval.max_pairs``; None when unset."""
    from clsys.eval.sts_data import load_sts, resolve_sts

    if not cfg.eval.sts_dev:
        return None
    dev = load_sts(resolve_sts(cfg.eval.sts_dev), split="dev")
    if cfg.eval.max_pairs:
        n = cfg.eval.max_pairs
        dev = dataclasses.replace(dev, sent1=dev.sent1[:n], sent2=dev.sent2[:n], scores=dev.scores[:n])
    return dev


def retrieval_dev_set(cfg: Config):
    """``eval.retrieval_dev``'s corpus and the queries of its ``eval.retrieval_split``; None when unset."""
    from clsys.eval.beir import load_beir, resolve_beir

    if not cfg.eval.retrieval_dev:
        return None
    return load_beir(resolve_beir(cfg.eval.retrieval_dev), cfg.eval.retrieval_split)


class Evaluator:
    """What ``eval.*`` asks for, loaded once; ``metric``: the score that selects the best checkpoint, or None."""

    def __init__(self, objective: Objective, cfg: Config, rank: int, tb: TensorBoard):
        self.objective, self.cfg, self.rank, self.tb = objective, cfg, rank, tb
        self.dev_set = dev_set(cfg)
        if self.dev_set is not None and self.dev_set.note and rank == 0:
            log.info(f"[clsys] eval.sts_dev {cfg.eval.sts_dev}: {self.dev_set.note}")
        self.retrieval_set = retrieval_dev_set(cfg)
        if self.retrieval_set is not None and self.retrieval_set.note and rank == 0:
            log.info(f"[clsys] eval.retrieval_dev {cfg.eval.retrieval_dev}: {self.retrieval_set.note}")
        self.metric = selected_metric(cfg, self.dev_set.name if self.dev_set is not None else None,
                                      self.retrieval_set.name if self.retrieval_set is not None else None)
        self.wanted = self.dev_set is not None or self.retrieval_set is not None or bool(
            cfg.eval.heatmap_text or cfg.eval.xling or cfg.eval.tatoeba)

    def due(self, step: int) -> bool:
        return self.wanted and (step % self.cfg.eval.every == 0 or step == self.cfg.train.steps)

    def __call__(self, step: int) -> dict[str, float]:
        """Collective: every score, as logged at ``step``."""
        cfg, objective = self.cfg, self.objective
        scores = self.retrieval()
        if self.dev_set is not None:
            from clsys.eval.sts import evaluate_sts

            scores[f"{self.dev_set.name}_spearman"] = evaluate_sts(
                objective.encoder(), objective.tokenizer, self.dev_set, pooling=cfg.eval.pooling,
                batch_size=cfg.eval.batch_size)["spearman"]
        if scores:
            self.tb.scalars("eval", scores, step)
            if self.rank == 0:
                shown = ", ".join(f"{k} {v:.2f}" for k, v in scores.items())
                log.info(f"[clsys] step {step}: {shown}")
        if cfg.eval.heatmap_text:
            tokens, similarity = token_similarity(objective.encoder(), objective.tokenizer, cfg.eval.heatmap_text)
            if self.rank == 0:
                self.tb.image("analysis/token_similarity", render([Panel(f"step {step}", tokens, similarity)]), step)
        return scores

    def retrieval(self) -> dict[str, float]:
        """XQuAD question→paragraph retrieval (bi-encoder, and re-ranked by the objective's scorer when it
        has one), Tatoeba bitext accuracy and the retrieval dev set's scores, as flat TensorBoard tags."""
        from clsys.eval.beir import evaluate_beir
        from clsys.eval.retrieval import evaluate_tatoeba, evaluate_xquad, parse_articles
        from clsys.model.folder import source_max_seq_length

        objective, e = self.objective, self.cfg.eval
        encoder, tokenizer = objective.encoder(), objective.tokenizer
        reranker = objective.reranker() if e.rerank_top else None
        scores = {}
        for direction in e.xling:
            query_lang, _, doc_lang = direction.partition("-")
            result = evaluate_xquad(encoder, tokenizer, query_lang, doc_lang, e.pooling,
                                    parse_articles(e.xling_articles), reranker, e.rerank_top, e.batch_size,
                                    self.cfg.data.max_length)
            scores.update({f"xquad_{direction}_{k}": v for k, v in result.items() if k != "n"})
        for pair in e.tatoeba:
            scores.update({f"tatoeba_{pair}_{k}": v for k, v in evaluate_tatoeba(encoder, tokenizer, pair, e.pooling,
                                                                                   e.batch_size).items() if k != "n"})
        if self.retrieval_set is not None:
            # Documents are read as far as the export will declare (its sentence_bert_config.json max_seq_length),
            # with the query and passage prompts it will declare: the last step's figures are the CLI's on the export.
            prompts = objective.export_spec().prompts
            result = evaluate_beir(encoder, tokenizer, self.retrieval_set, e.pooling, e.batch_size,
                                   source_max_seq_length(self.cfg.model.name, encoder.config),
                                   prompts.get("query", ""), prompts.get("passage", ""))
            scores.update({f"{self.retrieval_set.name}_{k}": v for k, v in result.items() if k != "n"})
        return scores
