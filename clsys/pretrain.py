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
import json
import logging
import os
import re
import socket
import sys
import tempfile

# A local Ray cluster started by this driver must not pick the machine's external address for its
# services and gloo (see docs/running/ray.md). Joining a cluster, the cluster's own settings apply.
if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray's driver holds back a worker's line that looks like another worker's line (numbers masked) for up
# to 5 s, to merge them into one "[repeated Nx]" line: "[clsys] rank 1/2: pid ..." came seconds after
# rank 0's steps. The run's own lines are each rank's news, printed as they come.
os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", r"\[clsys\]")

from clsys import integrity, storage  # noqa: E402
from clsys.config import ClusterConfig, Config, ConfigError, run_url  # noqa: E402
from clsys.config_paths import resolve_local_paths  # noqa: E402
from clsys.engine import checkpoint  # noqa: E402
from clsys.lease import LEASE, Lease  # noqa: E402
from clsys.engine.preemption import EXIT_PREEMPTED, clear_stop_marker, install_stop_handlers  # noqa: E402
from clsys.recipes import load_config  # noqa: E402

# Non-secret settings the workers need. Credentials are never put in Ray's runtime_env (it is
# visible in the dashboard): workers read them from their own environment / instance role.
WORKER_ENV = ("DS_ACCELERATOR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM",
              "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "TORCH_EXTENSIONS_DIR", "RAY_API_SERVER_ADDRESS")


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
    from clsys.data.pretokenized import check_stream_tokenizer
    from clsys.shards.reader import load_shards
    from clsys.data.epoch_layout import plan_epoch
    from clsys.model.encoder import load_tokenizer
    from clsys.objectives import OBJECTIVES
    from clsys.shards.manifest import read_manifest

    objective = OBJECTIVES[cfg.objective.name]
    streams = [storage.join(cfg.data.url, name) for name in objective.streams(cfg)]
    for stream in streams:
        try:
            plan_epoch(load_shards(stream), 0, cfg.train.seed, cfg.cluster.num_workers, cfg.data.loader_workers,
                       cfg.micro_batch)
        except ValueError as err:
            raise ValueError(f"{stream}: {err}") from None
        recorded = read_manifest(stream).get("tokenizer")
        if recorded is not None and objective.reads_ids(cfg):
            # Loaded only here: a pre-tokenized stream's ids must be the ones the training tokenizer gives.
            name = cfg.model.tokenizer or cfg.model.name
            check_stream_tokenizer(stream, recorded, name, load_tokenizer(name), cfg.data.max_length)
    return ", ".join(streams)


def init_ray(cfg: Config) -> None:
    import ray

    env = {k: os.environ[k] for k in WORKER_ENV if k in os.environ}
    if not cfg.cluster.use_gpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
    # Ray Train routes workers' print() through its logger, which reaches the console twice.
    env["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    # Read by Ray Train's controller when a failed worker group shuts down: how long its process group
    # gets to close before the workers are killed. A stuck rank never closes it, so every restart after
    # one waited Ray's whole default (30 s) for nothing.
    env["TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S"] = str(cfg.cluster.group_shutdown_timeout_s)
    env["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = str(cfg.cluster.health_check_timeout_s)  # read there too
    # Ray Train's preemption watcher is one more actor process per worker-group start (with a core-worker error
    # line about its arguments on every start), and it only records a node's drain notice for a training function
    # to ask about. clsys does not ask: a drained node's workers die with it and the run restarts from its last
    # checkpoint, and a notice to the driver (SIGUSR1/SIGTERM) checkpoints at once (docs/operations/fault-tolerance.md).
    env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    # Under `ray job submit`, variables the job's runtime_env sets already reach every worker, and
    # Ray refuses a driver runtime_env that sets them again ("Failed to merge the Job's runtime env").
    job_env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env") or {}
    env = {k: v for k, v in env.items() if k not in (job_env.get("env_vars") or {})}
    # Ray's notice that token authentication is on (docs/running/ray.md says so) came on every start.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env={"env_vars": env}, logging_level=logging.WARNING)
        print(f"[clsys] joined the Ray cluster at {os.environ['RAY_ADDRESS']}", flush=True)
        warn_if_no_node_fits_a_worker(cfg.cluster, [node["Resources"] for node in ray.nodes() if node["Alive"]])
        return
    cpus = max(cfg.cluster.num_workers * cfg.cluster.cpus_per_worker, os.cpu_count() or 1)
    # Ray Train's placement-group cleaner asks the State API (served by the dashboard) whether the
    # run's controller is alive, and at the end of the run waits for its last answer. A worker finds
    # the dashboard of a cluster that `ray.init` started only through RAY_API_SERVER_ADDRESS (else it
    # tries the address of the last `ray start` on this machine, then 127.0.0.1:8265): without both,
    # a warning every second, and where an old `ray start` left its address a 15 s wait and a "Failed
    # to stop PlacementGroupCleaner" traceback at the end of every run.
    port = free_loopback_port()
    env["RAY_API_SERVER_ADDRESS"] = dashboard = f"http://127.0.0.1:{port}"
    ray.init(address="local", num_cpus=cpus, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=port, runtime_env={"env_vars": env}, logging_level=logging.WARNING)
    print(f"[clsys] started a local Ray cluster with {cpus} CPUs, dashboard {dashboard} "
          "(set RAY_ADDRESS to join one)", flush=True)


def warn_if_no_node_fits_a_worker(cluster: ClusterConfig, nodes: list[dict[str, float]]) -> None:
    """Ray Train waits, silently, until a node has a worker's resources: say so when none has them now (an
    autoscaler may still add one), e.g. workers of 2 CPUs on cluster/local.sh's 1-CPU nodes."""
    need = {"CPU": cluster.cpus_per_worker, **({"GPU": 1} if cluster.use_gpu else {})}
    if not any(all(node.get(key, 0) >= amount for key, amount in need.items()) for node in nodes):
        most = max((node.get("CPU", 0) for node in nodes), default=0)
        print(f"[clsys] warning: no node of this cluster has {need} for a worker (the most CPUs on a node: "
              f"{most:g}); training waits until one joins. Set cluster.cpus_per_worker (and cluster.num_workers) "
              "to what the nodes have.", file=sys.stderr, flush=True)


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the tests' servers take theirs from here too)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(cfg: Config, resume: str | None, worker=None) -> None:
    """One Ray Train run of ``worker`` (default: the step loop, ``clsys.engine.loop.train_worker``)."""
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchTrainer

    from clsys.engine.failures import FailureReport
    from clsys.engine.rendezvous import BoundStoreTorchConfig

    if worker is None:
        from clsys.engine.loop import train_worker as worker

    c = cfg.cluster
    run = run_url(cfg)
    # Ray keeps its own bookkeeping here; our checkpoints go to the run's storage (clsys.engine.checkpoint).
    # Not under the driver's working folder: `ray job submit` on several raylets of one machine replaces
    # it while the driver runs (see main).
    ray_dir = os.path.join(storage.parse(run).path, "ray") if storage.is_local(run) else \
        os.path.join(tempfile.gettempdir(), "clsys-ray")
    trainer = TorchTrainer(
        worker,
        train_loop_config={"config": cfg.to_dict(), "resume": resume},
        # The collective watchdog: a rank stuck longer than this makes its peers' collectives fail,
        # which fails the worker group and (with cluster.max_restarts) restarts it from a checkpoint.
        torch_config=BoundStoreTorchConfig(backend="nccl" if c.use_gpu else "gloo",
                                           timeout_s=c.collective_timeout_s),
        scaling_config=ScalingConfig(num_workers=c.num_workers, use_gpu=c.use_gpu,
                                     resources_per_worker={"CPU": c.cpus_per_worker, **({"GPU": 1} if c.use_gpu else {})}),
        run_config=RunConfig(name=cfg.train.name.replace("/", "-"), storage_path=ray_dir,
                             failure_config=FailureConfig(max_failures=c.max_restarts),
                             # Ray Train's own INFO lines (resource requests, worker group starts, process
                             # group set-up) stay in its log files, off the console; warnings still show.
                             logging_config=LoggingConfig(log_level="WARNING"),
                             callbacks=[FailureReport()]),
    )
    try:
        trainer.fit()
    except TrainingFailedError as err:
        # FailureReport has named each failed rank's error; Ray's text holds the full tracebacks.
        raise RuntimeError(f"training failed after {c.max_restarts} restart(s): "
                           f"{str(err).strip().splitlines()[0]}") from err


def run_css_lm(cfg: Config, repeats: int) -> int:
    """CSS-LM (or its fine-tuning baseline) for ``repeats`` seeds train.seed, +1, …: one Ray Train run
    each (``clsys.engine.css_pipeline``), then test accuracy at the best dev epoch, mean ± std."""
    import copy
    import statistics

    from clsys.data.corpus import resolve_corpus_stream
    from clsys.shards.reader import load_shards
    from clsys.data.epoch_layout import plan_epoch
    from clsys.engine.css_pipeline import RESULT, css_lm_worker, load_task

    try:
        for key in ("train", "dev", "test"):
            if not getattr(cfg.task, key):
                raise ConfigError(f"task.{key}: set it to a labelled file (CSV/TSV/JSONL or 'LABEL text' lines)")
        if cfg.train.resume not in ("", "latest"):
            raise ConfigError("train.resume: css_lm resumes whole stages: '' or latest")
        task = load_task(cfg, cfg.train.seed)  # every file read and checked before any worker starts
        classes = len(task.train.label_names)
        if cfg.objective.num_labels not in (0, classes):
            raise ConfigError(f"objective.num_labels: {cfg.objective.num_labels}, but {cfg.task.train} has "
                              f"{classes} classes")
        cfg.objective.num_labels = classes
        if cfg.objective.method == "css_lm":
            corpus = resolve_corpus_stream(cfg.corpus.url)
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
            # This driver's lease (and its lock file, on a filesystem) is not a sign of an earlier run.
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

    print(f"[clsys] {cfg.objective.method} on {cfg.task.train}: {classes} classes, {cfg.task.shots or 'all'} "
          f"per class, {repeats} seed(s), {cfg.cluster.num_workers} worker(s), ZeRO-{cfg.train.zero_stage}")
    init_ray(cfg)
    results = []
    for seeded, run in runs:
        if storage.exists(storage.join(run, RESULT)):
            print(storage.redact(f"[clsys] seed {seeded.train.seed}: complete in {run}, skipped"), flush=True)
        else:
            train(seeded, None, css_lm_worker)
        results.append({"seed": seeded.train.seed, "run": run, **storage.read_json(storage.join(run, RESULT))})
    tests = [r["test_accuracy"] for r in results]
    summary = {"method": cfg.objective.method, "task": cfg.task.train, "shots": cfg.task.shots, "seeds": results,
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


def compare_on_sts(cfg: Config, exported: str) -> tuple[str, list[dict]]:
    """STS test scores of the base model and of the exported one, for each requested pooling; printed,
    and returned with the table's title."""
    from clsys.evaluate import evaluate_sts
    from clsys.model.encoder import load_encoder, load_tokenizer
    from clsys.sts_data import load_sts, resolve_sts

    sts = load_sts(resolve_sts(cfg.eval.sts_test))
    if sts.note:
        print(f"[clsys] eval.sts_test {cfg.eval.sts_test}: {sts.note}", flush=True)
    rows = []
    # A model trained from scratch has no "before" worth scoring.
    models = [("before", cfg.model.name)] if cfg.model.init == "pretrained" else []
    for label, model_name in models + [("after", exported)]:
        model, tokenizer = load_encoder(model_name), load_tokenizer(model_name)
        for pooling in cfg.eval.test_poolings.split(","):
            scores = evaluate_sts(model, tokenizer, sts, pooling=pooling.strip(), batch_size=cfg.eval.batch_size)
            rows.append({"model": label, "pooling": pooling.strip(), **scores})
    title = f"STS test: {sts.name} ({len(sts.scores)} pairs), cosine, ×100"
    print(f"\n{title}")
    print(f"{'model':<8} {'pooling':<8} {'Spearman':>9} {'Pearson':>9}")
    for r in rows:
        print(f"{r['model']:<8} {r['pooling']:<8} {r['spearman']:>9.2f} {r['pearson']:>9.2f}")
    return title, rows


class _Parser(argparse.ArgumentParser):
    def format_help(self) -> str:
        # The keys come from the config dataclasses (importing every objective): read only when asked for.
        from clsys.config_keys import help_text

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


def save_config(cfg: Config, run: str) -> None:
    """The resolved config, as a recipe, at ``<run>/config.yaml``: what this start of the run uses."""
    storage.write_bytes(storage.join(run, "config.yaml"), cfg.to_yaml().encode())


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m clsys.pretrain", description="Train a text encoder with a bundled or own "
                     "recipe on Ray Train + DeepSpeed (no arguments: the quickstart).",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="quickstart", help="recipe file or bundled recipe name (default: quickstart)")
    parser.add_argument("--resume", default=None, help="'latest' or a checkpoint URL (same as train.resume=...)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="css_lm: run this many seeds (train.seed, +1, ...) and report mean ± std")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (a recipe, YAML) and exit without training")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 data.url=s3://bucket/shards "
                        "(or --train.steps=50)")
    try:
        args = parser.parse_args(dotted_options_as_overrides(sys.argv[1:] if argv is None else list(argv)))
    except ConfigError as err:
        print(f"error: {storage.redact(str(err))}", file=sys.stderr)
        return 2
    # Under `ray job submit --working-dir` with several raylets on one machine, each node's runtime-env
    # agent unpacks the working dir into the same shared folder, replacing the one this process is in
    # (from ray.init on): note it while it exists, and come back to it (re-created) after training.
    started_in = os.getcwd()
    try:
        overrides = list(args.overrides) + ([f"train.resume={args.resume}"] if args.resume else [])
        cfg = load_config(args.config, overrides)
        resolve_local_paths(cfg)  # Ray Train workers do not run in the driver's folder: ship absolute paths
        if args.repeats < 1 or (args.repeats > 1 and cfg.objective.name != "css_lm"):
            raise ConfigError("--repeats: a number >= 1, and above 1 only for the css_lm recipe")
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
        if cfg.objective.name == "css_lm":
            return run_css_lm(cfg, args.repeats)
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

    print(storage.redact(f"[clsys] run {run}: {cfg.objective.name} on {stream}, {cfg.cluster.num_workers} worker(s), "
                         f"ZeRO-{cfg.train.zero_stage}, {cfg.train.steps} steps"
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
        print(storage.redact(f"[clsys] stopped at step {latest} on request; checkpoint "
                             f"{checkpoint.step_url(run, latest)}; resume with --resume latest"), flush=True)
        return EXIT_PREEMPTED

    from clsys.export import export

    exported = storage.join(run, "export")
    try:
        used, chosen = export(run, exported)
    except (integrity.IntegrityError, storage.StorageError, OSError) as err:
        print(f"error: training finished, but the export failed: {storage.redact(str(err))}", file=sys.stderr)
        return 1
    print(storage.redact(f"[clsys] exported {used} ({chosen})"), flush=True)
    if cfg.eval.sts_test:
        with tempfile.TemporaryDirectory() as local:
            if not storage.is_local(exported):
                storage.download_dir(exported, local)
            title, rows = compare_on_sts(cfg, storage.parse(exported).path if storage.is_local(exported) else local)
        from clsys.model_card import add_evaluation

        add_evaluation(exported, title, rows)  # the figures travel with the model, in its card

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
