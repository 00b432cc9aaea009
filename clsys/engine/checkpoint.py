"""Checkpoints on the run's storage (local folder, file:// or s3://), complete or invisible.

Layout, one folder per step:
    <run>/checkpoints/step-00000100/
        ds/...                 DeepSpeed model + optimizer shards (+ lr scheduler), every rank's files
        rank-00000.pt ...      per-rank RNG states and loader position (tensors/ints only)
        hf/                    model config + tokenizer, so that export needs nothing else
        clsys_state.json       step, world size, config, export pooling
        ranks/rank-00000 ...   each rank's "uploaded" marker: the checksums of its files
        SHA256SUMS             sha256 of every file above but the markers (clsys.storage.integrity), merged from them
        COMPLETE               written last, by rank 0, after every rank has uploaded: SHA256SUMS's sha256
Written by ``clsys.engine.checkpoint_writer`` (in the background while training goes on, by default).
Resume takes the newest folder with a COMPLETE marker, so a crash while writing leaves the
previous checkpoint as the one resumed from. Every rank checks the fields of clsys_state.json it reads
(``checked_state``), that SHA256SUMS is the list COMPLETE seals, that it lists every file of the folder
(but the markers and ``universal/``) and the files the format requires (``REQUIRED_FILES``,
``missing_rank_files``), and the files it downloads against it; when a rank finds a problem and an
older checkpoint passes the same checks, the damaged one is set aside (its COMPLETE marker replaced by
a CORRUPT file naming the bad files) and training resumes from the older one. A checkpoint of before
the seal (an empty COMPLETE) gets every check but the seal's. Every file is unpickled with
``weights_only`` (``weights_only_loads``). Older complete checkpoints beyond
``train.keep_checkpoints`` are deleted only after the new one is complete.

Elastic resume (a different number of ranks than wrote the checkpoint): a ZeRO stage-0 checkpoint holds
the whole state in one file and loads as it is; for the others rank 0 converts ``ds/`` to a
DeepSpeed *universal* checkpoint (parameters and Adam moments as whole fp32 tensors, one file per
parameter, any ZeRO stage) once, stores it as ``universal/`` next to ``ds/`` (its own COMPLETE
marker, which seals its own SHA256SUMS, last), and every rank loads its new partition from it. Dropout
RNG streams cannot carry over to a different rank count, so ranks start fresh ones; the data
position is remapped by the loader (``clsys.data.streaming``).
"""
from __future__ import annotations

import contextlib
import io
import itertools
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from clsys import storage
from clsys.storage import integrity
from clsys.engine.deepspeed import plain_data_parallel
from clsys.model import loading
from clsys.model.folder import COUNT, POSITIVE, SHOWN, TEXT, CheckpointError, Kind, checked_record
from clsys.storage.integrity import SEAL, SUMS

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"step-(\d{8})$")
RANK_MARKERS = "ranks"  # <checkpoint>/ranks/rank-NNNNN: that rank's files uploaded, with their checksums
UNIVERSAL = "universal"


def _deepspeed_record_classes() -> list:
    # The classes DeepSpeed pickles into its optimizer files besides tensors and containers (listed by
    # torch.serialization.get_unsafe_globals_in_checkpoint): plain records, rebuilt from their fields.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def weights_only_loads(local: str = "", url: str = ""):
    """Every ``torch.load`` inside, DeepSpeed's own included, reads tensors, plain containers and DeepSpeed's
    record classes only (``clsys.model.loading.weights_only_loads``): a checkpoint on shared storage is data. A
    file that holds anything else is refused with a CheckpointError naming it (as it is at ``url`` where it was
    downloaded to the folder ``local``)."""
    with loading.weights_only_loads(local, url, holds="tensors, plain containers and DeepSpeed's records",
                                    refusal=CheckpointError), \
            torch.serialization.safe_globals(_deepspeed_record_classes()):
        yield


