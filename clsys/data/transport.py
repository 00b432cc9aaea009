"""How a rank's batches cross from its loader worker processes to the trainer: ``data.transport``, plain or fast.

What the batches are (which samples, in which order, collated under which seeds, and the loader's position) is
``clsys.data.streaming``'s and the same under both; this module owns how they travel, and every private name of
torch, transformers and multiprocessing that the loader uses.

``plain``: a stock ``torch.utils.data.DataLoader``: each batch one item, its tensors through the DataLoader's shared
memory, its workers started as torch starts them (forked from the trainer), ended when its iterator is dropped; each
epoch's workers start at the epoch's first batch; collates call the tokenizer itself, ``tokenizer(texts, …)``. Public
names only.

``fast`` adds these, all of them switched off together by ``plain``:
  - batches as bytes in the pickle, a bundle of them per DataLoader item (``clsys.data.batch_transport``), handed out
    one at a time in plain's order;
  - the pipe that carries them grown to hold a bundle (``grow_result_pipe``);
  - workers forked from a forkserver that has imported the collate's modules, with the trainer's environment, at a
    lower priority, their imports out of the garbage collector's sight, ending with the trainer
    (``clsys.data.loader_workers``), and stopped at once when their segment ends;
  - the next epoch's workers started and read ahead from half-epoch on a thread (``ShardLoader``);
  - collates' tokenizer calls through a configured copy of the tokenizer's Rust backend
    (``clsys.data.batch_tokenizer``), where the tokenizer's call is the backend's (``tokenizer_call_is_the_backends``).

``uses_fast_path`` checks those private names once a process; where one is missing (another torch, transformers or
Python), the loader and the collates run plain, with one warning naming it.
"""
from __future__ import annotations

import fcntl
import functools
import itertools
import logging
import math
import os
from dataclasses import dataclass
from multiprocessing import forkserver, queues
from multiprocessing.context import BaseContext
from typing import Any, Callable, ClassVar, Iterator, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset, dataloader

from clsys.data.batch_transport import PackedBatch, batches_per_transfer, one_at_a_time, unpack
from clsys.data.loader_workers import (WorkerSetup, follow_trainer, forkserver_preload, process_start,
                                      worker_start)

log = logging.getLogger(__name__)

TRANSPORTS = ("plain", "fast")

# The HF methods between ``tokenizer(texts, ...)`` and the backend's ``encode_batch``, as of transformers 5.
TOKENIZER_CALL_PATH = ("__call__", "_encode_plus", "set_truncation_and_padding", "_convert_encoding")
# What marks a seq2seq tokenizer, which switches templates per call: one that has it keeps the HF call.
SEQ2SEQ_MARK = "_switch_to_input_mode"
# The pipe that carries finished bundles from the workers to the trainer holds this much (Linux; a pipe holds 64 KiB
# by default, and 1 MiB is the most an unprivileged process may ask for, /proc/sys/fs/pipe-max-size). A bundle,
# ~200 KB of SimCSE's at batch 64, does not fit a default pipe: the worker's queue thread writes part of it and
# waits, and the trainer reads that part, then waits for the thread to be scheduled and write the next, a few ms a
# bundle on cores the workers and the step share. In a pipe that holds it, a bundle made during a step is there whole.
RESULT_PIPE_BYTES = 1 << 20


def private_names() -> dict[str, bool]:
    """Each private name the fast transport uses (its library's dotted path) and whether this process has it."""
    import transformers  # on first use, as where the collates use it: importing the loader imports no tokenizer code

    iterator = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    tokenizer = transformers.PreTrainedTokenizerFast
    there = {
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter": iterator is not None,
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._shutdown_workers":
            hasattr(iterator, "_shutdown_workers"),
        # Attributes of an instance, set in the constructor: named there.
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._worker_result_queue":
            iterator is not None and "_worker_result_queue" in iterator.__init__.__code__.co_names,
        "multiprocessing.queues.Queue._writer": "_writer" in queues.Queue.__init__.__code__.co_names,
        "multiprocessing.forkserver._forkserver._forkserver_alive_fd":
            hasattr(getattr(forkserver, "_forkserver", None), "_forkserver_alive_fd"),
        **{f"transformers.PreTrainedTokenizerFast.{name}": hasattr(tokenizer, name) for name in TOKENIZER_CALL_PATH},
    }
    return there


