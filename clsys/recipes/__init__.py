"""Recipes: a YAML file that names an objective and its settings (bundled ones in ``clsys/configs``: quickstart,
simcse_unsup, ...; or a path) → a checked ``Config``.

This room knows the objectives (``clsys.objectives.OBJECTIVES``): it hands each one's config dataclass to
``clsys.config``, which parses and checks but imports no objective, so that objectives can build on the config.
"""
from __future__ import annotations

from pathlib import Path

from clsys.config import Config, ConfigError, ObjectiveConfig, parse_config, parse_config_dict
from clsys.objectives import OBJECTIVES

CONFIG_DIR = Path(__file__).parents[1] / "configs"


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
    """The inverse of ``Config.to_dict`` (used to ship the config to Ray workers and checkpoints)."""
    return parse_config_dict(d, objective_configs())
