"""``python -m clsys.pretrain --config css_lm [--repeats N]``: the recipe's driver, in place of the step loop's.

It checks the task files and the corpus before any worker starts, then runs one Ray Train run per seed
(``clsys.recipes.css_lm.pipeline``: stages A, B and C in one worker group), skips seeds whose run is complete,
and reports test accuracy at the best dev epoch, mean ± std over the seeds, in ``<run>/summary.json``.
"""
from __future__ import annotations

import copy
import logging
import statistics
import sys

from clsys import storage
from clsys.config import Config, ConfigError, run_url
from clsys.data.epoch_layout import plan_epoch
from clsys.engine.launch import init_ray, save_config, train
from clsys.engine.preemption import EXIT_PREEMPTED
from clsys.storage.lease import LEASE
from clsys.recipes.css_lm.corpus import resolve_corpus_stream
from clsys.recipes.css_lm.pipeline import RESULT, css_lm_worker, load_task
from clsys.shards.reader import load_shards

log = logging.getLogger(__name__)


def run(cfg: Config, repeats: int) -> int:
    """CSS-LM (or its fine-tuning baseline) for ``repeats`` seeds train.seed, +1, …: one Ray Train run
    each (``clsys.recipes.css_lm.pipeline``), then test accuracy at the best dev epoch, mean ± std."""
    task_cfg = cfg.objective.task
    try:
        for key in ("train", "dev", "test"):
            if not getattr(task_cfg, key):
                raise ConfigError(f"objective.task.{key}: set it to a labelled file "
                                  "(CSV/TSV/JSONL or 'LABEL text' lines)")
        if cfg.train.resume not in ("", "latest"):
            raise ConfigError("train.resume: css_lm resumes whole stages: '' or latest")
        task = load_task(cfg, cfg.train.seed)  # every file read and checked before any worker starts
        classes = len(task.train.label_names)
        if cfg.objective.num_labels not in (0, classes):
            raise ConfigError(f"objective.num_labels: {cfg.objective.num_labels}, but {task_cfg.train} has "
                              f"{classes} classes")
        cfg.objective.num_labels = classes
        if cfg.objective.method == "css_lm":
            corpus = resolve_corpus_stream(cfg.objective.corpus.url)
            plan_epoch(load_shards(corpus), 0, cfg.train.seed, cfg.cluster.num_workers, cfg.data.loader_workers,
                       cfg.micro_batch * cfg.objective.domain_negatives)
        runs = []
        for i in range(repeats):
            seeded = copy.deepcopy(cfg)
            seeded.train.seed = cfg.train.seed + i
            if repeats > 1:
                seeded.train.name = f"{cfg.train.name}/seed-{seeded.train.seed}"
            run = run_url(seeded)
            storage.check_bucket(run)
            # This driver's lease (its generation files, on a filesystem) is not a sign of an earlier run.
            earlier = (url for url in storage.list_prefix(run) if not url.rpartition("/")[2].startswith(LEASE))
            if cfg.train.resume != "latest" and next(earlier, None) is not None:
                raise ConfigError(f"{run} already exists: pass --resume latest to continue it (complete stages "
                                  f"are kept), or choose another train.name")
            runs.append((seeded, run))
        for seeded, run in runs:
            save_config(seeded, run)
    except (ConfigError, storage.StorageError, FileNotFoundError, ValueError) as err:
        print(f"error: {storage.redact(str(err))}", file=sys.stderr)
        return 2

    log.info(f"[clsys] {cfg.objective.method} on {task_cfg.train}: {classes} classes, {task_cfg.shots or 'all'} "
             f"per class, {repeats} seed(s), {cfg.cluster.num_workers} worker(s), ZeRO stage {cfg.train.zero_stage}")
    init_ray(cfg)
    results = []
    for seeded, run in runs:
        if storage.exists(storage.join(run, RESULT)):
            log.info(storage.redact(f"[clsys] seed {seeded.train.seed}: complete in {run}, skipped"))
        else:
            train(seeded, None, css_lm_worker)
            if not storage.exists(storage.join(run, RESULT)):  # a stage stopped on request (<stage run>/STOP)
                print(storage.redact(f"[clsys] seed {seeded.train.seed} stopped before its end: --resume latest "
                                     f"continues it from its checkpoint"), file=sys.stderr)
                return EXIT_PREEMPTED
        results.append({"seed": seeded.train.seed, "run": run, **storage.read_json(storage.join(run, RESULT))})
    tests = [r["test_accuracy"] for r in results]
    summary = {"method": cfg.objective.method, "task": task_cfg.train, "shots": task_cfg.shots, "seeds": results,
               "test_accuracy_mean": statistics.mean(tests),
               "test_accuracy_std": statistics.stdev(tests) if len(tests) > 1 else 0.0}
    storage.write_json(storage.join(run_url(cfg), "summary.json"), summary)
    print(f"\n{'seed':>6} {'warm-up dev':>12} {'warm-up test':>13} {'dev':>8} {'test':>8}   (accuracy at the best dev epoch)")
    for r in results:
        print(f"{r['seed']:>6} {r['warmup']['dev_accuracy']:>12.4f} {r['warmup']['test_accuracy']:>13.4f} "
              f"{r['dev_accuracy']:>8.4f} {r['test_accuracy']:>8.4f}")
    print(storage.redact(f"\n[clsys] {cfg.objective.method}: test accuracy "
                         f"{100 * summary['test_accuracy_mean']:.2f} ± {100 * summary['test_accuracy_std']:.2f} over "
                         f"{len(tests)} seed(s); summary {storage.join(run_url(cfg), 'summary.json')}"))
    classifier = storage.join(results[-1]["run"], "export")
    print(storage.redact(f"  classifier:  python -m clsys.classify --model {classifier} FILE"))
    return 0
