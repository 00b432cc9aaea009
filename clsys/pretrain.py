"""``python -m clsys.pretrain [--config RECIPE] [--resume latest|URL] [--print-config] [key=value ...]``

With no arguments this is the quickstart recipe. Overrides are ``section.key=value``, also written
``--section.key=value`` or ``--section.key value``; ``--help`` lists the bundled recipes and every key
with its default and meaning, ``--print-config`` prints the resolved config and exits. The driver
resolves the config, checks the data and the run folder, writes the resolved config to
``<run>/config.yaml`` (a recipe: ``--config`` takes it back), then runs Ray Train workers
(``clsys.engine.loop.train_worker``): it joins the Ray cluster named by ``RAY_ADDRESS`` (as under
``ray job submit``) and otherwise starts a local one in-process. After training it exports the final encoder and, when ``eval.sts_test``
is set, prints the STS scores of the base model and the trained one side by side.

SIGUSR1 or SIGTERM (a scheduler's preemption notice) makes the workers checkpoint at the next
step and stop; the driver then exits with code 75 and ``--resume latest`` continues the run
(``clsys.engine.preemption``).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

from clsys import logs, storage
from clsys.storage import integrity
from clsys.config import Config, ConfigError, run_url
from clsys.driver.paths import resolve_local_paths
from clsys.engine import checkpoint
from clsys.engine.launch import init_ray, save_config, train
from clsys.storage.lease import Lease
from clsys.engine.preemption import EXIT_PREEMPTED, clear_stop_marker, install_stop_handlers
from clsys.recipes import HOMES, load_config

log = logs.module_logger(__name__, __spec__)

SEEDED = [name for name, home in HOMES.items() if home.runs_seeds]  # recipes that take --repeats N > 1


def set_driver_environment() -> None:
    """The environment this driver and the Ray cluster it starts or joins need, unless the user set it: set in
    main, before Ray starts, so that importing this module changes nothing."""
    # A local Ray cluster started by this driver must not pick the machine's external address for its
    # services and gloo (see docs/running/ray.md). Joining a cluster, the cluster's own settings apply.
    if not os.environ.get("RAY_ADDRESS"):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ray's driver holds back a worker's line that looks like another worker's line (numbers masked) for up
    # to 5 s, to merge them into one "[repeated Nx]" line: "[clsys] rank 1/2: pid ..." came seconds after
    # rank 0's steps. The run's own lines are each rank's news, printed as they come.
    os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", r"\[clsys\]")


def resolve_resume(cfg: Config, run: str) -> str | None:
    """The checkpoint to start from, or None for a fresh run (which must not overwrite an old one)."""
    resume = cfg.train.resume
    if resume == "":
        if checkpoint.latest_checkpoint(run):
            raise ConfigError(f"{run} already has checkpoints: pass --resume latest to continue it, "
                              f"or choose another train.name")
        return None
    if resume == "latest":
        return checkpoint.latest_checkpoint(run)  # None: nothing to resume yet, start fresh
    if not storage.exists(storage.join(resume, "COMPLETE")):
        raise ConfigError(f"train.resume: {resume} is not a complete checkpoint")
    return resume


def check_data(cfg: Config) -> str:
    """Fail in the driver, before any worker starts, when the shards cannot feed this config."""
    from clsys.data.pretokenized import check_stream_tokenizer, refuse_unvouched_ids
    from clsys.shards.reader import load_shards
    from clsys.data.epoch_layout import plan_epoch
    from clsys.model.encoder import load_tokenizer
    from clsys.objectives import OBJECTIVES
    from clsys.shards.manifest import read_manifest

    objective = OBJECTIVES[cfg.objective.name]
    streams = [storage.join(cfg.data.url, name) for name in objective.streams(cfg)]
    for stream in streams:
        shards = load_shards(stream)
        try:
            plan_epoch(shards, 0, cfg.train.seed, cfg.cluster.num_workers, cfg.data.loader_workers, cfg.micro_batch)
        except ValueError as err:
            raise ValueError(f"{stream}: {err}") from None
        if not objective.reads_ids(cfg):
            continue
        recorded = read_manifest(stream).get("tokenizer")
        if recorded is None:
            refuse_unvouched_ids(stream, shards[0])
        else:
            # Loaded only here: a pre-tokenized stream's ids must be the ones the training tokenizer gives.
            name = cfg.model.tokenizer or cfg.model.name
            check_stream_tokenizer(stream, recorded, name, load_tokenizer(name), cfg.data.max_length)
    return ", ".join(streams)


def compare_on_sts(cfg: Config, exported: str) -> tuple[str, list[dict]]:
    """STS test scores of the base model and of the exported one, for each requested pooling; printed,
    and returned with the table's title."""
    from clsys.eval.sts import evaluate_sts
    from clsys.model.encoder import load_encoder, load_tokenizer
    from clsys.eval.sts_data import load_sts, resolve_sts

    sts = load_sts(resolve_sts(cfg.eval.sts_test))
    if sts.note:
        log.info(f"[clsys] eval.sts_test {cfg.eval.sts_test}: {sts.note}")
    rows = []
    # A model trained from scratch has no "before" worth scoring.
    models = [("before", cfg.model.name)] if cfg.model.init == "pretrained" else []
    for label, model_name in models + [("after", exported)]:
        model, tokenizer = load_encoder(model_name), load_tokenizer(model_name)
        for pooling in cfg.eval.test_poolings.split(","):
            scores = evaluate_sts(model, tokenizer, sts, pooling=pooling.strip(), batch_size=cfg.eval.batch_size)
            rows.append({"model": label, "pooling": pooling.strip(), **scores})
    title = f"STS test: {sts.name} ({len(sts.scores)} pairs), cosine, ×100"
    # A result table, like clsys.evaluate's: printed at every --log-level.
    print(f"\n{title}")
    print(f"{'model':<8} {'pooling':<8} {'Spearman':>9} {'Pearson':>9}")
    for r in rows:
        print(f"{r['model']:<8} {r['pooling']:<8} {r['spearman']:>9.2f} {r['pearson']:>9.2f}")
    return title, rows


