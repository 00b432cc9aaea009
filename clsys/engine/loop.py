"""The training loop that runs inside every Ray Train worker.

``Trainer`` is one rank's training, made of parts built once in this order: the process group, the objective
and its DeepSpeed engine, this rank's batches, TensorBoard, the evaluator, the newest intact checkpoint restored,
the checkpoint writer. ``run`` then reads top to bottom: step (forward → backward → optimizer step), every N steps
log, evaluate, checkpoint; stop at ``train.steps`` or on request.

What it trains is a ``Stage``: how the objective, the batches and the evaluation are built. The default is the
step loop's (the objective ``objective.name`` names, its shard streams, ``eval.*``); a recipe that trains in
stages gives each stage its own and runs one Trainer per stage (a recipe home's, ``clsys.recipes.home``).

A checkpoint holds, besides DeepSpeed's model, optimizer and schedule, each rank's *parts* by name
(``Trainer.parts``): ``rng`` (the global RNG streams), ``loader`` (the stream's position), ``sources`` (the steps
each data source was drawn for, ``SourceMeter``) and ``evaluator`` when the evaluator keeps a state (a stage's
record of its evaluations), each with ``state_dict`` / ``load_state_dict``; the step is the
checkpoint's own, the best checkpoint's record lives in ``<run>/best.json`` (``BestTracker`` reads it back itself),
and sample keys are written beside.
"""
from __future__ import annotations

import collections
import logging
import os
import random
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from clsys import storage
from clsys.config import Config, run_url
from clsys.data.streaming import rank_loader
from clsys.engine import checkpoint
from clsys.engine.checkpoint_writer import CheckpointWriter
from clsys.engine.deepspeed import build_engine, init_distributed, resolve_zero_stage, step_precision
from clsys.engine.grad_cache import grad_cache_backward
from clsys.engine.preemption import StopWatch
from clsys.engine.profile import StepClock
from clsys.engine.evaluator import Evaluator
from clsys.engine.selection import BestTracker
from clsys.metrics.event_sync import LOG_FOLDER, EventSync
from clsys.metrics.health import SourceMeter, TensorBoard, Throughput, batch_work, collapsed, duration, peak_tflops
from clsys.model.encoder import load_tokenizer
from clsys.objectives import OBJECTIVES, Objective

log = logging.getLogger(__name__)


def local_tensorboard_dir(cfg: Config) -> str:
    """TensorBoard writes to a local folder: the run's own when the run is local, else a fresh
    temporary one that ``EventSync`` mirrors to ``<run>/tensorboard``."""
    run = run_url(cfg)
    if storage.is_local(run):
        return os.path.join(storage.parse(run).path, "tensorboard")
    return tempfile.mkdtemp(prefix=f"clsys-tensorboard-{cfg.train.name.replace('/', '-')}-")


