"""data_prep's worker processes dying, and runs stopped: a worker killed with kill -9 (what the OOM killer does)
fails the run within seconds with one line naming it (``data_prep pairs`` and ``data_prep wiki``), and every
other process of the run ends; SIGTERM of the main process ends its workers too; neither leaves a staged shard
(``shard-….tar.tmp-PID``) in the output, and a run removes those an earlier one left. Real commands
(``python -m data_prep``) in subprocesses, real signals. A bad row: tests/test_data_prep_pairs.py; a Ray actor
killed: tests/test_data_prep_ray.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from data_prep.__main__ import main
from test_data_prep import ROOT, SAMPLE


def big_jsonl(path: Path, mb: float) -> None:
    """Distinct pairs of ~1 KB a line, ``mb`` MB of them: a few seconds' work for two workers."""
    line = json.dumps({"query": "query {i}", "positive": "a positive passage " * 40, "neg": ["a negative"] * 5})
    path.write_text("".join(line.replace("{i}", str(i)) + "\n" for i in range(int(mb * 1e6 / len(line)))))


def start(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "data_prep", *map(str, argv)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(condition, timeout: float = 60):
    deadline = time.time() + timeout
    while not (value := condition()):
        assert time.time() < deadline, "the run never got there"
        time.sleep(0.01)
    return value


def workers_of(proc: subprocess.Popen) -> list[psutil.Process]:
    """The run's worker processes: its children forked from it (same command line)."""
    main = psutil.Process(proc.pid)
    return [child for child in main.children() if child.cmdline() == main.cmdline()]


def finish(proc: subprocess.Popen, workers: list[psutil.Process], within: float) -> tuple[int, str]:
    """The run's exit code and stderr once it has ended, within ``within`` seconds, and every worker with it
    (a run left hanging, or a worker left behind, is killed and fails the test)."""
    try:
        _, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        for p in [*workers, psutil.Process(proc.pid)]:
            p.kill()
        proc.communicate()
        pytest.fail(f"still running {within:.0f} s after the signal: it hangs")
    _, alive = psutil.wait_procs(workers, timeout=5)
    for p in alive:
        p.kill()
    assert not alive, f"workers left running after the run ended: {alive}"
    return proc.returncode, err


@pytest.mark.parametrize("killed", ["a worker", "the main process"])
def test_pairs_worker_killed_or_run_stopped_ends_every_process_and_leaves_no_staged_shard(killed, tmp_path):
    """Once a worker is writing a shard: kill -9 of that worker fails the run with one line naming it (exit 1);
    SIGTERM of the main process stops it (exit 143). Either way: no traceback, both workers gone, no staged shard
    and no manifest left."""
    big_jsonl(tmp_path / "big.jsonl", 25)
    out = tmp_path / "out"
    proc = start("pairs", "--input", tmp_path / "big.jsonl", "--out", out, "--workers", 2, "--shard-size-mb", 1,
                 "--shuffle-window-mb", 0)
    stream = out / "pairs" / "big"
    staged = wait_for(lambda: sorted(stream.glob("*.tmp-*")))
    workers = workers_of(proc)
    assert len(workers) == 2
    writer = int(staged[0].name.rpartition("-")[2])  # the worker that stages it: the name ends in its pid
    os.kill(writer if killed == "a worker" else proc.pid, signal.SIGKILL if killed == "a worker" else signal.SIGTERM)
    code, err = finish(proc, workers, within=15)
    if killed == "a worker":
        assert code == 1, err
        assert re.search(rf"^data_prep pairs: error: worker [12] of 2 \(pid {writer}\) died: killed by SIGKILL "
                         r"\(kill -9, or the OOM killer", err, re.M), err
    else:
        assert code == 143, err
        assert "data_prep pairs: error: stopped by SIGTERM" in err
    assert "Traceback" not in err, err
    assert sorted(stream.glob("*.tmp-*")) == [] and not (stream / "manifest.json").exists()


def test_wiki_worker_killed_fails_the_run_within_seconds(tmp_path):
    """data_prep wiki --workers 2 (the bundled sample: seconds of work): kill -9 of a worker fails the run with one
    line naming it (exit 1), no traceback, and the other worker ends."""
    proc = start("wiki", "--input", SAMPLE, "--out", tmp_path / "out", "--workers", 2)
    workers = wait_for(lambda: len(found := workers_of(proc)) == 2 and found)
    time.sleep(0.5)  # at work on the dump's pages
    os.kill(workers[1].pid, signal.SIGKILL)
    code, err = finish(proc, workers, within=15)
    assert code == 1, err
    assert re.search(rf"^data_prep wiki: error: a worker process \(pid {workers[1].pid}\) died: killed by SIGKILL",
                     err, re.M), err
    assert "Traceback" not in err, err
    assert list((tmp_path / "out").rglob("manifest.json")) == []


def test_a_run_removes_the_staged_shards_an_earlier_one_left_and_never_lists_them(tmp_path, capsys):
    """Shards a killed run was building (one worker's and two workers' names, plain and gzip) are gone once a
    new run writes the stream; its manifest lists its shards alone."""
    big_jsonl(tmp_path / "s.jsonl", 0.01)
    stream = tmp_path / "out" / "pairs" / "s"
    stream.mkdir(parents=True)
    stale = ["shard-000000.tar.tmp-4242", "shard-001-000003.tar.gz.tmp-17"]
    for name in stale:
        (stream / name).write_bytes(b"half a shard")
    assert main(["pairs", "--input", str(tmp_path / "s.jsonl"), "--out", str(tmp_path / "out")]) == 0, capsys.readouterr()
    assert sorted(p.name for p in stream.iterdir()) == ["manifest.json", "shard-000000.tar"]
    assert [s["name"] for s in json.loads((stream / "manifest.json").read_text())["shards"]] == ["shard-000000.tar"]
