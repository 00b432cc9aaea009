"""The CSS-LM recipe inside Ray Train workers: stage A, the bank (stage B), stage C, export
(docs/training/objectives.md#css-lm).

One worker group runs the whole recipe for one seed, every stage data-parallel over the same ranks:

  A  warm-up (``objective.stage: warmup``): ``task.warmup_epochs`` epochs over the few-shot set,
     dev and test accuracy after each; the best-dev epoch's weights go to ``<run>/warmup/``.
     With ``objective.method: finetune`` this is the plain fine-tuning baseline and the recipe ends here.
  B  the bank: rank r encodes its contiguous slice of the first ``corpus.bank_size`` corpus sentences
     with >= ``corpus.min_tokens`` tokens using stage A's best model, and writes it as its shard
     under ``<run>/bank/`` (``clsys.recipes.css_lm.bank``); in stage C it keeps just that shard in memory.
  C  CSS-LM training (``objective.stage: css``) from stage A's best weights, heads included, with C
     and D frozen: ``task.epochs`` epochs, dev and test after each; test is reported at the best
     dev epoch, whose model is exported to ``<run>/export/`` (encoder + task head + label names).

Batches. Each epoch draws a fresh permutation of the few-shot set from (seed, epoch), cycled to
fill the last global batch, and rank r takes its rows of every global batch. Stage A's corpus
sentences (``objective.domain_negatives`` per query) stream from the corpus shards, shuffled.

Restarts. A stage is complete once its ``result.json`` is written (last, by rank 0); a restarted or
``--resume latest`` run skips complete stages, reuses a complete bank written by as many ranks,
and redoes an incomplete stage from its start.
"""
from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass

import safetensors.torch
import torch
import torch.distributed as dist

from clsys import storage
from clsys.config import Config, run_url
from clsys.recipes.css_lm.corpus import bank_sentences, corpus_texts, resolve_corpus_stream
from clsys.data.labeled import LabeledSet, few_shot, load_labeled
from clsys.engine.deepspeed import build_engine, init_distributed, resolve_zero_stage
from clsys.engine.loop import local_tensorboard_dir
from clsys.metrics.health import TensorBoard
from clsys.model.encoder import load_tokenizer
from clsys.recipes.css_lm.objective import CSSLM
from clsys.recipes.css_lm.bank import RetrievalBank, load_shard, save_shard
from clsys.metrics.event_sync import LOG_FOLDER, EventSync

log = logging.getLogger(__name__)

RESULT = "result.json"


@dataclass
class Task:
    train: LabeledSet  # the few-shot sample of this seed
    dev: LabeledSet
    test: LabeledSet


def load_task(cfg: Config, seed: int) -> Task:
    """The task's files, dev and test read with the training file's class names (so id i is one class)."""
    t = cfg.task
    fields = {"text_field": t.text_field or None, "label_field": t.label_field or None}
    full = load_labeled(t.train, **fields)
    dev = load_labeled(t.dev, full.label_names, **fields)
    test = load_labeled(t.test, full.label_names, **fields)
    return Task(few_shot(full, t.shots, seed), dev, test)


def stage_config(cfg: Config, stage: str, examples: int) -> Config:
    """The config one stage trains with: its objective stage, its number of steps, warm-up and detach point."""
    staged = copy.deepcopy(cfg)
    epochs = cfg.task.warmup_epochs if stage == "warmup" else cfg.task.epochs
    per_epoch = math.ceil(examples / cfg.train.batch_size)
    staged.objective.stage = stage
    staged.train.steps = epochs * per_epoch
    staged.optim.warmup_steps = int(cfg.task.warmup_fraction * staged.train.steps)
    if stage == "warmup":  # the original detaches C's and D's inputs from epoch 1 on
        staged.objective.detach_after_micro_steps = cfg.task.detach_after_epochs * per_epoch * cfg.train.grad_accum
    return staged


def epoch_rows(examples: int, batch_size: int, seed: int, epoch: int) -> list[int]:
    """The epoch's order of the few-shot set: a permutation from (seed, epoch), cycled to whole global batches."""
    order = list(range(examples))
    random.Random(f"css_lm/{seed}/{epoch}").shuffle(order)
    steps = math.ceil(examples / batch_size)
    return [order[i % examples] for i in range(steps * batch_size)]


