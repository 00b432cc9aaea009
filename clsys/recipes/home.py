"""What a recipe with pieces of its own tells the rest of clsys: its *home*, ``clsys/recipes/<name>/``.

Most recipes are an objective (``clsys.objectives``) trained by the step loop. A recipe whose training is more
than steps (stages, a retrieval bank, seeds averaged) keeps everything of its own in a home package named
after its objective, whose ``HOME`` says what the CLIs may ask of it. Its driver still trains with the one training
loop: each of its stages is a run of ``clsys.engine.loop.Trainer`` given a ``Stage`` of its own (the objective, the
batches, the evaluation). ``clsys.recipes`` finds the homes by looking at its own sub-packages, so no code outside a
home names its recipe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from clsys.config import Config
from clsys.objectives.base import Objective


@dataclass(frozen=True)
class RecipeHome:
    objective: type[Objective]  # what ``objective.name`` (the home's name) means in a recipe
    drive: Callable[[Config, int], int]  # runs the recipe instead of the step loop: (config, seeds) -> exit code
    runs_seeds: bool = False  # ``python -m clsys.pretrain --repeats N`` above 1: N seeds, mean ± std
    # ``python -m clsys.classify``: a local folder the recipe exported → an object with ``labels``,
    # ``predict(texts, batch_size)`` and ``accuracy(labeled_set, batch_size)``; None: it exports no classifier.
    load_classifier: Callable[[str], Any] | None = None
