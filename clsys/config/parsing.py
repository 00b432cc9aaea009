"""A Config from a YAML recipe plus dotted ``key=value`` overrides: how recipe and command-line text become values.

``clsys.recipes.load_config("simcse_unsup", ["train.steps=50", "data.url=s3://b/p"])`` (which hands this module
each objective's config dataclass: it imports no objective). Each value is coerced to its field's annotated type
(closed sets, lists, mappings, tuples); an unknown key or a value of the wrong type is an error that names the
key, so a typo in a recipe never silently falls back to a default. What a config holds, and the checks a whole
config passes, are ``clsys.config``'s. A group of an objective's config that it declares as a section of its own
(``ObjectiveConfig.own_sections``) is also read as a top-level section, the spelling from before it moved.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path

import yaml

from clsys.config import FREE_FORM, Config, ConfigError, ObjectiveConfig, choices, closed_set_problem


def _coerce(key: str, value, tp):
    """Convert ``value`` (from YAML or a CLI string) to the annotated type ``tp``, or fail naming ``key``."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:  # a closed set: the value in one of the set's types (str, int), and one of them
        for kind in dict.fromkeys(type(a) for a in typing.get_args(tp)):
            try:
                converted = _coerce(key, value, kind)
            except ConfigError:
                continue
            if closed_set_problem(key, converted, tp) is None:
                return converted
        raise ConfigError(closed_set_problem(key, value, tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
            return None
        return _coerce(key, value, args[0])
    if origin is list:
        if isinstance(value, str):  # a CLI override: "[en-de, en-es]" or "en-de,en-es"
            value = yaml.safe_load(value) if value.strip().startswith("[") else [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_type,) = typing.get_args(tp)
        return [_coerce(key, v, item_type) for v in value]
    if origin is dict:
        if isinstance(value, str):  # a CLI override: a YAML flow mapping, '{nq: "query: "}'
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as err:
                raise ConfigError(f"{key}: expected a mapping such as {{name: value}} ({err})") from None
        key_type, value_type = typing.get_args(tp)
        names_alone = type(None) in typing.get_args(value_type)  # a value may be null, so a list of names will do
        if names_alone and isinstance(value, (list, tuple)):  # [a, b] or [a, {b: 2}]: null where no value is given
            value = {_coerce(key, k, key_type): v for item in value
                     for k, v in (item.items() if isinstance(item, dict) else [(item, None)])}
        if not isinstance(value, dict):
            also = " or a list of names" if names_alone else ""
            raise ConfigError(f"{key}: expected a mapping such as {{name: value}}{also}, got {value!r}")
        return {_coerce(key, k, key_type): _coerce(f"{key}.{k}", v, value_type) for k, v in value.items()}
    if origin is tuple:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args))
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if not as_float.is_integer():
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(as_float)
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            return value[1:-1]  # a quoted CLI override
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {tp}")


def _set(cfg: Config, dotted: str, value) -> None:
    """Set ``section.key`` (or ``section.group.key`` for a nested group such as objective.grad_cache)."""
    *path, name = dotted.split(".")
    if path and path[0] in FREE_FORM:
        _set_mapping(getattr(cfg, path[0]), path[1:] + [name], value, dotted)
        return
    if not path or not name or not path[0]:
        sections = ", ".join(f.name for f in dataclasses.fields(Config))
        raise ConfigError(f"unknown config key '{dotted}' (sections: {sections})")
    node, where = cfg, []
    for part in path:
        fields = {f.name for f in dataclasses.fields(node)}
        child = getattr(node, part, None) if part in fields else None
        if not dataclasses.is_dataclass(child):
            kind = f"keys of {'.'.join(where)}" if where else "sections"
            raise ConfigError(f"unknown config key '{dotted}' ({kind}: {', '.join(sorted(fields))})")
        node, where = child, where + [part]
    fields = {f.name for f in dataclasses.fields(node)}  # not its ClassVars (own_sections, ...): no keys
    hints = {key: tp for key, tp in typing.get_type_hints(type(node)).items() if key in fields}
    if name not in hints:
        raise ConfigError(f"unknown config key '{dotted}' (keys of {'.'.join(where)}: {', '.join(hints)})")
    if dataclasses.is_dataclass(hints[name]):  # a group given whole: a YAML mapping or a to_dict() dict
        if not isinstance(value, dict):
            raise ConfigError(f"{dotted}: expected a mapping of {', '.join(typing.get_type_hints(hints[name]))}")
        for key, item in value.items():
            _set(cfg, f"{dotted}.{key}", item)
        return
    setattr(node, name, _coerce(dotted, value, hints[name]))


