"""Shared fixtures: a real S3-compatible server (moto_server) on 127.0.0.1, in its own process."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

# Keep Ray (and gloo's MASTER_ADDR) on loopback; see docs/running/ray.md, "Ray on one machine".
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from clsys import logs  # noqa: E402
from clsys.engine.launch import free_loopback_port as free_port  # noqa: E402  (the name the tests import)


# The files of the ``slow`` tests (Ray clusters, DeepSpeed runs): two thirds of the suite's time, during which
# ~30% of two cores sit idle while the tests wait on processes.
SLOW_FILES = {"tests/test_clir_pipeline.py", "tests/test_css_pipeline.py", "tests/test_fault_tolerance.py",
              "tests/test_local_cluster.py", "tests/test_logs.py", "tests/test_mine.py",
              "tests/test_pairs_objective.py", "tests/test_pretrain.py", "tests/test_slurm.py",
              "tests/test_source_mixing.py"}
# Of those, the files `make test` runs in one pytest-xdist worker, in this order, while the other worker takes the
# many short tests and test_pretrain.py's among them. With every slow file in the one worker, the other was done at
# 13.5 min and the slow files went on alone to 27.6 (2026-11-28). The local-cluster and SLURM tests come last, once the
# other worker is done: under its load a job was once submitted before Ray's job agent was up.
ONE_WORKER_FILES = ("tests/test_clir_pipeline.py", "tests/test_fault_tolerance.py", "tests/test_css_pipeline.py",
                    "tests/test_local_cluster.py", "tests/test_slurm.py")


def _file(nodeid: str) -> str:
    return nodeid.partition("::")[0]


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.get_closest_marker("slow") and _file(item.nodeid) not in SLOW_FILES:
        raise pytest.UsageError(f"{item.nodeid} is marked slow: add its file to SLOW_FILES in tests/conftest.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """ONE_WORKER_FILES' tests last, in that order of files (each file's tests in their own order), the others
    as they were."""
    lane = sorted((item for item in items if _file(item.nodeid) in ONE_WORKER_FILES),
                  key=lambda item: ONE_WORKER_FILES.index(_file(item.nodeid)))
    items[:] = [item for item in items if _file(item.nodeid) not in ONE_WORKER_FILES] + lane


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's scheduling by scope, one scope holding every test of ONE_WORKER_FILES. Scopes go out largest
    first, so that one starts at once; a file's short tests ride along (a few seconds)."""
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerFilesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "one worker" if _file(nodeid) in ONE_WORKER_FILES else nodeid

    return OneWorkerFilesTogether(config, log)


@contextlib.contextmanager
def environ_set(env: dict[str, str]):
    """This process's environment with ``env`` set (so also every subprocess a test starts), restored after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def use_endpoint(monkeypatch, url: str) -> None:
    """Fresh S3 clients from here on, for ``url`` (a fault proxy): storage caches one per process, and
    boto3's default session caches the credentials it first found."""
    import boto3

    from clsys import storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    storage.forget_s3_clients()


@pytest.fixture
def ray_tmpdir(monkeypatch) -> Path:
    """TMPDIR of the commands a test starts: where Ray keeps its session (its logs) and Ray Train the folder of a
    run on object storage, for a test that reads them. A short path: Ray's socket paths must stay under 107 bytes."""
    folder = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", folder)
    yield Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto_server did not start")


@pytest.fixture(autouse=True)
def logging_as_a_library():
    """Each test starts with the ``clsys`` and ``data_prep`` loggers as a library leaves them (no handler, records
    reaching the root, where pytest's caplog reads them): a command's main() run in-process configures them
    (``clsys.logs.configure``) for the rest of the process."""
    yield
    for name in logs.ROOTS:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, logs.ConsoleHandler)]:
            logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server process on 127.0.0.1; the AWS env of this process points at it."""
    port = free_port()
    moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_port(port, proc)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        with environ_set(env):
            yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh, empty bucket on the test S3 server; yields its s3:// URL."""
    from clsys import storage

    name = f"t-{uuid.uuid4().hex[:12]}"
    storage.s3_client().create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(scope="session")
