"""A rank's loader worker processes (clsys.data.loader_workers): they start from a forkserver, not from the trainer,
take its environment, run nicer than it, keep their imports out of garbage collection, and end with the trainer,
killed alone. What the workers read and hand out: test_streaming.py, whose helpers these tests share."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from clsys.data.epoch_layout import plan_epoch
from clsys.data.loader_workers import LOADER_WORKER_NICENESS
from clsys.data.streaming import ShardLoader
from clsys.shards.reader import load_shards
from test_streaming import SIZES, write_stream


def worker_environment(samples):
    return {"env": os.environ.get("CLSYS_TEST_LOADER_ENV")}


def worker_niceness(samples):
    return {"niceness": os.nice(0)}


def worker_collector(samples):
    """What a full collection of the cyclic garbage collector would traverse in this process, and what it leaves."""
    return {"traversed": len(gc.get_objects()), "frozen": gc.get_freeze_count()}


def test_loader_workers_do_not_share_the_trainers_memory(tmp_path, monkeypatch):
    """Loader workers start from a clean process (a forkserver), not forked from the training process: a
    worker forked from it shares its memory copy-on-write and keeps, as its own, every page the trainer
    writes afterwards (weights, gradients, optimizer state; ~5 GB per worker with multilingual-e5-small on
    CPU). They still see the trainer's environment of when the epoch began, as forked workers would."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    monkeypatch.setenv("CLSYS_TEST_LOADER_ENV", "set after the forkserver may have started")
    state = bytearray(64 * 2**20)  # stands for the training state, in memory before the workers start
    address = ctypes.addressof((ctypes.c_char * len(state)).from_buffer(state))
    batches = iter(ShardLoader(url, 0, 1, 4, worker_environment, seed=0, loader_workers=2, shuffle_buffer=8))
    assert [next(batches)["env"] for _ in range(2)] == ["set after the forkserver may have started"] * 2  # both workers
    workers = [p for p in psutil.Process().children(recursive=True) if p.name() == "pt_data_worker"]
    assert len(workers) == 2

    def maps_state(worker: psutil.Process) -> bool:
        # A forked worker has the trainer's mappings at the same addresses; a clean process has its own.
        spans = (m.addr.split("-") for m in worker.memory_maps(grouped=False))
        return any(int(start, 16) <= address < int(end, 16) for start, end in spans)

    assert not any(maps_state(w) for w in workers)
    assert all(w.ppid() != os.getpid() for w in workers)


def test_loader_workers_yield_the_cores_to_the_trainer(tmp_path):
    """Both workers run LOADER_WORKER_NICENESS nicer than the trainer, so that on shared cores the trainer's
    thread gets a core as soon as it asks for a batch; the trainer's own priority is left as it was."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [40, 40])
    trainer = os.nice(0)
    batches = iter(ShardLoader(url, 0, 1, 4, worker_niceness, seed=0, loader_workers=2, shuffle_buffer=8))
    assert {next(batches)["niceness"] for _ in range(4)} == {min(19, trainer + LOADER_WORKER_NICENESS)}
    assert os.nice(0) == trainer and LOADER_WORKER_NICENESS > 0


def test_loader_workers_leave_their_imports_out_of_garbage_collection(tmp_path):
    """A loader worker holds torch's and transformers' objects (its forkserver imported them), and a full collection
    of Python's garbage collector, which the chunk tokenizer's growing dictionary set off within each new worker's
    first 150 batches, walked all of them: measured, a quarter of a tokenizing worker's time there. The worker freezes
    what it starts with, so a collection walks only what the worker made."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [40, 40])
    batches = iter(ShardLoader(url, 0, 1, 4, worker_collector, seed=0, loader_workers=2, shuffle_buffer=8))
    seen = [next(batches) for _ in range(4)]
    assert all(b["frozen"] > 100_000 for b in seen)  # the imports: torch's alone are more
    assert all(b["traversed"] < 0.1 * b["frozen"] for b in seen)


# A trainer in miniature: the loader over the shards at argv[1], two workers, ``argv[2]`` batches taken, then a step
# that lasts until the process is killed. One batch a transfer: a worker that has made its whole piece of the epoch
# ends, and with bundles of 16 both of this epoch's did before half-epoch.
TRAINER = """
import sys, time
from clsys.data.streaming import ShardLoader
from test_streaming import collate
batches = iter(ShardLoader(sys.argv[1], 0, 1, 4, collate, seed=0, loader_workers=2, shuffle_buffer=8, bundle=1))
for _ in range(int(sys.argv[2])):
    next(batches)
time.sleep(600)
"""


