"""Writing checkpoints while training goes on (``train.async_checkpoint``, default on).

A synchronous save holds every rank for the whole write: DeepSpeed serialises the model and optimizer
state, each rank hashes and uploads its files, rank 0 records SHA256SUMS and COMPLETE. Here the ranks
stop only for a snapshot: DeepSpeed's checkpoint engine is wrapped (``HostSnapshots``) so that its
``save`` copies each state dict to host memory (pinned, one device sync at the end) instead of writing
it, and a thread per rank then serialises, hashes and uploads while the next steps run. The host holds
that copy of the model and optimizer state until it is written.

The thread serialises DeepSpeed's files itself (``torch.save``, the format of DeepSpeed's default
checkpoint engine, which loads them) and hashes the bytes as they are written, so no file is read back
to be hashed. In a local or shared run folder (file://) they are written straight into the checkpoint
folder, each atomically, instead of into a temporary folder and then copied: one write of the
checkpoint's bytes instead of two, and no room needed for them in the temporary folder. Elsewhere (s3://)
they go to the temporary folder and are uploaded from there.

The thread runs no collective (the training loop's collectives own the process group): each rank
announces its finished upload with a marker object ``ranks/rank-NNNNN`` holding its files' checksums;
rank 0's thread, once every rank's marker is there, writes SHA256SUMS and then COMPLETE (still last,
holding SHA256SUMS's own sha256: ``clsys.storage.integrity``),
prunes old checkpoints and runs the completion callback (best.json, the console line). At most one
checkpoint is in flight: the next save, and the end of training (``wait``), first wait for the previous
one, and an error of a writing thread is raised there, in the training loop. A process that dies before
COMPLETE leaves the checkpoint invisible to resume, as with a synchronous save.

With ``background=False`` the same steps run inside ``save``, which every rank leaves once the
checkpoint is complete (tests, and ``train.async_checkpoint: false``).
"""
from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from clsys import storage
from clsys.storage import integrity
from clsys.engine.checkpoint import RANK_MARKERS, delete_checkpoint, prune, step_url
from clsys.storage.integrity import SEAL, SUMS

MARKER_POLL_S = 0.2


