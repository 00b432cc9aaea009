"""Every configuration key with its type, default and meaning, read from the config dataclasses.

One source for the docs' configuration reference (``docs/hooks/config_reference.py`` renders it as
tables on every docs build) and for ``python -m clsys.pretrain --help``, so neither can drift from
the code. Nested groups become dotted keys (``objective.grad_cache.chunk_size``); each objective's
own config dataclass (the class ``objective.name`` selects through ``clsys.recipes.OBJECTIVES``)
gives the ``objective.*`` keys of that objective.

The meaning is the field's comment in the source, found with ``inspect`` + ``ast`` + ``tokenize``:
the trailing ``# ...`` on the field's line(s), else a block of comment lines directly above the
field. A field with neither is an error naming the key and ``file:line``.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import re
import textwrap
import tokenize
import typing
from pathlib import Path

import yaml

from clsys.config import closed_set

ROOT = Path(__file__).resolve().parents[2]  # the checkout: where a source path is shown from


class ConfigKeyError(ValueError):
    """A config field without a meaning (or a key that does not exist)."""


@dataclasses.dataclass
class Row:
    key: str
    type: str
    default: object
    recipe: object  # the quickstart recipe's value, or MISSING where it equals the default
    meaning: str


@dataclasses.dataclass
class Section:
    name: str  # a top-level section of Config (data, model, objective, ...)
    objective: str | None  # for the objective.* keys of one objective; None: the keys every objective has
    config_class: type
    rows: list[Row]


def _where(cls: type, line: int | None = None) -> str:
    path = Path(inspect.getsourcefile(cls) or "?").resolve()
    try:
        path = path.relative_to(ROOT)
    except ValueError:
        pass
    return f"{path}:{line}" if line else str(path)


def own_field_comments(cls: type) -> dict[str, tuple[str | None, int]]:
    """``{field: (meaning or None, line in its file)}`` for the fields ``cls`` itself declares."""
    lines, first = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    classdef = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, trailing code on that line?)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            trailing = bool(tok.line[:tok.start[1]].strip())
            comments[tok.start[0]] = (tok.string.lstrip("#").strip(), trailing)
    found = {}
    for node in classdef.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [comments[n][0] for n in range(node.lineno, node.end_lineno + 1)
                    if n in comments and comments[n][1]]
        text = " ".join(trailing)
        if not text:  # a comment block right above the field
            block, n = [], node.lineno - 1
            while n in comments and not comments[n][1]:
                block.insert(0, comments[n][0])
                n -= 1
            text = " ".join(block)
        found[node.target.id] = (text or None, first + node.lineno - 1)
    return found


def meaning(cls: type, name: str, key: str) -> str:
    """The comment of field ``name`` where it is declared (``cls`` or a base class)."""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in inspect.get_annotations(klass):
            text, line = own_field_comments(klass)[name]
            if not text:
                raise ConfigKeyError(
                    f"config key '{key}' ({klass.__name__}.{name}, {_where(klass, line)}) has no meaning: add a "
                    "trailing '# ...' comment to the field's line (docs/reference/config.md is generated from it)")
            return text
    raise ConfigKeyError(f"config key '{key}': no declaration of {cls.__name__}.{name} found")


def walk(obj, prefix: str, recipe=None, skip: frozenset[str] = frozenset()) -> list[Row]:
    """Rows for every leaf field of the dataclass instance ``obj`` (defaults), nested groups as
    dotted keys; ``recipe``: an instance holding a recipe's values, compared with the defaults."""
    rows = []
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        key, value = f"{prefix}.{f.name}", getattr(obj, f.name)
        other = getattr(recipe, f.name) if recipe is not None else dataclasses.MISSING
        if dataclasses.is_dataclass(value):
            rows += walk(value, key, other if other is not dataclasses.MISSING else None)
            continue
        resolved = typing.get_type_hints(type(obj))[f.name]
        meaning_text = meaning(type(obj), f.name, key)
        if values := closed_set(resolved):
            each = "each one" if typing.get_origin(resolved) is list else "one"
            meaning_text = f"{meaning_text} ({each} of {' | '.join(map(str, values))})"
        rows.append(Row(key, type_text(f.type, resolved), value, other if other != value else dataclasses.MISSING,
                        meaning_text))
    return rows


