"""Objective registry: ``objective.name`` in a recipe → the class that implements it."""
from clsys.objectives.base import LossOutput, Objective
from clsys.objectives.simcse import SimCSE

OBJECTIVES: dict[str, type[Objective]] = {
    "simcse": SimCSE,
}

__all__ = ["OBJECTIVES", "LossOutput", "Objective"]
