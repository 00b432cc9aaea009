"""wikitext → plain text with section structure, using mwparserfromhell's node tree (not regexes).

Templates, refs, tables, files/images, categories, interlanguage links, comments and non-prose tags
are dropped; formatting tags keep their inner text, links keep their label; tail sections
(References, External links, … and their de/fr/es names) are dropped with their sub-sections.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass

import mwparserfromhell
from mwparserfromhell.nodes import (Argument, Comment, ExternalLink, Heading, HTMLEntity, Tag, Template,
                                    Text, Wikilink)

# Tail sections that hold no prose (matched case-insensitively on the rendered heading).
TAIL_SECTIONS = frozenset({
    "references", "external links", "see also", "notes", "further reading", "bibliography", "sources",
    "citations", "footnotes", "notes and references", "references and notes",
    "einzelnachweise", "weblinks", "siehe auch", "literatur", "anmerkungen", "quellen",  # de
    "références", "liens externes", "voir aussi", "notes et références", "bibliographie",  # fr
    "referencias", "enlaces externos", "véase también", "bibliografía", "notas",  # es
})
# Tags whose content is not prose: dropped with everything inside.
_DROP_TAGS = frozenset({"ref", "references", "table", "gallery", "math", "chem", "ce", "score", "timeline",
                        "imagemap", "graph", "mapframe", "maplink", "syntaxhighlight", "source", "pre", "code",
                        "templatedata", "templatestyles", "style", "script", "noinclude", "includeonly"})
# Tags that start a new paragraph: list items / definition lists and block elements.
_BREAK_TAGS = frozenset({"li", "dt", "dd", "p", "div", "blockquote", "center", "tr", "hr"})
# Canonical names; localized ones (Datei, Kategorie, …) come from the dump's <siteinfo>.
MEDIA_PREFIXES = ("file", "image", "media")
CATEGORY_PREFIXES = ("category",)
_INTERLANG = re.compile(r"^[a-z]{2,3}(?:-[a-z0-9]+)*$")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]?\s*\)|\[\s*\]")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?)])")
_SPACES = re.compile(r"[ \t\u00a0]+")
# mwparserfromhell leaves a tag as plain text when its content has unbalanced '' or [ (common in
# <ref>s). Refs and comments never nest and are never prose, so they are cut before parsing, and
# any tag that still survives as text is stripped after rendering.
_PRE_CUT = re.compile(r"<!--.*?(?:-->|$)|<ref\b[^>]*?/>|<ref\b[^>]*?>.*?</ref\s*>", re.DOTALL | re.IGNORECASE)
_POSSESSIVE = re.compile(r"'''(?=s\b)")  # ''Iliad'''s -> Iliad's
_BOLD_ITALIC = re.compile(r"'{2,}")
_LEFTOVER_TAG = re.compile(r"</?[A-Za-z][\w:-]*(?:\s[^<>]*)?/?>")


@dataclass
class Section:
    heading: str  # heading path joined by " > "; "" for the lead section
    paragraphs: list[str]


class WikitextCleaner:
    """Renders wikitext to the prose a reader sees, using mwparserfromhell's node tree."""

    def __init__(self, media_prefixes=MEDIA_PREFIXES, category_prefixes=CATEGORY_PREFIXES):
        self.media_prefixes = {p.lower() for p in media_prefixes}
        self.category_prefixes = {p.lower() for p in category_prefixes}

    def sections(self, wikitext: str) -> list[Section]:
        """Split at headings (any level), render each section, drop tail sections and their children."""
        code = mwparserfromhell.parse(_PRE_CUT.sub("", wikitext))
        out: list[Section] = []
        path: list[tuple[int, str]] = []  # (level, title) of the enclosing headings
        skip_below: int | None = None  # inside a tail section of this level
        nodes: list = []

        def flush() -> None:
            if skip_below is None:
                paragraphs = self._paragraphs(self.render(nodes))
                if paragraphs:
                    out.append(Section(" > ".join(t for _, t in path), paragraphs))
            nodes.clear()

        for node in code.nodes:
            if not isinstance(node, Heading):
                nodes.append(node)
                continue
            flush()
            title = _clean_line(self.render(node.title.nodes))
            path = [(lvl, t) for lvl, t in path if lvl < node.level] + [(node.level, title)]
            if skip_below is not None and node.level <= skip_below:
                skip_below = None
            if skip_below is None and title.lower().rstrip(":") in TAIL_SECTIONS:
                skip_below = node.level
        flush()
        return out

    def render(self, nodes) -> str:
        parts: list[str] = []
        for node in nodes:
            if isinstance(node, Text):
                parts.append(node.value)
            elif isinstance(node, HTMLEntity):
                parts.append(node.normalize())
            elif isinstance(node, Wikilink):
                parts.append(self._wikilink(node))
            elif isinstance(node, ExternalLink):
                parts.append(self.render(node.title.nodes) if node.title else "")
            elif isinstance(node, Tag):
                parts.append(self._tag(node))
            elif isinstance(node, Heading):  # a heading nested in a tag: keep it as its own line
                parts.append("\n\n" + self.render(node.title.nodes) + "\n\n")
            elif isinstance(node, (Template, Comment, Argument)):
                continue
        return "".join(parts)

    def _wikilink(self, link: Wikilink) -> str:
        target = str(link.title).strip()
        prefix = target.split(":", 1)[0].strip().lower() if ":" in target else ""
        if not target.startswith(":"):
            if prefix in self.media_prefixes or prefix in self.category_prefixes:
                return ""
            if _INTERLANG.match(prefix) and link.text is None:
                return ""  # [[de:Foo]] is an interlanguage link, not rendered in the text
        if link.text is not None:
            return self.render(link.text.nodes)
        return target.lstrip(":").split("#", 1)[0] or target.lstrip("#")

    def _tag(self, tag: Tag) -> str:
        name = str(tag.tag).strip().lower()
        if name in _DROP_TAGS:
            return ""
        if name == "br":
            return " "
        inner = self.render(tag.contents.nodes) if tag.contents is not None else ""
        return f"\n\n{inner}" if name in _BREAK_TAGS else inner

    @staticmethod
    def _paragraphs(text: str) -> list[str]:
        """Blank lines separate paragraphs; a single newline inside one renders as a space."""
        text = _LEFTOVER_TAG.sub("", _MAGIC_WORD.sub("", text))
        return [p for p in (_clean_line(block) for block in re.split(r"\n\s*\n", text)) if p]


def _clean_line(text: str) -> str:
    # Entities and '' / ''' quote marks inside constructs the parser gave up on are still raw text.
    text = html.unescape(_BOLD_ITALIC.sub("", _POSSESSIVE.sub("'", text)))
    text = _SPACES.sub(" ", text.replace("\n", " "))
    # Removed templates/refs leave "( )" or "(; )" and spaces before punctuation behind.
    text = _EMPTY_PARENS.sub("", text)
    text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    return _SPACES.sub(" ", text).strip()
