"""A batch's tensors cross from a loader worker as one buffer per dtype (``clsys/data/batch_transport.py``):
the trainer gets the collate's values, dtypes, shapes and key order, as views of one storage per dtype."""
from __future__ import annotations

import torch

from clsys import storage
from clsys.data.batch_transport import pack, unpack
from clsys.data.streaming import ShardLoader
from test_streaming import write_stream


def mixed(samples: list[dict]) -> dict:
    """Tensors of three dtypes, one of them a transposed (non-contiguous) view and one 0-d, among plain values."""
    n = len(samples)
    ids = torch.arange(n * 5, dtype=torch.long).reshape(n, 5)
    return {"texts": [s["txt"] for s in samples], "input_ids": ids, "mask": ids.t() % 2 == 0,
            "weights": torch.linspace(0, 1, n), "labels": ids[:, 0] * 3, "count": torch.tensor(n),
            "empty": torch.zeros(0, 4), "note": "plain"}


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a.values(), b.values()))


def test_pack_and_unpack_give_the_batch_back():
    batch = mixed([{"txt": f"t{i}"} for i in range(6)])
    packed = pack(dict(batch))
    assert sum(isinstance(v, torch.Tensor) for v in packed.values()) == 0
    assert len(packed["__packed_tensors__"][0]) == 3  # int64, bool, float32
    assert same(unpack(packed), batch)
    single = {"input_ids": torch.ones(2, 3), "keys": ["a", "b"]}
    assert pack(dict(single)) == single  # one tensor: nothing to gain


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
