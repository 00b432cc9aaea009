"""The training loop that runs inside every Ray Train worker.

Reads top to bottom: set up the process group, build the objective and its DeepSpeed engine,
open this rank's shard stream, restore the newest checkpoint if there is one, then step:
forward → backward → optimizer step → (every N) log, evaluate, checkpoint.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import random
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

from clsys import storage
from clsys.analysis.heatmap import Panel, render, token_similarity
from clsys.config import Config, run_url
from clsys.engine import checkpoint
from clsys.engine.checkpoint_writer import CheckpointWriter
from clsys.engine.deepspeed import build_engine, init_distributed, step_precision
from clsys.engine.grad_cache import grad_cache_backward
from clsys.engine.preemption import StopWatch
from clsys.engine.profile import StepClock
from clsys.engine.selection import BestTracker, selected_metric
from clsys.metrics import TensorBoard, Throughput, batch_work, collapsed, duration, peak_tflops
from clsys.model.encoder import load_tokenizer
from clsys.objectives import OBJECTIVES, Objective
from clsys.tensorboard import LOG_FOLDER, EventSync


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


def _evaluate_dev(objective: Objective, dev_set, cfg: Config) -> dict:
    """STS dev score, computed by every rank on the same batches.

    Under ZeRO-3 each forward gathers the partitioned weights collectively, so all ranks must run
    the same forwards in step; under ZeRO 0-2 the other ranks would only wait for rank 0 anyway.
    """
    from clsys.evaluate import evaluate_sts

    return evaluate_sts(objective.encoder(), objective.tokenizer, dev_set, pooling=cfg.eval.pooling,
                        batch_size=cfg.eval.batch_size)


def _evaluate_retrieval(objective: Objective, cfg: Config) -> dict[str, float]:
    """XQuAD question→paragraph retrieval (bi-encoder, and re-ranked by the objective's scorer when it
    has one) and Tatoeba bitext accuracy, as flat TensorBoard tags."""
    from clsys.retrieval import evaluate_tatoeba, evaluate_xquad, parse_articles

    encoder, tokenizer, e = objective.encoder(), objective.tokenizer, cfg.eval
    reranker = objective.reranker() if e.rerank_top else None
    scores = {}
    for direction in e.xling:
        query_lang, _, doc_lang = direction.partition("-")
        result = evaluate_xquad(encoder, tokenizer, query_lang, doc_lang, e.pooling, parse_articles(e.xling_articles),
                                reranker, e.rerank_top, e.batch_size, cfg.data.max_length)
        scores.update({f"xquad_{direction}_{k}": v for k, v in result.items() if k != "n"})
    for pair in e.tatoeba:
        scores.update({f"tatoeba_{pair}_{k}": v for k, v in evaluate_tatoeba(encoder, tokenizer, pair, e.pooling,
                                                                               e.batch_size).items() if k != "n"})
    return scores


def _report_skipped(skipped: collections.Counter, rank: int) -> None:
    """Collective: the bad samples every rank's loader skipped (data.on_bad_sample: skip), summed."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(skipped))
    total = sum((collections.Counter(c) for c in everyone), collections.Counter())
    if rank == 0 and total:
        print("[clsys] skipped bad data: " + ", ".join(f"{reason} {n}" for reason, n in sorted(total.items())),
              flush=True)


def _dev_set(cfg: Config):
    from clsys.sts_data import load_sts, resolve_sts

    dev = load_sts(resolve_sts(cfg.eval.sts_dev), split="dev")  # of SICK.txt, its trial split
    if cfg.eval.max_pairs:
        n = cfg.eval.max_pairs
        dev = dataclasses.replace(dev, sent1=dev.sent1[:n], sent2=dev.sent2[:n], scores=dev.scores[:n])
    return dev


def _drop_sample_keys_after(run: str, step: int) -> None:
    """Delete every rank's sample-key files of steps after ``step``, the checkpoint resumed from (rank 0,
    before the first step, so before any rank writes a new one). They were written by an attempt whose
    later steps are now done again: with a checkpoint that never completed (a crash while it was written),
    or at steps this attempt will not checkpoint (a preemption's), they would list samples twice."""
    for url in storage.list_prefix(storage.join(run, "sample_keys")):
        name = url.rpartition("/")[2]
        if name.startswith("step-") and name.endswith(".txt") and int(name[5:-4]) > step:
            storage.delete(url)


