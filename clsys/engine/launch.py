"""Running a config on Ray Train: join or start the Ray cluster, then one TorchTrainer run of a worker function.

What every driver shares (``clsys.pretrain`` for the step loop, a recipe's own driver for its stages): the
workers' environment, Ray on loopback when this process starts the cluster, the run's failure policy and the
collective watchdog. The workers get the resolved ``Config`` itself in ``train_loop_config["config"]``.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import socket
import tempfile

from clsys import logs, storage
from clsys.config import ClusterConfig, Config, run_url
from clsys.engine.ray_guard import guard

log = logging.getLogger(__name__)

# Settings the workers need, handed to them through Ray's runtime_env (``handed_env``). Credentials are never
# among them: workers read them from their own environment or instance role.
WORKER_ENV = ("DS_ACCELERATOR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM",
              "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "TORCH_EXTENSIONS_DIR", "RAY_API_SERVER_ADDRESS")


def handed_env(env: dict[str, str], joining: bool) -> dict[str, str]:
    """What of ``env`` goes into Ray's runtime_env. Not the variables the job's runtime_env sets: under `ray job
    submit` they already reach every worker, and Ray refuses a driver runtime_env that sets them again ("Failed
    to merge the Job's runtime env"). Nor a variable whose value holds a secret (a URL's ``user:password``, a
    signed query: what ``storage.redact`` hides, e.g. in AWS_ENDPOINT_URL): Ray writes the runtime_env into its
    log files (runtime_env_agent.log, many times a run) and shows it in the dashboard. The workers of a cluster
    this process starts inherit such a variable from its environment; a joined cluster's nodes need it in
    their own, which is said."""
    job_env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("runtime_env") or {}
    secret = sorted(k for k, v in env.items() if storage.redact(v) != v)
    if secret and joining:
        log.warning(f"[clsys] warning: {', '.join(secret)}: its value holds a secret, so it is not handed to the "
                    "cluster's workers through Ray's runtime_env (Ray writes that to its logs); set it in the nodes' "
                    "own environment (docs/operations/storage.md)")
    return {k: v for k, v in env.items() if k not in (job_env.get("env_vars") or {}) and k not in secret}


def init_ray_for_tasks(cpus: int, names: tuple[str, ...]) -> bool:
    """Ray for tasks and actors of a command (no Ray Train): the cluster at RAY_ADDRESS (as under `ray job submit`),
    else a local one of ``cpus`` CPUs on 127.0.0.1; the variables ``names`` of this environment reach the workers.
    Whether it joined a cluster."""
    joining = bool(os.environ.get("RAY_ADDRESS"))
    env = handed_env({k: os.environ[k] for k in names if k in os.environ}, joining)
    if not joining:
        # Without it, a local cluster binds its services to the machine's external address (docs/running/ray.md).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    local = {} if joining else {"address": "local", "num_cpus": cpus, "include_dashboard": False}
    # No runtime_env unless there is something to set: a job with one gets worker processes of its own,
    # started (and their imports paid) while the command waits, instead of the cluster's idle ones
    # (measured: 0.6 s of a 16 s data_prep run on a 2-CPU cluster).
    started = ray.init(runtime_env={"env_vars": env} if env else None, logging_level=logging.WARNING, **local)
    if not joining:
        guard(started.address_info["session_dir"])  # its agents would outlive this process killed (ray_guard)
    return joining


def init_ray(cfg: Config) -> None:
    import ray

    env = {k: os.environ[k] for k in WORKER_ENV if k in os.environ}
    if not cfg.cluster.use_gpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
    # Ray Train routes workers' print() through its logger, which reaches the console twice.
    env["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    # The driver's level (its --log-level or CLSYS_LOG_LEVEL), for each worker's clsys.logs.configure().
    env[logs.LEVEL_ENV] = logging.getLevelName(logging.getLogger("clsys").getEffectiveLevel())
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
    env = handed_env(env, joining=bool(os.environ.get("RAY_ADDRESS")))
    # Ray's notice that token authentication is on (docs/running/ray.md says so) came on every start.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env={"env_vars": env}, logging_level=logging.WARNING)
        log.info(f"[clsys] joined the Ray cluster at {os.environ['RAY_ADDRESS']}")
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
    log.info(f"[clsys] started a local Ray cluster with {cpus} CPUs, dashboard {dashboard} "
             "(set RAY_ADDRESS to join one)")


def warn_if_no_node_fits_a_worker(cluster: ClusterConfig, nodes: list[dict[str, float]]) -> None:
    """Ray Train waits, silently, until a node has a worker's resources: say so when none has them now (an
    autoscaler may still add one), e.g. workers of 2 CPUs on cluster/local.sh's 1-CPU nodes."""
    need = {"CPU": cluster.cpus_per_worker, **({"GPU": 1} if cluster.use_gpu else {})}
    if not any(all(node.get(key, 0) >= amount for key, amount in need.items()) for node in nodes):
        most = max((node.get("CPU", 0) for node in nodes), default=0)
        log.warning(f"[clsys] warning: no node of this cluster has {need} for a worker (the most CPUs on a node: "
                    f"{most:g}); training waits until one joins. Set cluster.cpus_per_worker (and cluster.num_workers) "
                    "to what the nodes have.")


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
        functools.partial(run_logged, worker),
        train_loop_config={"config": cfg, "resume": resume},
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


def run_logged(worker, payload: dict) -> None:
    """``worker(payload)`` in a Ray Train worker, its logging configured first as the driver's is (the level
    comes in the workers' environment, ``init_ray``)."""
    logs.configure()
    worker(payload)


def save_config(cfg: Config, run: str) -> None:
    """The resolved config, as a recipe, at ``<run>/config.yaml``: what this start of the run uses, its URLs
    without their secrets (a recipe is shared; nothing resumes from it: a URL's secret comes from the command
    line again, or from the filesystem's configuration)."""
    storage.write_bytes(storage.join(run, "config.yaml"), storage.redact(cfg.to_yaml()).encode())
