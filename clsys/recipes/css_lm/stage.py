"""Stages A and C of CSS-LM as the step loop's ``Stage`` (``clsys.engine.loop``): what differs from the step loop.

- the objective: ``CSSLM``, from the previous stage's best weights, with this rank's bank shard attached (stage C);
- the batches (``FewShotBatches``): the few-shot set, a fresh permutation each epoch, plus stage A's corpus
  sentences streamed from the corpus shards;
- the evaluation (``TaskAccuracy``): dev and test accuracy after every epoch; dev accuracy selects the stage's
  best checkpoint, as ``eval.select`` does in the step loop;
- after a step: stage C re-encodes the bank every ``objective.bank_refresh_every`` steps.

Everything else (the engine, the step, logging, TensorBoard, checkpoints, resume, stop requests) is the Trainer's.
"""
from __future__ import annotations

import logging
import math
import random
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from clsys.config import Config
from clsys.data.labeled import LabeledSet
from clsys.data.streaming import ShardLoader
from clsys.engine.loop import Stage
from clsys.metrics.health import TensorBoard
from clsys.recipes.css_lm.bank import RetrievalBank
from clsys.recipes.css_lm.objective import CSSLM

log = logging.getLogger(__name__)

LABELS = {"warmup": "stage A", "css": "stage C"}


def epoch_rows(examples: int, batch_size: int, seed: int, epoch: int) -> list[int]:
    """The epoch's order of the few-shot set: a permutation from (seed, epoch), cycled to whole global batches."""
    order = list(range(examples))
    random.Random(f"css_lm/{seed}/{epoch}").shuffle(order)
    steps = math.ceil(examples / batch_size)
    return [order[i % examples] for i in range(steps * batch_size)]


class FewShotBatches:
    """This rank's micro-batches of the few-shot set, endless: each epoch is ``epoch_rows``, and rank r takes rows
    (a·world + r)·micro … of each global batch's accumulation step a. Stage A of ``method: css_lm`` adds
    ``objective.domain_negatives`` corpus sentences a row from ``corpus`` (a ``ShardLoader``). The position is the
    number of micro-batches handed out, and the corpus loader's own."""

    def __init__(self, train: LabeledSet, collate: Callable, cfg: Config, rank: int, world: int,
                 corpus: ShardLoader | None):
        self.train, self.collate, self.corpus = train, collate, corpus
        self.rank, self.world = rank, world
        self.batch_size, self.micro, self.accum = cfg.train.batch_size, cfg.micro_batch, cfg.train.grad_accum
        self.seed = cfg.train.seed
        self.per_epoch = math.ceil(len(train) / self.batch_size) * self.accum  # this rank's micro-batches an epoch
        self.handed_out = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        corpus = iter(self.corpus) if self.corpus is not None else None
        rows, rows_epoch = [], None
        try:
            while True:
                epoch, index = divmod(self.handed_out, self.per_epoch)
                if epoch != rows_epoch:
                    rows, rows_epoch = epoch_rows(len(self.train), self.batch_size, self.seed, epoch), epoch
                step, a = divmod(index, self.accum)
                first = step * self.batch_size + (a * self.world + self.rank) * self.micro
                mine = rows[first:first + self.micro]
                negatives = next(corpus) if corpus is not None else None
                batch = self.collate([self.train.texts[i] for i in mine], [self.train.labels[i] for i in mine],
                                     negatives)
                if negatives is not None and negatives.get("data_skipped"):
                    batch["data_skipped"] = negatives["data_skipped"]
                self.handed_out += 1
                yield {**batch, "keys": [f"{self.train.source}#{i}" for i in mine]}
        finally:  # the corpus loader's worker processes stop with the stage
            if corpus is not None:
                corpus.close()

    def state_dict(self) -> dict:
        return {"handed_out": self.handed_out, **({"corpus": self.corpus.state_dict()} if self.corpus else {})}

    def load_state_dict(self, state: dict) -> None:
        self.handed_out = state["handed_out"]
        if self.corpus is not None:
            self.corpus.load_state_dict(state["corpus"])


