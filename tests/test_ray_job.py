"""`ray start --head` + `ray job submit`: the job joins the running cluster (never starts its own),
streams shards from S3 and writes its checkpoints there."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clsys.engine.checkpoint import complete_checkpoints
from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
pytestmark = pytest.mark.slow


@pytest.fixture
def ray_head(s3_server):
    """A real Ray head on 127.0.0.1 with the job server; token auth on, as `ray start` defaults to."""
    # The job's `python` is looked up on the head's PATH: make it this environment's, as an
    # activated venv would.
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    dashboard = free_port()
    subprocess.run([RAY, "start", "--head", f"--port={free_port()}", "--num-cpus=2", "--node-ip-address=127.0.0.1",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--disable-usage-stats"],
                   env=env, check=True, timeout=180)
    try:
        # Ray 2.60 clients default to RAY_AUTH_MODE=disabled while `ray start` turns token auth on.
        yield {**env, "RAY_AUTH_MODE": "token", "RAY_ADDRESS": f"http://127.0.0.1:{dashboard}"}
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, timeout=120)


def test_job_submit_trains_on_the_running_cluster(ray_head, s3_bucket):
    shards, runs = f"{s3_bucket}/shards", f"{s3_bucket}/runs"
    sample = sorted((REPO / "data_prep" / "samples").glob("*.bz2"))
    subprocess.run([sys.executable, "-m", "data_prep", "wiki", "--input", *map(str, sample), "--out", shards,
                    "--shard-size-mb", "2"], check=True, timeout=300)
    proc = subprocess.run(
        [RAY, "job", "submit", "--working-dir", ".", "--", "python", "-m", "clsys.pretrain",
         "--config", "clsys/configs/simcse_unsup.yaml", f"data.url={shards}", f"train.run_root={runs}",
         "train.name=job", "train.steps=2", "train.log_every=1", "eval.max_pairs=32"],
        cwd=REPO, env=ray_head, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n")
    assert proc.returncode == 0
    assert "joined the Ray cluster" in proc.stdout
    assert "started a local Ray cluster" not in proc.stdout
    assert [step for step, _ in complete_checkpoints(f"{runs}/job")] == [2]