class _Parser(argparse.ArgumentParser):
    def format_help(self) -> str:
        # The keys come from the config dataclasses (importing every objective): read only when asked for.
        from clsys.driver.keys import help_text

        return f"{super().format_help()}\n{help_text()}\n"


DOTTED_OPTION = re.compile(r"--([a-z_]+(?:\.[a-z_0-9]+)+)(=.*)?", re.S)


def dotted_options_as_overrides(argv: list[str]) -> list[str]:
    """``--section.key=value`` and ``--section.key value`` (how torchtitan, tyro and HF users write them)
    as the ``section.key=value`` overrides they mean; every other argument unchanged."""
    out, i = [], 0
    while i < len(argv):
        match = DOTTED_OPTION.fullmatch(argv[i])
        if match and match.group(2):
            out.append(argv[i][2:])
        elif match and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append(f"{match.group(1)}={argv[i + 1]}")
            i += 1
        elif match:
            raise ConfigError(f"{argv[i]}: no value (write {argv[i]}=VALUE)")
        else:
            out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m clsys.pretrain", description="Train a text encoder with a bundled or own "
                     "recipe on Ray Train + DeepSpeed (no arguments: the quickstart).",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="quickstart", help="recipe file or bundled recipe name (default: quickstart)")
    parser.add_argument("--resume", default=None, help="'latest' or a checkpoint URL (same as train.resume=...)")
    parser.add_argument("--repeats", type=int, default=1,
                        help=f"{' or '.join(SEEDED)}: run this many seeds (train.seed, +1, ...) and report mean ± std")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (a recipe, YAML) and exit without training")
    logs.add_level_option(parser)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 data.url=s3://bucket/shards "
                        "(or --train.steps=50)")
    try:
        args = parser.parse_args(dotted_options_as_overrides(sys.argv[1:] if argv is None else list(argv)))
    except ConfigError as err:
        print(f"error: {storage.redact(str(err))}", file=sys.stderr)
        return 2
    logs.configure(args.log_level)
    set_driver_environment()
    # Under `ray job submit --working-dir` with several raylets on one machine, each node's runtime-env
    # agent unpacks the working dir into the same shared folder, replacing the one this process is in
    # (from ray.init on): note it while it exists, and come back to it (re-created) after training.
    started_in = os.getcwd()
    try:
        overrides = list(args.overrides) + ([f"train.resume={args.resume}"] if args.resume else [])
        cfg = load_config(args.config, overrides)
        resolve_local_paths(cfg)  # Ray Train workers do not run in the driver's folder: ship absolute paths
        if args.repeats < 1 or (args.repeats > 1 and cfg.objective.name not in SEEDED):
            raise ConfigError(f"--repeats: a number >= 1, and above 1 only for the {' or '.join(SEEDED)} recipe")
        if args.print_config:
            print(cfg.to_yaml(), end="")
            return 0
        run = run_url(cfg)
        storage.check_bucket(run)
        run_lease = Lease(run, cfg.cluster.lease_ttl_s)
        if cfg.cluster.lease_ttl_s:
            run_lease.acquire()
    except (ConfigError, storage.StorageError, FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"error: {storage.redact(str(err))}", file=sys.stderr)
        return 2
    try:
        if cfg.objective.name in HOMES:  # a recipe with a driver of its own (clsys.recipes.home)
            return HOMES[cfg.objective.name].drive(cfg, args.repeats)
        return run_and_export(cfg, run, started_in)
    finally:
        run_lease.release()


