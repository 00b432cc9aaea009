"""Batches from several shard streams, each tagged with the task that consumes it.

Cross-lingual pretraining (OBJECTIVES.md §4.5) reads one stream per language pair and runs more
than one task on them. Its schedule is made of *rounds*:

  1. a round draws ``len(streams)`` streams: every stream once in a shuffled order
     (``temperature: 0``, the original's schedule), or i.i.d. with p_i ∝ n_i^(1/T) where n_i is the
     stream's sample count (``temperature: T > 0``; T = 1 is proportional, large T tends to uniform);
  2. for each task in turn (``alternate``), the drawn streams are visited in that order, and each
     visit yields ``micro_steps`` consecutive batches (= one optimizer step after gradient
     accumulation) of that stream tagged with that task; with ``alternate`` off every visit is one
     step of all tasks together (the batch is tagged ``"+".join(tasks)``).

So with tasks [qlm, rr] and streams [en-de, en-es], one round is 4 optimizer steps: QLM on each
pair, then RR on each pair, as the original's "iteration".

Position: each stream's ``ShardLoader`` position plus (round, index within the round). A round's
draw is seeded with (seed, round), the same on every rank: all ranks step through the same stream
at the same time, so every stream's position is the same on all ranks (which an elastic resume
relies on), and a resumed run replays the same schedule.
"""
from __future__ import annotations

import random
from typing import Iterator

from clsys.data.streaming import ShardLoader


class TaskMixer:
    def __init__(self, loaders: dict[str, ShardLoader], tasks: list[str], alternate: bool, temperature: float,
                 micro_steps: int, seed: int):
        if temperature < 0:
            raise ValueError(f"stream temperature must be >= 0, got {temperature}")
        self.loaders, self.tasks, self.alternate = loaders, tasks, alternate
        self.temperature, self.micro_steps, self.seed = temperature, micro_steps, seed
        self.round, self.position = 0, 0  # position: batches yielded so far in the current round

    def weights(self) -> dict[str, float]:
        """Sampling probability of each stream under temperature sampling."""
        sizes = {name: sum(s.samples for s in loader.shards) for name, loader in self.loaders.items()}
        scaled = {name: n ** (1.0 / self.temperature) for name, n in sizes.items()}
        total = sum(scaled.values())
        return {name: v / total for name, v in scaled.items()}

    def schedule(self, round_index: int) -> list[tuple[str, str]]:
        """The (task, stream) of every batch of one round."""
        rng = random.Random(f"{self.seed}/{round_index}")
        names = sorted(self.loaders)
        if self.temperature == 0:
            rng.shuffle(names)
            drawn = names
        else:
            weights = self.weights()
            drawn = rng.choices(names, weights=[weights[n] for n in names], k=len(names))
        groups = [[task] for task in self.tasks] if self.alternate else [self.tasks]
        return [("+".join(group), name) for group in groups for name in drawn for _ in range(self.micro_steps)]

    def state_dict(self) -> dict:
        return {"round": self.round, "position": self.position,
                "streams": {name: loader.state_dict() for name, loader in self.loaders.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.round, self.position = state["round"], state["position"]
        for name, loader in self.loaders.items():
            loader.load_state_dict(state["streams"][name])

    def __iter__(self) -> Iterator[dict]:
        streams = {name: iter(loader) for name, loader in self.loaders.items()}
        while True:
            plan = self.schedule(self.round)
            while self.position < len(plan):
                task, name = plan[self.position]
                batch = next(streams[name])
                self.position += 1
                yield {**batch, "task": task, "stream": name}
            self.round, self.position = self.round + 1, 0
