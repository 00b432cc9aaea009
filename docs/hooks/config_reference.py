"""The configuration reference, generated from the config dataclasses on every docs build.

A MkDocs hook (``hooks:`` in mkdocs.yml). ``docs/reference/config.md`` holds the hand-written prose
and the marker ``<!-- config-reference -->``; the hook replaces the marker with one table per section
of ``clsys.config.Config`` (nested groups as dotted keys: ``objective.grad_cache.chunk_size``), and one
per objective's own config dataclass (the class ``objective.name`` selects through
``clsys.objectives.OBJECTIVES``). Each row: key, type (the annotation as written), default (from an
instance of the dataclass; the quickstart recipe's value beside it where that differs), meaning.

The meaning is the field's comment in the source, found with ``inspect`` + ``ast`` + ``tokenize``:
the trailing ``# ...`` on the field's line(s), else a block of comment lines directly above the
field. A field with neither fails the build, naming the key and ``file:line``. Details that go
beyond the comment are written on the page itself, in a ``<!-- config-notes ... -->`` block of
``key: text`` lines (YAML); a note naming a key that does not exist fails the build too.

Every page is checked as well: a key in the first column of a hand-written key table (``| key |
...`` header; the objective pages have them) must be a real key, so those tables cannot outlive a
renamed or removed field.

``python docs/hooks/config_reference.py`` prints the generated tables.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the checkout, also when clsys is not installed
    sys.path.insert(0, str(ROOT))

PAGE = "reference/config.md"
MARKER = "<!-- config-reference -->"
NOTES = re.compile(r"<!--\s*config-notes\s*\n(.*?)-->\n?", re.S)
KEY = re.compile(r"^[a-z_]+(?:\.[a-z_0-9]+)+$")
# The page that explains each objective's recipe, linked from its table (relative to reference/).
OBJECTIVE_PAGES = {"simcse": "../training/simcse.md", "self_guided": "../training/self-guided.md",
                   "tacl": "../training/tacl.md", "clir": "../training/clir.md", "css_lm": "../training/css-lm.md"}


class ConfigReferenceError(ValueError):
    """A field without a meaning, a note or table row naming an unknown key."""


@dataclasses.dataclass
class Row:
    key: str
    type: str
    default: object
    recipe: object  # the quickstart recipe's value, or MISSING where it equals the default
    meaning: str


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
                raise ConfigReferenceError(
                    f"config key '{key}' ({klass.__name__}.{name}, {_where(klass, line)}) has no meaning: add a "
                    "trailing '# ...' comment to the field's line (docs/reference/config.md is generated from it)")
            return text
    raise ConfigReferenceError(f"config key '{key}': no declaration of {cls.__name__}.{name} found")


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
        rows.append(Row(key, f.type if isinstance(f.type, str) else _type_name(f.type), value,
                        other if other != value else dataclasses.MISSING, meaning(type(obj), f.name, key)))
    return rows


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
    if isinstance(value, str):
        try:
            plain = value != "" and yaml.safe_load(value) == value
        except yaml.YAMLError:
            plain = False
        return value if plain else json.dumps(value, ensure_ascii=False)
    return str(value)


def _code(text: str) -> str:
    ticks = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _cell(text: str) -> str:
    """Comment text as a table cell: outside code spans, escape what Markdown would eat."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = (parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                    .replace("|", "\\|").replace("*", "\\*"))
    return "`".join(parts)


