"""A batch's tensors travel from a loader worker to the trainer as one buffer per dtype.

A DataLoader worker hands each tensor of a batch to the trainer through shared memory of its own: a segment
made, its file descriptor passed over a socket, mapped on the other side. That costs ~0.4 ms of the worker's
CPU per tensor, whatever its size: measured on this 2-core CPU, a worker yielding SimCSE's three [128, 32]
tensors (ids, attention mask, token types) and nothing else delivered 564 batches/s, one tensor 1,382, and
the loader's pre-tokenized path topped out near 25,000 sentences/s (batch 64) with a collate that alone
runs at 380,000. So ``pack`` concatenates a batch's tensors of one dtype into one flat buffer, in the
worker, and ``unpack`` makes them views of it again in the trainer: same values, dtypes, shapes and key
order. The DataLoader's pinning thread pins the buffers, so the views are page-locked too.
"""
from __future__ import annotations

import math
from typing import Any

import torch

PACKED = "__packed_tensors__"


def pack(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with its top-level tensors replaced by one flat buffer per dtype and their layout."""
    tensors = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
    if len(tensors) < 2:
        return batch
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key, tensor in tensors.items():
        by_dtype.setdefault(tensor.dtype, []).append(key)
    buffers, places = [], {}
    for index, keys in enumerate(by_dtype.values()):
        buffers.append(torch.cat([tensors[key].reshape(-1) for key in keys]))
        offset = 0
        for key in keys:
            places[key] = (index, offset, tuple(tensors[key].shape))
            offset += tensors[key].numel()
    rest = {key: value for key, value in batch.items() if key not in tensors}
    return {**rest, PACKED: (buffers, [(key, places.get(key)) for key in batch])}


def unpack(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch ``pack`` was given, its tensors views of the buffers, its keys in their order."""
    if PACKED not in batch:
        return batch
    buffers, order = batch.pop(PACKED)
    out = {}
    for key, place in order:
        if place is None:
            out[key] = batch.pop(key)
        else:
            index, offset, shape = place
            out[key] = buffers[index][offset:offset + math.prod(shape)].view(shape)
    out.update(batch)  # what was added after packing (none today), last
    return out
