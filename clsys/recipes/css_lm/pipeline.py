"""The CSS-LM recipe inside Ray Train workers: stage A, the bank (stage B), stage C, export
(docs/training/objectives.md#css-lm).

One worker group runs the whole recipe for one seed, every stage data-parallel over the same ranks. Stages A and
C are each one run of the step loop's Trainer (``clsys.engine.loop``) with CSS-LM's ``TaskStage``
(``clsys.recipes.css_lm.stage``), in a run folder of their own under the seed's run:

  A  warm-up (``objective.stage: warmup``), ``<run>/warmup/``: ``task.warmup_epochs`` epochs over the few-shot set,
     dev and test accuracy after each; the best-dev epoch's checkpoint is the stage's best (``best.json``).
     With ``objective.method: finetune`` this is the plain fine-tuning baseline and the recipe ends here.
  B  the bank: rank r encodes its contiguous slice of the first ``corpus.bank_size`` corpus sentences
     with >= ``corpus.min_tokens`` tokens using stage A's best model, and writes it as its shard
     under ``<run>/bank/`` (``clsys.recipes.css_lm.bank``); in stage C it keeps just that shard in memory.
  C  CSS-LM training (``objective.stage: css``), ``<run>/css/``, from stage A's best weights, heads included, with
     C and D frozen: ``task.epochs`` epochs, dev and test after each; test is reported at the best dev epoch, whose
     model is exported to ``<run>/export/`` (encoder + task head + label names).

(``task.*`` and ``corpus.*`` are ``objective.task.*`` and ``objective.corpus.*``.)

Restarts. A stage is complete once its ``result.json`` is written (last, by rank 0; then its checkpoints but the
best are deleted). A restarted or ``--resume latest`` run skips complete stages, reuses a complete bank written by
as many ranks, and resumes an incomplete stage from its newest complete checkpoint, as the step loop resumes.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import safetensors.torch
import torch
import torch.distributed as dist

from clsys import storage
from clsys.config import Config, run_url
from clsys.data.labeled import LabeledSet, few_shot, load_labeled
from clsys.engine import checkpoint
from clsys.engine.deepspeed import init_distributed
from clsys.engine.loop import Trainer
from clsys.engine.selection import best_weights, read_best
from clsys.model.encoder import load_tokenizer
from clsys.recipes.css_lm.bank import RetrievalBank, load_shard, save_shard
from clsys.recipes.css_lm.corpus import bank_sentences, corpus_texts, resolve_corpus_stream
from clsys.recipes.css_lm.objective import CSSLM
from clsys.recipes.css_lm.stage import LABELS, TaskStage, encode_rows

log = logging.getLogger(__name__)

RESULT = "result.json"


@dataclass
class Task:
    train: LabeledSet  # the few-shot sample of this seed
    dev: LabeledSet
    test: LabeledSet


def load_task(cfg: Config, seed: int) -> Task:
    """The task's files, dev and test read with the training file's class names (so id i is one class)."""
    t = cfg.objective.task
    fields = {"text_field": t.text_field or None, "label_field": t.label_field or None}
    full = load_labeled(t.train, **fields)
    dev = load_labeled(t.dev, full.label_names, **fields)
    test = load_labeled(t.test, full.label_names, **fields)
    return Task(few_shot(full, t.shots, seed), dev, test)


def stage_config(cfg: Config, stage: str, examples: int) -> Config:
    """The config one stage trains with: its run folder (``<run>/<stage>``), objective stage, number of steps,
    warm-up and detach point."""
    staged = copy.deepcopy(cfg)
    task = cfg.objective.task
    epochs = task.warmup_epochs if stage == "warmup" else task.epochs
    per_epoch = math.ceil(examples / cfg.train.batch_size)
    staged.train.run_root, staged.train.name, staged.train.resume = run_url(cfg), stage, ""
    staged.objective.stage = stage
    staged.train.steps = epochs * per_epoch
    staged.optim.warmup_steps = int(task.warmup_fraction * staged.train.steps)
    if stage == "warmup":  # the original detaches C's and D's inputs from epoch 1 on
        staged.objective.detach_after_micro_steps = task.detach_after_epochs * per_epoch * cfg.train.grad_accum
    return staged


def save_weights(url: str, state: dict[str, torch.Tensor]) -> None:
    storage.write_bytes(url, safetensors.torch.save({k: v.contiguous() for k, v in state.items()}))


class Worker:
    """One rank's run of the recipe; ``run`` is the whole of it."""

    def __init__(self, cfg: Config):
        self.cfg, self.run_url = cfg, run_url(cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
        self.task = load_task(cfg, cfg.train.seed)
        self.corpus = resolve_corpus_stream(cfg.objective.corpus.url) if cfg.objective.method == "css_lm" else None

    def log(self, message: str) -> None:
        if self.rank == 0:
            log.info(f"[clsys] {message}")

    def run(self) -> None:
        method, task = self.cfg.objective.method, self.cfg.objective.task
        self.log(f"{method} on {len(self.task.train)} labelled examples ({task.shots or 'all'} per class of "
                 f"{len(self.task.train.label_names)}), dev {len(self.task.dev)}, test {len(self.task.test)}")
        warmup_url = storage.join(self.run_url, "warmup")
        if not self.train_stage("warmup", init=None, bank=None):
            return
        if method == "finetune":
            self.finish(warmup_url)
            return
        init = best_weights(warmup_url)
        bank = self.bank(init)
        if not self.train_stage("css", init=init, bank=bank):
            return
        self.finish(storage.join(self.run_url, "css"))

    # ---- stages A and C -----------------------------------------------------------------------

    def train_stage(self, stage: str, init: dict | None, bank: tuple[RetrievalBank, list] | None) -> bool:
        """Run the stage unless it is complete; False when it stopped on request before its end."""
        cfg = stage_config(self.cfg, stage, len(self.task.train))
        out, label = run_url(cfg), LABELS[stage]
        if storage.exists(storage.join(out, RESULT)):
            self.log(f"{label}: complete in {storage.redact(out)}, skipped")
            return True
        started = time.perf_counter()
        corpus = self.corpus if stage == "warmup" else None
        trainer = Trainer(cfg, None, TaskStage(self.task.train, self.task.dev, self.task.test, init, bank, corpus))
        trainer.run()
        if trainer.step < cfg.train.steps:
            return False
        if self.rank == 0:
            epochs, best = trainer.evaluator.epochs, read_best(out)
            chosen = next(e for e in epochs if e["step"] == best.step)
            result = {"stage": stage, "epochs": epochs, "best_epoch": chosen["epoch"],
                      "dev_accuracy": chosen["dev_accuracy"], "test_accuracy": chosen["test_accuracy"],
                      "seconds": round(time.perf_counter() - started, 1)}
            storage.write_json(storage.join(out, RESULT), result)  # the stage is complete
            checkpoint.prune(out, 0, protect=best.checkpoint)  # only the best is read again
            self.log(f"{label}: best dev {result['dev_accuracy']:.4f} at epoch {result['best_epoch']}, "
                     f"test there {result['test_accuracy']:.4f}")
        dist.barrier()
        return True

    # ---- stage B ------------------------------------------------------------------------------

    def bank(self, init: dict) -> tuple[RetrievalBank, list[list[int]]]:
        """This rank's bank shard and its token ids: read back when a complete bank of this many ranks
        exists, else encoded now and written."""
        url = storage.join(self.run_url, "bank")
        if all(storage.exists(storage.join(url, f"shard-{r:05d}-of-{self.world:05d}.json")) for r in range(self.world)):
            local = load_shard(url, self.rank)
            self.log(f"stage B: the bank in {url} is complete, reused")
        else:
            if next(iter(storage.list_prefix(url)), None) is not None:
                raise storage.StorageError(f"{url}: holds an incomplete bank or one of another worker count; "
                                           f"delete it to rebuild")
            local = self.encode_bank(init, url)
        ids = self.tokenizer(local.texts, truncation=True, max_length=self.cfg.data.max_length,
                             return_attention_mask=False, return_token_type_ids=False)["input_ids"]
        return local, ids

    def encode_bank(self, init: dict, url: str) -> RetrievalBank:
        c, started = self.cfg.objective.corpus, time.perf_counter()
        wanted = c.bank_size
        start, stop = self.rank * wanted // self.world, (self.rank + 1) * wanted // self.world
        texts, seen = bank_sentences(self._corpus_texts(), self.tokenizer, c.min_tokens, start, stop)
        # The last rank counted furthest: when the corpus had fewer qualifying sentences, every rank
        # re-slices that smaller total.
        total = torch.tensor([seen if self.rank == self.world - 1 else 0])
        dist.all_reduce(total)
        rows = int(total)
        if rows < self.cfg.objective.k:
            raise ValueError(f"objective.corpus.url: {self.corpus} has {rows} sentences with >= {c.min_tokens} "
                             f"tokens, fewer than objective.k = {self.cfg.objective.k}")
        if rows < wanted:
            self.log(f"stage B: the corpus has only {rows} sentences with >= {c.min_tokens} tokens "
                     f"(objective.corpus.bank_size {wanted})")
            start, stop = self.rank * rows // self.world, (self.rank + 1) * rows // self.world
            texts, _ = bank_sentences(self._corpus_texts(), self.tokenizer, c.min_tokens, start, stop)
        objective = CSSLM(self.cfg, self.tokenizer).to(self.device())
        objective.load_state_dict(init)
        local = encode_rows(objective, texts, start, self.cfg.eval.batch_size)
        save_shard(url, self.rank, self.world, local)
        dist.barrier()
        seconds = time.perf_counter() - started
        self.log(f"stage B: bank of {rows} sentences in {seconds:.1f} s over {self.world} worker(s) -> {url}")
        return local

    @staticmethod
    def device() -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def _corpus_texts(self):
        data = self.cfg.data
        return corpus_texts(self.corpus, data.verify_checksums, max_bytes=data.max_shard_mb << 20)

    # ---- the outcome --------------------------------------------------------------------------

    def finish(self, stage_url: str) -> None:
        """Export the best-dev model of the last stage and write the run's result."""
        if self.rank == 0:
            result = storage.read_json(storage.join(stage_url, RESULT))
            warmup = storage.read_json(storage.join(self.run_url, "warmup", RESULT))
            best = CSSLM(self.cfg, self.tokenizer)
            best.load_state_dict(best_weights(stage_url))
            export_classifier(best, self.task.train.label_names, storage.join(self.run_url, "export"))
            summary = {"method": self.cfg.objective.method, "seed": self.cfg.train.seed,
                       "dev_accuracy": result["dev_accuracy"], "test_accuracy": result["test_accuracy"],
                       "best_epoch": result["best_epoch"], "warmup": {k: warmup[k] for k in
                                                                      ("dev_accuracy", "test_accuracy", "best_epoch")}}
            storage.write_json(storage.join(self.run_url, RESULT), summary)
            self.log(f"{self.cfg.objective.method} seed {self.cfg.train.seed}: test accuracy "
                     f"{summary['test_accuracy']:.4f} at the best dev epoch ({summary['dev_accuracy']:.4f})")
        dist.barrier()


def export_classifier(objective: CSSLM, label_names: list[str], out: str) -> None:
    """``out``: the encoder as a Hugging Face / sentence-transformers folder (CLS pooling: the class
    view u), plus ``task_head.safetensors`` and ``classifier.json``: ``clsys.classify`` reads them."""
    from clsys.model.folder import publish, write_model

    cfg = objective.cfg
    work = tempfile.mkdtemp(prefix="clsys-css-export-")
    try:
        objective.tokenizer.save_pretrained(os.path.join(work, "tokenizer"))
        folder = os.path.join(work, "out")
        write_model(folder, objective.model.state_dict(), objective.model.config, os.path.join(work, "tokenizer"),
                    "cls", cfg.data.max_length, out, cfg.model.name if cfg.model.init == "pretrained" else "")
        save_weights(os.path.join(folder, "task_head.safetensors"), objective.task_head.state_dict())
        with open(os.path.join(folder, "classifier.json"), "w") as f:
            json.dump({"labels": label_names, "max_length": cfg.data.max_length, "recipe": cfg.objective.name,
                       "method": cfg.objective.method, "seed": cfg.train.seed}, f, indent=2)
        publish(folder, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def css_lm_worker(payload: dict) -> None:
    """The Ray Train worker function of ``python -m clsys.pretrain --config css_lm``."""
    init_distributed()
    Worker(payload["config"]).run()
