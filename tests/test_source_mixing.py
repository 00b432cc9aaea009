"""Many sources in one run: ``data.sources`` (which streams, with what weights), the schedule that draws a source per
optimizer step (``same``) or per micro-batch (``mixed``), the same on every rank and replayed on resume, exact and
elastic resume of the mixer over real ShardLoaders reading real ``data_prep pairs`` shards, and the steps and loss
per source in TensorBoard event files read back with TensorBoard's own reader."""
from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from clsys.config import ConfigError
from clsys.data.mixing import SOURCE, StreamMixer, mix_sources, size_weights, source_streams
from clsys.data.streaming import ShardLoader
from clsys.metrics.health import SourceMeter, TensorBoard
from clsys.objectives.simcse import SimCSE, SimCSEData
from clsys.recipes import load_config
from data_prep.__main__ import main as data_prep

# Pairs per source: three sizes, so that weighing by size shows.
SIZES = {"hotpotqa": 60, "msmarco": 240, "nq": 120}
STREAMS = [f"pairs/{name}" for name in sorted(SIZES)]
SEED = 11
MICRO_STEPS = 2  # train.grad_accum
GLOBAL_BATCH = 8  # rows per micro-step over all ranks: micro-batches of 4 on 2 ranks, of 8 on 1


@pytest.fixture(scope="module")
def pairs_root(tmp_path_factory) -> str:
    """``data_prep pairs`` output: pairs/<source> for each of SIZES, in shards of a few dozen pairs (blocks of 4)."""
    folder = tmp_path_factory.mktemp("pairs")
    inputs = []
    for source, n in SIZES.items():
        path = folder / f"{source}.jsonl"
        path.write_text("".join(json.dumps({"query": f"{source} question {i}", "pos": [f"{source} answer {i}"],
                                            "neg": [f"{source} wrong {i}"]}) + "\n" for i in range(n)))
        inputs.append(str(path))
    out = folder / "out"
    assert data_prep(["pairs", "--input", *inputs, "--out", str(out), "--shard-size-mb", "0.004",
                      "--block-records", "4"]) == 0
    return str(out)


class NoisyCollate:
    """Keeps state across batches and draws from the global RNGs, as real collates do (negatives, masks): a resumed
    mixer must replay those draws too."""

    def __init__(self):
        self.seen = 0

    def __call__(self, samples):
        self.seen += len(samples)
        return {"noise": torch.rand(3), "coin": random.random(), "seen": self.seen,
                "queries": [s["txt"] for s in samples]}


def loaders(root: str, rank: int, ranks: int, micro_batch: int) -> dict[str, ShardLoader]:
    return {stream: ShardLoader(f"{root}/{stream}", rank, ranks, micro_batch, NoisyCollate(), SEED, shuffle_buffer=8,
                                kind="pairs")
            for stream in STREAMS}


def mixer(root: str, mode: str, rank: int = 0, ranks: int = 1, weights=None) -> StreamMixer:
    streams = loaders(root, rank, ranks, GLOBAL_BATCH // ranks)
    return StreamMixer(streams, MICRO_STEPS, SEED, weights or size_weights(streams, 0.5),
                       per_micro_batch=mode == "mixed", rank=rank)


def take(it, n: int) -> list[dict]:
    return [next(it) for _ in range(n)]


def same_batches(a: list[dict], b: list[dict]) -> bool:
    """Bitwise: every tensor equal, every other value equal."""
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
                                     for k in x)
        for x, y in zip(a, b))


def config(*overrides: str):
    return load_config(None, ["cluster.num_workers=1", *overrides])


# ---- data.sources, data.source_alpha, data.source_batches ------------------------------------------------------

def test_sources_are_written_as_a_mapping_of_weights_or_a_list_and_read_back(tmp_path):
    weighted = {"pairs/msmarco": 2.0, "pairs/nq": 1.0}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data:\n  sources:\n    pairs/msmarco: 2\n    pairs/nq: 1\n")
    assert load_config(str(recipe)).data.sources == weighted
    recipe.write_text("data:\n  sources:\n    - pairs/msmarco: 2\n    - pairs/nq: 1\n")  # YAML's list of pairs
    assert load_config(str(recipe)).data.sources == weighted
    assert config("data.sources={pairs/msmarco: 2, pairs/nq: 1}").data.sources == weighted
    assert config("data.sources=[pairs/msmarco, pairs/nq]").data.sources == {"pairs/msmarco": None, "pairs/nq": None}
    assert config().data.sources == {}  # every stream the objective finds
    # A run's config is written as YAML (its checkpoints, TensorBoard) and read back the same.
    cfg = config("data.sources=[pairs/msmarco, pairs/nq]", "data.source_alpha=0", "data.source_batches=mixed",
                 "train.grad_accum=2", "train.batch_size=4")
    recipe.write_text(cfg.to_yaml())
    assert load_config(str(recipe)) == cfg


@pytest.mark.parametrize("override,message", [
    (["data.sources={pairs/msmarco: 2, pairs/nq: null}"],
     "data.sources: expected a weight > 0 for every source, or none"),
    (["data.sources={pairs/msmarco: 0}"], "data.sources: expected a weight > 0"),
    (["data.sources={pairs/msmarco: .inf}"], "data.sources: expected a weight > 0"),
    (["data.sources={pairs/msmarco: lots}"], "data.sources.pairs/msmarco: expected a number, got 'lots'"),
    (["data.sources=pairs/msmarco"], "data.sources: expected a mapping such as {name: value} or a list of names"),
    (["data.source_alpha=-1"], "data.source_alpha: expected >= 0"),
    (["data.source_alpha=nan"], "data.source_alpha: expected >= 0"),
    (["data.source_batches=shuffled"], "data.source_batches: expected same or mixed, got 'shuffled'"),
    (["data.source_batches=mixed"], "data.source_batches: expected same when train.grad_accum is 1"),
])
def test_bad_source_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        config(*override)
    assert message in str(err.value)


def test_source_streams_are_the_listed_ones_or_every_one_found():
    found = ["pairs/nq", "pairs/msmarco", "pairs/hotpotqa"]
    assert source_streams(config(), found) == ["pairs/hotpotqa", "pairs/msmarco", "pairs/nq"]
    listed = config("data.sources={pairs/nq: 1, pairs/msmarco: 3}")
    assert source_streams(listed, found) == ["pairs/nq", "pairs/msmarco"]
    with pytest.raises(ConfigError, match=r"data.sources: msmarco is not a stream under .* \(did you mean "
                                          r"pairs/msmarco\?\); there are: pairs/hotpotqa, pairs/msmarco, pairs/nq"):
        source_streams(config("data.sources=[msmarco]"), found)
    with pytest.raises(ConfigError, match="data.url: no stream to read under /nowhere"):
        source_streams(config("data.url=/nowhere"), [])


# ---- the schedule ----------------------------------------------------------------------------------------------

def test_weights_follow_data_sources_or_the_manifests_sizes(pairs_root):
    streams = loaders(pairs_root, 0, 1, 4)
    sources = "data.sources={pairs/msmarco: 3, pairs/nq: 1, pairs/hotpotqa: 1}"
    # Given weights win over data.source_alpha.
    assert mix_sources(config(sources, "data.source_alpha=1"), streams).weights == pytest.approx(
        {"pairs/msmarco": 0.6, "pairs/nq": 0.2, "pairs/hotpotqa": 0.2})
    # α = 1: in proportion to the manifests' pair counts (60 : 240 : 120); α = 0: uniform; α = 0.5 between.
    assert mix_sources(config("data.source_alpha=1"), streams).weights == pytest.approx(
        {"pairs/hotpotqa": 1 / 7, "pairs/msmarco": 4 / 7, "pairs/nq": 2 / 7})
    assert mix_sources(config("data.source_alpha=0"), streams).weights == pytest.approx(dict.fromkeys(STREAMS, 1 / 3))
    half = mix_sources(config(), streams).weights
    assert half["pairs/msmarco"] / half["pairs/hotpotqa"] == pytest.approx(2.0)  # (240 / 60) ** 0.5
    # The draws follow them.
    drawn = collections.Counter(s for r in range(300) for step in mix_sources(config(sources), streams).steps(r)
                                for s in step[:1])
    assert abs(drawn["pairs/msmarco"] / drawn.total() - 0.6) < 0.04


def test_same_draws_one_source_per_optimizer_step_the_same_on_every_rank(pairs_root):
    cfg = config("train.grad_accum=3", "train.batch_size=6", "cluster.num_workers=2")
    ranks = [mix_sources(cfg, loaders(pairs_root, rank, 2, 1)) for rank in range(2)]
    steps = [s for r in range(20) for s in ranks[0].steps(r)]
    assert all(step == [step[0]] * 3 for step in steps), "every micro-batch of a step from one source"
    assert set(s[0] for s in steps) == set(STREAMS)
    assert [ranks[1].steps(r) for r in range(20)] == [ranks[0].steps(r) for r in range(20)]
    # Seeded by (train.seed, round): another seed, another schedule; the same seed, the same one.
    other = mix_sources(config("train.grad_accum=3", "train.batch_size=6", "train.seed=12"),
                        loaders(pairs_root, 0, 1, 2))
    assert [other.steps(r) for r in range(20)] != [ranks[0].steps(r) for r in range(20)]
    assert [mix_sources(cfg, loaders(pairs_root, 0, 2, 1)).steps(r) for r in range(20)] == \
        [ranks[0].steps(r) for r in range(20)]


def test_mixed_draws_each_micro_batch_and_every_rank_reads_each_draw_of_a_step_once(pairs_root):
    cfg = config("data.source_batches=mixed", "train.grad_accum=3", "train.batch_size=9", "cluster.num_workers=3",
                 "data.source_alpha=0")
    ranks = [mix_sources(cfg, loaders(pairs_root, rank, 3, 1)) for rank in range(3)]
    mixed_steps = 0
    for r in range(30):
        for steps in zip(*(rank.steps(r) for rank in ranks)):
            # The same draws on every rank, so that every stream stands at one position on all ranks at a step's end.
            assert all(collections.Counter(s) == collections.Counter(steps[0]) for s in steps)
            # Rank r reads them rotated by r: within a micro-step the ranks' micro-batches are different draws.
            assert steps[1] == steps[0][1:] + steps[0][:1] and steps[2] == steps[0][2:] + steps[0][:2]
            mixed_steps += len(set(steps[0])) > 1
    assert mixed_steps > 30, "a step's micro-batches come from several sources"


# ---- exact and elastic resume over real shards -------------------------------------------------------------------

def run_ranks(root: str, mode: str, ranks: int, state: dict | None, steps: int):
    """Every rank of a geometry resumes from ``state`` (None: fresh) and reads ``steps`` optimizer steps. Returns each
    rank's batches and its mixer's states at the end of each step."""
    batches, states = [], []
    for rank in range(ranks):
        mix = mixer(root, mode, rank, ranks)
        if state is not None:
            mix.load_state_dict(state)
        it = iter(mix)
        batches.append([])
        states.append([])
        for _ in range(steps):
            batches[-1] += take(it, MICRO_STEPS)
            states[-1].append(mix.state_dict())
        it.close()
    return batches, states


def positions(state: dict) -> dict:
    """What of a mixer's state every rank must agree on: the schedule's place and each stream's position."""
    return {"round": state["round"], "position": state["position"],
            "streams": {name: (s["epoch"], s["segments"]) for name, s in state["streams"].items()}}


@pytest.mark.parametrize("mode", ["same", "mixed"])
def test_the_mixer_resumes_exactly_and_elastically_from_two_ranks_to_one_and_back(pairs_root, mode):
    # Two ranks; one rank from rank 0's state (what clsys.engine.checkpoint hands every rank of another count);
    # two ranks again. At every step's end every stream's position is the same on all ranks.
    first, states = run_ranks(pairs_root, mode, 2, None, 3)
    assert all(positions(a) == positions(b) for a, b in zip(*states))
    one = mixer(pairs_root, mode)
    one.load_state_dict(states[0][-1])
    it = iter(one)
    second = take(it, 2 * MICRO_STEPS + 1)
    mid_step = one.state_dict()  # inside a step, inside its source's stream
    second += take(it, 2 * MICRO_STEPS - 1)
    after_one = one.state_dict()
    following = take(it, 3)
    it.close()
    third, states = run_ranks(pairs_root, mode, 2, after_one, 3)
    assert all(positions(a) == positions(b) for a, b in zip(*states))
    assert all(s["epoch"] == 0 for s in states[0][-1]["streams"].values()), "the run stays in each stream's epoch 0"

    # The schedule goes on as if nothing had happened: rank 0 draws what an uninterrupted run's rank 0 draws.
    straight = iter(mixer(pairs_root, mode))
    assert [b[SOURCE] for b in first[0] + second + third[0]] == [b[SOURCE] for b in take(straight, 10 * MICRO_STEPS)]
    straight.close()
    # No pair is read twice, on any rank, through both changes of rank count.
    read = [(b[SOURCE], q) for batches in (*first, second, *third) for b in batches for q in b["queries"]]
    assert len(read) == len(set(read)) == 10 * MICRO_STEPS * GLOBAL_BATCH
    # Exactly: the one-rank mixer restored mid-step continues with the same batches, bitwise, collate draws included.
    resumed = mixer(pairs_root, mode)
    resumed.load_state_dict(mid_step)
    it = iter(resumed)
    assert same_batches(take(it, 2 * MICRO_STEPS - 1 + 3), second[2 * MICRO_STEPS + 1:] + following)
    it.close()
    # And a rank of two restored from its own state of a step ago does its last step again.
    resumed = mixer(pairs_root, mode, 1, 2)
    resumed.load_state_dict(states[1][-2])
    it = iter(resumed)
    assert same_batches(take(it, MICRO_STEPS), third[1][-MICRO_STEPS:])
    it.close()


# ---- TensorBoard ---------------------------------------------------------------------------------------------------

def test_steps_and_loss_per_source_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    meter, tb = SourceMeter(micro_steps=2), TensorBoard(str(tmp_path))
    # Steps 1-2 (two micro-batches each), logged at 2; steps 3-4, logged at 4, then a checkpoint.
    for source, loss in [("pairs/nq", 1.0), ("pairs/nq", 3.0), ("pairs/msmarco", 5.0), ("pairs/msmarco", 7.0)]:
        meter.add(source, torch.tensor(loss))
    tb.scalars("train/source", meter.take(), 2)
    for loss in (2.0, 4.0, 6.0, 8.0):
        meter.add("pairs/nq", torch.tensor(loss))
    tb.scalars("train/source", meter.take(), 4)
    # The run resumes from that checkpoint: its meter, restored from the checkpoint's part, counts on.
    resumed = SourceMeter(micro_steps=2)
    resumed.load_state_dict(meter.state_dict())
    resumed.add("pairs/msmarco", torch.tensor(1.0))
    resumed.add("pairs/msmarco", torch.tensor(2.0))
    tb.scalars("train/source", resumed.take(), 5)
    tb.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {"train/source/pairs/nq/steps": [(2, 1.0), (4, 3.0), (5, 3.0)],
                       "train/source/pairs/msmarco/steps": [(2, 1.0), (4, 1.0), (5, 2.0)],
                       # the mean of its micro-batches in the window; no point in a window that did not draw it
                       "train/source/pairs/nq/loss": [(2, 2.0), (4, 5.0)],
                       "train/source/pairs/msmarco/loss": [(2, 6.0), (5, 1.5)]}


# ---- through the training loop -------------------------------------------------------------------------------------

class SourcesData(SimCSEData):
    """Unsupervised SimCSE's batches of the queries of several pairs sources, mixed as an objective on many sources
    mixes them: a stand-in for such an objective, so that the loop's part is tested on its own."""

    def combine(self, loaders):
        return mix_sources(self.cfg, loaders)


class SourcesSimCSE(SimCSE):
    data_class = SourcesData

    @classmethod
    def streams(cls, cfg):
        return source_streams(cfg, STREAMS)

    def forward(self, batch, part="loss", whole=None):
        return super().forward({k: v for k, v in batch.items() if k != SOURCE}, part, whole)