def train_worker(payload: dict) -> None:
    """The Ray Train worker function of the step loop; ``payload``: ``{"config": Config, "resume": URL or None}``
    (``clsys.engine.launch.train``)."""
    cfg = payload["config"]
    # Before the process group exists: DeepSpeed's backend keeps references to some collectives it finds then.
    clock = StepClock(torch.device("cuda" if cfg.cluster.use_gpu else "cpu"), cfg.train.profile)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    run = run_url(cfg)

    # Same seed on every rank while building, so freshly initialised heads are identical everywhere.
    torch.manual_seed(cfg.train.seed)
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name)
    objective: Objective = OBJECTIVES[cfg.objective.name](cfg, tokenizer)
    # Fault tooling and operators find a rank's process by this line (tests/faults.py).
    precision = step_precision(cfg)  # what train.precision: auto means on this worker's device
    print(f"[clsys] rank {rank}/{world}: pid {os.getpid()}, {torch.get_num_threads()} threads, "
          f"precision {precision}", flush=True)
    resume = checkpoint.fetch_intact(_resume_candidates(run, payload.get("resume")), world)
    saved_world = resume.saved_world if resume else world
    engine = build_engine(objective, cfg, load_universal=bool(resume and resume.universal))
    engine.train()  # from_pretrained returns eval mode; the contrastive views need dropout on
    loader = objective.loader(cfg, rank, world)
    # From here on each rank draws its own dropout masks.
    torch.manual_seed(cfg.train.seed + 1 + rank)
    random.seed(cfg.train.seed + 1 + rank)

    step = 0
    if resume:
        step, rank_state = resume.step, checkpoint.load(engine, resume, world)
        if "rng" in rank_state:  # absent after a change of rank count: fresh streams, seeded above
            checkpoint.set_rng_state(rank_state["rng"])
        loader.load_state_dict(rank_state["loader"])
        if rank == 0:
            elastic = "" if saved_world == world else \
                f" (written by {saved_world} ranks, {'resharded for' if resume.universal else 'loaded whole on'} {world})"
            print(storage.redact(f"[clsys] resumed from {resume.url} at step {step}{elastic}"), flush=True)
            if cfg.train.log_sample_keys:
                _drop_sample_keys_after(run, step)

    tb_dir = local_tensorboard_dir(cfg) if rank == 0 else None
    tb = TensorBoard(tb_dir)
    tb_sync = (EventSync(tb_dir, storage.join(run, LOG_FOLDER), cfg.train.tensorboard_sync_s)
               if tb_dir is not None and not storage.is_local(run) else None)
    dev_set = _dev_set(cfg) if cfg.eval.sts_dev else None
    if dev_set is not None and dev_set.note and rank == 0:
        print(f"[clsys] eval.sts_dev {cfg.eval.sts_dev}: {dev_set.note}", flush=True)
    encoder_prefix = next(name for name, module in objective.named_modules() if module is objective.encoder())
    meta = {"world_size": world, "objective": cfg.objective.name, "export_pooling": objective.export_pooling(),
            "encoder_prefix": encoder_prefix, "export_head_map": objective.export_head_map(),
            "export_reranker_map": objective.export_reranker_map(),
            "precision": precision, "config": cfg.to_dict(), "fingerprint": cfg.fingerprint()}

    def hf_files(folder: str) -> None:
        tokenizer.save_pretrained(folder)
        objective.encoder().config.save_pretrained(folder)

    consumed: list[str] = []  # sample keys since the last checkpoint (train.log_sample_keys)
    skipped: collections.Counter = collections.Counter()  # bad samples the loader skipped, by reason

    metric = selected_metric(cfg, dev_set.name if dev_set is not None else None)
    best = BestTracker(run, metric, cfg.eval.select_mode, cfg.train.keep_checkpoints) if metric else None
    tb.config(cfg, metric)
    collapsing = False  # the alarm's state, so that the console warns once per episode

    writer = CheckpointWriter(engine, run, cfg.train.keep_checkpoints, background=cfg.train.async_checkpoint,
                              wait_s=cfg.cluster.collective_timeout_s)

    def save_checkpoint(best_value: float | None) -> None:
        """Checkpoint this step (written in the background with train.async_checkpoint); ``best_value``:
        this step's evaluation is the best so far, and its checkpoint becomes the best one once complete."""
        if cfg.train.log_sample_keys:
            # Written with the checkpoint that covers them; on resume the files of later steps are dropped
            # (_drop_sample_keys_after), so the folder always lists exactly the samples the weights have seen.
            keys_url = storage.join(run, "sample_keys", f"rank-{rank:05d}", f"step-{step:08d}.txt")
            storage.write_bytes(keys_url, "".join(f"{k}\n" for k in consumed).encode())
            consumed.clear()
        rank_state = {"rng": checkpoint.rng_state(), "loader": loader.state_dict()}
        # best.json names the previous best until this checkpoint is complete: pruning keeps that one till then.
        protect = best.protected if best else None
        record = best.record(step, best_value, checkpoint.step_url(run, step)) if best_value is not None else None
        saved_step = step

        def complete(url: str) -> None:  # rank 0, once the checkpoint is complete
            if record is not None:
                best.write(record)
            print(storage.redact(f"[clsys] step {saved_step}: checkpoint {url}" +
                                 (f", the best {metric} so far ({record.value:.2f})" if record is not None else "")),
                  flush=True)

        writer.save(step, rank_state, meta, hf_files, protect, complete if rank == 0 else None)
        if rank == 0:
            tb.flush()
            if tb_sync is not None:  # the curves on storage cover at least what the checkpoint covers
                tb_sync.sync()

    def evaluate(at_step: int) -> dict[str, float]:
        # Every rank runs the same forwards (ZeRO-3 gathers weights collectively); rank 0 logs.
        scores = _evaluate_retrieval(objective, cfg)
        if dev_set is not None:
            scores[f"{dev_set.name}_spearman"] = _evaluate_dev(objective, dev_set, cfg)["spearman"]
        if scores:
            tb.scalars("eval", scores, at_step)
            if rank == 0:
                shown = ", ".join(f"{k} {v:.2f}" for k, v in scores.items())
                print(f"[clsys] step {at_step}: {shown}", flush=True)
        if cfg.eval.heatmap_text:
            tokens, similarity = token_similarity(objective.encoder(), tokenizer, cfg.eval.heatmap_text)
            if rank == 0:
                tb.image("analysis/token_similarity", render([Panel(f"step {at_step}", tokens, similarity)]), at_step)
        return scores

    evaluating = dev_set is not None or bool(cfg.eval.heatmap_text or cfg.eval.xling or cfg.eval.tatoeba)
    if evaluating and step == 0:
        evaluate(0)

    batches = iter(loader)
    chunk_size = cfg.objective.grad_cache.chunk_size
    meter = Throughput(peak_tflops(cfg.train.peak_tflops, cfg.cluster.use_gpu, precision))
    encoder_config = objective.encoder().config  # what perf/model_tflops_per_device counts
    stop_watch = StopWatch(run, cfg.cluster.stop_poll_s)
    started, first_step = time.perf_counter(), step  # for the console's elapsed time and ETA
    while step < cfg.train.steps:
        for _ in range(cfg.train.grad_accum):
            clock.start()
            batch = next(batches)
            clock.lap("loader_wait")
            keys = batch.pop("keys")
            skipped.update(batch.pop("data_skipped", {}))
            if cfg.train.log_sample_keys:
                stream = batch.get("stream")
                consumed.extend(f"{stream}/{k}" if stream else k for k in keys)
            # Tensors go to the device; anything else (a task tag) passes through.
            batch = {k: v.to(engine.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                     for k, v in batch.items()}
            if chunk_size:
                out = grad_cache_backward(engine, batch, chunk_size, cfg.train.grad_accum)
            else:
                out = engine(batch)
                engine.backward(out.loss)
            clock.lap("forward_backward")
            engine.step()
            clock.lap("optimizer")
            tokens, flops = batch_work(encoder_config, [v for k, v in batch.items() if k.endswith("attention_mask")])
            meter.add(len(keys), tokens, clock.take(), flops)
        step += 1

        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            values = {k: float(v) for k, v in out.metrics.items()}
            values["lr"] = engine.get_lr()[0]
            grad_norm = engine.get_global_grad_norm()
            if grad_norm is not None:
                values["grad_norm"] = float(grad_norm)
            rates = meter.rates(phases=cfg.train.profile)
            # Every rank does the same work, so the job's rates are this rank's times the world size.
            for name in ("samples_per_s", "tokens_per_s"):
                rates[name] *= world
            tb.scalars("train", values, step)
            tb.scalars("perf", rates, step)
            if cfg.train.collapse_uniformity and "uniformity" in values:
                now = collapsed(values, cfg.train.collapse_uniformity)
                tb.scalars("health", {"collapse": float(now)}, step)
                if now and not collapsing and rank == 0:
                    print(f"[clsys] warning: step {step}: the embeddings are collapsing (train/uniformity "
                          f"{values['uniformity']:.3f} > train.collapse_uniformity {cfg.train.collapse_uniformity}): "
                          "distinct sentences get nearly the same vector; lower optim.lr or check the data",
                          flush=True)
                collapsing = now
            if skipped:
                tb.scalars("data", {f"skipped_{reason}": n for reason, n in skipped.items()}, step)
            if rank == 0:
                # The ETA extrapolates this start's pace, evaluations and checkpoints included.
                elapsed = time.perf_counter() - started
                eta = elapsed / (step - first_step) * (cfg.train.steps - step)
                print(f"[clsys] step {step}/{cfg.train.steps} loss {values['loss']:.4f} lr {values['lr']:.2e} "
                      f"{rates['samples_per_s']:.1f} samples/s, {duration(elapsed)} elapsed, ETA {duration(eta)}",
                      flush=True)
            # No ray.train.report: nothing reads Ray's copy of the metrics (TensorBoard and the console
            # have them), and each report is a barrier across ranks plus a one-slot queue the controller
            # empties every 2 s: logging more often than that blocked every rank for up to 2 s a report.

        best_value = None
        if evaluating and (step % cfg.eval.every == 0 or step == cfg.train.steps):
            scores = evaluate(step)
            if best is not None and best.improves(scores, step):
                best_value = scores[metric]

        stopping = stop_watch.should_stop()
        if best_value is not None or step % cfg.train.ckpt_every == 0 or step == cfg.train.steps or stopping:
            save_checkpoint(best_value)
        if stopping:
            if rank == 0:
                print(f"[clsys] step {step}: stopped on request", flush=True)
            break
    writer.wait()  # the last checkpoint complete before the worker returns
    stop_watch.close()
    clock.close()
    tb.close()
    _report_skipped(skipped, rank)
    if tb_sync is not None:
        tb_sync.close()  # the last copy, with everything written
        shutil.rmtree(tb_dir, ignore_errors=True)
