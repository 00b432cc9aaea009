"""A batch's tensors travel from a loader worker to the trainer as bytes, one buffer per dtype, inside the pickle.

A DataLoader worker hands each tensor of a batch to the trainer through shared memory of its own: a segment
made and filled in the worker (~0.4 ms of its CPU per tensor, whatever its size), its file descriptor fetched
by the trainer over a fresh authenticated socket connection to the worker (~1 ms per tensor of the
trainer's time in ``next(batches)``, longer while the worker's tokenizing holds its interpreter lock).
Measured on this 2-core CPU: a worker yielding SimCSE's three [128, 32] tensors delivered 564 batches/s, one
tensor 1,382; one buffer per dtype through shared memory still left ~2 ms of every step waiting on the
connection. A batch of token ids is small, and smaller still in the narrowest integer type that holds its
values (a 30k vocabulary's ids with their masks and token types in int16: SimCSE at batch 256, max length 32,
100 KB rather than 400 KB in int64), so copied through the worker's pipe inside the pickle it costs tens of
µs. ``PackedBatch`` holds a batch's tensors of one dtype as one flat numpy byte array (numpy arrays pickle as
their bytes, tensors as shared memory), integers narrowed, and the rest of the batch as it is; ``unpack``
widens them again and makes the tensors views of one tensor per dtype in the trainer: same values, dtypes,
shapes and key order. With ``pin_memory`` the DataLoader's pinning thread calls
``PackedBatch.pin_memory``, which pins one buffer per dtype, so the views are page-locked too.

Batches travel in bundles, a list of one worker's batches per DataLoader item (``batches_per_transfer``), each batch
tagged with its worker (``WORKER_KEY``), through a pipe grown to hold a bundle (``clsys.data.transport``, the fast
transport, which uses this module); the trainer hands them out one at a time in the order single batches would come
(``one_at_a_time``).
"""
from __future__ import annotations

import collections
import math
from typing import Any, Iterator

import numpy
import torch

WORKER_KEY = "__loader_worker__"  # tags a batch with the worker that made it; the trainer's loader pops it
# A loader worker sends its batches to the trainer in bundles of about this many samples (``batches_per_transfer``):
# each item the DataLoader moves costs the trainer's process ~0.3 ms of CPU whatever its size (its queue, the next
# index sent back, thread wake-ups), 8-15% of a core at 64-sample batches, taken from the cores the workers share.
TRANSFER_SAMPLES = 512
MAX_TRANSFER = 16  # batches per bundle

_SIGNED = (torch.int8, torch.int16, torch.int32, torch.int64)


class PackedBatch:
    """A collated batch in transit: ``buffers[i]`` the bytes of all its tensors of ``dtypes[i]``, back to back."""

    def __init__(self, batch: dict[str, Any]):
        by_dtype: dict[torch.dtype, list[str]] = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                by_dtype.setdefault(value.dtype, []).append(key)
        self.dtypes = list(by_dtype)
        self.wire_dtypes: list[torch.dtype] = []  # integers travel in the narrowest type that holds their range
        self.buffers: list[numpy.ndarray] = []
        places: dict[str, tuple[int, int, tuple[int, ...]]] = {}  # key -> (buffer, offset, shape)
        for index, keys in enumerate(by_dtype.values()):
            flat = torch.cat([batch[key].detach().reshape(-1).cpu() for key in keys])
            flat = flat.to(_narrowest(flat))
            self.wire_dtypes.append(flat.dtype)
            self.buffers.append(flat.view(torch.uint8).numpy())  # any dtype, bool and bfloat16 included, as bytes
            offset = 0
            for key in keys:
                places[key] = (index, offset, tuple(batch[key].shape))
                offset += batch[key].numel()
        self.order = [(key, places.get(key)) for key in batch]
        self.rest = {key: value for key, value in batch.items() if key not in places}

    def unpack(self, pin: bool = False) -> dict[str, Any]:
        """The batch it was made from, its tensors views of one tensor per dtype (page-locked with ``pin``)."""
        flats = []
        for dtype, wire, buffer in zip(self.dtypes, self.wire_dtypes, self.buffers):
            flat = torch.from_numpy(buffer).view(wire).to(dtype)
            flats.append(flat.pin_memory() if pin else flat)
        out = {}
        for key, place in self.order:
            if place is None:
                out[key] = self.rest[key]
            else:
                index, offset, shape = place
                out[key] = flats[index][offset:offset + math.prod(shape)].view(shape)
        return out

    def pin_memory(self, device: Any = None) -> dict[str, Any]:
        """What the DataLoader's pinning thread calls (``torch.utils.data._utils.pin_memory``)."""
        return self.unpack(pin=True)


def _narrowest(flat: torch.Tensor) -> torch.dtype:
    """The smallest signed integer type that holds ``flat``'s values (an integer tensor), else its own dtype."""
    if flat.dtype not in _SIGNED or flat.numel() == 0:
        return flat.dtype
    low, high = flat.min().item(), flat.max().item()
    return next(d for d in _SIGNED if torch.iinfo(d).min <= low and high <= torch.iinfo(d).max)


def unpack(batch: PackedBatch | dict[str, Any]) -> dict[str, Any]:
    """A batch as collate made it; one the pinning thread has already unpacked is passed through."""
    return batch.unpack() if isinstance(batch, PackedBatch) else batch


def batches_per_transfer(micro_batch: int) -> int:
    """How many batches a loader worker sends at once: ``TRANSFER_SAMPLES``' worth, from 1 to ``MAX_TRANSFER``."""
    return max(1, min(MAX_TRANSFER, TRANSFER_SAMPLES // micro_batch))


def one_at_a_time(bundles: Iterator[list[dict]], workers: int, turn: int) -> Iterator[dict]:
    """The batches of loader workers' ``bundles`` (each a list of one worker's batches, tagged with it) in the order
    the DataLoader hands out single batches: each worker in turn from ``turn``, an exhausted one passed over.

    A batch is handed out only in its worker's turn, and a worker whose batches are used up is asked for the next
    bundle, so the order is that of single batches whatever the bundles hold. Who ran dry comes from the DataLoader's
    own order: it takes items from its workers in turn (its first worker is the one whose turn it is) and passes over
    the exhausted, so the workers between two consecutive bundles' senders have no batch left. Knowing that is what
    keeps this from reading ahead (without it, a worker that ran dry would be waited for to the end of the epoch): it
    holds about a bundle a worker."""
    pending = [collections.deque() for _ in range(workers)]
    exhausted = [False] * workers
    last_sender = (turn - 1) % workers
    while not all(exhausted[w] and not pending[w] for w in range(workers)):
        if pending[turn]:
            yield pending[turn].popleft()
            turn = (turn + 1) % workers
        elif exhausted[turn]:
            turn = (turn + 1) % workers
        elif (batches := next(bundles, None)) is None:
            exhausted = [True] * workers
        else:
            sender = batches[0][WORKER_KEY]
            passed = (last_sender + 1) % workers
            while passed != sender:
                exhausted[passed], passed = True, (passed + 1) % workers
            pending[sender].extend(batches)
            last_sender = sender

