"""Streaming WebDataset shards (file:// or s3://) into per-rank batches, deterministically and resumably.

Its nouns:
  - ``ShardLoader``: one rank's batches of one data stream (the shards under one URL: ``sentences``,
    ``clir/en-de``), epoch after epoch, with a position that checkpoints save and restore; ``stream_loader`` and
    ``rank_loader`` build it from a config;
  - ``SegmentReader``: in the trainer, the rest of the current segment of an epoch: it starts the segment's loader
    workers, hands out their batches and advances the position;
  - ``WorkerBatches``: the DataLoader's dataset, run in each loader worker: that worker's piece as collated batches.
What each (rank, loader worker) reads in an epoch (``EpochPlan``, its pieces and spans of sample streams) and the
position checkpoints store (``LoaderState``, its segments) are ``clsys.data.epoch_layout``'s: each loader worker
reads its shards as one sample stream, cut into micro-batches (a trailing partial batch is dropped), and every rank
stops after the same number of batches.

Shards are read whole and checked before use by ``clsys.shards.reader`` (one shard per loader
worker at a time, plus the decoded samples of the shuffle buffer). ``on_bad_sample`` says what bad
data does:
  - ``error`` (default): a ShardError naming the shard URL, the member or sample and the reason
    stops the run;
  - ``skip``: a bad shard is left out whole (reasons ``checksum``, ``truncated``, ``corrupt``,
    ``unsafe``, ``too_large``; counted per shard), a bad sample alone (``undecodable``, ``missing_fields``;
    counted per sample). A worker that lost data yields fewer batches and a rank ends its epoch when its
    workers run dry, so no rank ever waits for a batch; ranks can then drift apart by a few batches
    at epoch boundaries (with ``error`` the counts are exact). A rank that gets no batch in a whole
    epoch is an error.
A shard that storage cannot read at all (``StorageError``, after its retries) stops the run either way.
Every batch carries ``batch["data_skipped"]``: {reason: count}, plain ints, what its loader worker
skipped since that worker's previous batch (always empty with ``error``); the training loop pops it
and logs ``data/skipped_<reason>``. Faults a worker finds after its last batch of an epoch go unreported.

Length grouping (``length_group`` K > 0, ``data.length_group_batches``): a loader worker takes its
stream K micro-batches at a time, sorts that window's samples by length (``lengths``: the objective's
token counts in training, ``text_lengths`` by default), cuts it into K batches and hands them out in
an order seeded by (seed, epoch, segment, rank, worker, window). Collate pads each batch to its longest
row, so batches of similar lengths carry less padding; the shuffle buffer still decides which samples
meet in a window, and within it the sort, not chance, decides which share a batch (in-batch negatives
are then of similar length). K is part of the geometry (``clsys.data.epoch_layout``).

Exact resume (same geometry): each worker replays its stream and skips the batches it had handed
out, and the workers are rotated so that the DataLoader's first worker is the one whose turn it was.
Before collating batch k a loader worker seeds Python's ``random``, torch's global RNG and numpy's
(when imported) from (seed, epoch, segment, rank, worker, k), so collate functions may draw from the
global RNGs (masks, negatives, directions) and a resumed run draws exactly the same. Collate may
keep state (CLIR's pool of recent documents), so skipped batches are collated too and dropped: a
resume tokenizes the skipped part of the epoch once. The DataLoader gets its own generator, so
starting one never draws from the training process's RNG (dropout masks).

A state saved under another geometry continues its epoch as ``clsys.data.epoch_layout`` deals it (elastic resume).

How batches cross from the loader workers to the trainer (``data.transport``: a stock DataLoader, or the same
batches faster) is ``clsys.data.transport``'s, and how its fast workers start, live and end
``clsys.data.loader_workers``'s.
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import math
import random
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Callable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from clsys import storage
from clsys.config import Config
from clsys.data.batch_transport import WORKER_KEY
from clsys.data.epoch_layout import (EpochPlan, LoaderState, Piece, Segment, plan_epoch, plan_last_segment,
                                     round_robin_position)
from clsys.data.spec import DataSpec
from clsys.data.transport import Delivery, Transport, transport_for
from clsys.shards.fields import stream_kind
from clsys.shards.reader import MAX_SHARD_BYTES, ShardError, load_shards, read_shard

log = logging.getLogger(__name__)

ON_BAD_SAMPLE = ("error", "skip")

# The batches in flight cover this long of training steps, so that a worker's stall (a shard fetched from object
# storage: 64 MiB at ~100 MB/s is 0.6 s; a run of long texts) does not reach the step. Batches are small (token ids).
PREFETCH_SECONDS = 2.0
MAX_PREFETCH = 64  # batches per loader worker


def prefetch_depth(step_seconds: float | None, workers: int) -> int:
    """Batches each loader worker keeps ready (the DataLoader's ``prefetch_factor``) for steps of ``step_seconds``:
    the DataLoader's default of 2 until a step time is measured, and never fewer."""
    if not step_seconds:
        return 2
    return max(2, min(MAX_PREFETCH, math.ceil(PREFETCH_SECONDS / step_seconds / workers)))


def text_lengths(samples: list[dict]) -> list[int]:
    """Characters of each sample's text: length grouping's sort key where no tokenizer is at hand."""
    return [len(sample["txt"]) for sample in samples]


def seed_global_rngs(seed: int, epoch: int, segment: int, rank: int, worker: int, batch: int) -> None:
    """Seed this loader worker's global RNGs for one batch, so collate's draws replay on resume."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{segment}/{rank}/{worker}/{batch}".encode()).digest()
    value = int.from_bytes(digest[:8], "little")
    random.seed(value)
    # The CPU generator alone: torch.manual_seed also queues a seed for every lazily initialised device
    # (CUDA, XPU, MTIA), formatting a stack trace each time, ~0.3 ms a batch; collates never draw on a device.
    torch.default_generator.manual_seed(value)
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed(value % 2**32)


class WorkerBatches(IterableDataset):
    """The DataLoader's dataset for one rank's segment, run in each of its loader workers: that worker's piece as
    collated batches, past those handed out before the saved position."""

    def __init__(self, plan: EpochPlan, state: LoaderState, micro_batch: int, seed: int,
                 collate: Callable[[list[dict]], dict], verify: bool, on_bad_sample: str,
                 lengths: Callable[[list[dict]], list[int]], transport: Transport):
        self.plan, self.micro_batch, self.seed, self.collate = plan, micro_batch, seed, collate
        self.transport = transport  # how the batches travel to the trainer
        self.length_group, self.lengths = state.segments[-1].length_group, lengths
        self.verify, self.on_bad_sample = verify, on_bad_sample
        # A copy of the position: the training process goes on changing its own.
        self.epoch, self.segment, self.rank = state.epoch, len(state.segments) - 1, state.rank
        self.shuffle_buffer, self.skip, self.rotation = state.shuffle_buffer, list(state.produced), state.next_worker

    def _stream(self, rank: int, worker: int, skipped: collections.Counter) -> Iterator[dict]:
        """The sample stream of (rank, worker): its shards' samples through its seeded shuffle buffer."""
        rng = random.Random(f"{self.seed}/{self.epoch}/{rank}/{worker}")
        buffer: list[dict] = []
        for shard in self.plan.shards[rank][worker]:
            for sample in read_shard(shard, self.verify, skipped if self.on_bad_sample == "skip" else None):
                if len(buffer) < self.shuffle_buffer:
                    buffer.append(sample)
                    continue
                i = rng.randrange(len(buffer))
                buffer[i], sample = sample, buffer[i]
                yield sample
        rng.shuffle(buffer)
        yield from buffer

    def _samples(self, piece: Piece, skipped: collections.Counter) -> Iterator[dict]:
        for span in piece.spans:
            stream = self._stream(span.rank, span.worker, skipped)
            # The samples before the span were consumed earlier in the epoch, under another geometry,
            # and the faults found reaching them were reported then.
            reported = collections.Counter(skipped)
            collections.deque(itertools.islice(stream, span.start), maxlen=0)
            skipped.clear()
            skipped.update(reported)
            yield from itertools.islice(stream, span.stop - span.start)

    def _batches(self, worker: int, piece: Piece, skipped: collections.Counter) -> Iterator[list[dict]]:
        """The piece's samples cut into micro-batches. With length grouping (K > 0) each window of K
        batches' samples is sorted by length before it is cut (similar lengths pad less), and the
        window's batches come out in an order drawn from the window's own seed, so that batch lengths do
        not rise steadily through each window."""
        samples = self._samples(piece, skipped)
        window = max(self.length_group, 1)
        for number, first in enumerate(range(0, piece.batches, window)):
            taken = list(itertools.islice(samples, min(window, piece.batches - first) * self.micro_batch))
            count = len(taken) // self.micro_batch  # fewer only when bad data was skipped
            order = list(range(count))
            if self.length_group:
                lengths = self.lengths(taken)
                taken = [taken[i] for i in sorted(range(len(taken)), key=lengths.__getitem__)]  # ties: stream order
                random.Random(f"{self.seed}/{self.epoch}/{self.segment}/{self.rank}/{worker}/window{number}"
                              ).shuffle(order)
            for i in order:
                yield taken[i * self.micro_batch:(i + 1) * self.micro_batch]
            if count < window:
                return

    def __iter__(self) -> Iterator:
        return iter(self.transport.send(self._handed_out()))

    def _handed_out(self) -> Iterator[dict]:
        """This loader worker's collated batches past those handed out before the saved position, each tagged with its
        keys, its faults and its worker."""
        info = get_worker_info()
        worker = ((info.id if info is not None else 0) + self.rotation) % len(self.skip)
        piece, skip = self.plan.pieces[self.rank][worker], self.skip[worker]
        if skip >= piece.batches:
            return  # nothing left to hand out, so nothing to replay
        skipped: collections.Counter = collections.Counter()
        for made, batch in enumerate(self._batches(worker, piece, skipped)):
            seed_global_rngs(self.seed, self.epoch, self.segment, self.rank, worker, made)
            out = self.collate(batch)  # skipped batches too: collate may keep state
            if made >= skip:
                out.update({"keys": [s["__key__"] for s in batch], "data_skipped": dict(skipped), WORKER_KEY: worker})
                yield out
            skipped.clear()  # a skipped batch's faults were reported before the checkpoint


class ShardLoader:
    """Batches for this rank across epochs, with a position that checkpoints can save and restore."""

    def __init__(self, stream_url: str, rank: int, ranks: int, micro_batch: int, collate: Callable,
                 seed: int, loader_workers: int = 1, shuffle_buffer: int = 2048, verify: bool = True,
                 on_bad_sample: str = "error", length_group: int = 0,
                 lengths: Callable[[list[dict]], list[int]] = text_lengths, kind: str = "",
                 max_shard_bytes: int = MAX_SHARD_BYTES, pin_memory: bool = False, bundle: int | None = None,
                 vocab_size: int | None = None, transport: str = "fast"):
        """``kind``: the stream kind whose json fields every sample must have (``clsys.shards.fields``);
        ``max_shard_bytes``: the most a shard's tar may take in memory (``data.max_shard_mb``); ``bundle``: batches a
        fast loader worker sends at once (default ``batches_per_transfer``), which changes nothing but the transfer;
        ``vocab_size``: where collate reads the samples' token ids, the tokenizer's number of ids, which they are
        checked against (``clsys.shards.reader.Shard.ids_vocab``); ``transport``: how batches cross from the loader
        workers (``data.transport``, ``clsys.data.transport``), which changes nothing but the crossing."""
        if on_bad_sample not in ON_BAD_SAMPLE:
            raise ValueError(f"data.on_bad_sample: expected {' or '.join(ON_BAD_SAMPLE)}, got {on_bad_sample!r}")
        if length_group < 0:
            raise ValueError(f"data.length_group_batches: expected 0 (off) or a number of batches, got {length_group}")
        if max_shard_bytes <= 0:
            raise ValueError(f"data.max_shard_mb: expected a positive size, got {max_shard_bytes} bytes")
        self.shards = load_shards(stream_url, kind, max_shard_bytes, vocab_size)
        self.rank, self.ranks, self.micro_batch, self.collate = rank, ranks, micro_batch, collate
        self.seed, self.workers, self.shuffle_buffer, self.verify = seed, loader_workers, shuffle_buffer, verify
        self.on_bad_sample, self.length_group, self.lengths = on_bad_sample, length_group, lengths
        # Batches in page-locked memory (the DataLoader's pinning thread), so that the step's copies to a GPU
        # are asynchronous (non_blocking) rather than staged through a pageable buffer.
        self.pin_memory = pin_memory
        self.transport = transport_for(transport, collate, micro_batch, bundle)
        log.debug(f"[clsys] rank {rank} loader: {loader_workers} worker(s), {self.transport}, "
                  f"{'pinned' if pin_memory else 'pageable'} memory")
        plan_epoch(self.shards, 0, seed, ranks, loader_workers, micro_batch)  # fail at start-up, not mid-run
        self.state = self._epoch_start(0)

    def _epoch_start(self, epoch: int) -> LoaderState:
        segment = Segment(self.ranks, self.workers, self.micro_batch, length_group=self.length_group)
        return LoaderState(epoch, self.shuffle_buffer, [segment], self.rank, [0] * self.workers)

    def plan(self, state: LoaderState) -> EpochPlan:
        """What each (rank, loader worker) reads in the last segment of ``state``'s epoch."""
        return plan_last_segment(self.shards, state.epoch, self.seed, state.segments)

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; one saved under another geometry (ranks, loader workers,
        micro-batch or length grouping) continues its epoch with this geometry (see the module docstring)."""
        legacy = "segments" not in state  # saved before geometries were recorded: under this one
        saved = self._epoch_start(state["epoch"]) if legacy else LoaderState.from_dict(state)
        if legacy:
            saved.segments[0].batches = state["batches"]
        plan = self.plan(saved)
        current, limit = saved.segments[-1], plan.batches_per_rank
        if current.batches > limit:
            raise ValueError(f"loader state at batch {current.batches} of epoch {saved.epoch}, which has "
                             f"{limit} per rank: not a state of this stream and seed")
        if legacy:
            saved.produced, saved.next_worker = round_robin_position(plan.worker_batches(self.rank), current.batches)
        if current.geometry() == (self.ranks, self.workers, self.micro_batch, self.length_group):
            if saved.rank != self.rank:
                raise ValueError(f"the loader state of rank {saved.rank} cannot resume rank {self.rank}: "
                                 f"with an unchanged geometry each rank resumes its own")
            self.state = saved
        elif current.batches == limit:
            self.state = self._epoch_start(saved.epoch + 1)  # its epoch was complete
        else:
            saved.segments.append(Segment(self.ranks, self.workers, self.micro_batch, length_group=self.length_group))
            self.state = LoaderState(saved.epoch, saved.shuffle_buffer, saved.segments, self.rank,
                                     [0] * self.workers)

    def __iter__(self) -> Iterator[dict]:
        """Endless: epoch after epoch, starting from the saved position; the fast transport reads the next epoch
        ahead (``_epochs_read_ahead``)."""
        return self._epochs_read_ahead() if self.transport.reads_ahead else self._epochs()

    def _epochs(self) -> Iterator[dict]:
        """Each epoch's loader workers started at its first batch and stopped after its last."""
        while True:
            reader = SegmentReader(self, self.state)
            try:
                yield from reader
            finally:
                reader.close()
            self.state = self._epoch_start(self.state.epoch + 1)

    def _epochs_read_ahead(self) -> Iterator[dict]:
        """``_epochs`` under the fast transport: once half of an epoch's batches are handed out, the next epoch's
        loader workers start and read ahead (their first shards, shuffle buffers and the DataLoader's prefetch), so
        the steps after an epoch boundary do not wait for new workers. Half, not at once: a run that ends early in an
        epoch (most tests) starts no workers it never uses. They are started from a thread: starting a worker blocks
        until it has unpickled the dataset (the collate's tokenizer), ~0.7 s a worker in a GPU trainer, measured as a
        3 s stall of every step at half-epoch when the training thread started them; that thread also takes each new
        worker's first bundle off the pipe (``clsys.data.transport.FastDelivery``). The finished epoch's workers are
        stopped from a thread too. The next epoch's workers keep ``prefetch_depth`` batches each ready besides their
        first (whole bundles, at least two), from this epoch's step time. A run that ends between half-epoch and the
        read-ahead's first bundles waits for them before it stops the new workers."""
        reader, ahead = SegmentReader(self, self.state), None
        background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="clsys-epoch-boundary")

        def read_ahead() -> Future:
            depth = prefetch_depth(reader.step_seconds, self.workers)
            log.debug(f"[clsys] rank {self.rank} loader: epoch {self.state.epoch + 1} read ahead, {depth} batches "
                      f"ready per worker (steps of {reader.step_seconds or 0:.3f} s)")
            return background.submit(SegmentReader, self, self._epoch_start(self.state.epoch + 1), depth)

        # The finished epoch's reader, whose workers are stopped (20-40 ms of joining them, from the thread) once the
        # next epoch's first batch is out: stopping them meanwhile took the trainer's thread's interpreter lock, and
        # the first step after the boundary waited 1-6 ms for it.
        finished: SegmentReader | None = None

        def stop_finished() -> None:
            nonlocal finished
            if finished is not None:
                background.submit(finished.close)
                finished = None

        try:
            while True:
                for batch in reader:
                    yield batch
                    stop_finished()
                    if ahead is None and reader.half_read:
                        ahead = read_ahead()
                stop_finished()  # still there when this epoch had no batch to hand out
                finished = reader
                if ahead is None:  # an epoch resumed at its end
                    ahead = read_ahead()
                reader, ahead = ahead.result(), None
                self.state = reader.state
        finally:
            reader.close()
            if finished is not None:
                finished.close()
            if ahead is not None and ahead.exception() is None:  # waits for its workers' first bundles
                ahead.result().close()
            background.shutdown()