def run_and_export(cfg: Config, run: str, started_in: str) -> int:
    """Train (resuming as configured), export, and compare on STS; the driver's exit code."""
    try:
        resume = resolve_resume(cfg, run)
        stream = check_data(cfg)
        if cfg.model.init == "pretrained":
            from clsys.model.loading import checked_model_path

            checked_model_path(cfg.model.name)  # a damaged exported folder fails here, not in every worker
        clear_stop_marker(run)
        save_config(cfg, run)
    except (ConfigError, storage.StorageError, FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"error: {storage.redact(str(err))}", file=sys.stderr)
        return 2

    log.info(storage.redact(f"[clsys] run {run}: {cfg.objective.name} on {stream}, "
                            f"{cfg.cluster.num_workers} worker(s), ZeRO stage {cfg.train.zero_stage}, "
                            f"{cfg.train.steps} steps"
                            + (f", resuming {resume}" if resume else "")))
    install_stop_handlers(run)
    init_ray(cfg)
    install_stop_handlers(run)  # again: ray.init installs a SIGTERM handler of its own
    try:
        train(cfg, resume)
    except RuntimeError as err:
        print(f"error: {storage.redact(str(err))}", file=sys.stderr)
        return 1
    os.chdir(started_in if os.path.isdir(started_in) else tempfile.gettempdir())
    latest = checkpoint.complete_checkpoints(run)[-1][0]
    if latest < cfg.train.steps:  # the workers stopped on request
        log.info(storage.redact(f"[clsys] stopped at step {latest} on request; checkpoint "
                                f"{checkpoint.step_url(run, latest)}; resume with --resume latest"))
        return EXIT_PREEMPTED

    from clsys.export import export
    from clsys.model.folder import CheckpointError

    exported = storage.join(run, "export")
    try:
        used, chosen = export(run, exported)
    except (integrity.IntegrityError, storage.StorageError, CheckpointError, OSError) as err:
        print(f"error: training finished, but the export failed: {storage.redact(str(err))}", file=sys.stderr)
        return 1
    log.info(storage.redact(f"[clsys] exported {used} ({chosen})"))
    if cfg.eval.sts_test:
        with tempfile.TemporaryDirectory() as local:
            if not storage.is_local(exported):
                storage.download_dir(exported, local)
            title, rows = compare_on_sts(cfg, storage.parse(exported).path if storage.is_local(exported) else local)
        from clsys.model.card import add_evaluation

        add_evaluation(exported, title, rows)  # the figures travel with the model, in its card

    # The run's outcome and where its outputs are: the command's result, printed at every --log-level.
    print("\n[clsys] done")
    print(storage.redact(f"  shards:      {stream}"))
    print(storage.redact(f"  checkpoints: {storage.join(run, 'checkpoints')}"))
    print(storage.redact(f"  model:       {exported}"))
    if not storage.is_local(run):
        print(storage.redact(f"  logs:        python -m clsys.tensorboard {run}"))
    else:
        print(f"  logs:        tensorboard --logdir {storage.parse(run).path}/tensorboard --host 127.0.0.1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