def checkpoint_weights(folder: str, url: str | None = None) -> dict[str, torch.Tensor]:
    """The fp32 weights of the objective in a downloaded checkpoint ``folder`` (of ``url``, which errors
    name): gathered from the ZeRO partitions (stages 1-3), or, at ZeRO stage 0, which writes no partitions,
    the module's own state. A file that holds more than weights is refused (``weights_only_loads``)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ds = os.path.join(folder, "ds")
    with weights_only_loads(folder, url or folder):
        if any(name.endswith("optim_states.pt") for name in os.listdir(ds)):
            # Its progress prints and bars ("Processing zero checkpoint", "Loading checkpoint shards", ...) say
            # nothing the export's own line does not; errors still raise.
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                return get_fp32_state_dict_from_zero_checkpoint(folder, tag="ds")
        saved = torch.load(os.path.join(ds, "mp_rank_00_model_states.pt"), map_location="cpu")
    return {name: tensor.float() for name, tensor in saved["module"].items()}


def step_url(run_url: str, step: int) -> str:
    return storage.join(run_url, "checkpoints", f"step-{step:08d}")


def complete_checkpoints(run_url: str) -> list[tuple[int, str]]:
    """(step, url) of every complete checkpoint of the run, oldest first."""
    found = []
    for obj in storage.list_prefix(storage.join(run_url, "checkpoints")):
        folder, _, name = obj.rpartition("/")
        match = STEP_DIR.search(folder)
        if name == SEAL and match:
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


def prune(run_url: str, keep: int, protect: str | None = None) -> None:
    """Delete the complete checkpoints older than the newest ``keep`` (0: every one), except ``protect`` (the best
    one)."""
    complete = complete_checkpoints(run_url)
    for _, old in complete[:len(complete) - keep]:
        if old != protect:
            delete_checkpoint(old)


def delete_checkpoint(url: str) -> None:
    # The marker goes first: a half-deleted folder must never look complete.
    storage.delete(storage.join(url, SEAL))
    if not storage.is_local(url):  # an object store: its objects one by one
        for obj in storage.list_prefix(url):
            storage.delete(obj)
    else:
        storage.delete(url)


def set_aside(url: str, problems: list[str]) -> None:
    """Make a damaged checkpoint invisible to resume and pruning, keeping its files for a post-mortem."""
    storage.write_bytes(storage.join(url, "CORRUPT"), "".join(f"{p}\n" for p in problems).encode())
    storage.delete(storage.join(url, SEAL))


def recorded_sums(url: str, required: bool) -> dict[str, str] | None:
    """The checksums recorded in folder ``url``'s SHA256SUMS, checked against its COMPLETE seal; None for
    a folder written without one (by an older clsys), which is read unverified. ``required``: the
    folder's writer recorded them, so a missing file is damage."""
    sums_url = storage.join(url, SUMS)
    if not required and not storage.exists(sums_url):
        return None
    return integrity.sealed_sums(storage.read_bytes(sums_url), storage.read_bytes(storage.join(url, SEAL)), url)


def listed_apart(rel: str) -> bool:
    """The files of a checkpoint folder that its SHA256SUMS does not list: the ranks' markers (the lists
    it was merged from) and the universal form (sealed on its own)."""
    return rel.startswith((f"{RANK_MARKERS}/", f"{UNIVERSAL}/"))


# The files every checkpoint holds, as ``integrity.listing_problems`` takes them (each rank's: ``missing_rank_files``).
REQUIRED_FILES = {"clsys_state.json": r"clsys_state\.json",
                  "ds/*model_states.pt": r"ds/(.+_)?mp_rank_\d+_model_states\.pt"}
ZERO_STAGE = Kind("0, 1, 2 or 3", lambda value: value in (0, 1, 2, 3) and COUNT.holds(value), optional=True)
# The fields of clsys_state.json that resume reads (export reads more: clsys.export), and what each holds.
STATE_FIELDS = {"world_size": POSITIVE, "step": COUNT, "precision": replace(TEXT, optional=True),
                "config.train.zero_stage": ZERO_STAGE}


def checked_state(state: object, source: str) -> dict:
    """A checkpoint's clsys_state.json (``source`` names it) once the fields resume reads are what clsys
    writes (``STATE_FIELDS``): CheckpointError naming the field otherwise (a wrong type used to end in a
    traceback on every rank)."""
    return checked_record(state, STATE_FIELDS, source)


def missing_rank_files(state: dict, sums: dict[str, str]) -> list[str]:
    """The files of its ranks that a checkpoint's SHA256SUMS (``sums``) does not list, as
    ``integrity.listing_problems`` says them: every rank's state file, plus, unless the checkpoint keeps the
    whole state in one file (``_whole_state``), every rank's optimizer partition (``bf16_`` in front in
    DeepSpeed's bf16 optimizer). The ranks listed are counted, not matched one pattern per rank: a world size of
    200000 in a hostile clsys_state.json took seconds and gave an error line of 10 MB; now the first ``SHOWN``
    missing are named and the others counted."""
    world = state["world_size"]
    kinds = [("rank-{:05d}.pt", "rank-NNNNN.pt", r"rank-(\d{5})\.pt")]
    if not _whole_state(state):
        kinds.append(("ds/*zero_pp_rank_{}_*optim_states.pt", "ds/*zero_pp_rank_N_*optim_states.pt",
                      r"ds/(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt"))
    problems = []
    for name, names, pattern in kinds:
        listed = {int(match.group(1)) for rel in sums if (match := re.fullmatch(pattern, rel))}
        missing = world - len({rank for rank in listed if rank < world})
        first = itertools.islice((rank for rank in range(world) if rank not in listed), SHOWN)
        problems += [f"{name.format(rank)}: required, not listed in {SUMS}" for rank in first]
        if missing > SHOWN:
            problems.append(f"{names} of {missing - SHOWN} more ranks: required, not listed in {SUMS}")
    return problems


