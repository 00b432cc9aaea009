"""Recipes: a YAML file that names an objective and its settings (bundled ones in ``clsys/configs``: quickstart,
simcse_unsup, ...; or a path) → a checked ``Config``; and the recipes that bring pieces of their own.

This package knows the objectives: the step loop's (``clsys.objectives.OBJECTIVES``) and those of the recipe homes
under it (``clsys/recipes/<name>/``, ``clsys.recipes.home``), found by looking at its own sub-packages. It hands
each objective's config dataclass to ``clsys.config.parsing``, which parses and checks but imports no objective,
so that objectives can build on the config.
"""
from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from clsys import objectives
from clsys.config import Config, ConfigError, ObjectiveConfig
from clsys.config.parsing import parse_config, parse_config_dict
from clsys.objectives.base import Objective
from clsys.recipes.home import RecipeHome

CONFIG_DIR = Path(__file__).parents[1] / "configs"

HOMES: dict[str, RecipeHome] = {
    module.name: importlib.import_module(f"{__name__}.{module.name}").HOME
    for module in pkgutil.iter_modules(__path__) if module.ispkg
}
# Every objective a recipe can name: the step loop's and the homes'.
OBJECTIVES: dict[str, type[Objective]] = {**objectives.OBJECTIVES,
                                          **{name: home.objective for name, home in HOMES.items()}}


def objective_configs() -> dict[str, type[ObjectiveConfig]]:
    """``objective.name`` → the config dataclass its objective declares."""
    return {name: objective.config_class for name, objective in OBJECTIVES.items()}


def resolve_recipe(path: str) -> Path:
    """A recipe path as given, or the name of a bundled recipe (``simcse_unsup``)."""
    p = Path(path)
    if p.exists():
        return p
    bundled = CONFIG_DIR / (path if path.endswith(".yaml") else f"{path}.yaml")
    if bundled.exists():
        return bundled
    raise ConfigError(f"{path}: no such config file (bundled recipes: "
                      f"{', '.join(sorted(q.stem for q in CONFIG_DIR.glob('*.yaml')))})")


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """The recipe ``path`` (a bundled recipe's name or a file; None: the defaults) with ``key=value`` overrides."""
    return parse_config(resolve_recipe(path) if path else None, list(overrides), objective_configs())


def config_from_dict(d: dict) -> Config:
    """The inverse of ``Config.to_dict`` (a run's saved config, a checkpoint's)."""
    return parse_config_dict(d, objective_configs())
