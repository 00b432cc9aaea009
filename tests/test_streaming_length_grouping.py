"""Length grouping (``data.length_group_batches``): a loader worker sorts a window of K batches' samples by length
before cutting it; the same samples with less padding, exact and elastic resume mid-window, the objective's token
counts as the key. The loader's other guarantees: tests/test_streaming.py."""
from __future__ import annotations

import pytest
from test_streaming import SIZES, NoisyCollate, consume, rest_of_epoch, same_batches, take, write_stream

from clsys.data.epoch_layout import plan_epoch
from clsys.data.streaming import ShardLoader, text_lengths
from clsys.shards.reader import load_shards


def ragged(n: int, i: int) -> str:
    """Sentences of 1 to 40 words, in no order."""
    return " ".join(["word"] * (1 + (n * 7919 + i * 104729) % 40))


def texts(samples):
    return {"texts": [s["txt"] for s in samples]}


def grouped_loader(url, k, collate_fn=texts, **geometry):
    args = {"rank": 0, "ranks": 1, "micro_batch": 4, "loader_workers": 2, **geometry}
    return ShardLoader(url, collate=collate_fn, seed=9, shuffle_buffer=16, length_group=k, **args)


def padding(batches: list[dict]) -> int:
    """Characters of padding when every batch is padded to its longest text."""
    return sum(max(map(len, b["texts"])) * len(b["texts"]) - sum(map(len, b["texts"])) for b in batches)


def test_length_grouping_reads_the_same_samples_with_less_padding(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES, ragged)
    per_epoch = plan_epoch(load_shards(url), 0, 9, 1, 2, 4).batches_per_rank
    plain, grouped = consume(grouped_loader(url, 0), per_epoch)[0], consume(grouped_loader(url, 8), per_epoch)[0]
    # The same samples in the epoch (a window only permutes the samples it holds), in whole batches.
    assert sorted(k for b in grouped for k in b["keys"]) == sorted(k for b in plain for k in b["keys"])
    assert all(len(b["keys"]) == 4 for b in grouped)
    assert padding(grouped) < 0.3 * padding(plain)
    # The two loader workers take turns; each window of 8 of a worker's batches holds disjoint
    # length ranges (sorted, then cut), handed out in a seeded order, not shortest first.
    windows = [grouped[w::2][i:i + 8] for w in range(2) for i in range(0, per_epoch // 2 - 7, 8)]
    assert len(windows) >= 2
    for window in windows:
        ranges = sorted((min(map(len, b["texts"])), max(map(len, b["texts"]))) for b in window)
        assert all(high <= low for (_, high), (low, _) in zip(ranges, ranges[1:])), ranges
    assert any([max(map(len, b["texts"])) for b in w] != sorted(max(map(len, b["texts"])) for b in w)
               for w in windows)


def test_length_grouping_resumes_exactly_mid_window(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES, ragged)
    per_epoch = plan_epoch(load_shards(url), 0, 9, 2, 2, 3).batches_per_rank
    args = dict(rank=1, ranks=2, micro_batch=3, loader_workers=2)
    straight, states = consume(grouped_loader(url, 5, NoisyCollate(), **args), per_epoch + 4)
    for k in (3, 7, per_epoch - 1, per_epoch + 2):  # mid-window, across windows, in the next epoch
        resumed = grouped_loader(url, 5, NoisyCollate(), **args)
        resumed.load_state_dict(states[k - 1])
        assert same_batches(consume(resumed, per_epoch + 4 - k)[0], straight[k:]), k


@pytest.mark.parametrize("old_k,new_k,new_ranks", [(4, 4, 3), (4, 0, 2), (0, 3, 2), (3, 5, 2)])
def test_length_grouping_elastic_resume_reads_no_sample_twice(tmp_path, old_k, new_k, new_ranks):
    """Another rank count or another K mid-window: the begun windows count as read whole, so at most
    K − 1 batches per old loader worker go unread besides the usual remainder."""
    url = f"file://{tmp_path}/stream"
    every_key = write_stream(url, tmp_path, SIZES, ragged)
    before, states = [], []
    for rank in range(2):
        loader = grouped_loader(url, old_k, rank=rank, ranks=2, micro_batch=6, loader_workers=2)
        before += [k for b in take(loader, 7) for k in b]  # 7 batches: both workers mid-window
        states.append(loader.state_dict())
    after = []
    for rank in range(new_ranks):
        loader = grouped_loader(url, new_k, rank=rank, ranks=new_ranks, micro_batch=12 // new_ranks,
                                loader_workers=2)
        loader.load_state_dict(states[0])
        after += rest_of_epoch(loader)[0]
    read = before + after
    assert len(read) == len(set(read)), "a sample was read twice in the epoch"
    left_out = 2 * 2 * max(old_k - 1, 0) * 6  # old ranks × workers × (K − 1) batches × micro-batch
    assert len(set(every_key) - set(read)) < left_out + 12


def test_length_grouping_must_not_be_negative(tmp_path):
    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES)
    with pytest.raises(ValueError, match="data.length_group_batches"):
        grouped_loader(url, -1)


def mixed_scripts(n: int, i: int) -> str:
    """Sentences whose tokens per character differ several-fold: words, digit groups, CJK."""
    words = 1 + (n * 7919 + i * 104729) % 30
    return [" ".join(["word"] * words), " ".join(["90817"] * words), "漢字" * words][(n + i) % 3]


def test_training_groups_by_the_objectives_token_counts(tmp_path, tiny):
    """The objective's DataSpec.sample_lengths (tokens) as the sort key: far less padding than characters give."""
    from clsys.recipes import OBJECTIVES, load_config
    from clsys.model.encoder import load_tokenizer

    url = f"file://{tmp_path}/stream"
    write_stream(url, tmp_path, SIZES, mixed_scripts)
    cfg = load_config(None, [f"model.name={tiny}", "model.init=scratch", "model.tokenizer=all-MiniLM-L6-v2",
                             "data.max_length=128"])
    objective = OBJECTIVES["simcse"](cfg, load_tokenizer(cfg.model.tokenizer)).data
    per_epoch = plan_epoch(load_shards(url), 0, 9, 1, 2, 4).batches_per_rank

    def padding_tokens(k: int, lengths) -> int:
        loader = ShardLoader(url, 0, 1, 4, objective.collate, seed=9, loader_workers=2, shuffle_buffer=16,
                             length_group=k, lengths=lengths)
        return sum((b["attention_mask"] == 0).sum().item() for b in consume(loader, per_epoch)[0])

    plain, by_chars = padding_tokens(0, objective.sample_lengths), padding_tokens(8, text_lengths)
    by_tokens = padding_tokens(8, objective.sample_lengths)
    assert by_tokens < 0.5 * by_chars and by_tokens < 0.2 * plain, (plain, by_chars, by_tokens)
    assert objective.sample_lengths([{"txt": "漢字漢字"}, {"txt": "word word"}]) == [4, 2]