@functools.lru_cache(maxsize=1)
def sections() -> list[tuple[str, str, str, list[Row]]]:
    """``(anchor, title, intro, rows)`` per table, in ``Config`` order, each objective after ``objective``."""
    from clsys.config import Config, ObjectiveConfig, load_config
    from clsys.objectives import OBJECTIVES

    quickstart = load_config("quickstart")
    defaults = Config()
    out = []
    for f in dataclasses.fields(Config):
        name = f.name
        if name != "objective":
            out.append((name, f"`{name}`", "", walk(getattr(defaults, name), name, getattr(quickstart, name))))
            continue
        out.append(("objective", "`objective` (every objective)",
                    "Keys every objective has; the others are the chosen objective's own (below).",
                    walk(ObjectiveConfig(), "objective", quickstart.objective)))
        base = frozenset(x.name for x in dataclasses.fields(ObjectiveConfig))
        for objective, cls in OBJECTIVES.items():
            config_class = cls.config_class
            recipe = quickstart.objective if type(quickstart.objective) is config_class else None
            rows = walk(config_class(name=objective), "objective", recipe, skip=base)
            page = OBJECTIVE_PAGES.get(objective)
            intro = f"`{config_class.__module__}.{config_class.__name__}`" + (
                f"; the recipe and each key in context: [{objective}]({page})" if page else "")
            out.append((f"objective-{objective.replace('_', '-')}", f"`objective.name: {objective}`", intro, rows))
    return out


def known_keys() -> set[str]:
    return {row.key for _, _, _, rows in sections() for row in rows}


def render(notes: dict[str, str] | None = None) -> str:
    """The generated tables (Markdown); ``notes``: extra text per key, appended to its meaning."""
    notes = dict(notes or {})
    unknown = sorted(set(notes) - known_keys())
    if unknown:
        raise ConfigReferenceError(f"{PAGE}: config-notes name keys that do not exist: {', '.join(unknown)}")
    parts = []
    for anchor, title, intro, rows in sections():
        level = "###" if anchor.startswith("objective-") else "##"
        parts.append(f"{level} {title} {{#{anchor}}}\n")
        if intro:
            parts.append(intro + "\n")
        parts.append("| key | type | default | meaning |\n|---|---|---|---|")
        for row in rows:
            default = _code(yaml_value(row.default))
            if row.recipe is not dataclasses.MISSING:
                default += f" (quickstart: {_code(yaml_value(row.recipe))})"
            text = _cell(row.meaning)
            if row.key in notes:
                text += "<br>" + " ".join(str(notes[row.key]).split())
            parts.append(f"| {_code(row.key)} | {_code(row.type)} | {default} | {text} |")
        parts.append("")
    return "\n".join(parts)


def expand(markdown: str) -> str:
    """The reference page's source with its notes block consumed and the marker replaced."""
    if MARKER not in markdown:
        raise ConfigReferenceError(f"{PAGE}: the marker {MARKER} is missing")
    notes: dict[str, str] = {}
    for block in NOTES.findall(markdown):
        loaded = yaml.safe_load(block) or {}
        if not isinstance(loaded, dict):
            raise ConfigReferenceError(f"{PAGE}: config-notes must be 'key: text' lines")
        notes.update(loaded)
    return NOTES.sub("", markdown).replace(MARKER, render(notes))


def check_key_tables(markdown: str, where: str) -> None:
    """Every key in the first column of a ``| key | ...`` table must exist (objective.* keys: in any
    objective). Rows may list several keys: ``| `task.train`, `task.dev` | ...``."""
    keys, in_table, fence = known_keys(), False, False
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
        if fence:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        if not cells:
            in_table = False
            continue
        if cells[0] == "key":
            in_table = True
            continue
        if not in_table:
            continue
        for key in re.findall(r"`([^`]+)`", cells[0]):
            if KEY.match(key) and key not in keys:
                raise ConfigReferenceError(f"{where}:{number}: '{key}' in a key table is not a config key")


# --- MkDocs hook events -------------------------------------------------------------------------

def on_pre_build(config) -> None:
    """Read the dataclasses once per build, before any page: a field without a meaning stops here."""
    from mkdocs.exceptions import PluginError

    sections.cache_clear()  # `mkdocs serve` rebuilds in one process: read the comments afresh
    try:
        sections()
    except ConfigReferenceError as err:
        raise PluginError(str(err)) from None


def on_page_markdown(markdown: str, page, config, files) -> str:
    from mkdocs.exceptions import PluginError

    where = f"docs/{page.file.src_uri}"
    try:
        if page.file.src_uri == PAGE:
            markdown = expand(markdown)
        else:
            check_key_tables(markdown, where)
    except ConfigReferenceError as err:
        raise PluginError(str(err)) from None
    return markdown


if __name__ == "__main__":
    print(render())
