"""Checkpoints on the run's storage (local folder, file:// or s3://), complete or invisible.

Layout, one folder per step:
    <run>/checkpoints/step-00000100/
        ds/...                 DeepSpeed model + optimizer shards (+ lr scheduler), every rank's files
        rank-00000.pt ...      per-rank RNG states and loader position (tensors/ints only)
        hf/                    model config + tokenizer, so that export needs nothing else
        clsys_state.json       step, world size, config, export pooling
        COMPLETE               written last, by rank 0, after every rank has uploaded
Resume takes the newest folder with a COMPLETE marker, so a crash while writing leaves the
previous checkpoint as the one resumed from. Older complete checkpoints beyond
``train.keep_checkpoints`` are deleted only after the new one is complete.

Elastic resume (a different number of ranks than wrote the checkpoint): rank 0 converts ``ds/`` to a
DeepSpeed *universal* checkpoint (parameters and Adam moments as whole fp32 tensors, one file per
parameter, any ZeRO stage) once, stores it as ``universal/`` next to ``ds/`` (its own COMPLETE
marker last), and every rank loads its new partition from it. Dropout RNG streams cannot carry
over to a different rank count, so ranks start fresh ones; the data position is remapped by the
loader (``clsys.data.streaming``).
"""
from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from clsys import storage

STEP_DIR = re.compile(r"step-(\d{8})$")


def step_url(run_url: str, step: int) -> str:
    return storage.join(run_url, "checkpoints", f"step-{step:08d}")


def complete_checkpoints(run_url: str) -> list[tuple[int, str]]:
    """(step, url) of every complete checkpoint of the run, oldest first."""
    found = []
    for obj in storage.list_prefix(storage.join(run_url, "checkpoints")):
        folder, _, name = obj.rpartition("/")
        match = STEP_DIR.search(folder)
        if name == "COMPLETE" and match:
            found.append((int(match.group(1)), folder))
    return sorted(found)


def latest_checkpoint(run_url: str) -> str | None:
    found = complete_checkpoints(run_url)
    return found[-1][1] if found else None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, run_url: str, step: int, rank_state: dict, meta: dict, hf_files, keep: int,
         protect: str | None = None) -> str:
    """Collective: every rank calls it. ``hf_files(dir)`` writes config + tokenizer (rank 0 only).

    Keeps the newest ``keep`` complete checkpoints, and ``protect`` (the best one) whatever its age.
    """
    rank, url = dist.get_rank(), step_url(run_url, step)
    local = tempfile.mkdtemp(prefix="clsys-ckpt-")
    try:
        engine.save_checkpoint(local, tag="ds", client_state={"step": step})
        torch.save(rank_state, os.path.join(local, f"rank-{rank:05d}.pt"))
        if rank == 0:
            hf_files(os.path.join(local, "hf"))
        storage.upload_dir(local, url)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    dist.barrier()
    if rank == 0:
        storage.write_json(storage.join(url, "clsys_state.json"), {**meta, "step": step})
        storage.write_bytes(storage.join(url, "COMPLETE"), b"")
        prune(run_url, keep, protect)
    dist.barrier()
    return url


def prune(run_url: str, keep: int, protect: str | None = None) -> None:
    """Delete the complete checkpoints older than the newest ``keep``, except ``protect`` (the best one)."""
    for _, old in complete_checkpoints(run_url)[:-keep]:
        if old != protect:
            delete_checkpoint(old)


def delete_checkpoint(url: str) -> None:
    # The marker goes first: a half-deleted folder must never look complete.
    storage.delete(storage.join(url, "COMPLETE"))
    if storage.is_s3(url):
        for obj in storage.list_prefix(url):
            storage.delete(obj)
    else:
        storage.delete(url)


def saved_world_size(url: str) -> int:
    return int(storage.read_json(storage.join(url, "clsys_state.json"))["world_size"])


def _ensure_universal(url: str) -> str:
    """Collective: the universal form of ``url``'s DeepSpeed checkpoint, converted once by rank 0."""
    universal = storage.join(url, "universal")
    if dist.get_rank() == 0 and not storage.exists(storage.join(universal, "COMPLETE")):
        work = tempfile.mkdtemp(prefix="clsys-universal-")
        try:
            storage.download_dir(storage.join(url, "ds"), os.path.join(work, "in"))
            # DeepSpeed's converter, as a process: its options change between versions, its CLI less.
            # --inject_missing_state: the converter expects Megatron's parallelism metadata, which a
            # plain data-parallel model does not write; the defaults it injects are the right ones.
            proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                                   os.path.join(work, "in"), "--output_folder", os.path.join(work, "out", "ds"),
                                   "--inject_missing_state"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{url}: conversion to a universal checkpoint failed:\n{proc.stderr[-2000:]}")
            storage.upload_dir(os.path.join(work, "out"), universal)
            storage.write_bytes(storage.join(universal, "COMPLETE"), b"")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    dist.barrier()
    return universal


def load(engine, url: str, world_size: int) -> tuple[int, dict]:
    """Collective: restore model/optimizer/scheduler; returns (step, this rank's saved state).

    With the rank count that wrote ``url`` every rank gets back its own RNG and loader state. With
    another count (``engine`` built with ``load_universal``) the weights and optimizer are resharded
    and every rank gets rank 0's loader state (all ranks stand at the same position) and no RNG state.
    """
    saved = saved_world_size(url)
    rank = dist.get_rank()
    local = tempfile.mkdtemp(prefix="clsys-restore-")
    try:
        if saved == world_size:
            storage.download_dir(storage.join(url, "ds"), os.path.join(local, "ds"))
            rank_file = f"rank-{rank:05d}.pt"
        else:
            storage.download_dir(_ensure_universal(url), local)
            rank_file = "rank-00000.pt"
        path, client = engine.load_checkpoint(local, tag="ds")
        if path is None:
            raise RuntimeError(f"{url}: DeepSpeed could not load the checkpoint")
        storage.download_file(storage.join(url, rank_file), os.path.join(local, rank_file))
        rank_state = torch.load(os.path.join(local, rank_file), weights_only=True)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    if saved != world_size:
        rank_state = {"loader": rank_state["loader"]}
    return int(client["step"]), rank_state
