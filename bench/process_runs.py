"""Measuring one command's process tree (wall and CPU time, peak memory) and the workers of a local Ray
cluster that work for it: what ``bench/data_prep_throughput.py`` compares. Linux only (``/proc``)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import psutil  # installed with deepspeed

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.2  # memory sampling period: often enough for peaks that last seconds, cheap on a busy machine
TASK_POLL_S = 0.5  # Ray workers' CPU and peak RSS (VmHWM, the kernel's own peak, so no peak is missed)


@dataclass
class Run:
    """One subprocess run: what it cost and what it said."""

    wall_s: float
    cpu_s: float  # user + system of the whole process tree
    max_rss_mb: float  # largest single process
    tree_pss_mb: float  # peak of the tree's sum, sampled
    procs: int  # most processes seen at once
    stdout: str
    task_rss_mb: float = 0.0  # Ray runs: the largest peak RSS of a worker process, i.e. per task
    task_cpu_s: float = 0.0  # Ray runs: user + system of the worker processes (the tree's CPU is the driver's)
    idle_core_s: float = 0.0  # core-seconds the whole machine spent idle during the run (/proc/stat)


def machine_idle_s() -> float:
    """Core-seconds this machine has spent idle (idle + iowait) since it booted."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()  # "cpu user nice system idle iowait ...", in clock ticks
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def tree_memory(root: psutil.Process) -> tuple[int, int]:
    """(summed PSS in bytes, number of processes) of ``root`` and its descendants right now."""
    total = count = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for proc in procs:
        try:
            total += proc.memory_full_info().pss
            count += 1
        except psutil.NoSuchProcess:  # a worker that exited between listing and reading
            pass
    return total, count


def peak_rss(proc: psutil.Process) -> int:
    """The kernel's record of ``proc``'s peak resident set (VmHWM), in bytes."""
    with open(f"/proc/{proc.pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def measure(cmd: list[str], log: Path, env: dict | None = None,
            tasks: Callable[[], list[psutil.Process]] | None = None, sample_tree: bool = True) -> Run:
    """Run ``cmd`` from the repository root with stdout/stderr to ``log``.{out,err}; exit on failure.
    ``sample_tree``: sample the tree's memory (PSS) every POLL_S, which costs a few percent of a core: off
    where one run is compared with one that keeps every core busy. ``tasks``: the processes outside the tree
    that work for it (a Ray cluster's workers, which exit with the job): their CPU time and peak memory
    (VmHWM, reset at the start for the idle ones) are read every TASK_POLL_S, a cheaper reading."""
    stop = threading.Event()
    peak = {"pss": 0, "procs": 0, "task_rss": 0}
    task_cpu: dict[int, float] = {}  # pid → its CPU seconds when last seen
    before = {}  # pid → CPU seconds of the idle workers at the start
    for task in tasks() if tasks else []:
        with contextlib.suppress(psutil.Error, OSError):
            before[task.pid] = sum(task.cpu_times()[:2])
            with open(f"/proc/{task.pid}/clear_refs", "w") as clear:
                clear.write("5")  # VmHWM := the current RSS
    with open(log.with_suffix(".out"), "wb") as out, open(log.with_suffix(".err"), "wb") as err:
        start, idle_before = time.perf_counter(), machine_idle_s()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, env=env)
        root = psutil.Process(proc.pid)

        def poll() -> None:
            period = POLL_S if sample_tree else TASK_POLL_S
            while not stop.wait(period):
                if sample_tree:
                    pss, procs = tree_memory(root)
                    peak["pss"], peak["procs"] = max(peak["pss"], pss), max(peak["procs"], procs)
                for task in tasks() if tasks else []:
                    with contextlib.suppress(psutil.Error, OSError):
                        peak["task_rss"] = max(peak["task_rss"], peak_rss(task))
                        task_cpu[task.pid] = sum(task.cpu_times()[:2]) - before.get(task.pid, 0.0)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        # wait4, not Popen.wait: its rusage covers the child and every descendant it reaped (both
        # tools join their workers), which is the tree's CPU time and its largest process's peak RSS.
        _, status, usage = os.wait4(proc.pid, 0)
        wall, idle = time.perf_counter() - start, machine_idle_s() - idle_before
        proc.returncode = os.waitstatus_to_exitcode(status)
        stop.set()
        poller.join()
    if proc.returncode != 0:
        sys.exit(f"{Path(sys.argv[0]).stem}: {' '.join(cmd)} exited {proc.returncode}:\n"
                 f"{log.with_suffix('.err').read_text()[-3000:]}")
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, peak["pss"] / 2**20,
               peak["procs"], log.with_suffix(".out").read_text(), peak["task_rss"] / 2**20, sum(task_cpu.values()), idle)


# The kernel's peak RSS of a child (wait4's, getrusage's) includes the image it was forked from, until it exec'd:
# under a parent of 500 MB (pytest with a model loaded), every child peaks at 500 MB or more. So ``peak_rss_mib``
# starts the command from this small Python process (~10 MB), which writes its child's peak (KiB) to argv[1].
_PEAK_LAUNCHER = ("import resource, subprocess, sys; "
                  "code = subprocess.call(sys.argv[3:], timeout=float(sys.argv[2])); "
                  "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
                  "sys.exit(code)")


def peak_rss_mib(cmd: list[str], log: Path, env: dict | None = None, timeout_s: float = 600) -> float:
    """Run ``cmd`` from the repository root, stdout and stderr to ``log``; its peak resident memory in MiB,
    whatever this process holds. A failure (or ``timeout_s`` passed: the command killed) is a CalledProcessError."""
    peak = log.with_suffix(".peak")
    with open(log, "wb") as out:
        subprocess.run([sys.executable, "-c", _PEAK_LAUNCHER, str(peak), str(timeout_s), *cmd], cwd=REPO,
                       stdout=out, stderr=subprocess.STDOUT, env=env, check=True)
    return int(peak.read_text()) / 1024


@contextlib.contextmanager
def local_ray_cluster(cpus: int) -> Iterator[str]:
    """A Ray cluster of ``cpus`` CPUs on 127.0.0.1, its processes children of this one (so that its workers can
    be measured), as `ray start` would make it; yields its address. Started before the timed run, as a cluster
    is there before `ray job submit`."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # else Ray binds the external address
    # Ray runs its workers at nice 15: on a machine busy with other work they would get less CPU than the
    # one-process run they are compared with (nice 0), which is not what is measured here.
    os.environ["RAY_worker_niceness"] = "0"
    from ray.cluster_utils import Cluster

    # Cluster's own default object store is a test-sized 150 MiB; `ray start` gives it 30% of the free memory.
    store = int(0.3 * psutil.virtual_memory().available)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False, "object_store_memory": store})
    try:
        # A cluster that is there: its agents done starting (their imports, seconds of CPU, would otherwise
        # run beside the timed run on these two cores). Its workers start when a job connects.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            before = cluster_cpu_s()
            time.sleep(0.5)
            if cluster_cpu_s() - before <= 0.05:
                break
        yield cluster.address
    finally:
        cluster.shutdown()


def cluster_cpu_s() -> float:
    """CPU seconds used so far by this process's descendants that are still running."""
    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(proc.cpu_times()[:2])
    return total


def ray_workers() -> list[psutil.Process]:
    """The Ray worker processes among this process's descendants (their title is ``ray::…``, as the agents'
    is: ``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            title = proc.cmdline()[:1]
            if title and title[0].startswith("ray::") and not title[0].endswith("Agent"):
                found.append(proc)
    return found
