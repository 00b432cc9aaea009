"""wikitext → plain text with section structure, using mwparserfromhell's node tree (not regexes).

Templates, refs, tables, files/images, categories, interlanguage links, comments and non-prose tags
are dropped; formatting tags keep their inner text, links keep their label; tail sections
(References, External links, … and their de/fr/es/zh/ja/ar/he names) are dropped with their sub-sections.

Building the tree is most of the cost, so ``prerender`` first cuts the constructs dropped anyway
(templates and arguments, tables, file and category links, non-prose extension tags) out of the text
and replaces plain links by their text, in one linear pass with a bracket stack: the parser then
sees little more than prose.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass

import mwparserfromhell
from mwparserfromhell.definitions import PARSER_BLACKLIST
from mwparserfromhell.nodes import (Argument, Comment, ExternalLink, Heading, HTMLEntity, Tag, Template,
                                    Text, Wikilink)

from data_prep.wikitext_scan import BREAK_TAGS, DROP_TAGS, plain_blocks

# Tail sections that hold no prose (matched case-insensitively on the rendered heading).
TAIL_SECTIONS = frozenset({
    "references", "external links", "see also", "notes", "further reading", "bibliography", "sources",
    "citations", "footnotes", "notes and references", "references and notes",
    "einzelnachweise", "weblinks", "siehe auch", "literatur", "anmerkungen", "quellen",  # de
    "références", "liens externes", "voir aussi", "notes et références", "bibliographie",  # fr
    "referencias", "enlaces externos", "véase también", "bibliografía", "notas",  # es
    "参考文献", "参考资料", "參考資料", "外部链接", "外部連結", "参见", "參見", "注释", "註釋", "脚注",  # zh
    "出典", "関連項目", "外部リンク", "注釈",  # ja
    "المراجع", "مراجع", "وصلات خارجية", "انظر أيضا", "انظر أيضًا", "ملاحظات",  # ar
    "הערות שוליים", "קישורים חיצוניים", "ראו גם", "לקריאה נוספת",  # he
})
# Canonical names; localized ones (Datei, Kategorie, …) come from the dump's <siteinfo>.
MEDIA_PREFIXES = ("file", "image", "media")
CATEGORY_PREFIXES = ("category",)
_INTERLANG = re.compile(r"^[a-z]{2,3}(?:-[a-z0-9]+)*$")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
_EMPTY_PARENS = re.compile(r"\(\s*[,;:]?\s*\)|\[\s*\]")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?)])")
# Finds the same places from the punctuation side: a character class first lets the regex engine skip
# to candidates in C, where _SPACE_BEFORE_PUNCT is tried at every space (most of a line's cost).
_PUNCT_AFTER_SPACE = re.compile(r"[,.;:!?)](?<=\s.)")
_SPACES = re.compile(r"[ \t\u00a0]+")
# mwparserfromhell leaves a tag as plain text when its content has unbalanced '' or [ (common in
# <ref>s). Refs and comments never nest and are never prose, so they are cut before parsing, and
# any tag that still survives as text is stripped after rendering.
_PRE_CUT = re.compile(r"<!--.*?(?:-->|$)|<ref\b[^>]*?/>|<ref\b[^>]*?>.*?</ref\s*>", re.DOTALL | re.IGNORECASE)
_POSSESSIVE = re.compile(r"'''(?=s\b)")  # ''Iliad'''s -> Iliad's
_BOLD_ITALIC = re.compile(r"''+")
_LEFTOVER_TAG = re.compile(r"</?[A-Za-z][\w:-]*(?:\s[^<>]*)?/?>")
# prerender's events: runs of braces and of brackets (read as mwparserfromhell reads them:
# "{{{" opens an argument, "}}}}}" closes an argument and a template), table starts and ends (at a
# line start, after at most one whitespace character, as the parser requires), and the opening tags
# of the extension tags whose content the parser takes as plain text, so brackets inside count for nothing.
# Every alternative starts with a literal character (a line start is the "\n" before it: the text gets one
# in front), so that the regex engine skips to the next candidate in C; with "^" or a group first it is
# tried at every position, 8x slower (wikitext_scan has the same pattern).
_EVENT = re.compile(r"\{(?P<open_braces>\{+)|\}(?P<close_braces>\}+)|\[(?P<open_link>\[+)|\](?P<close_link>\]+)"
                    r"|\n[^\S\n]?(?:(?P<open_table>\{\|)|(?P<close_table>\|\}))"
                    r"|<(?P<tag>(?i:%s))\b[^<>]*>" % "|".join(PARSER_BLACKLIST))
_CLOSE_TAG = {name: re.compile(rf"</{name}\s*>", re.IGNORECASE) for name in PARSER_BLACKLIST}
# A link title the parser accepts (no newline, brackets or angle brackets), with no template in it.
_LINK_TITLE = re.compile(r"[^\n\[\]{}<>|]*(?=\||\]\])")
# A link that renders as plain text: title and label free of markup and of anything that could start
# a construct once the brackets are gone (quotes, entities, the ":" of URLs and namespaces, the "=" of
# headings), each starting with a word character (so no list or heading marker lands at a line start).
_PLAIN_LINK = re.compile(r"\[\[(\w[^\n\[\]{}<>|&'=:!]*)(?:\|(\w[^\n\[\]{}<>|&'=:!]*))?\]\](?!\])")
# What a dropped construct is replaced with: an empty comment renders as nothing but, unlike nothing,
# keeps its neighbours apart as the construct did: "''{{lang|fr|x}}''" must not become a "''''" quote
# run, nor "{{x}}* y" a list item.
_DROPPED = "<!---->"
_BRACES, _TABLE, _LINK, _DROPPED_LINK = range(4)  # kinds of prerender's open constructs


@dataclass
class Section:
    heading: str  # heading path joined by " > "; "" for the lead section
    paragraphs: list[str]


class WikitextCleaner:
    """Renders wikitext to the prose a reader sees, using mwparserfromhell's node tree."""

    def __init__(self, media_prefixes=MEDIA_PREFIXES, category_prefixes=CATEGORY_PREFIXES):
        self.media_prefixes = {p.lower() for p in media_prefixes}
        self.category_prefixes = {p.lower() for p in category_prefixes}
        self._dropped_links = frozenset(self.media_prefixes | self.category_prefixes)

    def sections(self, wikitext: str) -> list[Section]:
        """Split at headings (any level), render each section, drop tail sections and their children."""
        text = prerender(_PRE_CUT.sub("", wikitext), self._dropped_links)
        blocks = plain_blocks(text, self.link)  # most pages need no parser (wikitext_scan)
        sections = self._sections(blocks) if blocks is not None else None
        return sections if sections is not None else self._sections(self._tree_blocks(text))

    def _sections(self, blocks: list[tuple[int, str, str, bool]]) -> list[Section] | None:
        """The kept sections of rendered blocks; None if a kept block needs the parser (``plain_blocks``)."""
        out: list[Section] = []
        path: list[tuple[int, str]] = []  # (level, title) of the enclosing headings
        skip_below: int | None = None  # inside a tail section of this level
        for level, title, body, needs_parser in blocks:
            if level:
                title = _clean_line(title)
                path = [(lvl, t) for lvl, t in path if lvl < level] + [(level, title)]
                if skip_below is not None and level <= skip_below:
                    skip_below = None
                if skip_below is None and title.lower().rstrip(":") in TAIL_SECTIONS:
                    skip_below = level
            if skip_below is None:
                if needs_parser:
                    return None
                paragraphs = self._paragraphs(body)
                if paragraphs:
                    out.append(Section(" > ".join(t for _, t in path), paragraphs))
        return out

    def _tree_blocks(self, text: str) -> list[tuple[int, str, str, bool]]:
        """``plain_blocks``'s blocks rendered from the parser's tree (none of them needs the parser again)."""
        blocks: list[tuple[int, str, list]] = [(0, "", [])]
        for node in mwparserfromhell.parse(text).nodes:
            if isinstance(node, Heading):
                blocks.append((node.level, self.render(node.title.nodes), []))
            else:
                blocks[-1][2].append(node)
        return [(level, title, self.render(nodes), False) for level, title, nodes in blocks]

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
        return self.link(str(link.title), self.render(link.text.nodes) if link.text is not None else None)

    def link(self, title: str, label: str | None) -> str:
        """What a wikilink renders as, given its title and its rendered label (None: no "|")."""
        target = title.replace(_DROPPED, "").strip()  # a template in the title was cut out
        prefix = target.split(":", 1)[0].strip().lower() if ":" in target else ""
        if not target.startswith(":"):
            if prefix in self.media_prefixes or prefix in self.category_prefixes:
                return ""
            if _INTERLANG.match(prefix) and label is None:
                return ""  # [[de:Foo]] is an interlanguage link, not rendered in the text
        if label is not None:
            return label
        return _link_text(target)

    def _tag(self, tag: Tag) -> str:
        name = str(tag.tag).strip().lower()
        if name in DROP_TAGS:
            return ""
        if name == "br":
            return " "
        inner = self.render(tag.contents.nodes) if tag.contents is not None else ""
        return f"\n\n{inner}" if name in BREAK_TAGS else inner

    @staticmethod
    def _paragraphs(text: str) -> list[str]:
        """Blank lines separate paragraphs; a single newline inside one renders as a space."""
        text = _LEFTOVER_TAG.sub("", _MAGIC_WORD.sub("", text))
        return [p for p in (_clean_line(block) for block in re.split(r"\n\s*\n", text)) if p]