def _resume_candidates(run: str, requested: str | None) -> list[str]:
    """Where to resume from, in order of preference: this run's complete checkpoints (written before a
    worker failure), newest first, then the requested one (the run's start).

    Rank 0 lists and broadcasts, so that every rank tries the same checkpoints.
    """
    choice = [[]]
    if dist.get_rank() == 0:
        choice[0] = [url for _, url in reversed(checkpoint.complete_checkpoints(run))]
        if requested and requested not in choice[0]:
            choice[0].append(requested)
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _report_skipped(skipped: collections.Counter, rank: int) -> None:
    """Collective: the bad samples every rank's loader skipped (data.on_bad_sample: skip), summed."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(skipped))
    total = sum((collections.Counter(c) for c in everyone), collections.Counter())
    if rank == 0 and total:
        log.info("[clsys] skipped bad data: " + ", ".join(f"{reason} {n}" for reason, n in sorted(total.items())))


def _drop_sample_keys_after(run: str, step: int) -> None:
    """Delete every rank's sample-key files of steps after ``step``, the checkpoint resumed from (rank 0,
    before the first step, so before any rank writes a new one). They were written by an attempt whose
    later steps are now done again: with a checkpoint that never completed (a crash while it was written),
    or at steps this attempt will not checkpoint (a preemption's), they would list samples twice."""
    for url in storage.list_prefix(storage.join(run, "sample_keys")):
        name = url.rpartition("/")[2]
        if name.startswith("step-") and name.endswith(".txt") and int(name[5:-4]) > step:
            storage.delete(url)


class GlobalRng:
    """The rank's global RNG streams (torch's, CUDA's, Python's) as a checkpoint part: dropout masks continue."""

    def state_dict(self) -> dict:
        return checkpoint.rng_state()

    def load_state_dict(self, state: dict) -> None:
        checkpoint.set_rng_state(state)


class SampleKeys:
    """``train.log_sample_keys``: the keys of the samples this rank consumed since its last checkpoint, written
    with the checkpoint that covers them to ``<run>/sample_keys/rank-R/step-S.txt``."""

    def __init__(self, run: str, rank: int, enabled: bool):
        self.run, self.rank, self.enabled = run, rank, enabled
        self.consumed: list[str] = []

    def add(self, keys: list[str], stream: str | None) -> None:
        if self.enabled:
            self.consumed.extend(f"{stream}/{k}" if stream else k for k in keys)

    def write(self, step: int) -> None:
        # On resume the files of later steps are dropped (_drop_sample_keys_after), so the folder always lists
        # exactly the samples the weights have seen.
        if self.enabled:
            url = storage.join(self.run, "sample_keys", f"rank-{self.rank:05d}", f"step-{step:08d}.txt")
            storage.write_bytes(url, "".join(f"{k}\n" for k in self.consumed).encode())
            self.consumed.clear()


class Stage:
    """What a Trainer trains: how it builds its objective, its batches and its evaluation, and what it does after a
    step. This one is the step loop's; a recipe's stage overrides what differs."""

    def objective(self, cfg: Config, tokenizer) -> Objective:
        """Built with the same seed on every rank (the Trainer seeds first)."""
        return OBJECTIVES[cfg.objective.name](cfg, tokenizer)

    def loader(self, cfg: Config, rank: int, world: int, objective: Objective):
        """This rank's endless batch iterator with ``state_dict``/``load_state_dict``; each batch holds its samples'
        ``keys``, and may hold ``data_skipped`` (bad samples left out, by reason) and ``source``."""
        return rank_loader(cfg, rank, world, objective.data)

    def evaluator(self, objective: Objective, cfg: Config, rank: int, tb: TensorBoard):
        """Collective when called: ``wanted``, ``due(step)``, ``metric`` (the score that selects the best checkpoint,
        or None) and ``evaluator(step)`` → scores; with ``state_dict``/``load_state_dict`` it is a checkpoint part."""
        return Evaluator(objective, cfg, rank, tb)

    def after_step(self, step: int, resumed: bool = False) -> None:
        """After optimizer step ``step``, on every rank; ``resumed``: the step a checkpoint brought back."""


class Trainer:
    """One rank's training of a ``Stage`` (see the module docstring): its parts, then ``run``."""

    def __init__(self, cfg: Config, requested_resume: str | None, stage: Stage | None = None):
        self.cfg = cfg
        self.stage = stage = stage or Stage()
        # Before the process group exists: DeepSpeed's backend keeps references to some collectives it finds then.
        self.clock = StepClock(torch.device("cuda" if cfg.cluster.use_gpu else "cpu"), cfg.train.profile)
        init_distributed()
        self.rank, self.world = rank, world = dist.get_rank(), dist.get_world_size()
        self.run_url = run = run_url(cfg)

        # Same seed on every rank while building, so freshly initialised heads are identical everywhere.
        torch.manual_seed(cfg.train.seed)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
        self.objective: Objective = stage.objective(cfg, self.tokenizer)
        self.precision = step_precision(cfg)  # what train.precision: auto means on this worker's device
        # Fault tooling and operators find a rank's process by this line (tests/faults.py).
        log.info(f"[clsys] rank {rank}/{world}: pid {os.getpid()}, {torch.get_num_threads()} threads, "
                 f"precision {self.precision}")
        resume = checkpoint.fetch_intact(_resume_candidates(run, requested_resume), world)
        # train.zero_stage: auto made a stage, so that checkpoints record the one their files are laid out for.
        self.cfg = cfg = resolve_zero_stage(cfg, self.objective, resume.zero_stage if resume else None)
        self.engine = build_engine(self.objective, cfg, load_universal=bool(resume and resume.universal))
        self.engine.train()  # from_pretrained returns eval mode; the contrastive views need dropout on
        self.loader = stage.loader(cfg, rank, world, self.objective)
        # From here on each rank draws its own dropout masks.
        torch.manual_seed(cfg.train.seed + 1 + rank)
        random.seed(cfg.train.seed + 1 + rank)
        self.sources = SourceMeter(cfg.train.grad_accum)  # steps and loss per source, from the batches' "source"
        self.tb_dir = local_tensorboard_dir(cfg) if rank == 0 else None
        self.tb = TensorBoard(self.tb_dir)
        self.tb_sync = (EventSync(self.tb_dir, storage.join(run, LOG_FOLDER), cfg.train.tensorboard_sync_s)
                        if self.tb_dir is not None and not storage.is_local(run) else None)
        self.evaluator = stage.evaluator(self.objective, cfg, rank, self.tb)
        # Saved and restored by name.
        self.parts: dict[str, Any] = {"rng": GlobalRng(), "loader": self.loader, "sources": self.sources}
        if hasattr(self.evaluator, "state_dict"):
            self.parts["evaluator"] = self.evaluator
        self.step = self.restore(resume) if resume else 0
        if resume:
            stage.after_step(self.step, resumed=True)

        self.meta = self.checkpoint_meta()
        self.sample_keys = SampleKeys(run, rank, cfg.train.log_sample_keys)
        self.skipped: collections.Counter = collections.Counter()  # bad samples the loader skipped, by reason
        metric = self.evaluator.metric
        self.best = BestTracker(run, metric, cfg.eval.select_mode, cfg.train.keep_checkpoints) if metric else None
        self.tb.config(cfg, metric)
        self.collapsing = False  # the alarm's state, so that the console warns once per episode
        self.writer = CheckpointWriter(self.engine, run, cfg.train.keep_checkpoints,
                                       background=cfg.train.async_checkpoint, wait_s=cfg.cluster.collective_timeout_s)

    def restore(self, resume: checkpoint.Fetched) -> int:
        """The engine and every part from ``resume``; its step. A part the checkpoint lacks stays as built (the
        RNG streams after a change of rank count: fresh, seeded per rank)."""
        saved = checkpoint.load(self.engine, resume, self.world)
        for name, part in self.parts.items():
            if name in saved:
                part.load_state_dict(saved[name])
        if self.rank == 0:
            saved_world = resume.saved_world
            elastic = "" if saved_world == self.world else (
                f" (written by {saved_world} ranks, {'resharded for' if resume.universal else 'loaded whole on'} "
                f"{self.world})")
            log.info(storage.redact(f"[clsys] resumed from {resume.url} at step {resume.step}{elastic}"))
            if self.cfg.train.log_sample_keys:
                _drop_sample_keys_after(self.run_url, resume.step)
        return resume.step

    def checkpoint_meta(self) -> dict:
        """What every checkpoint records of the run, for export and resume (its config's URLs without their
        secrets: neither reads one back)."""
        cfg = self.cfg
        return {"world_size": self.world, "objective": cfg.objective.name, **self.objective.export_spec().to_meta(),
                "precision": self.precision, "config": storage.redact_values(cfg.to_dict()),
                "fingerprint": cfg.fingerprint()}

    def run(self) -> None:
        cfg = self.cfg
        if self.evaluator.wanted and self.step == 0:
            self.evaluator(0)
        batches = iter(self.loader)  # closed at the end: a stage's loader workers stop with it
        meter = Throughput(peak_tflops(cfg.train.peak_tflops, cfg.cluster.use_gpu, self.precision))
        stop_watch = StopWatch(self.run_url, cfg.cluster.stop_poll_s)
        started, first_step = time.perf_counter(), self.step  # for the console's elapsed time and ETA
        while self.step < cfg.train.steps:
            for _ in range(cfg.train.grad_accum):
                out = self.micro_step(batches, meter)
            self.step += 1
            self.stage.after_step(self.step)
            if self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps:
                self.log(out, meter, started, first_step)
            best_value = None
            if self.evaluator.due(self.step):
                scores = self.evaluator(self.step)
                if self.best is not None and self.best.improves(scores, self.step):
                    best_value = scores[self.evaluator.metric]
            stopping = stop_watch.should_stop()
            if best_value is not None or self.step % cfg.train.ckpt_every == 0 or self.step == cfg.train.steps \
                    or stopping:
                self.save_checkpoint(best_value)
            if stopping:
                if self.rank == 0:
                    log.info(f"[clsys] step {self.step}: stopped on request")
                break
        self.writer.wait()  # the last checkpoint complete before the worker returns
        stop_watch.close()
        batches.close()
        self.close()

    def micro_step(self, batches, meter: Throughput):
        """One micro-batch: forward and backward (GradCache's chunks with ``objective.grad_cache.chunk_size``),
        then the engine's step, which steps the optimizer at the last micro-batch of ``train.grad_accum``."""
        clock, engine = self.clock, self.engine
        clock.start()
        batch = next(batches)
        clock.lap("loader_wait")
        keys = batch.pop("keys")
        self.skipped.update(batch.pop("data_skipped", {}))
        source = batch.get("source")  # the stream of a batch of several (clsys.data.mixing)
        self.sample_keys.add(keys, source)
        # Tensors go to the device; anything else (a task tag) passes through.
        batch = {k: v.to(engine.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                 for k, v in batch.items()}
        chunk_size = self.cfg.objective.grad_cache.chunk_size
        if chunk_size:
            out = grad_cache_backward(engine, batch, chunk_size, self.cfg.train.grad_accum)
        else:
            out = engine(batch)
            engine.backward(out.loss)
        clock.lap("forward_backward")
        if source is not None:
            self.sources.add(source, out.loss)
        engine.step()
        clock.lap("optimizer")
        # What perf/model_tflops_per_device counts: the encoder's work on this batch's tokens.
        tokens, flops = batch_work(self.objective.encoder().config,
                                   [v for k, v in batch.items() if k.endswith("attention_mask")])
        meter.add(len(keys), tokens, clock.take(), flops)
        return out

    def log(self, out, meter: Throughput, started: float, first_step: int) -> None:
        """The step's metrics to TensorBoard (train/, train/source/ for batches of several streams, perf/, health/,
        data/) and, on rank 0, the console."""
        cfg, step, tb = self.cfg, self.step, self.tb
        values = {k: float(v) for k, v in out.metrics.items()}
        values["lr"] = self.engine.get_lr()[0]
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            values["grad_norm"] = float(grad_norm)
        rates = meter.rates(phases=cfg.train.profile)
        # Every rank does the same work, so the job's rates are this rank's times the world size.
        for name in ("samples_per_s", "tokens_per_s"):
            rates[name] *= self.world
        tb.scalars("train", values, step)
        tb.scalars("perf", rates, step)
        if cfg.train.collapse_uniformity and "uniformity" in values:
            now = collapsed(values, cfg.train.collapse_uniformity)
            tb.scalars("health", {"collapse": float(now)}, step)
            if now and not self.collapsing and self.rank == 0:
                log.warning(f"[clsys] warning: step {step}: the embeddings are collapsing (train/uniformity "
                            f"{values['uniformity']:.3f} > train.collapse_uniformity {cfg.train.collapse_uniformity}): "
                            "distinct sentences get nearly the same vector; lower optim.lr or check the data")
            self.collapsing = now
        if self.sources.batches:
            tb.scalars("train/source", self.sources.take(), step)
        if self.skipped:
            tb.scalars("data", {f"skipped_{reason}": n for reason, n in self.skipped.items()}, step)
        if self.rank == 0:
            # The ETA extrapolates this start's pace, evaluations and checkpoints included.
            elapsed = time.perf_counter() - started
            eta = elapsed / (step - first_step) * (cfg.train.steps - step)
            log.info(f"[clsys] step {step}/{cfg.train.steps} loss {values['loss']:.4f} lr {values['lr']:.2e} "
                     f"{rates['samples_per_s']:.1f} samples/s, {duration(elapsed)} elapsed, ETA {duration(eta)}")
        # No ray.train.report: nothing reads Ray's copy of the metrics (TensorBoard and the console have them),
        # and each report is a barrier across ranks plus a one-slot queue the controller empties every 2 s:
        # logging more often than that blocked every rank for up to 2 s a report.

    def save_checkpoint(self, best_value: float | None) -> None:
        """Checkpoint this step (written in the background with train.async_checkpoint); ``best_value``:
        this step's evaluation is the best so far, and its checkpoint becomes the best one once complete."""
        step, best, metric = self.step, self.best, self.evaluator.metric
        self.sample_keys.write(step)
        saved = {name: part.state_dict() for name, part in self.parts.items()}
        # best.json names the previous best until this checkpoint is complete: pruning keeps that one till then.
        protect = best.protected if best else None
        record = best.record(step, best_value, checkpoint.step_url(self.run_url, step)) if best_value is not None \
            else None

        def complete(url: str) -> None:  # rank 0, once the checkpoint is complete
            if record is not None:
                best.write(record)
            log.info(storage.redact(f"[clsys] step {step}: checkpoint {url}" +
                                    (f", the best {metric} so far ({record.value:.2f})" if record is not None else "")))

        self.writer.save(step, saved, self.meta, self.hf_files, protect, complete if self.rank == 0 else None)
        if self.rank == 0:
            self.tb.flush()
            if self.tb_sync is not None:  # the curves on storage cover at least what the checkpoint covers
                self.tb_sync.sync()

    def hf_files(self, folder: str) -> None:
        """What a checkpoint's hf/ folder holds: the tokenizer and the encoder's config."""
        self.tokenizer.save_pretrained(folder)
        self.objective.encoder().config.save_pretrained(folder)

    def close(self) -> None:
        self.clock.close()
        self.tb.close()
        _report_skipped(self.skipped, self.rank)
        if self.tb_sync is not None:
            self.tb_sync.close()  # the last copy, with everything written
            shutil.rmtree(self.tb_dir, ignore_errors=True)


def train_worker(payload: dict) -> None:
    """The Ray Train worker function of the step loop; ``payload``: ``{"config": Config, "resume": URL or None}``
    (``clsys.engine.launch.train``)."""
    Trainer(payload["config"], payload.get("resume")).run()