def missing_private_names() -> list[str]:
    """The private names the fast transport uses that this process's torch, transformers or Python lacks."""
    return [name for name, present in private_names().items() if not present]


@functools.cache
def fast_is_available() -> bool:
    """Whether every private name the fast transport uses is there; checked once a process, warned about once."""
    missing = missing_private_names()
    if missing:
        log.warning(f"[clsys] data.transport fast needs {', '.join(missing)}, which this torch, transformers or "
                    f"Python lacks: the loader and collates run plain (data.transport: plain)")
    return not missing


def uses_fast_path(transport: str) -> bool:
    """Whether ``data.transport: transport`` runs fast here: asked for, and every private name it uses there."""
    if transport not in TRANSPORTS:
        raise ValueError(f"data.transport: expected {' or '.join(TRANSPORTS)}, got {transport!r}")
    return transport == "fast" and fast_is_available()


def tokenizer_call_is_the_backends(tokenizer) -> bool:
    """Whether the HF call on a batch of texts is the Rust backend's ``encode_batch`` and nothing more: the tokenizer's
    class keeps transformers' own call path (``TOKENIZER_CALL_PATH``)."""
    from transformers import PreTrainedTokenizerFast as base  # transformers 5: the base of every Rust-backed one

    return (isinstance(tokenizer, base) and tokenizer.pad_token is not None  # else the HF call refuses to pad
            and all(getattr(type(tokenizer), name) is getattr(base, name) for name in TOKENIZER_CALL_PATH)
            and not hasattr(tokenizer, SEQ2SEQ_MARK))


class Delivery(Protocol):
    """A segment's running DataLoader: its batches in the trainer, in the loader's order, and its workers' end."""

    def __iter__(self) -> Iterator[dict]: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """How batches travel: ``send`` in the loader worker (what the dataset yields, from its collated batches), ``start``
    in the trainer (a segment's DataLoader over that dataset)."""

    name: ClassVar[str]
    reads_ahead: ClassVar[bool]  # whether the loader starts the next epoch's workers from half-epoch

    def send(self, batches: Iterator[dict]) -> Iterator[Any]: ...

    def start(self, dataset: IterableDataset, workers: int, turn: int, prefetch: int, pin_memory: bool) -> Delivery:
        """``dataset``'s DataLoader with ``workers`` workers, the first of them in the turn of loader worker ``turn``;
        ``prefetch``: batches each worker keeps ready (fast)."""
        ...


def data_loader(dataset: IterableDataset, workers: int, pin_memory: bool, **options: Any) -> DataLoader:
    """The DataLoader of a segment's batches, made by its dataset. Its own generator: otherwise starting the workers
    draws their base seed from the training process's torch RNG, and a resumed run would draw different dropout
    masks."""
    return DataLoader(dataset, batch_size=None, num_workers=workers, generator=torch.Generator(),
                      pin_memory=pin_memory, **options)


class PlainDelivery:
    """The DataLoader's own iterator: its batches as it hands them out, in the loader's order (the dataset rotates
    its workers so that the first is the one whose turn it is)."""

    def __init__(self, batches: Iterator[dict]):
        self.batches: Iterator[dict] | None = batches

    def __iter__(self) -> Iterator[dict]:
        return self.batches if self.batches is not None else iter(())

    def close(self) -> None:
        self.batches = None  # the DataLoader's iterator, dropped, stops its workers


def transport_for(name: str, collate: Callable, micro_batch: int, bundle: int | None = None) -> Transport:
    """The transport ``data.transport: name`` runs here, for a loader collating with ``collate`` batches of
    ``micro_batch``: fast where asked for and every private name it uses is there, else plain. ``bundle``: batches a
    fast loader worker sends at once (default ``batches_per_transfer``)."""
    if not uses_fast_path(name):
        return PlainTransport()
    return FastTransport(bundle or batches_per_transfer(micro_batch), worker_start(collate),
                         tuple(forkserver_preload(collate)))


@dataclass(frozen=True)
class PlainTransport:
    """A stock DataLoader, each batch one item (see the module)."""

    name: ClassVar[str] = "plain"
    reads_ahead: ClassVar[bool] = False

    def __str__(self) -> str:
        return "plain transport (a stock DataLoader)"

    def send(self, batches: Iterator[dict]) -> Iterator[dict]:
        return batches

    def start(self, dataset: IterableDataset, workers: int, turn: int, prefetch: int, pin_memory: bool) -> Delivery:
        return PlainDelivery(iter(data_loader(dataset, workers, pin_memory)))


