"""Streaming WebDataset shards (file:// or s3://) into per-rank batches, deterministically.

How an epoch is laid out (every rank computes the same plan from the manifest, no communication):
  1. the shard list is shuffled with ``seed + epoch``;
  2. shard i goes to slot i mod (ranks × loader_workers); slot s is loader worker s // ranks of rank
     s mod ranks, so each rank gets whole shards and no shard is read twice;
  3. each loader worker streams its shards, shuffles samples in a seeded buffer and cuts them
     into micro-batches (a trailing partial batch is dropped);
  4. every rank stops after the same number of batches: the minimum over ranks of what its
     workers can produce. Equal counts are what keeps collectives from hanging at epoch end.

Position: ``LoaderState(epoch, batches)``. ``DataLoader`` takes batches from its workers in
round-robin order, so the number of batches each worker has produced after ``batches`` is
computable; a resumed worker replays its shuffle without collating the skipped batches, and the
workers are rotated so that the DataLoader's first worker is the one whose turn it was.

Only ``txt`` and ``json`` members are decoded; anything else (a pickle, say) is refused.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import group_by_keys, tar_file_iterator

from clsys import storage

SAFE_EXTENSIONS = {"txt": lambda b: b.decode("utf-8"), "json": lambda b: json.loads(b)}


class ShardError(RuntimeError):
    """A shard that cannot be trusted: checksum mismatch, unsafe member, unreadable tar."""


@dataclass
class LoaderState:
    epoch: int = 0
    batches: int = 0  # batches this rank has consumed in ``epoch``


@dataclass(frozen=True)
class Shard:
    url: str
    samples: int
    sha256: str


def load_shards(stream_url: str) -> list[Shard]:
    from data_prep.shards import read_manifest

    manifest = read_manifest(stream_url)
    return [Shard(storage.join(stream_url, s["name"]), int(s["samples"]), s["sha256"]) for s in manifest["shards"]]


class _HashingReader:
    """A read-through wrapper that hashes every byte the tar parser consumes."""

    def __init__(self, raw):
        self.raw, self.digest = raw, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n) if n is not None and n >= 0 else self.raw.read()
        self.digest.update(data)
        return data

    def drain(self) -> str:
        while self.read(1 << 20):
            pass
        return self.digest.hexdigest()


def read_shard(shard: Shard, verify: bool = True) -> Iterator[dict[str, Any]]:
    """Decoded samples of one shard; raises ShardError naming the shard when it cannot be trusted."""
    raw = storage.open_read(shard.url)
    reader = _HashingReader(raw)
    try:
        members = ({**member, "__url__": shard.url} for member in tar_file_iterator(reader))
        for sample in group_by_keys(members):
            decoded = {"__key__": sample["__key__"]}
            for ext, value in sample.items():
                if ext.startswith("__"):
                    continue
                if ext not in SAFE_EXTENSIONS:
                    raise ShardError(f"{shard.url}: sample {sample['__key__']} has a '.{ext}' member; "
                                     f"only {', '.join(SAFE_EXTENSIONS)} are decoded (never pickles)")
                decoded[ext] = SAFE_EXTENSIONS[ext](value)
            yield decoded
        if verify and (got := reader.drain()) != shard.sha256:
            raise ShardError(f"{shard.url}: sha256 {got} does not match the manifest ({shard.sha256})")
    except (OSError, ValueError, KeyError) as err:
        raise ShardError(f"{shard.url}: unreadable shard ({type(err).__name__}: {err})") from None
    finally:
        raw.close()


@dataclass(frozen=True)
class EpochPlan:
    """Which shards each (rank, loader worker) reads in one epoch, and how many batches it yields."""

    shards: list[list[list[Shard]]]  # [rank][worker] -> shards
    micro_batch: int
    batches_per_rank: int = 0

    def worker_batches(self, rank: int) -> list[int]:
        return [sum(s.samples for s in shards) // self.micro_batch for shards in self.shards[rank]]


def plan_epoch(shards: list[Shard], epoch: int, seed: int, ranks: int, workers: int, micro_batch: int) -> EpochPlan:
    slots = ranks * workers
    if len(shards) < slots:
        raise ValueError(f"too few shards: {len(shards)} shard(s) for {ranks} rank(s) × {workers} loader worker(s) "
                         f"= {slots} readers; write smaller shards (data_prep --shard-size-mb) or use fewer workers")
    order = list(shards)
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    table = [[[] for _ in range(workers)] for _ in range(ranks)]
    for i, shard in enumerate(order):
        slot = i % slots
        table[slot % ranks][slot // ranks].append(shard)
    per_rank = [sum(EpochPlan(table, micro_batch).worker_batches(r)) for r in range(ranks)]
    if min(per_rank) == 0:
        raise ValueError(f"a rank would get no batch of {micro_batch} samples in epoch {epoch}: "
                         f"samples per rank {[sum(s.samples for w in t for s in w) for t in table]}")
    return EpochPlan(table, micro_batch, min(per_rank))


def round_robin_position(worker_batches: list[int], consumed: int) -> tuple[list[int], int]:
    """After the DataLoader has handed out ``consumed`` batches: how many each worker produced, and
    which worker is next in turn. DataLoader asks workers in turn and skips exhausted ones."""
    produced, turn = [0] * len(worker_batches), 0
    while consumed > 0:
        if produced[turn] < worker_batches[turn]:
            produced[turn] += 1
            consumed -= 1
        turn = (turn + 1) % len(worker_batches)
    return produced, turn


class RankStream(IterableDataset):
    """The batches of one rank in one epoch; each DataLoader worker reads its own shards."""

    def __init__(self, plan: EpochPlan, rank: int, epoch: int, seed: int, shuffle_buffer: int,
                 collate: Callable[[list[dict]], dict], skip: list[int], rotation: int, verify: bool):
        self.plan, self.rank, self.epoch, self.seed = plan, rank, epoch, seed
        self.shuffle_buffer, self.collate, self.verify = shuffle_buffer, collate, verify
        self.skip, self.rotation = skip, rotation

    def _samples(self, worker: int) -> Iterator[dict]:
        rng = random.Random(f"{self.seed}/{self.epoch}/{self.rank}/{worker}")
        buffer: list[dict] = []
        for shard in self.plan.shards[self.rank][worker]:
            for sample in read_shard(shard, self.verify):
                if len(buffer) < self.shuffle_buffer:
                    buffer.append(sample)
                    continue
                i = rng.randrange(len(buffer))
                buffer[i], sample = sample, buffer[i]
                yield sample
        rng.shuffle(buffer)
        yield from buffer

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        workers = len(self.skip)
        worker = ((info.id if info is not None else 0) + self.rotation) % workers
        micro = self.plan.micro_batch
        limit = self.plan.worker_batches(self.rank)[worker]
        batch: list[dict] = []
        produced = 0
        for sample in self._samples(worker):
            batch.append(sample)
            if len(batch) < micro:
                continue
            if produced >= self.skip[worker]:
                out = self.collate(batch)
                out["keys"] = [s["__key__"] for s in batch]
                yield out
            produced += 1
            batch = []
            if produced >= limit:
                return


class ShardLoader:
    """Batches for this rank across epochs, with a position that checkpoints can save and restore."""

    def __init__(self, stream_url: str, rank: int, ranks: int, micro_batch: int, collate: Callable,
                 seed: int, loader_workers: int = 1, shuffle_buffer: int = 2048, verify: bool = True):
        self.shards = load_shards(stream_url)
        self.rank, self.ranks, self.micro_batch, self.collate = rank, ranks, micro_batch, collate
        self.seed, self.workers, self.shuffle_buffer, self.verify = seed, loader_workers, shuffle_buffer, verify
        self.state = LoaderState()
        plan_epoch(self.shards, 0, seed, ranks, loader_workers, micro_batch)  # fail at start-up, not mid-run

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = LoaderState(**state)

    def __iter__(self) -> Iterator[dict]:
        """Endless: epoch after epoch, starting from the saved position."""
        while True:
            plan = plan_epoch(self.shards, self.state.epoch, self.seed, self.ranks, self.workers, self.micro_batch)
            skip, rotation = round_robin_position(plan.worker_batches(self.rank), self.state.batches)
            dataset = RankStream(plan, self.rank, self.state.epoch, self.seed, self.shuffle_buffer,
                                 self.collate, skip, rotation, self.verify)
            loader = DataLoader(dataset, batch_size=None, num_workers=self.workers)
            for batch in loader:
                if self.state.batches >= plan.batches_per_rank:
                    break
                self.state.batches += 1
                yield batch
            self.state = LoaderState(self.state.epoch + 1, 0)