def type_text(written, resolved) -> str:
    """A key's type as the reference shows it: as written, but a closed set (``Literal``, whatever alias names it)
    as the type of its values (``str``, ``int``, ``list[str]``), the values going after the meaning."""
    if values := closed_set(resolved):
        name = " or ".join(dict.fromkeys(type(v).__name__ for v in values))  # int or str: stages and auto
        return f"list[{name}]" if typing.get_origin(resolved) is list else name
    return written if isinstance(written, str) else _type_name(written)


def _type_name(tp) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def yaml_value(value) -> str:
    """A value as one writes it in a recipe (YAML) or an override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), repr(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_value(k)}: {yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        try:
            plain = value != "" and yaml.safe_load(value) == value
        except yaml.YAMLError:
            plain = False
        return value if plain else json.dumps(value, ensure_ascii=False)
    return str(value)


@functools.lru_cache(maxsize=1)
def sections() -> list[Section]:
    """Every key, section by section in ``Config`` order; after ``objective`` (the keys every objective
    has), one section per objective with its own keys. Defaults from the dataclasses; the quickstart
    recipe's value beside them where it differs."""
    from clsys.config import Config, ObjectiveConfig
    from clsys.recipes import OBJECTIVES, load_config

    quickstart = load_config("quickstart")
    defaults = Config()
    out = []
    for f in dataclasses.fields(Config):
        section = getattr(defaults, f.name)
        if not dataclasses.is_dataclass(section):  # a free-form mapping (deepspeed): one row for the whole
            recipe = getattr(quickstart, f.name)
            row = Row(f"{f.name}.*", f.type if isinstance(f.type, str) else _type_name(f.type), section,
                      recipe if recipe != section else dataclasses.MISSING, meaning(Config, f.name, f.name))
            out.append(Section(f.name, None, Config, [row]))
            continue
        if f.name != "objective":
            out.append(Section(f.name, None, type(section), walk(section, f.name, getattr(quickstart, f.name))))
            continue
        out.append(Section("objective", None, ObjectiveConfig,
                           walk(ObjectiveConfig(), "objective", quickstart.objective)))
        base = frozenset(x.name for x in dataclasses.fields(ObjectiveConfig))
        for objective, cls in OBJECTIVES.items():
            config_class = cls.config_class
            recipe = quickstart.objective if type(quickstart.objective) is config_class else None
            out.append(Section("objective", objective, config_class,
                               walk(config_class(name=objective), "objective", recipe, skip=base)))
    return out


def known_keys() -> set[str]:
    return {row.key for section in sections() for row in section.rows}


def recipes() -> dict[str, str]:
    """The bundled recipes (``--config NAME``) and the first sentence of each one's header comment."""
    from clsys.recipes import CONFIG_DIR

    out = {}
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line.lstrip("#").strip())
        # A sentence ends at a full stop before a capital ("Kim et al. 2021" goes on).
        out[path.stem] = re.split(r"(?<=\.)\s+(?=[A-Z])", " ".join(header), maxsplit=1)[0]
    return out


def help_text() -> str:
    """The recipes and every key with its default and meaning, as ``--help`` prints them."""
    lines = ["bundled recipes (--config NAME):"]
    named = recipes()
    width = max(map(len, named))
    lines += [f"  {name:<{width}}  {text}" for name, text in named.items()]
    lines += ["", "keys (override as section.key=VALUE or --section.key=VALUE; default, quickstart's value in "
              "brackets where it differs):"]
    for section in sections():
        title = (f"objective.* of objective.name: {section.objective}" if section.objective
                 else f"{section.name}" + (" (every objective)" if section.name == "objective" else ""))
        lines.append(f"  {title}")
        for row in section.rows:
            value = yaml_value(row.default)
            if row.recipe is not dataclasses.MISSING:
                value += f" [{yaml_value(row.recipe)}]"
            lines.append(f"    {row.key} = {value}  ({row.type}) {row.meaning}")
    return "\n".join(lines)