class SegmentReader:
    """The rest of the current segment of one epoch, read by this rank's DataLoader workers; they start
    (and begin reading ahead) when the reader is made. Iterating updates ``state``, the loader's position."""

    def __init__(self, loader: ShardLoader, state: LoaderState, prefetch: int = 2):
        """``prefetch``: batches each loader worker keeps ready, under the fast transport."""
        self.state, self.rank = state, loader.rank
        self.plan = loader.plan(state)
        self.delivery: Delivery | None = None  # the batches of the segment's DataLoader
        self.handed_out_at: float | None = None  # when the last batch went to the trainer
        self.step_times: collections.deque[float] = collections.deque(maxlen=256)  # the recent intervals
        self.fresh = state.segments[-1].batches == 0
        if state.segments[-1].batches < self.plan.batches_per_rank:
            dataset = WorkerBatches(self.plan, state, loader.micro_batch, loader.seed, loader.collate, loader.verify,
                                    loader.on_bad_sample, loader.lengths, loader.transport)
            self.delivery = loader.transport.start(dataset, loader.workers, state.next_worker, prefetch,
                                                   loader.pin_memory)

    @property
    def step_seconds(self) -> float | None:
        """The trainer's time per batch (its step and its wait for the batch), the median of the recent ones: the
        first steps' compilation and warm-up do not count. None before two batches."""
        return statistics.median(self.step_times) if self.step_times else None

    @property
    def half_read(self) -> bool:
        return 2 * self.state.segments[-1].batches >= self.plan.batches_per_rank

    def __iter__(self) -> Iterator[dict]:
        state, current = self.state, self.state.segments[-1]
        if self.delivery is None:
            return
        for batch in self.delivery:
            worker = batch.pop(WORKER_KEY)
            current.batches += 1
            state.produced[worker] += 1
            state.next_worker = (worker + 1) % len(state.produced)
            now = time.monotonic()
            if self.handed_out_at is not None:
                self.step_times.append(now - self.handed_out_at)
            self.handed_out_at = now
            yield batch
            if current.batches >= self.plan.batches_per_rank:
                break
        if self.fresh and current.batches == 0:
            raise ShardError(f"rank {self.rank} got no batch in epoch {state.epoch}: all the data it was given "
                             f"was skipped as bad (data.on_bad_sample=skip)")

    def close(self) -> None:
        """Stop the workers (and free their shards) now."""
        if self.delivery is not None:
            self.delivery.close()
            self.delivery = None


def stream_loader(cfg: Config, stream: str, rank: int, world: int, data: DataSpec) -> ShardLoader:
    """A ``ShardLoader`` over the stream ``stream`` (``sentences``, ``clir/en-de``, …) under ``data.url``, configured
    by the ``data`` section, collating with ``data``."""
    d = cfg.data
    return ShardLoader(storage.join(d.url, stream), rank, world, cfg.micro_batch, data.collate, cfg.train.seed,
                       d.loader_workers, d.shuffle_buffer, d.verify_checksums, d.on_bad_sample, d.length_group_batches,
                       data.sample_lengths, stream_kind(stream), d.max_shard_mb << 20, pin_memory=cfg.cluster.use_gpu,
                       vocab_size=len(data.tokenizer) if data.reads_ids else None, transport=d.transport)


def rank_loader(cfg: Config, rank: int, world: int, data: DataSpec):
    """This rank's endless batch iterator with ``state_dict``/``load_state_dict`` (its data position), built from an
    objective's data spec: a ``stream_loader`` for each of its streams, combined as it says."""
    return data.combine({stream: stream_loader(cfg, stream, rank, world, data) for stream in data.streams})