def s3_auth_server():
    """A second moto server that enforces IAM auth, for wrong-credential tests.

    moto_server skips auth for its first ``INITIAL_NO_AUTH_ACTION_COUNT`` requests: we spend them
    creating an IAM user with an allow-all policy and an access key; from then on a request signed
    with a wrong secret gets 403/SignatureDoesNotMatch. Yields endpoint, key pair and a bucket URL;
    this process's AWS env is not touched (pass the values to a subprocess).
    """
    import json

    import boto3

    port = free_port()
    moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port, proc)
        endpoint = f"http://127.0.0.1:{port}"
        anon = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test")
        iam = boto3.client("iam", **anon)
        iam.create_user(UserName="clsys-test")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="clsys-test", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="clsys-test")["AccessKey"]
        bucket = "auth-bucket"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key["AccessKeyId"],
                     aws_secret_access_key=key["SecretAccessKey"]).create_bucket(Bucket=bucket)
        yield {"endpoint": endpoint, "access_key_id": key["AccessKeyId"], "secret_access_key": key["SecretAccessKey"],
               "bucket_url": f"s3://{bucket}"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


FTP_SERVER = """
import sys
from pyftpdlib.authorizers import DummyAuthorizer
from pyftpdlib.handlers import FTPHandler
from pyftpdlib.servers import FTPServer

authorizer = DummyAuthorizer()
authorizer.add_anonymous(sys.argv[1], perm="elradfmwMT")
for user, password in zip(sys.argv[3::2], sys.argv[4::2]):
    authorizer.add_user(user, password, sys.argv[1], perm="elradfmwMT")
FTPHandler.authorizer = authorizer
FTPServer(("127.0.0.1", int(sys.argv[2])), FTPHandler).serve_forever()
"""


@contextlib.contextmanager
def ftp_server(folder, *users: str):
    """An FTP server on 127.0.0.1 in its own process, serving ``folder`` writable to anonymous and to each
    (user, password) of ``users``; yields its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", FTP_SERVER, str(folder), str(port), *users],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port, proc)
        yield f"ftp://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def ftp_root(tmp_path):
    """An anonymous, writable FTP server (``ftp_server``); yields (URL, its folder)."""
    folder = tmp_path / "ftp"
    folder.mkdir()
    with ftp_server(folder) as url:
        yield url, folder


@pytest.fixture
def small_disk(tmp_path):
    """A mount point with a tmpfs of 2 MiB, a real disk that fills up; yields (path, resize(size))."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True)

    def resize(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)

    try:
        yield disk, resize
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    """The architecture of a 1-layer BERT (hidden 32, 64 positions) for model.init=scratch, with the
    packaged tokenizer: CSS-LM's tests."""
    from transformers import BertConfig

    folder = tmp_path_factory.mktemp("tiny-bert")
    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_bert_with_heads(tmp_path_factory) -> str:
    """A small random BERT with pooler, MLM and NSP heads and the packaged tokenizer, as a model folder."""
    import torch
    from transformers import BertConfig, BertForPreTraining

    from clsys.model.encoder import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-bert-with-heads")
    tokenizer = load_tokenizer("all-MiniLM-L6-v2")
    torch.manual_seed(0)
    BertForPreTraining(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=128)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray cluster (all on 127.0.0.1, dashboard included) that every `python -m clsys.pretrain`
    a test module starts joins, through RAY_ADDRESS in this process's environment, instead of starting
    and stopping a cluster of its own (~7 s a run). Modules whose assertions are about a cluster the
    run starts itself, or about other launchers, do not use it; test_pretrain's S3 run keeps the
    driver's own local cluster covered. Yields the joining environment; a test can pass another."""
    # 4 logical CPUs: the elastic tests resume on 3 workers of 1 CPU.
    with loopback_ray_cluster(head_cpus=4) as (_, env), environ_set(env):
        yield env


@contextlib.contextmanager
def loopback_ray_cluster(head_cpus: int):
    """A real Ray cluster (``ray.cluster_utils.Cluster``) on 127.0.0.1, its dashboard on a free port;
    yields (cluster, env), env being what a driver needs to join it: its address, and its dashboard's
    for Ray Train's State API queries (see clsys.engine.launch.init_ray)."""
    from ray.cluster_utils import Cluster

    port = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "node_ip_address": "127.0.0.1", "include_dashboard": True,
        "dashboard_host": "127.0.0.1", "dashboard_port": port})
    try:
        yield cluster, {"RAY_ADDRESS": cluster.address, "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}
    finally:
        cluster.shutdown()


class RankCheckpoints:
    """Inside one of ``world`` processes (``torch.multiprocessing.spawn``): a gloo group on 127.0.0.1 and a
    real DeepSpeed engine (CPU, ZeRO ``stage``) on the ``tiny`` BERT, saving checkpoints as a training
    worker does, with its rank in the loader state so that a restore shows whose state came back."""

    def __init__(self, rank: int, port: int, tiny: str, world: int = 2, stage: int = 2):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
        from clsys.recipes import OBJECTIVES, load_config
        from clsys.engine.deepspeed import build_engine, init_distributed
        from clsys.model.encoder import load_tokenizer

        init_distributed()
        self.cfg = load_config(None, ["objective.name=simcse", f"model.name={tiny}", "model.init=scratch",
                                      "model.tokenizer=all-MiniLM-L6-v2", f"cluster.num_workers={world}",
                                      "train.batch_size=8", f"train.zero_stage={stage}", "train.precision=fp32"])
        self.rank, self.world = rank, world
        self.objective = OBJECTIVES["simcse"](self.cfg, load_tokenizer(self.cfg.model.tokenizer))
        self.engine = build_engine(self.objective, self.cfg)

    def save(self, run: str, step: int) -> str:
        """Checkpoint ``step``, complete when this returns (the background writer, waited for); what the
        training loop writes, so that ``clsys.export`` takes it."""
        from clsys.engine.checkpoint_writer import CheckpointWriter

        def hf_files(folder: str) -> None:
            self.objective.tokenizer.save_pretrained(folder)
            self.objective.encoder().config.save_pretrained(folder)

        writer = CheckpointWriter(self.engine, run, keep=10)
        meta = {"world_size": self.world, "config": self.cfg.to_dict(), "precision": self.cfg.train.precision,
                "objective": "simcse", **self.objective.export_spec().to_meta()}
        url = writer.save(step, {"loader": {"rank": self.rank}}, meta, hf_files)
        writer.wait()
        return url

    def resume(self, candidates: list[str]) -> tuple[int, dict]:
        """(step, loader state) restored from the first intact checkpoint of ``candidates``."""
        from clsys.engine import checkpoint

        fetched = checkpoint.fetch_intact(candidates, self.world)
        return fetched.step, checkpoint.load(self.engine, fetched, self.world)["loader"]
