"""The configuration reference, generated from the config dataclasses on every docs build.

A MkDocs hook (``hooks:`` in mkdocs.yml). ``docs/reference/config.md`` holds the hand-written prose
and the marker ``<!-- config-reference -->``; the hook replaces the marker with one table per section
of ``clsys.config.Config`` (nested groups as dotted keys: ``objective.grad_cache.chunk_size``), and one
per objective's own config dataclass (the class ``objective.name`` selects through
``clsys.recipes.OBJECTIVES``). Each row: key, type (the annotation as written), default (from an
instance of the dataclass; the quickstart recipe's value beside it where that differs), meaning.

The rows (key, type, default, quickstart's value, meaning from the field's comment) come from
``clsys.driver.keys``, which ``python -m clsys.pretrain --help`` prints too; a field without a
meaning fails the build, naming the key and ``file:line``. Details that go beyond the comment are
written on the page itself, in a ``<!-- config-notes ... -->`` block of ``key: text`` lines (YAML); a
note naming a key that does not exist fails the build too.

Every page is checked as well: a key in the first column of a hand-written key table (``| key |
...`` header; the objective pages have them) must be a real key, so those tables cannot outlive a
renamed or removed field.

``python docs/hooks/config_reference.py`` prints the generated tables.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the checkout, also when clsys is not installed
    sys.path.insert(0, str(ROOT))

from clsys.driver import keys as config_keys  # noqa: E402
from clsys.driver.keys import ConfigKeyError, Row, yaml_value  # noqa: E402

PAGE = "reference/config.md"
MARKER = "<!-- config-reference -->"
NOTES = re.compile(r"<!--\s*config-notes\s*\n(.*?)-->\n?", re.S)
KEY = re.compile(r"^[a-z_]+(?:\.[a-z_0-9]+)+$")
# The page that explains each objective's recipe, linked from its table (relative to reference/).
OBJECTIVE_PAGES = {"simcse": "../training/simcse.md", "self_guided": "../training/self-guided.md",
                   "tacl": "../training/tacl.md", "clir": "../training/clir.md", "pairs": "../training/pairs.md",
                   "css_lm": "../training/css-lm.md"}


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
    out = []
    for section in config_keys.sections():
        objective, cls = section.objective, section.config_class
        if objective is None and section.name != "objective":
            out.append((section.name, f"`{section.name}`", "", section.rows))
        elif objective is None:
            out.append(("objective", "`objective` (every objective)",
                        "Keys every objective has; the others are the chosen objective's own (below).", section.rows))
        else:
            page = OBJECTIVE_PAGES.get(objective)
            intro = f"`{cls.__module__}.{cls.__name__}`" + (
                f"; the recipe and each key in context: [{objective}]({page})" if page else "")
            if cls.own_sections:  # the spelling from before these groups moved under objective, still read
                owned = ", ".join(f"`{s}`" for s in cls.own_sections)
                intro += (f". Its groups {owned} are also read as top-level sections of a recipe and as overrides "
                          f"without `objective.` (`{cls.own_sections[0]}.KEY=VALUE`)")
            out.append((f"objective-{objective.replace('_', '-')}", f"`objective.name: {objective}`", intro,
                        section.rows))
    return out


def known_keys() -> set[str]:
    return config_keys.known_keys()


def render(notes: dict[str, str] | None = None) -> str:
    """The generated tables (Markdown); ``notes``: extra text per key, appended to its meaning."""
    notes = dict(notes or {})
    unknown = sorted(set(notes) - known_keys())
    if unknown:
        raise ConfigKeyError(f"{PAGE}: config-notes name keys that do not exist: {', '.join(unknown)}")
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
        raise ConfigKeyError(f"{PAGE}: the marker {MARKER} is missing")
    notes: dict[str, str] = {}
    for block in NOTES.findall(markdown):
        loaded = yaml.safe_load(block) or {}
        if not isinstance(loaded, dict):
            raise ConfigKeyError(f"{PAGE}: config-notes must be 'key: text' lines")
        notes.update(loaded)
    return NOTES.sub("", markdown).replace(MARKER, render(notes))


def check_key_tables(markdown: str, where: str) -> None:
    """Every key in the first column of a ``| key | ...`` table must exist (objective.* keys: in any
    objective). Rows may list several keys: ``| `objective.task.train`, `objective.task.dev` | ...``."""
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
                raise ConfigKeyError(f"{where}:{number}: '{key}' in a key table is not a config key")


# --- MkDocs hook events -------------------------------------------------------------------------

def on_pre_build(config) -> None:
    """Read the dataclasses once per build, before any page: a field without a meaning stops here."""
    from mkdocs.exceptions import PluginError

    # `mkdocs serve` rebuilds in one process: read the comments afresh.
    config_keys.sections.cache_clear()
    sections.cache_clear()
    try:
        sections()
    except ConfigKeyError as err:
        raise PluginError(str(err)) from None


def on_page_markdown(markdown: str, page, config, files) -> str:
    from mkdocs.exceptions import PluginError

    where = f"docs/{page.file.src_uri}"
    try:
        if page.file.src_uri == PAGE:
            markdown = expand(markdown)
        else:
            check_key_tables(markdown, where)
    except ConfigKeyError as err:
        raise PluginError(str(err)) from None
    return markdown


if __name__ == "__main__":
    print(render())
