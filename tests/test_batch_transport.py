"""A batch's tensors cross from a loader worker as bytes, one buffer per dtype (``clsys/data/batch_transport.py``):
the trainer gets the collate's values, dtypes, shapes and key order, as views of one storage per dtype, with
no shared memory on the way, and page-locked where the loader pins."""
from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import torch

from clsys import storage
from clsys.data.batch_transport import PackedBatch, unpack
from clsys.data.streaming import ShardLoader
from test_streaming import write_stream


def mixed(samples: list[dict]) -> dict:
    """Tensors of three dtypes, one of them a transposed (non-contiguous) view and one 0-d, among plain values."""
    n = len(samples)
    ids = torch.arange(n * 5, dtype=torch.long).reshape(n, 5)
    return {"texts": [s["txt"] for s in samples], "input_ids": ids, "mask": ids.t() % 2 == 0,
            "weights": torch.linspace(0, 1, n), "labels": ids[:, 0] * 3, "count": torch.tensor(n),
            "empty": torch.zeros(0, 4), "half": torch.full((n, 2), 1.5, dtype=torch.bfloat16), "note": "plain"}


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a.values(), b.values()))


def test_a_packed_batch_crosses_a_pipe_as_bytes_and_unpacks_to_the_batch():
    batch = mixed([{"txt": f"t{i}"} for i in range(6)])
    wire = ForkingPickler.dumps(PackedBatch(dict(batch)))  # what the DataLoader's worker queue sends
    assert b"rebuild_storage" not in bytes(wire)  # no tensor pickled by reference to shared memory
    received = pickle.loads(wire)
    assert received.dtypes == [torch.int64, torch.bool, torch.float32, torch.bfloat16]
    assert received.wire_dtypes == [torch.int8, torch.bool, torch.float32, torch.bfloat16]  # ids < 128: int8
    out = unpack(received)
    assert same(out, batch)
    for values, wire in (([-129, 5], torch.int16), ([0, 2**31], torch.int64), ([-2**31, 7], torch.int32)):
        wide = {"ids": torch.tensor(values).repeat(3, 1), "mask": torch.ones(3, 2, dtype=torch.int32)}
        received = pickle.loads(ForkingPickler.dumps(PackedBatch(dict(wide))))
        assert received.wire_dtypes == [wire, torch.int8] and same(unpack(received), wide)
    out["input_ids"] += 1  # writable, as collated tensors are
    single = {"input_ids": torch.ones(2, 3), "keys": ["a", "b"]}
    assert same(unpack(pickle.loads(ForkingPickler.dumps(PackedBatch(dict(single))))), single)
    assert unpack(single) is single  # already unpacked (the pinning thread's output): passed through


def test_the_pinning_thread_unpacks_and_pins_one_buffer_per_dtype(monkeypatch):
    """The DataLoader's pinning thread (``pin_memory=True`` on a GPU node) hands the trainer the unpacked batch,
    its views on pinned buffers. Page-locking needs a GPU: here ``Tensor.pin_memory`` is replaced by a recorder
    (on a CUDA machine the real one runs and ``is_pinned`` is checked)."""
    from torch.utils.data._utils.pin_memory import pin_memory
    pinned_storages = []
    if not torch.cuda.is_available():
        def record(tensor, device=None):
            copy = tensor.clone()
            pinned_storages.append(copy.untyped_storage().data_ptr())
            return copy
        monkeypatch.setattr(torch.Tensor, "pin_memory", record)
    batch = mixed([{"txt": f"t{i}"} for i in range(6)])
    out = pin_memory(pickle.loads(ForkingPickler.dumps(PackedBatch(dict(batch)))))
    assert same(out, batch)
    tensors = [v for v in out.values() if isinstance(v, torch.Tensor)]
    if torch.cuda.is_available():
        assert all(t.is_pinned() for t in tensors)
    else:
        assert len(pinned_storages) == 4 and {t.untyped_storage().data_ptr() for t in tensors} == set(pinned_storages)


def test_the_loaders_batches_share_one_storage_per_dtype(tmp_path):
    url = storage.join(str(tmp_path), "sentences")
    write_stream(url, tmp_path, [40, 40])
    loader = ShardLoader(url, 0, 1, 8, mixed, seed=1, loader_workers=2)
    batches = iter(loader)
    for _ in range(4):
        batch = next(batches)
        expected = mixed([{"txt": t} for t in batch["texts"]])
        assert same({k: batch[k] for k in expected}, expected)
        storages = {k: v.untyped_storage().data_ptr() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        assert storages["input_ids"] == storages["labels"] == storages["count"]
        assert storages["weights"] != storages["input_ids"]