@torch.no_grad()
def accuracy(objective: CSSLM, data: LabeledSet, batch_size: int) -> float:
    """Collective: accuracy of the task head on ``data``, each rank classifying every world-th example."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next(objective.parameters()).device
    rows = list(range(rank, len(data), world))
    correct = torch.zeros(1, dtype=torch.float64)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        batch = objective.collate_corpus([data.texts[i] for i in chunk])
        logits = objective.classify(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        correct += (logits.argmax(-1).cpu() == torch.tensor([data.labels[i] for i in chunk])).sum()
    dist.all_reduce(correct)
    return float(correct) / len(data)


class TaskAccuracy:
    """A stage's evaluation: dev and test accuracy at step 0 and after every epoch, to TensorBoard's ``eval/`` and
    the console. ``dev_accuracy`` selects the best checkpoint. Its record of the epochs is a checkpoint part, so a
    resumed stage reports every epoch."""

    metric = "dev_accuracy"
    wanted = True

    def __init__(self, objective: CSSLM, dev: LabeledSet, test: LabeledSet, cfg: Config, rank: int,
                 tb: TensorBoard, label: str, per_epoch: int):
        self.objective, self.dev, self.test, self.cfg, self.rank, self.tb = objective, dev, test, cfg, rank, tb
        self.label, self.per_epoch = label, per_epoch
        self.epochs: list[dict] = []  # {"epoch", "step", "dev_accuracy", "test_accuracy"}

    def due(self, step: int) -> bool:
        return step % self.per_epoch == 0 or step == self.cfg.train.steps

    def __call__(self, step: int) -> dict[str, float]:
        batch_size = self.cfg.eval.batch_size
        scores = {"dev_accuracy": accuracy(self.objective, self.dev, batch_size),
                  "test_accuracy": accuracy(self.objective, self.test, batch_size)}
        self.tb.scalars("eval", scores, step)
        shown = f"dev {scores['dev_accuracy']:.4f} test {scores['test_accuracy']:.4f}"
        if step == 0:
            where, note = "before training", ""
        else:
            improved = all(scores["dev_accuracy"] > e["dev_accuracy"] for e in self.epochs)
            self.epochs.append({"epoch": len(self.epochs) + 1, "step": step, **scores})
            where = f"epoch {len(self.epochs)}/{self.cfg.train.steps // self.per_epoch}"
            note = " (best dev)" if improved else ""
        if self.rank == 0:
            log.info(f"[clsys] {self.label} {where}: {shown}{note}")
        return scores

    def state_dict(self) -> dict:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict) -> None:
        self.epochs = list(state["epochs"])


def encode_rows(objective: CSSLM, texts: list[str], offset: int, batch_size: int) -> RetrievalBank:
    """Bank rows for ``texts`` (global rows from ``offset``): their (u, v) views in float32 on the CPU."""
    device = next(objective.parameters()).device
    us, vs = [], []
    for first in range(0, len(texts), batch_size):
        batch = objective.collate_corpus(texts[first:first + batch_size])
        u, v = objective.encode_views(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        us.append(u.float().cpu())
        vs.append(v.float().cpu())
    dim = objective.model.config.hidden_size
    return RetrievalBank(torch.cat(us) if us else torch.empty(0, dim), torch.cat(vs) if vs else torch.empty(0, dim),
                         texts, offset)


class TaskStage(Stage):
    """Stage A (``objective.stage: warmup``) or C (``css``) of one seed; ``init``: the weights it starts from
    (stage A's best for C; None: fresh heads on the pretrained encoder); ``bank``: this rank's bank shard and its
    token ids (stage C); ``corpus``: the corpus's sentences stream (stage A of ``method: css_lm``)."""

    def __init__(self, train: LabeledSet, dev: LabeledSet, test: LabeledSet, init: dict | None,
                 bank: tuple[RetrievalBank, list[list[int]]] | None, corpus: str | None):
        self.train, self.dev, self.test, self.init, self.bank, self.corpus = train, dev, test, init, bank, corpus
        self.built: CSSLM | None = None

    def objective(self, cfg: Config, tokenizer) -> CSSLM:
        self.cfg = cfg
        self.built = objective = CSSLM(cfg, tokenizer)
        if self.init is not None:
            objective.load_state_dict(self.init)
        if self.bank is not None:
            objective.attach_bank(*self.bank)
        return objective

    def loader(self, cfg: Config, rank: int, world: int, objective: CSSLM) -> FewShotBatches:
        corpus = None
        if self.corpus is not None:
            d = cfg.data
            # Tokenised in the loader's worker processes by the objective's collate.
            corpus = ShardLoader(self.corpus, rank, world, micro_batch=cfg.micro_batch * cfg.objective.domain_negatives,
                                 collate=objective.data.collate, seed=cfg.train.seed, loader_workers=d.loader_workers,
                                 shuffle_buffer=d.shuffle_buffer, verify=d.verify_checksums,
                                 on_bad_sample=d.on_bad_sample, kind="sentences", max_shard_bytes=d.max_shard_mb << 20,
                                 transport=d.transport)
        return FewShotBatches(self.train, objective.collate_labeled, cfg, rank, world, corpus)

    def evaluator(self, objective: CSSLM, cfg: Config, rank: int, tb: TensorBoard) -> TaskAccuracy:
        per_epoch = math.ceil(len(self.train) / cfg.train.batch_size)
        return TaskAccuracy(objective, self.dev, self.test, cfg, rank, tb, LABELS[cfg.objective.stage], per_epoch)

    def after_step(self, step: int, resumed: bool = False) -> None:
        # Each rank re-encodes its own shard with the current model (C and D stay frozen). A resumed stage
        # re-encodes with the weights it resumed with: the model of the last refresh is not kept.
        refresh, objective = self.cfg.objective.bank_refresh_every, self.built
        due = step % refresh == 0 or (resumed and step > refresh) if refresh else False
        if objective.oc.stage != "css" or not due:
            return
        objective.bank = encode_rows(objective, objective.bank.texts, objective.bank.offset, self.cfg.eval.batch_size)
        if dist.get_rank() == 0:
            log.info(f"[clsys] stage C step {step}: bank re-encoded with the current model")
