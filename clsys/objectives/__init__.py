"""The step loop's objective registry: ``objective.name`` in a recipe → the class ``clsys.engine.loop`` trains.

A recipe that brings a driver of its own keeps its objective in its home (``clsys/recipes/<name>/``);
``clsys.recipes.OBJECTIVES`` is this registry with those added.
"""
from clsys.objectives.base import LossOutput, Objective
from clsys.objectives.clir import CLIR
from clsys.objectives.pairs import Pairs
from clsys.objectives.self_guided import SelfGuided
from clsys.objectives.simcse import SimCSE
from clsys.objectives.tacl import TaCL

OBJECTIVES: dict[str, type[Objective]] = {
    "simcse": SimCSE,
    "self_guided": SelfGuided,
    "tacl": TaCL,
    "clir": CLIR,
    "pairs": Pairs,
}

__all__ = ["OBJECTIVES", "LossOutput", "Objective"]