def to_host(obj):
    """A copy of ``obj`` with every tensor copied to host memory (device tensors into pinned memory,
    asynchronously: synchronise before reading them); other leaves deep-copied, so that nothing the
    training goes on to change can reach the written file."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return obj.detach().clone()
        host = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=True)
        return host.copy_(obj.detach(), non_blocking=True)
    if type(obj) in (dict, OrderedDict):
        return type(obj)((key, to_host(value)) for key, value in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(to_host(value) for value in obj)
    return copy.deepcopy(obj)


class HostSnapshots:
    """DeepSpeed's checkpoint engine with ``save`` deferred: the state dicts are copied to host memory and
    kept (``take``) for the writer to serialise; everything else (loading) goes to the engine it wraps."""

    def __init__(self, inner):
        self.inner, self.name, self.taken = inner, f"host snapshots over {inner.name}", []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def save(self, state_dict, path: str):
        self.taken.append((path, to_host(state_dict)))

    def preserves_storage_sharing(self):
        return False  # to_host already copies each tensor alone: DeepSpeed need not clone them first

    def take(self) -> list[tuple[str, object]]:
        """The snapshots since the last call, (file path, state), safe to read from another thread."""
        taken, self.taken = self.taken, []
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned copies have landed
        return taken


class _HashingWriter:
    """A file wrapper that hashes what passes through it (``torch.save`` needs only write and flush)."""

    def __init__(self, file):
        self.file, self.sha256 = file, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def save_hashed(state, url: str, zipfile_serialization: bool = True) -> str:
    """``torch.save`` ``state`` to the local file of ``url`` (atomically, see ``storage.write_file``);
    returns the sha256 of the bytes written."""
    writer = None

    def fill(file) -> None:
        nonlocal writer
        writer = _HashingWriter(file)
        torch.save(state, writer, _use_new_zipfile_serialization=zipfile_serialization)

    storage.write_file(url, fill)
    return writer.sha256.hexdigest()


def _yield_to_training() -> None:
    """Give this (writing) thread the lowest CPU priority (Linux: a thread's niceness is its own): where the
    step loop keeps every core busy, as CPU training does, the write takes the gaps instead of the step's
    time; the write takes longer, which is fine while it ends before the next checkpoint."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not permitted: the same write, at normal priority
        pass


@dataclass
class _Write:
    """One checkpoint being written by this rank."""

    url: str
    local: str  # staging: DeepSpeed's and this rank's small files (and, for s3://, the serialised state)
    snapshots: list
    protect: str | None
    on_complete: Callable[[str], None] | None
    error: BaseException | None = None
    thread: threading.Thread | None = field(default=None, repr=False)


class CheckpointWriter:
    """Writes the run's checkpoints (collective: every rank holds one and calls ``save`` at the same steps).

    Keeps the newest ``keep`` complete checkpoints, and the ``protect`` folder given to ``save`` (the best
    one) whatever its age. ``wait_s``: how long rank 0 waits for the other ranks' parts of a checkpoint."""

    def __init__(self, engine, run_url: str, keep: int, background: bool = True, wait_s: float = 1800):
        self.engine, self.run_url, self.keep, self.background, self.wait_s = engine, run_url, keep, background, wait_s
        if not isinstance(engine.checkpoint_engine, HostSnapshots):
            engine.checkpoint_engine = HostSnapshots(engine.checkpoint_engine)
        self.snapshots: HostSnapshots = engine.checkpoint_engine
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.in_flight: _Write | None = None

    def save(self, step: int, rank_state: dict, meta: dict, hf_files: Callable[[str], None],
             protect: str | None = None, on_complete: Callable[[str], None] | None = None) -> str:
        """Checkpoint ``step``: this rank's ``rank_state`` (RNG, loader position); rank 0 also writes
        ``meta`` and ``hf_files(folder)`` (config + tokenizer). Returns once the state is snapshotted (in
        the background mode) or written. ``on_complete(url)`` runs on rank 0 once the checkpoint is complete."""
        self.wait()
        url = step_url(self.run_url, step)
        if self.rank == 0 and next(storage.list_prefix(url), None) is not None:
            # Left by a write cut short, or set aside as damaged: none of its files may mix with the new ones.
            delete_checkpoint(url)
        dist.barrier()  # no rank uploads before rank 0 has cleared the folder
        local = tempfile.mkdtemp(prefix="clsys-ckpt-")
        try:
            self.engine.save_checkpoint(local, tag="ds", client_state={"step": step})
            torch.save(rank_state, os.path.join(local, f"rank-{self.rank:05d}.pt"))
            if self.rank == 0:
                hf_files(os.path.join(local, "hf"))
                with open(os.path.join(local, "clsys_state.json"), "wb") as f:
                    f.write(storage.json_bytes({**meta, "step": step, "sums": SUMS}))
            job = _Write(url, local, self.snapshots.take(), protect, on_complete)
        except BaseException:
            self.snapshots.take()  # drops what was snapshotted before the failure
            shutil.rmtree(local, ignore_errors=True)
            raise
        if self.background:
            job.thread = threading.Thread(target=self._run, args=(job,), name=f"clsys-checkpoint-{step}", daemon=True)
            job.thread.start()
            self.in_flight = job
        else:
            self._run(job)
            if job.error is not None:
                raise job.error
            dist.barrier()  # every rank leaves once the checkpoint is complete
        return url

    def wait(self) -> None:
        """Wait for the checkpoint in flight, if any; raise what its writing raised."""
        job, self.in_flight = self.in_flight, None
        if job is None:
            return
        job.thread.join()
        if job.error is not None:
            raise job.error

    def _run(self, job: _Write) -> None:
        if self.background:
            _yield_to_training()
        try:
            self._write(job)
        except BaseException as err:  # raised by wait(), in the training loop
            job.error = err
        finally:
            job.snapshots.clear()
            shutil.rmtree(job.local, ignore_errors=True)

    def _write(self, job: _Write) -> None:
        in_place = storage.is_local(job.url)  # see the module's docstring
        zipfile_serialization = getattr(self.snapshots.inner, "zipfile_serialization", True)
        sums = {}
        while job.snapshots:
            path, state = job.snapshots.pop(0)  # each host copy goes as soon as it is written
            rel = Path(path).relative_to(job.local).as_posix()
            sums[rel] = save_hashed(state, storage.join(job.url, rel) if in_place else f"file://{path}",
                                    zipfile_serialization)
        # What the staging folder holds: DeepSpeed's small files, this rank's state, rank 0's config, and
        # (not in place) the files just written.
        sums.update(integrity.folder_sums(job.local, skip=sums.__contains__))
        storage.upload_dir(job.local, job.url)
        marker = storage.join(job.url, RANK_MARKERS, f"rank-{self.rank:05d}")
        storage.write_bytes(marker, integrity.format_sums(sums))
        if self.rank != 0:
            return
        merged = integrity.format_sums(merged_rank_sums(job.url, self.world, self.wait_s))
        storage.write_bytes(storage.join(job.url, SUMS), merged)
        storage.write_bytes(storage.join(job.url, SEAL), integrity.seal(merged))  # SHA256SUMS's own sha256
        prune(self.run_url, self.keep, job.protect)
        if job.on_complete is not None:
            job.on_complete(job.url)


def merged_rank_sums(url: str, world: int, wait_s: float) -> dict[str, str]:
    """Every rank's checksums of the checkpoint at ``url``, once each of the ``world`` ranks' markers is there
    (rank 0 runs this); RuntimeError after ``wait_s`` seconds without them."""
    markers_url = storage.join(url, RANK_MARKERS)
    names = [f"rank-{rank:05d}" for rank in range(world)]
    deadline = time.monotonic() + wait_s
    while True:
        # By name: on a filesystem a marker is written under a temporary name beside it (rank-NNNNN.tmp-PID)
        # and renamed, and that name must not count as the marker (it was once read as it vanished).
        listed = {obj.rsplit("/", 1)[-1] for obj in storage.list_prefix(markers_url)}
        missing = [name for name in names if name not in listed]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: {len(missing)} of {world} ranks did not finish "
                               f"writing their part of the checkpoint within {wait_s:.0f} s")
        time.sleep(MARKER_POLL_S)
    merged: dict[str, str] = {}
    for marker in (storage.join(markers_url, name) for name in names):
        for rel, digest in integrity.parse_sums(storage.read_bytes(marker), marker).items():
            if merged.setdefault(rel, digest) != digest:
                raise RuntimeError(f"{url}: two ranks wrote different contents to {rel}")
    return merged
