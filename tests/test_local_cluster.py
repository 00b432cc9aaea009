"""`cluster/local.sh up` (`ray start` of a head plus two worker raylets on 127.0.0.1, token auth on),
`ray job submit` of the quickstart recipe with this checkout as the working dir, streaming its shards
from S3 and writing its checkpoints and export there, `cluster/local.sh down`: real Ray, real jobs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from clsys import storage
from clsys.engine.checkpoint import complete_checkpoints
from conftest import free_port
from test_pretrain import REPO, SAMPLE, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def ray_processes(marker: str) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if marker in line and "ps -eo" not in line]


def test_local_cluster_up_submit_down(s3_bucket, tmp_path):
    # The raylets start in this environment, which points boto3 at the test's S3 server: so do the workers.
    shards, runs = f"{s3_bucket}/shards", f"{s3_bucket}/runs"
    assert run("-m", "data_prep", "wiki", "--input", *map(str, SAMPLE), "--out", shards,
               "--shard-size-mb", "0.5").returncode == 0
    port, dashboard = free_port(), free_port()
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "CLSYS_RAY_PORT": str(port), "CLSYS_DASHBOARD_PORT": str(dashboard),
           "CLSYS_LOCAL_DIR": str(tmp_path / "cluster"), "CLSYS_PYTHON": sys.executable,
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    local_sh = str(REPO / "cluster" / "local.sh")
    gcs = f"127.0.0.1:{port}"

    up = subprocess.run([local_sh, "up"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        status = subprocess.run([local_sh, "status"], env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True,
                                text=True, timeout=120).stdout
        assert status.count("node_") == 3, status  # the head and two worker raylets
        assert "2.0 CPU" in status, status  # only the worker nodes have CPUs

        job = subprocess.run(
            [f"{bin_dir}/ray", "job", "submit", "--runtime-env", "cluster/runtime_env.yaml", "--working-dir", ".",
             "--", "python", "-m", "clsys.pretrain", f"data.url={shards}", f"train.run_root={runs}",
             "train.steps=4", "train.log_every=1", "train.batch_size=8", "eval.sts_dev=", "eval.sts_test="],
            cwd=REPO, env={**env, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": f"http://127.0.0.1:{dashboard}"},
            capture_output=True, text=True, timeout=600)
        output = job.stdout + job.stderr
        assert job.returncode == 0, output[-5000:]
        # The job joins the running cluster, never starts one of its own.
        assert "joined the Ray cluster at" in output and "started a local Ray cluster" not in output
        assert "[clsys] step 4/4" in output and "succeeded" in output
        assert [step for step, _ in complete_checkpoints(f"{runs}/quickstart")] == [4]
        assert storage.exists(f"{runs}/quickstart/export/model.safetensors")
    finally:
        down = subprocess.run([local_sh, "down"], env=env, capture_output=True, text=True, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not ray_processes(gcs), "cluster/local.sh down left processes of its cluster running"
    assert not ray_processes("local_node.py")


def test_local_sh_usage_error():
    proc = subprocess.run([str(REPO / "cluster" / "local.sh"), "sideways"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr
