"""Batches from several shard streams in one seeded schedule: the sources of a run on many pair sources
(``data.sources``, ``mix_sources``) and CLIR's language pairs, each with the tasks that consume it (``tasks``).

The schedule is made of *rounds*; a round has one optimizer step (``micro_steps`` micro-batches: the gradient
accumulation) per stream, each drawn with the round's seed (seed, round):

  1. which streams: every stream equally often, in shuffled order (``weights`` None: CLIR's
     ``pair_temperature: 0``), or i.i.d. with the given probabilities (``weights``; ``size_weights``:
     p_i ∝ n_i^a where n_i is the stream's sample count, from its manifest);
  2. for what: with ``per_micro_batch`` off, a step's micro-batches all come from the stream drawn for it
     (``data.source_batches: same``); with it on, each micro-batch has a draw of its own (``mixed``), and rank r
     reads its step's draws rotated by r, so that in each micro-step the ranks' micro-batches come from
     different draws of the step. A micro-batch is never of two sources: each stream's loader cuts batches of
     its own, and merging two collated batches (their padding, their row layout) would be the objective's;
  3. tasks (CLIR): for each task in turn (``alternate``) the round's steps are visited in that order, tagged with
     that task, or (``alternate`` off) once, tagged with all of them (``"+".join(tasks)``).

So with tasks [qlm, rr] and streams [en-de, en-es], one round is 4 optimizer steps: QLM on each pair, then RR on
each pair, as the original's "iteration". Every batch carries ``source``: the name of its stream (the key of
``loaders``), and ``task`` where there are tasks.

Position: each stream's ``ShardLoader`` position plus (round, batches yielded in the round). A round's draws are
the same on every rank, and every rank reads each of a step's draws once in the step (in ``mixed`` too, in its
own order), so at every step's end every stream's position is the same on all ranks, which an elastic resume
relies on (it hands every new rank rank 0's position, and a stream's loader remaps one position to another
number of ranks); checkpoints are taken between steps. A resumed run replays the same schedule.
"""
from __future__ import annotations

import difflib
import random
from typing import Iterator

from clsys import storage
from clsys.config import Config, ConfigError
from clsys.data.streaming import ShardLoader

SOURCE = "source"  # the batch key naming the stream the batch came from


def size_weights(loaders: dict[str, ShardLoader], exponent: float) -> dict[str, float]:
    """Each stream's sampling probability, p_i ∝ n_i^exponent, n_i its sample count (its manifest's): 1 is in
    proportion to size, 0 uniform."""
    sizes = {name: sum(s.samples for s in loader.shards) for name, loader in loaders.items()}
    scaled = {name: n ** exponent for name, n in sizes.items()}
    total = sum(scaled.values())
    return {name: v / total for name, v in scaled.items()}


class StreamMixer:
    """One rank's batches from ``loaders`` in the schedule of the module docstring, with ``state_dict`` /
    ``load_state_dict`` (the position)."""

    def __init__(self, loaders: dict[str, ShardLoader], micro_steps: int, seed: int,
                 weights: dict[str, float] | None = None, tasks: list[str] | None = None, alternate: bool = True,
                 per_micro_batch: bool = False, rank: int = 0):
        """``weights``: each stream's probability, None: every stream once a round; ``tasks``: the tags of
        CLIR's steps (None: no ``task`` key); ``rank``: this rank (its order of a step's draws with
        ``per_micro_batch``)."""
        self.loaders, self.micro_steps, self.seed, self.weights = loaders, micro_steps, seed, weights
        self.tasks, self.alternate, self.per_micro_batch, self.rank = tasks, alternate, per_micro_batch, rank
        self.round, self.position = 0, 0  # position: batches yielded so far in the current round

    def steps(self, round_index: int) -> list[list[str]]:
        """The stream of each micro-batch of each optimizer step of one round (before tasks)."""
        rng = random.Random(f"{self.seed}/{round_index}")
        names = sorted(self.loaders)
        draws_per_step = self.micro_steps if self.per_micro_batch else 1
        if self.weights is None:
            drawn = names * draws_per_step
            rng.shuffle(drawn)
        else:
            drawn = rng.choices(names, weights=[self.weights[n] for n in names], k=len(names) * draws_per_step)
        if not self.per_micro_batch:
            return [[name] * self.micro_steps for name in drawn]
        turn = self.rank % self.micro_steps
        steps = [drawn[i:i + self.micro_steps] for i in range(0, len(drawn), self.micro_steps)]
        return [step[turn:] + step[:turn] for step in steps]

    def schedule(self, round_index: int) -> list[tuple[str | None, str]]:
        """The (task or None, stream) of every batch of one round."""
        steps = self.steps(round_index)
        groups = [None] if self.tasks is None else [[t] for t in self.tasks] if self.alternate else [self.tasks]
        return [(None if group is None else "+".join(group), name)
                for group in groups for step in steps for name in step]

    def state_dict(self) -> dict:
        return {"round": self.round, "position": self.position,
                "streams": {name: loader.state_dict() for name, loader in self.loaders.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.round, self.position = state["round"], state["position"]
        for name, loader in self.loaders.items():
            loader.load_state_dict(state["streams"][name])

    def __iter__(self) -> Iterator[dict]:
        streams = {name: iter(loader) for name, loader in self.loaders.items()}
        try:
            while True:
                plan = self.schedule(self.round)
                while self.position < len(plan):
                    task, name = plan[self.position]
                    batch = next(streams[name])
                    self.position += 1
                    yield {**batch, SOURCE: name} if task is None else {**batch, "task": task, SOURCE: name}
                self.round, self.position = self.round + 1, 0
        finally:  # each stream's loader workers stopped now, not whenever the garbage collector gets to them
            for stream in streams.values():
                stream.close()


def source_streams(cfg: Config, available: list[str]) -> list[str]:
    """The streams a run on several sources reads: those ``data.sources`` names, in its order, or every one of
    ``available`` (the streams of the objective's kind found under ``data.url``) when it names none. A name that is
    not available is an error naming ``data.sources`` and the streams there are."""
    found = sorted(set(available))
    if not found:
        raise ConfigError(f"data.url: no stream to read under {storage.redact(cfg.data.url)}")
    for name in cfg.data.sources:
        if name not in found:
            close = [f for f in found if f.endswith(f"/{name}")] or difflib.get_close_matches(name, found, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"data.sources: {name} is not a stream under {storage.redact(cfg.data.url)}{hint}; "
                              f"there are: {', '.join(found)}")
    return list(cfg.data.sources) or found


def source_weights(cfg: Config, loaders: dict[str, ShardLoader]) -> dict[str, float]:
    """Each source's probability: ``data.sources``' weights where it gives them, normalised, else
    ``size_weights`` with ``data.source_alpha``."""
    given = cfg.data.sources
    if not given or any(w is None for w in given.values()):
        return size_weights(loaders, cfg.data.source_alpha)
    unweighted = sorted(set(loaders) - set(given))
    if unweighted:  # the objective reads streams data.sources does not list (source_streams keeps it from that)
        raise ConfigError(f"data.sources: no weight for {', '.join(unweighted)}")
    total = sum(given[name] for name in loaders)
    return {name: given[name] / total for name in loaders}


def mix_sources(cfg: Config, loaders: dict[str, ShardLoader]) -> StreamMixer:
    """This rank's batches from one loader per source (``source_streams``), each batch tagged with its source:
    a ``DataSpec.combine`` for objectives that read many sources. ``data.source_batches: same`` draws a source
    per optimizer step, ``mixed`` per micro-batch."""
    rank = next(iter(loaders.values())).rank
    return StreamMixer(loaders, cfg.train.grad_accum, cfg.train.seed, source_weights(cfg, loaders),
                       per_micro_batch=cfg.data.source_batches == "mixed", rank=rank)