@torch.no_grad()
def accuracy(objective: CSSLM, data: LabeledSet, cfg: Config, device) -> float:
    """Collective: accuracy of the task head on ``data``, each rank classifying every world-th example."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = list(range(rank, len(data), world))
    correct = torch.zeros(1, dtype=torch.float64)
    for start in range(0, len(rows), cfg.eval.batch_size):
        chunk = rows[start:start + cfg.eval.batch_size]
        batch = objective.collate_corpus([data.texts[i] for i in chunk])
        logits = objective.classify(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        correct += (logits.argmax(-1).cpu() == torch.tensor([data.labels[i] for i in chunk])).sum()
    dist.all_reduce(correct)
    return float(correct) / len(data)


def _cpu_copy(objective: CSSLM) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in objective.state_dict().items()}


def save_weights(url: str, state: dict[str, torch.Tensor]) -> None:
    storage.write_bytes(url, safetensors.torch.save({k: v.contiguous() for k, v in state.items()}))


def load_weights(url: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(storage.read_bytes(url))


class Worker:
    """One rank's run of the recipe; ``run`` is the whole of it."""

    def __init__(self, cfg: Config):
        self.cfg, self.run_url = cfg, run_url(cfg)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
        self.task = load_task(cfg, cfg.train.seed)
        self.corpus = resolve_corpus_stream(cfg.corpus.url) if cfg.objective.method == "css_lm" else None
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.tb_dir = local_tensorboard_dir(cfg) if self.rank == 0 else None
        self.tb = TensorBoard(self.tb_dir)
        # Remote runs: the local event files are copied to <run>/tensorboard periodically and at each stage's end.
        self.tb_sync = (EventSync(self.tb_dir, storage.join(self.run_url, LOG_FOLDER), cfg.train.tensorboard_sync_s)
                        if self.tb_dir is not None and not storage.is_local(self.run_url) else None)
        self.step = 0  # TensorBoard step: stage C continues stage A's count

    def log(self, message: str) -> None:
        if self.rank == 0:
            log.info(f"[clsys] {message}")

    def run(self) -> None:
        method = self.cfg.objective.method
        self.log(f"{method} on {len(self.task.train)} labelled examples ({self.cfg.task.shots or 'all'} per class of "
                 f"{len(self.task.train.label_names)}), dev {len(self.task.dev)}, test {len(self.task.test)}")
        warmup_url = storage.join(self.run_url, "warmup")
        if not storage.exists(storage.join(warmup_url, RESULT)):
            self.train_stage("warmup", warmup_url, init=None, bank=None)
        else:
            self.log(f"stage A: complete in {warmup_url}, skipped")
        if method == "finetune":
            self.finish(warmup_url)
            return
        init = load_weights(storage.join(warmup_url, "best.safetensors"))
        bank = self.bank(init)
        css_url = storage.join(self.run_url, "css")
        self.train_stage("css", css_url, init=init, bank=bank)
        self.finish(css_url)

    # ---- stages A and C -----------------------------------------------------------------------

    def train_stage(self, stage: str, out: str, init: dict | None, bank: tuple[RetrievalBank, list] | None) -> None:
        cfg = stage_config(self.cfg, stage, len(self.task.train))
        label = {"warmup": "stage A", "css": "stage C"}[stage]
        torch.manual_seed(cfg.train.seed)  # the same fresh heads on every rank
        objective = CSSLM(cfg, self.tokenizer)
        if init is not None:
            objective.load_state_dict(init)
        if bank is not None:
            objective.attach_bank(*bank)
        cfg = resolve_zero_stage(cfg, objective, None)  # a stage trains from its start: no checkpoint to follow
        engine = build_engine(objective, cfg)
        engine.train()
        torch.manual_seed(cfg.train.seed + 1 + self.rank)  # each rank its own dropout masks
        micro, accum = cfg.micro_batch, cfg.train.grad_accum
        corpus = None
        if stage == "warmup" and cfg.objective.method == "css_lm":
            from clsys.data.streaming import ShardLoader

            d = cfg.data
            # Tokenised in the loader's worker processes by the objective's collate.
            corpus = iter(ShardLoader(self.corpus, self.rank, self.world, micro * cfg.objective.domain_negatives,
                                      objective.data.collate, cfg.train.seed, d.loader_workers,
                                      d.shuffle_buffer, d.verify_checksums, d.on_bad_sample,
                                      kind="sentences", max_shard_bytes=d.max_shard_mb << 20, transport=d.transport))
        epochs = cfg.train.steps // math.ceil(len(self.task.train) / cfg.train.batch_size)
        history, best, best_state = [], None, None
        started, first_step = time.perf_counter(), self.step
        for epoch in range(epochs):
            rows = epoch_rows(len(self.task.train), cfg.train.batch_size, cfg.train.seed, epoch)
            for start in range(0, len(rows), cfg.train.batch_size):
                for a in range(accum):
                    first = start + (a * self.world + self.rank) * micro
                    mine = rows[first:first + micro]
                    texts = [self.task.train.texts[i] for i in mine]
                    labels = [self.task.train.labels[i] for i in mine]
                    batch = objective.collate_labeled(texts, labels, next(corpus) if corpus else None)
                    output = engine({k: v.to(self.device) for k, v in batch.items()})
                    engine.backward(output.loss)
                    engine.step()
                self.step += 1
                refresh = cfg.objective.bank_refresh_every
                if stage == "css" and refresh and (self.step - first_step) % refresh == 0:
                    # Each rank re-encodes its own shard with the current model (C and D stay frozen).
                    objective.bank = self.encode(objective, objective.bank.texts, objective.bank.offset)
                    self.log(f"{label} step {self.step}: bank re-encoded with the current model")
                if self.step % cfg.train.log_every == 0:
                    values = {k: float(v) for k, v in output.metrics.items()}
                    self.tb.scalars(f"train_{stage}", {**values, "lr": engine.get_lr()[0]}, self.step)
                    self.log(f"{label} step {self.step}: " + " ".join(f"{k} {v:.4f}" for k, v in values.items()))
            dev, test = accuracy(objective, self.task.dev, cfg, self.device), accuracy(objective, self.task.test, cfg, self.device)
            history.append({"epoch": epoch + 1, "step": self.step, "dev_accuracy": dev, "test_accuracy": test})
            self.tb.scalars("eval", {"dev_accuracy": dev, "test_accuracy": test}, self.step)
            improved = best is None or dev > history[best]["dev_accuracy"]
            if improved:
                best = epoch
                if self.rank == 0:  # ZeRO 0-2: every rank holds the whole model
                    best_state = _cpu_copy(objective)
            self.log(f"{label} epoch {epoch + 1}/{epochs}: dev {dev:.4f} test {test:.4f}" + (" (best dev)" if improved else ""))
        if corpus is not None:
            corpus.close()  # stops the loader's worker processes now
        self.tb.flush()
        if self.tb_sync is not None:
            self.tb_sync.sync()
        if self.rank == 0:
            save_weights(storage.join(out, "best.safetensors"), best_state)
            result = {"stage": stage, "epochs": history, "best_epoch": best + 1,
                      "dev_accuracy": history[best]["dev_accuracy"], "test_accuracy": history[best]["test_accuracy"],
                      "seconds": round(time.perf_counter() - started, 1)}
            storage.write_json(storage.join(out, RESULT), result)  # last: the stage is complete
            self.log(f"{label}: best dev {result['dev_accuracy']:.4f} at epoch {result['best_epoch']}, "
                     f"test there {result['test_accuracy']:.4f}")
        dist.barrier()
        del engine, objective

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
        c, started = self.cfg.corpus, time.perf_counter()
        wanted = c.bank_size
        start, stop = self.rank * wanted // self.world, (self.rank + 1) * wanted // self.world
        texts, seen = bank_sentences(self._corpus_texts(), self.tokenizer, c.min_tokens, start, stop)
        # The last rank counted furthest: when the corpus had fewer qualifying sentences, every rank
        # re-slices that smaller total.
        total = torch.tensor([seen if self.rank == self.world - 1 else 0])
        dist.all_reduce(total)
        rows = int(total)
        if rows < self.cfg.objective.k:
            raise ValueError(f"corpus.url: {self.corpus} has {rows} sentences with >= {c.min_tokens} tokens, "
                             f"fewer than objective.k = {self.cfg.objective.k}")
        if rows < wanted:
            self.log(f"stage B: the corpus has only {rows} sentences with >= {c.min_tokens} tokens "
                     f"(corpus.bank_size {wanted})")
            start, stop = self.rank * rows // self.world, (self.rank + 1) * rows // self.world
            texts, _ = bank_sentences(self._corpus_texts(), self.tokenizer, c.min_tokens, start, stop)
        objective = CSSLM(self.cfg, self.tokenizer).to(self.device)
        objective.load_state_dict(init)
        local = self.encode(objective, texts, start)
        save_shard(url, self.rank, self.world, local)
        dist.barrier()
        seconds = time.perf_counter() - started
        self.log(f"stage B: bank of {rows} sentences in {seconds:.1f} s over {self.world} worker(s) -> {url}")
        return local

    def encode(self, objective: CSSLM, texts: list[str], offset: int) -> RetrievalBank:
        """Bank rows for ``texts`` (global rows from ``offset``): their (u, v) views in float32 on the CPU."""
        us, vs = [], []
        for first in range(0, len(texts), self.cfg.eval.batch_size):
            batch = objective.collate_corpus(texts[first:first + self.cfg.eval.batch_size])
            u, v = objective.encode_views(batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device))
            us.append(u.float().cpu())
            vs.append(v.float().cpu())
        dim = objective.model.config.hidden_size
        return RetrievalBank(torch.cat(us) if us else torch.empty(0, dim), torch.cat(vs) if vs else torch.empty(0, dim),
                             texts, offset)

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
            best.load_state_dict(load_weights(storage.join(stage_url, "best.safetensors")))
            export_classifier(best, self.task.train.label_names, storage.join(self.run_url, "export"))
            summary = {"method": self.cfg.objective.method, "seed": self.cfg.train.seed,
                       "dev_accuracy": result["dev_accuracy"], "test_accuracy": result["test_accuracy"],
                       "best_epoch": result["best_epoch"], "warmup": {k: warmup[k] for k in
                                                                      ("dev_accuracy", "test_accuracy", "best_epoch")}}
            storage.write_json(storage.join(self.run_url, RESULT), summary)
            self.log(f"{self.cfg.objective.method} seed {self.cfg.train.seed}: test accuracy "
                     f"{summary['test_accuracy']:.4f} at the best dev epoch ({summary['dev_accuracy']:.4f})")
        self.tb.close()
        if self.tb_sync is not None:
            self.tb_sync.close()  # the last copy, with everything written
            shutil.rmtree(self.tb_dir, ignore_errors=True)
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