class FastDelivery:
    """Bundles off a pipe grown to hold them, each worker's first taken off as the delivery is made (on the read-ahead
    thread, not on the trainer's in the epoch's first steps: 2.4-3.5 ms of a step's wait each), handed out one batch at
    a time in plain's order."""

    def __init__(self, bundles: Iterator[list], workers: int, turn: int):
        self.bundles: Iterator[list] | None = bundles
        self.workers, self.turn = workers, turn
        grow_result_pipe(bundles)
        # The DataLoader hands out one item per worker in turn, so the first ``workers`` items are each worker's first
        # (fewer: a worker had nothing to send).
        try:
            self.first = list(itertools.islice(bundles, workers))
        except BaseException:
            self.close()  # a worker's error: it reaches the trainer at the boundary, with no worker left behind
            raise

    def __iter__(self) -> Iterator[dict]:
        if self.bundles is None:
            return iter(())
        bundles = ([unpack(b) for b in bundle] for bundle in itertools.chain(self.first, self.bundles))
        return one_at_a_time(bundles, self.workers, self.turn)

    def close(self) -> None:
        """Stop the workers (and free their shards) now. Left to the garbage collector, as when an exception's
        traceback holds the iterator, its queues can go first and each worker is then waited for 5 s before
        it is killed."""
        if self.bundles is not None:
            self.bundles._shutdown_workers()
            self.bundles = None


@dataclass(frozen=True)
class FastTransport:
    """The stock DataLoader's batches in bundles of packed batches, from forkserver workers that follow the trainer
    (see the module)."""

    bundle: int  # batches a worker sends at once
    context: BaseContext  # how the workers start (``worker_start``)
    preload: tuple[str, ...]  # what their forkserver imports (``forkserver_preload``)
    name: ClassVar[str] = "fast"
    reads_ahead: ClassVar[bool] = True

    def __str__(self) -> str:
        return (f"fast transport (workers from a forkserver preloading {', '.join(self.preload)}, "
                f"{self.bundle} batch(es) per transfer)")

    def send(self, batches: Iterator[dict]) -> Iterator[list[PackedBatch]]:
        bundle = []
        for batch in batches:
            bundle.append(PackedBatch(batch))  # its tensors as bytes in the pickle: shared memory costs more
            if len(bundle) == self.bundle:
                yield bundle
                bundle = []
        if bundle:
            yield bundle

    def start(self, dataset: IterableDataset, workers: int, turn: int, prefetch: int, pin_memory: bool) -> Delivery:
        trainer = os.getpid()
        begin = functools.partial(begin_worker, WorkerSetup.in_trainer(), trainer, process_start(trainer))
        bundles = iter(data_loader(dataset, workers, pin_memory, multiprocessing_context=self.context,
                                   prefetch_factor=max(2, math.ceil(prefetch / self.bundle)), worker_init_fn=begin))
        return FastDelivery(bundles, workers, turn)


def begin_worker(setup: WorkerSetup, trainer: int, started: int | None, worker_id: int) -> None:
    """A fast loader worker's start (the DataLoader's ``worker_init_fn``): the trainer's setup, and the worker and its
    forkserver ending with the trainer, process ``trainer`` started at ``started``."""
    setup.apply()
    close_forkserver_alive_copy()
    follow_trainer(trainer, started)


def close_forkserver_alive_copy() -> None:
    """Close this process's copy of the write end of its forkserver's "alive" pipe. The forkserver exits once that
    end is closed in every process, but multiprocessing hands each process it starts a copy (so that a worker could
    start processes of its own through it; ours start none): closed in every worker, the forkserver ends with the
    trainer."""
    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)  # None: not started by a forkserver
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None


def grow_result_pipe(batches: Iterator) -> int:
    """Make the pipe that carries a DataLoader iterator's finished items hold ``RESULT_PIPE_BYTES``; its size after.
    Where the resize is missing (another OS) or refused (over the user's pipe limits), the pipe stays as it was and
    bundles are read in parts."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return 0
    try:
        pipe = batches._worker_result_queue._writer.fileno()
    except OSError:  # closed: the iterator is done
        return 0
    try:
        return fcntl.fcntl(pipe, fcntl.F_SETPIPE_SZ, RESULT_PIPE_BYTES)
    except OSError:
        return fcntl.fcntl(pipe, fcntl.F_GETPIPE_SZ)