def _train(rank: int, port: int, tiny: str, root: str, runs: str, world: int) -> None:
    """One of ``world`` ranks. 2: a run of 6 steps straight, one stopped after 4 and resumed from its last checkpoint,
    and another stopped after 4; 1: that other one resumed on one rank."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    from clsys.engine.loop import Trainer
    from clsys.objectives import OBJECTIVES

    OBJECTIVES["simcse"] = SourcesSimCSE  # this process's registry: the loop builds the stand-in
    common = ["objective.name=simcse", f"model.name={tiny}", f"data.url={root}", "data.shuffle_buffer=8",
              "data.source_batches=mixed", f"cluster.num_workers={world}", "train.batch_size=8", "train.grad_accum=2",
              "train.zero_stage=0", "train.precision=fp32", "optim.schedule=constant", "train.log_every=1",
              "train.ckpt_every=2", "train.log_sample_keys=true", "train.async_checkpoint=false", "eval.sts_dev=",
              "eval.select=", f"train.run_root={runs}"]
    try:
        if world == 1:
            Trainer(load_config(None, [*common, "train.name=shrunk", "train.steps=6", "train.resume=latest"]),
                    None).run()
            return
        Trainer(load_config(None, [*common, "train.name=straight", "train.steps=6"]), None).run()
        Trainer(load_config(None, [*common, "train.name=stopped", "train.steps=4"]), None).run()
        Trainer(load_config(None, [*common, "train.name=stopped", "train.steps=6", "train.resume=latest"]), None).run()
        Trainer(load_config(None, [*common, "train.name=shrunk", "train.steps=4"]), None).run()
    finally:
        # As Ray Train does when a run ends: a process group left to the interpreter's exit was seen once to abort
        # the process there ("terminate called without an active exception": torch's destruction order at exit).
        dist.destroy_process_group()


def source_scalars(run: Path) -> dict[str, dict[int, float]]:
    """The run's train/source/ scalars by step, read back by TensorBoard; a step logged again keeps its last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]
            if tag.startswith("train/source/")}


def total_steps(scalars: dict[str, dict[int, float]], step: int) -> float:
    return sum(v[step] for tag, v in scalars.items() if tag.endswith("/steps") and step in v)


@pytest.mark.slow
def test_the_loop_logs_each_sources_steps_and_loss_and_resumes_count_on(pairs_root, tiny_bert_with_heads, tmp_path):
    import torch.multiprocessing as mp

    from faults import sample_keys
    from tests.conftest import free_port

    for world in (2, 1):
        mp.spawn(_train, args=(free_port(), tiny_bert_with_heads, pairs_root, str(tmp_path), world), nprocs=world,
                 join=True)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    # The resumed run read exactly the samples, on each rank, of the run that was never stopped.
    assert sample_keys(stopped) == sample_keys(straight)
    assert len(sample_keys(straight)["rank-00000"]) == 6 * 2 * 2  # steps × micro-batches × rows

    logged = source_scalars(straight)
    assert {tag.rpartition("/")[2] for tag in logged} == {"steps", "loss"}
    assert {tag.rpartition("/")[0] for tag in logged} == {f"train/source/{s}" for s in STREAMS}
    # mixed: each source's share of the steps so far (micro-batches / train.grad_accum); together, the steps.
    assert [total_steps(logged, step) for step in range(1, 7)] == [1, 2, 3, 4, 5, 6]
    # The counts go on after the resume as if the run had not stopped; the losses are those of the same batches.
    resumed = source_scalars(stopped)
    assert resumed.keys() == logged.keys()
    for tag, values in logged.items():
        assert resumed[tag].keys() == values.keys(), tag
        assert resumed[tag] == pytest.approx(values, rel=1e-5), tag
    # On one rank from a checkpoint of two (elastic), too: every rank's count is rank 0's.
    shrunk = source_scalars(tmp_path / "shrunk")
    assert [total_steps(shrunk, step) for step in range(1, 7)] == [1, 2, 3, 4, 5, 6]
