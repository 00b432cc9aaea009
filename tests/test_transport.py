"""How batches cross from the loader workers (``data.transport``, ``clsys/data/transport.py``): ``plain`` (a stock
DataLoader, the tokenizer's own call) and ``fast`` give the same batches and positions, a position saved under one
resumes under the other, and ``fast`` falls back to ``plain``, with one warning, where a private name it uses is
missing."""
from __future__ import annotations

import logging

import pytest
import transformers

from clsys.data import transport
from clsys.data.epoch_layout import plan_epoch
from clsys.data.streaming import ShardLoader, stream_loader
from clsys.model.encoder import load_tokenizer
from clsys.objectives.simcse import SimCSE
from clsys.recipes import load_config
from clsys.shards.reader import load_shards
from test_streaming import collate, consume, same_batches, write_stream

SIZES = [23, 18, 30, 21]  # 92 sentences: 21 batches of 4 an epoch over two loader workers


@pytest.fixture(scope="module")
def minilm():
    return load_tokenizer("all-MiniLM-L6-v2")


def simcse_loader(root: str, tokenizer, chosen: str) -> ShardLoader:
    """SimCSE's loader with its MLM auxiliary (the masks drawn from the loader worker's seeded global RNGs), two loader
    workers, batches of 4, through ``data.transport: chosen``."""
    cfg = load_config("quickstart", [f"data.url={root}", f"data.transport={chosen}", "data.loader_workers=2",
                                     "data.shuffle_buffer=8", "cluster.num_workers=1", "train.batch_size=4",
                                     "objective.mlm_weight=0.1"])
    data = SimCSE.data_class(cfg, tokenizer, SimCSE.streams(cfg), SimCSE.reads_ids(cfg))
    return stream_loader(cfg, "sentences", 0, 1, data)


def test_plain_and_fast_give_the_same_batches_and_positions_across_an_epoch_boundary(tmp_path, minilm):
    root = str(tmp_path / "shards")
    write_stream(f"{root}/sentences", tmp_path, SIZES)
    per_epoch = plan_epoch(load_shards(f"{root}/sentences"), 0, 42, 1, 2, 4).batches_per_rank
    fast, plain = simcse_loader(root, minilm, "fast"), simcse_loader(root, minilm, "plain")
    assert (fast.transport.name, plain.transport.name) == ("fast", "plain")
    fast_batches, fast_states = consume(fast, per_epoch + 3)
    plain_batches, plain_states = consume(plain, per_epoch + 3)
    assert same_batches(plain_batches, fast_batches) and plain_states == fast_states
    assert {s["epoch"] for s in plain_states} == {0, 1}
    # Plain's tensors came through the DataLoader's own shared memory; fast's as bytes in the pickle.
    assert plain_batches[0]["input_ids"].is_shared() and not fast_batches[0]["input_ids"].is_shared()


@pytest.mark.parametrize("saved_under, resumed_under, at", [("fast", "plain", 5), ("plain", "fast", "boundary")])
def test_a_position_saved_under_one_transport_resumes_under_the_other(tmp_path, minilm, saved_under, resumed_under,
                                                                      at):
    root = str(tmp_path / "shards")
    write_stream(f"{root}/sentences", tmp_path, SIZES)
    per_epoch = plan_epoch(load_shards(f"{root}/sentences"), 0, 42, 1, 2, 4).batches_per_rank
    k = per_epoch - 1 if at == "boundary" else at  # the epoch's last batch still to come
    straight, states = consume(simcse_loader(root, minilm, saved_under), per_epoch + 2)
    resumed = simcse_loader(root, minilm, resumed_under)
    resumed.load_state_dict(states[k - 1])
    assert same_batches(consume(resumed, per_epoch + 2 - k)[0], straight[k:])


@pytest.fixture
def fresh_check():
    """The private names are checked once a process: forget the answer before and after the test."""
    transport.fast_is_available.cache_clear()
    yield
    transport.fast_is_available.cache_clear()


def test_a_missing_private_name_falls_back_to_plain_with_one_warning(tmp_path, monkeypatch, caplog, fresh_check):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, [20, 20])
    monkeypatch.delattr(transformers.PreTrainedTokenizerFast, "_convert_encoding")
    with caplog.at_level(logging.WARNING, logger="clsys"):
        loaders = [ShardLoader(url, 0, 1, 4, collate, seed=0, loader_workers=2, shuffle_buffer=8, transport="fast")
                   for _ in range(2)]
    assert [loader.transport.name for loader in loaders] == ["plain", "plain"]
    assert not transport.uses_fast_path("fast")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "PreTrainedTokenizerFast._convert_encoding" in warnings[0].getMessage()
    batches, _ = consume(loaders[0], 3)
    assert all(len(batch["texts"]) == 4 for batch in batches)


def test_every_private_name_is_there_in_the_installed_libraries(fresh_check):
    assert transport.missing_private_names() == []
    assert transport.uses_fast_path("fast") and not transport.uses_fast_path("plain")
