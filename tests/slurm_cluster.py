"""A real SLURM cluster on this machine for tests: munged, slurmctld and two slurmd daemons, all on
127.0.0.1, with their configuration, key, sockets, spool, logs and pid files in one temporary folder
(nothing under /etc or /var is written; ``SLURM_CONF`` points every SLURM command at the folder).

The two slurmd daemons are two SLURM nodes of the same machine (``slurmd -N``, each with its own
port), so a job can get two nodes and run one srun task on each. Each node declares the machine's
CPUs; ``SlurmdParameters=config_overrides`` keeps slurmd from draining a node over hardware it
shares with the other one. ``cred_expire=10`` shortens the wait before a requeued job may start
again (SLURM holds it for the credential lifetime + 1 s, 121 s by default), ``KillWait=10`` the wait
between SIGTERM and SIGKILL for a cancelled job (30 s by default).

Needs the Debian packages ``slurm-wlm`` and ``munge``; ``ensure_installed()`` installs them with
apt-get when they are missing and this is root.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

SBIN = Path("/usr/sbin")
DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("slurm-wlm", "munge")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_installed() -> str | None:
    """None when SLURM and munge are there (installed now if need be), else why not."""
    def present() -> bool:
        return all((SBIN / d).exists() for d in DAEMONS) and all(shutil.which(c) for c in ("sbatch", "scontrol"))

    if present():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "SLURM is not installed (apt-get install slurm-wlm munge needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:  # a stale package index: refresh it once
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not present():
        return f"could not install {' '.join(PACKAGES)}: {(proc.stderr or proc.stdout)[-500:]}"
    return None


class SlurmCluster:
    """``with SlurmCluster() as slurm:`` starts the daemons and waits for idle nodes; leaving the
    block cancels every job, waits for them to end and stops the daemons (by their pid files)."""

    def __init__(self, nodes: int = 2, cpus: int | None = None):
        self.root = Path(tempfile.mkdtemp(prefix="clsys-slurm-"))  # short: the munge socket path is limited
        self.host = socket.gethostname().split(".")[0]  # hostname -s
        self.nodes = [f"{self.host}-{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pid_files: list[Path] = []

    # --- set-up -------------------------------------------------------------------------------
    def _write_config(self) -> None:
        r = self.root
        for d in ("ctld", "log", "munge"):
            (r / d).mkdir()
        for n in self.nodes:
            (r / "spool" / n).mkdir(parents=True)
        ports = [_free_port() for _ in range(2 + len(self.nodes))]
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
            f"RealMemory=1000 State=UNKNOWN" for n, port in zip(self.nodes, ports[2:]))
        self.conf.write_text(f"""\
ClusterName=clsystest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.sock,cred_expire=10
StateSaveLocation={r}/ctld
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SchedulerParameters=sched_interval=1
KillWait=10
{nodes}
PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)

    def _daemon(self, *cmd: str, pid_file: Path) -> None:
        self._pid_files.append(pid_file)
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")

    def start(self) -> "SlurmCluster":
        self._write_config()
        m = self.root / "munge"
        try:
            # --force: munged refuses to run as root otherwise (this is a test's private instance).
            self._daemon(str(SBIN / "munged"), "--force", f"--socket={m}/munge.sock", f"--key-file={m}/munge.key",
                         f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed",
                         pid_file=m / "munged.pid")
            self._daemon(str(SBIN / "slurmctld"), "-i", pid_file=self.root / "slurmctld.pid")
            for n in self.nodes:
                self._daemon(str(SBIN / "slurmd"), "-N", n, pid_file=self.root / f"slurmd-{n}.pid")
            self._wait_idle(60)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_idle(self, timeout: float) -> None:
        deadline, states = time.time() + timeout, ""
        while time.time() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout
            if states.split() and all(line.split()[1] == "idle" for line in states.splitlines()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes not idle after {timeout}s: {states!r}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").glob("*.log")))

    # --- use ----------------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=60, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {proc.returncode} {proc.stderr}")
        return proc

    def sbatch(self, *args: str, env: dict | None = None, cwd: Path | None = None) -> str:
        """Submit; the job gets ``env`` (on top of this environment and SLURM_CONF); returns its id."""
        proc = self.run("sbatch", "--parsable", *args, env={**self.env, **(env or {})}, cwd=cwd)
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """A few fields of ``scontrol show job`` (sacct needs accounting, which is off)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return {k: m.group(1) for k in ("JobState", "Reason", "ExitCode", "Restarts", "NodeList", "BatchHost")
                if (m := re.search(rf"\b{k}=(\S+)", out))}

    def wait_job(self, job_id: str, states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                   "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"),
                 timeout: float = 600) -> dict[str, str]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout}s: {self.job(job_id)}")

    # --- tear-down ----------------------------------------------------------------------------
    def stop(self) -> None:
        if self.conf.exists() and (self.root / "slurmctld.pid").exists():
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.time() + 60
                while time.time() < deadline and self.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
                    time.sleep(1)
        for pid_file in reversed(self._pid_files):  # slurmd(s), slurmctld, then munged
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.time() + 20
            while time.time() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                os.kill(pid, signal.SIGKILL)
        self._pid_files.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