def prerender(text: str, link_prefixes: frozenset[str]) -> str:
    """``text`` with what ``WikitextCleaner`` renders as nothing cut out and plain links replaced by their text.

    Cut, with everything inside them: templates and arguments, tables, links whose namespace prefix
    (lower case) is in ``link_prefixes``, and the non-prose extension tags of ``DROP_TAGS``; each
    leaves ``_DROPPED`` in its place. Plain links (``_PLAIN_LINK``) become the text they render as.
    One pass over the text with a stack of open constructs, nested as mwparserfromhell nests them: a
    closer closes the innermost open construct when it is of its kind, and is text otherwise. An
    opener that never closes is text to the parser, which then reads what follows it in another light:
    a stack cannot follow that, so everything after such an opener is left to the parser as it is.
    """
    stack: list[list[int]] = []  # [kind, start, braces still open] of the open constructs, innermost last
    cuts: list[tuple[int, int, str]] = []  # (start, end, replacement) of closed constructs; nested ones too
    closing_tags: dict[str, re.Match | None] = {}  # next closing tag of each extension tag; None: no more
    text = "\n" + text  # a line start before the first line too; cut off again at the end
    pos = 0
    while (event := _EVENT.search(text, pos)) is not None:
        kind = event.lastgroup
        # A run of braces or brackets is the whole match; a table's "{|" or "|}", or a tag's name, its group.
        start, pos = event.span(kind) if kind in ("open_table", "close_table", "tag") else event.span()
        if kind == "open_braces":
            stack.append([_BRACES, start, pos - start])
        elif kind == "close_braces":
            left = pos - start
            while left >= 2 and stack and stack[-1][0] == _BRACES:
                entry = stack[-1]
                used = 3 if min(entry[2], left) >= 3 else 2  # an argument if both sides have three braces
                entry[2] -= used
                left -= used
                cuts.append((entry[1] + entry[2], pos - left, _DROPPED))
                if entry[2] < 2:  # a single "{" left over is text
                    stack.pop()
        elif kind == "open_link":
            plain = _PLAIN_LINK.match(text, start) if pos - start == 2 else None
            # After "<" or "&", the label could make a tag or an entity of what follows the link.
            if plain is not None and text[start - 1] not in "<&":
                target, label = plain.groups()
                cuts.append((start, plain.end(), label if label is not None else _link_text(target.strip())))
                pos = plain.end()
                continue
            start = pos - 2  # "[[[": the first "[" is text
            title = _LINK_TITLE.match(text, pos)
            target = title.group().strip() if title else ""
            dropped = (":" in target and not target.startswith(":")
                       and target.split(":", 1)[0].strip().lower() in link_prefixes)
            stack.append([_DROPPED_LINK if dropped else _LINK, start, 0])
        elif kind == "close_link":
            left = pos - start
            while left >= 2 and stack and stack[-1][0] in (_LINK, _DROPPED_LINK):
                entry = stack.pop()
                left -= 2
                if entry[0] == _DROPPED_LINK:
                    # A lone "]" left at the end of the run closed an external link in the caption.
                    cuts.append((entry[1], pos if left == 1 else pos - left, _DROPPED))
        elif kind == "open_table":
            stack.append([_TABLE, start, 0])
        elif kind == "close_table":
            if stack and stack[-1][0] == _TABLE:
                cuts.append((stack.pop()[1], pos, _DROPPED))
            else:  # "|}}" in a template is a separator and the template's end: read the braces again
                pos = start + 1
        else:  # an extension tag: its content is text, up to its closing tag
            if event.group().endswith("/>"):
                continue
            name = event.group("tag").lower()
            found = closing_tags.get(name)
            if name not in closing_tags or (found is not None and found.start() < pos):
                found = closing_tags[name] = _CLOSE_TAG[name].search(text, pos)
            if found is None:  # never closed: the parser takes the opening tag as text and reads on
                continue
            if name in DROP_TAGS:
                cuts.append((event.start(), found.end(), _DROPPED))
            pos = found.end()
    if stack:
        cuts = [cut for cut in cuts if cut[1] <= stack[0][1]]
    parts, end = [], 0
    for cut_start, cut_end, replacement in sorted(cuts, key=lambda cut: (cut[0], -cut[1])):  # outer first
        if cut_start >= end:  # not inside a cut already made
            parts += (text[end:cut_start], replacement)
            end = cut_end
    parts.append(text[end:])
    return "".join(parts)[1:]


def _link_text(target: str) -> str:
    """What a link without a label shows: its target without a leading ":" and without the "#section"."""
    return target.lstrip(":").split("#", 1)[0] or target.lstrip("#")


def _clean_line(text: str) -> str:
    # Entities and '' / ''' quote marks inside constructs the parser gave up on are still raw text.
    text = html.unescape(_BOLD_ITALIC.sub("", _POSSESSIVE.sub("'", text)))
    text = _collapse_spaces(text.replace("\n", " "))
    # Removed templates/refs leave "( )" or "(; )" and spaces before punctuation behind.
    text = _EMPTY_PARENS.sub("", text)
    if _PUNCT_AFTER_SPACE.search(text):
        text = _SPACE_BEFORE_PUNCT.sub(r"\1", text)
    return _collapse_spaces(text).strip()


def _collapse_spaces(text: str) -> str:
    """Runs of spaces, tabs and no-break spaces as one space. Most lines hold single spaces only, which
    the regex would find one by one and replace by themselves."""
    if "  " in text or "\t" in text or "\u00a0" in text:
        return _SPACES.sub(" ", text)
    return text