def session_processes(session: int) -> dict[int, str]:
    """The processes of ``session`` that are still running (zombies are over): pid -> what it is, for messages."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, _, fields = stat.read_text().partition("(")[2].rpartition(")")
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        state, parent, _, sid = fields.split()[:4]
        if int(sid) == session and state not in "ZX":
            found[int(stat.parent.name)] = f"{comm} (parent {parent}): {command[:100]}"
    return found


def alive_pipe_writers(processes: dict[int, str]) -> set[int]:
    """Of ``processes`` (``session_processes``), those holding the write end of the loader workers' forkserver's
    "alive" pipe, whose read end is the forkserver's second argument: the forkserver exits once no process has it."""
    forkserver, alive = next((pid, int(found[1])) for pid, what in processes.items()
                             if not what.startswith("pt_data_worker")
                             and (found := re.search(r"multiprocessing.forkserver import main; main\(\d+, (\d+)", what)))
    pipe = os.readlink(f"/proc/{forkserver}/fd/{alive}")  # "pipe:[inode]", as each end of it reads
    holders = set()
    for pid in processes.keys() - {forkserver}:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # closed meanwhile
                if os.readlink(fd) == pipe:
                    holders.add(pid)
    return holders


def test_killing_the_trainer_ends_its_loader_processes(tmp_path):
    """Ray restarting a rank, the OOM killer and scancel past its grace period kill the trainer's process alone, with
    SIGKILL: its loader workers (~200 MB each), the next epoch's reading ahead among them, and their forkserver
    (~285 MB) must end with it, or every restart leaks a full set. Killed mid-epoch, and while the next epoch's
    workers read ahead, within seconds no process the trainer started is left (all are in its session)."""
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    per_epoch = plan_epoch(load_shards(url), 0, 0, 1, 2, 4).batches_per_rank
    # Batches taken before the kill, and the loader workers seen by then: this epoch's two, or those and the next
    # epoch's first (its second may still be starting when the trainer is killed: a case of its own to clean up).
    cases = {"mid-epoch": (1, 2), "reading ahead": (per_epoch // 2 + 2, 3)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    logs = {case: tmp_path / f"{case}.log" for case in cases}
    trainers = {}
    for case, (taken, _) in cases.items():  # both at once: each takes seconds to start its forkserver
        with logs[case].open("w") as log:
            trainers[case] = subprocess.Popen([sys.executable, "-c", TRAINER, url, str(taken)], env=env,
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Workers seen, in both trainers from their start, not workers running: a worker that has made its whole
        # piece of the epoch ends, which under load can come before the next epoch's second worker starts (the next
        # epoch's wait for the trainer's step).
        deadline, seen = time.monotonic() + 60, {case: set() for case in cases}
        while any(len(seen[case]) < workers for case, (_, workers) in cases.items()):
            for case, trainer in trainers.items():
                seen[case] |= {pid for pid, what in session_processes(trainer.pid).items()
                               if what.startswith("pt_data_worker")}
                assert trainer.poll() is None, logs[case].read_text()
                assert time.monotonic() < deadline, f"{case}: workers never started: seen {seen[case]}, now " \
                    f"{session_processes(trainer.pid)}; {logs[case].read_text()}"
            time.sleep(0.1)
        for case, trainer in trainers.items():
            # Once the workers have started (a worker just forked may not be there yet), the write end of the
            # forkserver's alive pipe is the trainer's alone: no worker keeps the forkserver running without it.
            deadline = time.monotonic() + 5
            while (writers := alive_pipe_writers(started := session_processes(trainer.pid))) != {trainer.pid} \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            assert writers == {trainer.pid}, f"{case}: the forkserver's alive pipe is held by {writers} of {started}"
            trainer.kill()
            trainer.wait()
            deadline = time.monotonic() + 5
            while (left := session_processes(trainer.pid)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not left, f"{case}: left running after the trainer was killed: {left}; started: {started}"
    finally:
        for trainer in trainers.values():
            trainer.kill()
            trainer.wait()
            for pid in session_processes(trainer.pid):
                os.kill(pid, signal.SIGKILL)
