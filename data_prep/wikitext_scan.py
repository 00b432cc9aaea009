"""Rendering a prerendered page without mwparserfromhell, when a linear scan renders it exactly as the tree does.

After ``prerender`` most pages hold prose with little markup left: headings, list markers, bold and
italic quote runs, formatting tags (``<small>``, ``<span>``, ``<sup>``, ``<br>``), HTML entities and
the empty comments that mark a cut. Building mwparserfromhell's node tree for that is still most of a
page's cost, so ``plain_blocks`` renders such a page in one regex pass: the same blocks (level, title,
body) that ``WikitextCleaner`` renders from the tree's top-level nodes, character for character.

Where the tree could read the text in another way than this scan, the scan gives up and the page
goes to the parser whole: what is left of templates and tables that never closed (``{{``, ``{|``),
links with brackets or URLs inside, tags other than the formatting and block ones, quote runs of 4 or
6+ quotes, and formatting that is not closed where it must be: quotes or tags still open at a
heading, at the end of a tag, link label or the page, or closed in another order than opened (the
parser then leaves some runs as text, or splits ``'''`` into ``'`` and ``''``). Free URLs and ``;``
definition lines change nothing beyond their line: a page needs the parser for them only where they
are in a section that is kept (most are in "External links"). ``tests/test_wikitext.py`` compares the
two on the bundled dump (93 of its 106 articles are scanned) and on generated pages.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from html.entities import name2codepoint

from mwparserfromhell.definitions import URI_SCHEMES

# Tags whose content is not prose: dropped with everything inside.
DROP_TAGS = frozenset({"ref", "references", "table", "gallery", "math", "chem", "ce", "score", "timeline",
                        "imagemap", "graph", "mapframe", "maplink", "syntaxhighlight", "source", "pre", "code",
                        "templatedata", "templatestyles", "style", "script", "noinclude", "includeonly"})
# Tags that start a new paragraph: list items / definition lists and block elements.
BREAK_TAGS = frozenset({"li", "dt", "dd", "p", "div", "blockquote", "center", "tr", "hr"})
# The tags of BREAK_TAGS that must be closed: their content follows the paragraph break they start.
_BLOCK_TAGS = frozenset({"p", "div", "blockquote", "center"})
# Tags that render as their content, nothing more.
FORMATTING_TAGS = frozenset({"abbr", "b", "bdi", "bdo", "big", "cite", "del", "dfn", "em", "font", "i", "ins",
                             "kbd", "mark", "q", "s", "samp", "small", "span", "strike", "strong", "sub", "sup",
                             "time", "tt", "u", "var"})
_SLASH_SCHEMES = tuple(s for s, slashes in URI_SCHEMES.items() if slashes)
_BARE_SCHEMES = tuple(s for s, slashes in URI_SCHEMES.items() if not slashes)
_ALL_SCHEMES = tuple(s + ":" for s in URI_SCHEMES)
# Left to the parser wherever they occur: "[[[" and "]]]", and what is left of templates and tables that
# never closed.
_PAGE_NEEDS_PARSER = ("[[[", "]]]", "{{", "{|")
# Every alternative starts with a literal character, so that the regex engine skips from one of those
# characters to the next in C (a pattern whose alternatives start otherwise, e.g. with "^" or a group,
# is tried at every position: 5x slower on the bundled dump). Line starts are "\n" (the text gets one
# in front), and the groups that tell the tokens apart come after each token's first character.
_TOKEN = re.compile(
    r"\n(?:(?P<heading>=[^\n]*)|(?P<list_marker>[*#:]+)|(?P<rule>-{4,}))"
    r"|'(?P<quotes>'+)"
    r"|<(?P<comment>!---->)"
    r"|<(?P<tag>(?P<closing>/?)(?P<name>[A-Za-z][\w:-]*)(?P<attributes>\s[^<>]*?)?(?P<self_closing>/?)>)"
    r"|<(?P<unknown_tag>[/!A-Za-z])"
    r"|&(?P<entity>(?:#(?P<decimal>[0-9]+)|#[xX](?P<hexadecimal>[0-9a-fA-F]+)|(?P<named>[A-Za-z][A-Za-z0-9]*));)"
    # A link's title and label and an external link's label hold no brackets (nor a newline): their
    # content is then read as it is anywhere else. A label is the text after the first "|" (link) or
    # after the URL's first space (external link).
    r"|\[(?P<link>\[(?P<link_title>[^\n\[\]{}<>|]+)(?:\|(?P<link_label>[^\n\[\]]*))?\]\])"
    r"|\[(?P<external>(?:(?i:%s):)?//[^\s\[\]<>\"'{}|]*(?: (?P<external_label>[^\n\[\]]*))?\])"
    r"|\[(?P<unknown_link>\[|//|(?i:%s):)" % ("|".join(_SLASH_SCHEMES), "|".join(URI_SCHEMES)))
_MARKUP = re.compile(r"['<\[{&]")
_DROPPED_CONTENT = re.compile(r"[^<>'\[\]{}]*</([A-Za-z]+)\s*>")
LinkRenderer = Callable[[str, "str | None"], str]
_BREAK = "\n\n"  # what a list item, definition or horizontal rule renders as (WikitextCleaner._tag)


def block_needs_parser(text: str) -> bool:
    """Whether a block's raw ``text`` holds what the scan reads otherwise than the parser: definition
    lines (";"), and URLs outside brackets (the parser links them, and where such a link ends is its
    call) or with a scheme that takes no "//" (mailto:, news:, …). URLs are found by the scheme before
    each "://" and ":" (letters of any case; a scheme that merely ends a longer word counts too, to be safe)."""
    if "\n;" in text or text.startswith(";"):
        return True
    position = text.find(":")
    while position != -1:
        before = text[max(0, position - 8):position].lower()
        if before.endswith(_BARE_SCHEMES):
            return True
        if text.startswith("//", position + 1):
            scheme = next((s for s in _SLASH_SCHEMES if before.endswith(s)), None)
            if scheme is not None and not before.endswith("[" + scheme):
                return True
        position = text.find(":", position + 1)
    return False


_QUOTE_KINDS = {2: "i", 3: "b"}  # italic and bold runs; 5 opens or closes both


class _GiveUp(Exception):
    """The scan cannot tell how the parser reads this text."""


class _Formatting:
    """The formatting open at a point of the text: tags, and in each tag (and outside any) the open quote
    runs, innermost last ("i" italic, "b" bold, "ib" both from one run of five)."""

    def __init__(self) -> None:
        self.tags: list[tuple[str, list[str]]] = [("", [])]

    def closed(self) -> bool:
        return len(self.tags) == 1 and not self.tags[0][1]

    def quotes(self, run: int) -> None:
        open_ = self.tags[-1][1]
        if run == 5:
            if open_ and open_[-1] == "ib":
                open_.pop()
            elif open_[-2:] in (["i", "b"], ["b", "i"]):
                del open_[-2:]
            elif not open_:
                open_.append("ib")
            else:
                raise _GiveUp
            return
        kind = _QUOTE_KINDS.get(run)
        if kind is None:
            raise _GiveUp  # 4 or 6+ quotes: the parser keeps some of them as apostrophes
        if open_ and open_[-1] == kind:
            open_.pop()
        elif any(kind in entry for entry in open_):
            # Closes over the other kind, or half of a run of five: the parser reinterprets the runs.
            raise _GiveUp
        else:
            open_.append(kind)

    def tag(self, name: str, closing: bool) -> bool:
        """Opens or closes a tag; False for a closing tag that nothing opened, which is text to the parser."""
        if not closing:
            self.tags.append((name, []))
        elif self.tags[-1][0] == name and not self.tags[-1][1]:
            self.tags.pop()
        elif len(self.tags) > 1:
            raise _GiveUp  # closes over quotes or another tag still open, or closes none inside a tag
        else:
            return False
        return True


def _render(text: str, formatting: _Formatting, link: LinkRenderer, blocks: list | None = None) -> str:
    """``text`` rendered. With ``blocks`` (a page's body), headings split it: each heading ends the last
    block's body (stored there) and starts a new block; the text after the last heading is returned."""
    out: list[str] = []
    last = 0
    while (token := _TOKEN.search(text, last)) is not None:
        out.append(text[last:token.start()])
        last = token.end()
        kind = token.lastgroup  # the outermost group: a token's inner groups close before it
        if kind == "quotes":
            formatting.quotes(len(token.group()))
        elif kind == "tag":
            dropped_end = _dropped_tag_end(text, token)
            if dropped_end is not None:
                last = dropped_end  # the tag and everything inside it render as nothing
            else:
                out.append(_tag(token, formatting))
        elif kind == "entity":
            out.append(_entity(token))
        elif kind == "link":
            if "//" in token.group("link_title") or token.group("link_title").lower().startswith(_ALL_SCHEMES):
                raise _GiveUp  # "[[http://…]]" is "[", an external link and "]" to the parser
            label = token.group("link_label")
            out.append(link(token.group("link_title"), None if label is None else _label(label, link)))
        elif kind == "external":
            label = token.group("external_label")
            out.append("" if label is None else _label(label, link))
        elif kind in ("unknown_tag", "unknown_link"):
            raise _GiveUp
        elif kind == "heading":
            # A heading runs from the line's first "=" run to its last one; the rest of the line is text.
            # A line with one "=" run only is text.
            line = token.group("heading")
            left = len(line) - len(line.lstrip("="))
            end = line.rfind("=") + 1
            right_start = len(line[:end].rstrip("="))
            out.append("\n")
            last = token.start("heading")  # the line itself is read on from its start
            if right_start < left:  # one "=" run only: a line of text, unless the parser reads a heading
                if _MARKUP.search(line):  # on past the line, inside formatting that opens in it
                    raise _GiveUp
                continue
            if not formatting.closed():
                raise _GiveUp  # inside a tag or quote run the parser does not take the line for a heading
            level = min(left, end - right_start, 6)  # surplus "=" on either side belong to the title
            title = _label(line[level:end - level], link)
            blocks[-1][2:4] = "".join(out), text[blocks[-1][3]:token.start()]
            blocks.append([level, title, "", last + end])
            out = []
            last += end  # the rest of the heading's line is text of the new block
        elif kind in ("list_marker", "rule"):
            out.append("\n" + _BREAK)
        # a comment (the mark of a cut) renders as nothing
    out.append(text[last:])
    return "".join(out)


def _label(text: str, link: LinkRenderer) -> str:
    """A heading's title or a link's label: rendered on its own, so all its formatting must close in it."""
    formatting = _Formatting()
    rendered = _render(text, formatting, link)
    if not formatting.closed():
        raise _GiveUp
    return rendered


def _tag(token: re.Match, formatting: _Formatting) -> str:
    """What a tag renders as (``WikitextCleaner._tag``). Tags the parser may close elsewhere than where
    they appear to close are given up on: ``li``, ``dt``, ``dd``, ``tr`` (closing tags optional) and
    tags the scan does not know."""
    name = token.group("name").lower()
    attributes = token.group("attributes") or ""
    if "\n" in attributes or attributes.count('"') % 2 or attributes.count("'") % 2:
        raise _GiveUp  # the parser may end such a tag elsewhere, or not take it for one
    if name in ("br", "wbr"):
        if token.group("closing") and not formatting.closed():
            raise _GiveUp  # "</br>" inside a tag: the parser does not close that tag then
        return " " if name == "br" else ""
    if name not in FORMATTING_TAGS and name not in _BLOCK_TAGS:
        raise _GiveUp
    if token.group("self_closing"):
        return _BREAK if name in _BLOCK_TAGS else ""
    closing = bool(token.group("closing"))
    if not formatting.tag(name, closing):
        return token.group()  # text, as to the parser (and stripped as a leftover tag where the parser's is)
    return _BREAK if name in _BLOCK_TAGS and not closing else ""


def _dropped_tag_end(text: str, token: re.Match) -> int | None:
    """Where a tag of ``DROP_TAGS`` opened by ``token`` ends (after its closing tag); None: not a dropped
    tag. Its content must be plain text (no tag, quote run or bracket): the parser may end a tag elsewhere
    or not take it for one when its content holds markup."""
    name = token.group("name").lower()
    if name not in DROP_TAGS or token.group("closing"):
        return None
    if token.group("self_closing"):
        return token.end()
    closing = _DROPPED_CONTENT.match(text, token.end())
    if closing is None or closing.group(1).lower() != name:
        raise _GiveUp
    return closing.end()


def _entity(token: re.Match) -> str:
    """An entity as the parser decodes it (``HTMLEntity.normalize``), or as text where it is none to the parser."""
    if token.group("named") is not None:
        code = name2codepoint.get(token.group("named"))
    else:
        digits = token.group("decimal")
        code = int(digits) if digits is not None else int(token.group("hexadecimal"), 16)
        if len(digits or token.group("hexadecimal")) > 7:
            raise _GiveUp
        code = code if 0 < code <= 0x10FFFF else None
    return chr(code) if code is not None else token.group()


def plain_blocks(text: str, link: LinkRenderer) -> list[tuple[int, str, str, bool]] | None:
    """(heading level, title, body, needs the parser) for the lead (level 0, title "") and each section,
    rendered as the tree renders them; None when the page needs the parser. A block that "needs the
    parser" holds what only the parser reads right (``block_needs_parser``) but nothing that changes how the
    rest of the page is read: the page needs the parser only if that block is kept (not a tail section,
    whose text is dropped anyway: that is where most URLs are). ``link(title, rendered label or None)``
    renders a wikilink, as for the tree."""
    if any(marker in text for marker in _PAGE_NEEDS_PARSER):
        return None
    text = "\n" + text
    # level, title, body, raw start (then raw text); the lead's body keeps the "\n" put in front (it
    # changes no paragraph)
    blocks: list = [[0, "", "", 0]]
    formatting = _Formatting()
    try:
        rest = _render(text, formatting, link, blocks)
    except _GiveUp:
        return None
    if not formatting.closed():
        return None
    blocks[-1][2:4] = rest, text[blocks[-1][3]:]
    return [(level, title, body, block_needs_parser(raw)) for level, title, body, raw in blocks]
