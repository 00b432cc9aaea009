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
"""
from __future__ import annotations

import os
import random
import re
import shutil
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


def save(engine, run_url: str, step: int, rank_state: dict, meta: dict, hf_files, keep: int) -> str:
    """Collective: every rank calls it. ``hf_files(dir)`` writes config + tokenizer (rank 0 only)."""
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
        for _, old in complete_checkpoints(run_url)[:-keep]:
            _delete_checkpoint(old)
    dist.barrier()
    return url


def _delete_checkpoint(url: str) -> None:
    # The marker goes first: a half-deleted folder must never look complete.
    storage.delete(storage.join(url, "COMPLETE"))
    if storage.is_s3(url):
        for obj in storage.list_prefix(url):
            storage.delete(obj)
    else:
        storage.delete(url)


def load(engine, url: str, world_size: int) -> tuple[int, dict]:
    """Collective: restore model/optimizer/scheduler; returns (step, this rank's saved state)."""
    meta = storage.read_json(storage.join(url, "clsys_state.json"))
    if meta["world_size"] != world_size:
        raise RuntimeError(f"{url} was written by {meta['world_size']} ranks; resuming with {world_size} ranks "
                           f"needs the same number of workers (cluster.num_workers={meta['world_size']})")
    rank = dist.get_rank()
    local = tempfile.mkdtemp(prefix="clsys-restore-")
    try:
        storage.download_dir(url, local)
        path, client = engine.load_checkpoint(local, tag="ds")
        if path is None:
            raise RuntimeError(f"{url}: DeepSpeed could not load the checkpoint")
        rank_state = torch.load(os.path.join(local, f"rank-{rank:05d}.pt"), weights_only=True)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return int(client["step"]), rank_state
