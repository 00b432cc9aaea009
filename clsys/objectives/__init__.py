"""Objective registry: ``objective.name`` in a recipe → the class that implements it."""
from clsys.objectives.base import LossOutput, Objective
from clsys.objectives.clir import CLIR
from clsys.objectives.css_lm import CSSLM
from clsys.objectives.self_guided import SelfGuided
from clsys.objectives.simcse import SimCSE
from clsys.objectives.tacl import TaCL

OBJECTIVES: dict[str, type[Objective]] = {
    "simcse": SimCSE,
    "self_guided": SelfGuided,
    "tacl": TaCL,
    "clir": CLIR,
    "css_lm": CSSLM,
}

__all__ = ["OBJECTIVES", "LossOutput", "Objective"]
