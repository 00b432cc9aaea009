"""TensorBoard for long runs: event files mirrored to S3 while they grow, and served from there by
`python -m clsys.tensorboard` on 127.0.0.1 (a real moto S3 server, a real TensorBoard over HTTP)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from torch.utils.tensorboard import SummaryWriter

from clsys import storage
from clsys.metrics.event_sync import EventSync
from clsys.tensorboard import pull
from conftest import free_port
from tensorboard_events import tensorboard_scalars
from test_pretrain import REPO


def wait_for(condition, timeout: float = 60, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = condition()
        except (OSError, ValueError, KeyError):
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def write_losses(writer: SummaryWriter, steps: range) -> None:
    for step in steps:
        writer.add_scalar("train/loss", 1.0 / (step + 1), step)
    writer.flush()


def test_event_sync_mirrors_growing_files_then_pull_fetches_only_what_changed(s3_bucket, tmp_path):
    local, url = tmp_path / "tb", f"{s3_bucket}/runs/r1/tensorboard"
    writer = SummaryWriter(str(local))
    write_losses(writer, range(3))
    sync = EventSync(str(local), url, every_s=0.2)
    wait_for(lambda: list(storage.list_prefix(url)), what="the first sync")

    cache, pulled = tmp_path / "cache", {}
    assert pull(f"{s3_bucket}/runs/r1", str(cache), pulled) == 1
    assert tensorboard_scalars(str(cache))["train/loss"] == pytest.approx([1, 1 / 2, 1 / 3])
    assert pull(f"{s3_bucket}/runs/r1", str(cache), pulled) == 0, "an unchanged file was fetched again"

    write_losses(writer, range(3, 5))  # the event file grows; the background sync copies it again
    wait_for(lambda: pull(f"{s3_bucket}/runs/r1", str(cache), pulled), what="the grown file")
    writer.add_scalar("train/loss", 0.01, 5)
    writer.close()
    sync.close()  # the last copy happens at close, whatever the interval
    pull(f"{s3_bucket}/runs/r1", str(cache), pulled)
    assert tensorboard_scalars(str(cache))["train/loss"][-1] == pytest.approx(0.01)
    assert len(tensorboard_scalars(str(cache))["train/loss"]) == 6


def serve(run_url: str, cache, *extra: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clsys.tensorboard", run_url, "--port", str(port),
                             "--cache", str(cache), *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def test_serve_a_run_from_s3_and_follow_it(s3_bucket, tmp_path):
    """A run root with two runs: both served under their names; new points appear after a refresh."""
    writers = {}
    for name in ("alpha", "beta"):
        writers[name] = SummaryWriter(str(tmp_path / name))
        write_losses(writers[name], range(2))
        EventSync(str(tmp_path / name), f"{s3_bucket}/runs/{name}/tensorboard", every_s=3600).close()

    proc, base = serve(f"{s3_bucket}/runs", tmp_path / "cache", "--refresh", "0.5")
    try:
        tags = wait_for(lambda: get_json(f"{base}/data/plugin/scalars/tags"), what="TensorBoard to answer")
        assert set(tags) == {"alpha", "beta"} and "train/loss" in tags["alpha"]

        write_losses(writers["alpha"], range(2, 4))
        EventSync(str(tmp_path / "alpha"), f"{s3_bucket}/runs/alpha/tensorboard", every_s=3600).close()
        points = f"{base}/data/plugin/scalars/scalars?run=alpha&tag=train/loss"
        wait_for(lambda: len(get_json(points)) == 4, what="the new points of alpha")
        assert [step for _, step, _ in get_json(points)] == [0, 1, 2, 3]
    finally:
        proc.terminate()
        output = proc.communicate(timeout=10)[0]
    assert "http://127.0.0.1:" in output, output  # bound to loopback by default


def test_serve_a_local_run_in_place(tmp_path):
    write_losses(SummaryWriter(str(tmp_path / "run" / "tensorboard")), range(3))
    proc, base = serve(str(tmp_path / "run"), tmp_path / "unused")
    try:
        points = f"{base}/data/plugin/scalars/scalars?run=.&tag=train/loss"
        assert len(wait_for(lambda: get_json(points), what="TensorBoard to answer")) == 3
    finally:
        proc.terminate()
        proc.communicate(timeout=10)
    assert not os.path.exists(tmp_path / "unused"), "a local run was copied instead of served in place"


def test_a_run_without_event_files_is_a_clear_error(s3_bucket, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "clsys.tensorboard", f"{s3_bucket}/runs/none"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"no TensorBoard event files under {s3_bucket}/runs/none" in proc.stderr