def _uncovered(url: str, sums: dict[str, str], apart: Callable[[str], bool], required: dict[str, str]) -> list[str]:
    """``integrity.listing_problems`` of the folder ``url`` on storage."""
    return integrity.listing_problems((rel for _, rel in storage.list_relative(url)), sums, apart, required)


def _agreed(problems: list[str]) -> list[str]:
    """Collective: every rank's problems, so that all ranks take the same decision."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    return sorted({p for rank_problems in everyone for p in rank_problems})


def _ensure_universal(url: str, sums: dict[str, str] | None) -> list[str]:
    """Collective: convert ``url``'s DeepSpeed checkpoint to ``universal/`` once (rank 0), from a
    ``ds/`` checked against ``sums``; returns the problems found on the way (every rank the same)."""
    universal, problems = storage.join(url, UNIVERSAL), []
    if dist.get_rank() == 0 and not storage.exists(storage.join(universal, SEAL)):
        work = tempfile.mkdtemp(prefix="clsys-universal-")
        try:
            storage.download_dir(storage.join(url, "ds"), os.path.join(work, "in", "ds"))
            if sums is not None:
                problems = integrity.differences(os.path.join(work, "in"), sums, lambda rel: rel.startswith("ds/"))
            if not problems:
                _convert_to_universal(url, os.path.join(work, "in", "ds"), os.path.join(work, "out"))
                delete_checkpoint(universal)  # what a conversion cut short left: none of it may mix with the new
                integrity.upload_sealed(os.path.join(work, "out"), universal)
        except storage.StorageError as err:
            problems = [str(err)]
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _agreed(problems)


# DeepSpeed's converter (what `python -m deepspeed.checkpoint.ds_to_universal` runs), its loads restricted
# as ours are; its worker processes are forked from it, so theirs are too.
_CONVERT = """
from deepspeed.checkpoint import ds_to_universal
from clsys.engine.checkpoint import weights_only_loads
with weights_only_loads():
    ds_to_universal.main(ds_to_universal.parse_arguments())