def _set_mapping(mapping: dict, keys: list[str], value, dotted: str) -> None:
    """Set ``keys[-1]`` under the nested mappings ``keys[:-1]`` of a free-form section; a mapping value
    merges into what is there."""
    for key in keys[:-1]:
        mapping = mapping.setdefault(key, {})
        if not isinstance(mapping, dict):
            raise ConfigError(f"{dotted}: '{key}' is already set to a value, not a mapping")
    if isinstance(value, dict):
        for key, item in value.items():
            _set_mapping(mapping, [keys[-1], str(key)], item, f"{dotted}.{key}")
    elif isinstance(value, str) and EXPONENT_NUMBER.fullmatch(value):
        mapping[keys[-1]] = float(value)  # 5e8: a number in JSON and YAML 1.2, a string to PyYAML (YAML 1.1)
    else:
        mapping[keys[-1]] = value


EXPONENT_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def _objective_config(name: str, objective_configs: Mapping[str, type[ObjectiveConfig]]) -> ObjectiveConfig:
    if name not in objective_configs:
        raise ConfigError(f"objective.name: unknown objective '{name}' (choose from {', '.join(objective_configs)})")
    return objective_configs[name](name=name)


def _placed(key: str, value, objective: ObjectiveConfig,
            objective_configs: Mapping[str, type[ObjectiveConfig]]) -> str | None:
    """``key`` where Config holds it. A top-level section an objective owns (``task.shots``: ``own_sections``) is
    the spelling from before it moved under ``objective``: read there when the selected objective owns it; another
    objective's key at its default is skipped (None), as every run saved before the move holds those sections,
    whatever its objective; set to anything else, it is an error naming the objective that owns it."""
    section = key.split(".")[0]
    if section in type(objective).own_sections:
        return f"objective.{key}"
    owners = {name: cls for name, cls in objective_configs.items() if section in cls.own_sections}
    if not owners:
        return key
    if any(_changes_nothing(cls, name, key, value) for name, cls in owners.items()):
        return None
    sections, names = ", ".join(f.name for f in dataclasses.fields(Config)), choices(tuple(owners))
    raise ConfigError(f"unknown config key '{key}' (sections: {sections}; {section} is a section of objective "
                      f"{names}: objective.name: {names})")


def _changes_nothing(config_class: type[ObjectiveConfig], name: str, key: str, value) -> bool:
    """Whether ``objective.key`` set to ``value`` (read as any value is) leaves objective ``name``'s defaults as
    they are."""
    probe = Config(objective=config_class(name=name))
    try:
        _set(probe, f"objective.{key}", value)
    except ConfigError:
        return False
    return probe.objective == config_class(name=name)


def _build(items: list[tuple[str, object, str]], objective_configs: Mapping[str, type[ObjectiveConfig]]) -> Config:
    """Apply (dotted key, value, where-it-came-from) items in order onto a fresh Config."""
    name = next((v for k, v, _ in reversed(items) if k == "objective.name"), ObjectiveConfig.name)
    cfg = Config(objective=_objective_config(str(name), objective_configs))
    for key, value, source in items:
        try:
            if (placed := _placed(key, value, cfg.objective, objective_configs)) is not None:
                _set(cfg, placed, value)
        except ConfigError as err:
            raise ConfigError(f"{source}{err}") from None
    cfg.validate()
    return cfg


def parse_config(recipe: Path | None, overrides: list[str],
                 objective_configs: Mapping[str, type[ObjectiveConfig]]) -> Config:
    """A checked Config from a recipe file and ``key=value`` overrides, the ``objective`` section checked against
    ``objective_configs[objective.name]`` (each objective's own dataclass: ``clsys.recipes`` passes them, so that
    this module imports no objective)."""
    items: list[tuple[str, object, str]] = []
    if recipe is not None:
        try:
            raw = yaml.safe_load(recipe.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{recipe}: not valid YAML ({err})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{recipe}: expected a mapping of sections at the top level")
        for section, values in raw.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{recipe}: section '{section}' must be a mapping")
            items += [(f"{section}.{key}", value, f"{recipe}: ") for key, value in values.items()]
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, value = key.strip(), value.strip()
        if key.split(".")[0] in FREE_FORM:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as err:
                raise ConfigError(f"override: {key}: not a YAML value ({err})") from None
        # Else the raw string: _coerce parses it for the key's type (YAML would read 24:48 as the number 1488).
        items.append((key, value, "override: "))
    return _build(items, objective_configs)


def parse_config_dict(d: dict, objective_configs: Mapping[str, type[ObjectiveConfig]]) -> Config:
    """The inverse of ``Config.to_dict``."""
    return _build([(f"{section}.{key}", value, "") for section, values in d.items() for key, value in values.items()],
                  objective_configs)
