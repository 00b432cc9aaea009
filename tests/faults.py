"""Fault injection for the fault-tolerance tests: a test utility, never a code path in the trainer.

``Run`` starts ``python -m clsys.pretrain ...`` as a subprocess, follows its console line by line and
fires one-shot actions when a line matches, or when a storage condition appears:

    run = Run(["--config", "quickstart", "train.steps=8", ...])
    run.on_line(r"\\[clsys\\] step 3/", lambda: run.signal_rank(1, signal.SIGKILL))   # kill -9 rank 1
    run.on_line(r"\\[clsys\\] step 5/", lambda: run.signal_driver(signal.SIGUSR1))    # preemption notice
    run.when(lambda: partial_checkpoint(run_url, 4), lambda: run.signal_rank(0, signal.SIGKILL))
    result = run.wait(timeout=600)        # CompletedProcess-like: returncode, output, fired

A rank's process id comes from the "[clsys] rank R/N: pid P" line every training worker prints at
start (after a restart the new pids replace the old ones). Ray forwards each worker's console on its
own schedule, so rank 0's "step 3" can arrive before rank 1's pid line: an action that signals a rank
whose pid has not been seen yet stays armed and fires as soon as the pid line arrives. ``SIGSTOP`` instead of ``SIGKILL`` makes a
rank hang without dying, which is what the collective watchdog (``cluster.collective_timeout_s``)
has to catch. ``two_node_cluster`` gives a real multi-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``) whose worker nodes can be removed mid-run.

To try a fault on a real deployment, the same actions work by hand: find the pid in the job's log and
``kill -9`` it, or stop a node; the S3 side is ``tests/s3_fault_proxy.py``.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from clsys import storage

REPO = Path(__file__).resolve().parents[1]
RANK_PID = re.compile(r"\[clsys\] rank (\d+)/\d+: pid (\d+)")


class PidNotSeenYet(Exception):
    """The action's rank has not printed its pid line yet; the action is retried later."""


@dataclass
class RunResult:
    returncode: int
    output: str
    fired: list[str] = field(default_factory=list)


class Run:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, module: str = "clsys.pretrain"):
        self.cmd = [sys.executable, "-m", module, *args]
        self.env = {**os.environ, **(env or {})}
        self.pids: dict[int, int] = {}
        self.lines: list[str] = []
        self.fired: list[str] = []
        self._line_actions: list[tuple[re.Pattern, Callable[[], None], str]] = []
        self._conditions: list[tuple[Callable[[], bool], Callable[[], None], str]] = []
        self._armed: list[tuple[Callable[[], None], str]] = []  # triggered, waiting for a pid
        self._lock = threading.Lock()

    def on_line(self, pattern: str, action: Callable[[], None]) -> "Run":
        """Run ``action`` once, the first time a console line matches ``pattern``."""
        self._line_actions.append((re.compile(pattern), action, f"line {pattern}"))
        return self

    def when(self, condition: Callable[[], bool], action: Callable[[], None], name: str = "condition") -> "Run":
        """Run ``action`` once, as soon as ``condition()`` (polled every 50 ms) is true."""
        self._conditions.append((condition, action, name))
        return self

    def signal_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        if rank not in self.pids:
            raise PidNotSeenYet(rank)
        pid = self.pids[rank]
        os.kill(pid, sig)
        self.fired.append(f"{signal.Signals(sig).name} rank {rank} (pid {pid})")

    def signal_driver(self, sig: int) -> None:
        """Signal the ``clsys.pretrain`` process itself, as a scheduler's preemption notice does."""
        self.proc.send_signal(sig)
        self.fired.append(f"{signal.Signals(sig).name} driver (pid {self.proc.pid})")

    def _poll_conditions(self, done: threading.Event) -> None:
        while not done.is_set():
            for item in list(self._conditions):
                condition, action, name = item
                try:
                    ready = condition()
                except Exception:  # storage not there yet: keep polling
                    ready = False
                if ready:
                    with self._lock:
                        self._conditions.remove(item)
                        self._armed.append((action, name))
            self._fire_armed()
            time.sleep(0.05)

    def _fire_armed(self) -> None:
        with self._lock:
            for item in list(self._armed):
                action, name = item
                try:
                    action()
                except PidNotSeenYet:
                    continue
                self._armed.remove(item)
                self.fired.append(name)

    def wait(self, timeout: float = 900) -> RunResult:
        self.proc = proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True, bufsize=1)
        done = threading.Event()
        poller = threading.Thread(target=self._poll_conditions, args=(done,), daemon=True)
        poller.start()
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            for line in proc.stdout:
                self.lines.append(line)
                if match := RANK_PID.search(line):
                    self.pids[int(match.group(1))] = int(match.group(2))
                for item in list(self._line_actions):
                    pattern, action, name = item
                    if pattern.search(line):
                        with self._lock:
                            self._line_actions.remove(item)
                            self._armed.append((action, name))
                self._fire_armed()
            proc.wait()
        finally:
            killer.cancel()
            done.set()
            poller.join(timeout=5)
        output = "".join(self.lines)
        print(output[-6000:])
        return RunResult(proc.returncode, output, self.fired)


def partial_checkpoint(run_url: str, step: int) -> bool:
    """True while checkpoint ``step`` is being written: some of its files exist, its COMPLETE marker not yet."""
    folder = storage.join(run_url, "checkpoints", f"step-{step:08d}")
    names = [url.rpartition("/")[2] for url in storage.list_prefix(folder)]
    return bool(names) and "COMPLETE" not in names


def complete_checkpoint(run_url: str, step: int) -> bool:
    """True once checkpoint ``step`` is complete (written in the background, that is some steps after ``step``)."""
    return storage.exists(storage.join(run_url, "checkpoints", f"step-{step:08d}", "COMPLETE"))


def sample_keys(run_dir: Path) -> dict[str, list[str]]:
    """Each rank's consumed sample keys in order (``train.log_sample_keys``: its per-checkpoint files,
    concatenated by step), by rank folder name (``rank-00000``, …)."""
    return {rank.name: [key for part in sorted(rank.glob("step-*.txt")) for key in part.read_text().split()]
            for rank in sorted((run_dir / "sample_keys").iterdir())}


class RunsCodeWhenUnpickled:
    """What a hostile checkpoint file holds: unpickling it runs code (here: creates the file ``marker``)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def flip_a_byte(url: str) -> None:
    """Damage a stored file at rest, as a bad disk or a stray write would: one bit of its middle byte."""
    data = bytearray(storage.read_bytes(url))
    data[len(data) // 2] ^= 0x01
    storage.write_bytes(url, bytes(data))


@contextlib.contextmanager
def two_node_cluster(cpus_per_node: int = 1):
    """A head node with no CPUs (Ray Train's controller needs none) and two worker nodes, all on
    127.0.0.1; yields (cluster, [node, node], env), env being what a driver needs to join it (its
    address, and its dashboard's for Ray Train's State API queries: see clsys.engine.launch.init_ray).
    ``cluster.remove_node(node)`` kills a node's raylet and every worker process on it, like losing a
    machine."""
    import ray

    from conftest import loopback_ray_cluster

    with loopback_ray_cluster(head_cpus=0) as (cluster, join):
        nodes = [cluster.add_node(num_cpus=cpus_per_node, node_ip_address="127.0.0.1") for _ in range(2)]
        cluster.wait_for_nodes()
        try:
            yield cluster, nodes, join
        finally:
            ray.shutdown()