"""


def _convert_to_universal(url: str, ds_folder: str, out: str) -> None:
    # DeepSpeed's converter, as a process: its options change between versions, its CLI less.
    # --inject_missing_state: the converter expects Megatron's parallelism metadata, which a
    # plain data-parallel model does not write; the defaults it injects are the right ones.
    proc = subprocess.run([sys.executable, "-c", _CONVERT, "--input_folder", ds_folder,
                           "--output_folder", os.path.join(out, "ds"), "--inject_missing_state"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{url}: conversion to a universal checkpoint failed:\n{proc.stderr[-2000:]}")
    integrity.write_folder_sums(out)


@dataclass
class Fetched:
    """A checkpoint downloaded and checked: what this rank restores from ``folder``."""

    url: str
    step: int
    saved_world: int  # the rank count that wrote it
    folder: str  # local: ds/ (or the universal form's ds/) and this rank's state file
    rank_file: str
    universal: bool  # the universal form, for another rank count (the engine is built with load_universal)
    zero_stage: int | None = None  # the ZeRO stage that wrote it (its files' layout), where recorded


def _fetch(url: str, world: int) -> tuple[Fetched | None, list[str]]:
    """Collective: download what this rank needs from checkpoint ``url`` and check it against the
    recorded checksums; (the download, []) or (None, the problems any rank found)."""
    rank, local = dist.get_rank(), tempfile.mkdtemp(prefix="clsys-restore-")
    sums, state, problems = None, {}, []
    try:
        state_url = storage.join(url, "clsys_state.json")
        storage.download_file(state_url, os.path.join(local, "clsys_state.json"))
        with open(os.path.join(local, "clsys_state.json"), "rb") as f:
            state = checked_state(storage.parse_json(f.read(), state_url), state_url)
        # A SHA256SUMS file damaged or deleted after the fact reads as "recorded, but wrong or missing".
        sums = recorded_sums(url, required="sums" in state)
        if sums is not None:
            problems = (_uncovered(url, sums, listed_apart, REQUIRED_FILES) + missing_rank_files(state, sums)
                        + integrity.differences(local, sums, lambda rel: rel == "clsys_state.json"))
    except (storage.StorageError, integrity.IntegrityError, CheckpointError) as err:
        problems = [str(err)]
    problems = _agreed(problems)
    universal = not problems and state["world_size"] != world and not _whole_state(state)
    if universal:
        problems = _ensure_universal(url, sums)
    if problems:
        shutil.rmtree(local, ignore_errors=True)
        return None, problems

    saved = state["world_size"]
    rank_file = f"rank-{rank if saved == world else 0:05d}.pt"
    try:
        if not universal:
            storage.download_dir(storage.join(url, "ds"), os.path.join(local, "ds"))
            if sums is not None:
                problems = integrity.differences(local, sums, lambda rel: rel.startswith("ds/"))
        else:
            universal_url = storage.join(url, UNIVERSAL)
            storage.download_dir(universal_url, local)
            universal_sums = recorded_sums(universal_url, required=sums is not None)
            if universal_sums is not None:
                problems = [f"{UNIVERSAL}/{p}" for p in _uncovered(universal_url, universal_sums, lambda rel: False, {})
                            + integrity.differences(local, universal_sums)]
        storage.download_file(storage.join(url, rank_file), os.path.join(local, rank_file))
        if sums is not None:
            problems += integrity.differences(local, sums, lambda rel: rel == rank_file)
    except (storage.StorageError, integrity.IntegrityError) as err:
        problems.append(str(err))
    problems = _agreed(problems)
    if problems:
        shutil.rmtree(local, ignore_errors=True)
        return None, problems
    return Fetched(url, state["step"], saved, local, rank_file, universal, _saved_zero_stage(state)), []


def _whole_state(state: dict) -> bool:
    """Whether the checkpoint keeps the whole model and Adam state in DeepSpeed's one model-states file
    (plain data parallelism), which any rank count loads as it is. Every other kind holds each rank's
    partition of the optimizer, which another rank count reads through the universal form (whose
    converter needs those partition files, so it cannot read a stage-0 checkpoint)."""
    return plain_data_parallel(_saved_zero_stage(state), state.get("precision"))


def _saved_zero_stage(state: dict) -> int | None:
    return state.get("config", {}).get("train", {}).get("zero_stage")


def fetch_intact(candidates: list[str], world: int) -> Fetched | None:
    """Collective: the newest of ``candidates`` (checkpoint URLs, newest first) whose files are intact.

    A damaged one is set aside (``set_aside``) once an older one passes, and named in a warning; when
    none passes, nothing is set aside and RuntimeError lists what was found. None: no candidates."""
    damaged = []
    log.debug(storage.redact(f"[clsys] checkpoints to resume from, newest first: {', '.join(candidates) or 'none'}"))
    for url in candidates:
        fetched, problems = _fetch(url, world)
        if fetched is None:
            damaged.append((url, problems))
            continue
        if dist.get_rank() == 0:
            for bad, bad_problems in damaged:
                set_aside(bad, bad_problems)
                log.warning(f"[clsys] warning: checkpoint {bad} is damaged ({'; '.join(bad_problems)}); set aside "
                            f"(its COMPLETE marker replaced by a CORRUPT file), resuming from {url} instead")
        log.debug(storage.redact(f"[clsys] resuming from {url}: its files match its SHA256SUMS"))
        return fetched
    if damaged:
        raise RuntimeError("no intact checkpoint to resume from: " +
                           " | ".join(f"{url}: {'; '.join(problems)}" for url, problems in damaged))
    return None


def load(engine, fetched: Fetched, world_size: int) -> dict:
    """Restore model/optimizer/scheduler from ``fetched`` (removing the local copy); this rank's saved state.

    With the rank count that wrote it every rank gets back its own RNG and loader state. With another
    count the weights and optimizer are resharded (from the universal form, ``engine`` built with
    ``load_universal``; a stage-0 checkpoint's whole state as it is) and every rank gets rank 0's parts (all ranks
    stand at the same loader position and have counted the same) but no RNG state.
    """
    try:
        with weights_only_loads(fetched.folder, fetched.url):
            path, _ = engine.load_checkpoint(fetched.folder, tag="ds")
            if path is None:
                raise RuntimeError(f"{fetched.url}: DeepSpeed could not load the checkpoint")
            rank_state = torch.load(os.path.join(fetched.folder, fetched.rank_file))
    finally:
        shutil.rmtree(fetched.folder, ignore_errors=True)
    if fetched.saved_world != world_size:
        rank_state = {name: part for name, part in rank_state.items() if name != "rng"}
    return rank_state
