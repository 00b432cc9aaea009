"""data_prep.wikitext's prerender pass: it must not change what the reader sees, only how fast it is parsed."""
from __future__ import annotations

from pathlib import Path

import pytest

from data_prep import wikitext
from data_prep.wikitext import WikitextCleaner, prerender
from data_prep.wikitext_scan import plain_blocks

SAMPLE = (Path(__file__).resolve().parents[1] / "data_prep" / "samples"
          / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
LINKS = frozenset({"file", "image", "media", "category"})
TRICKY = {
    "quote runs around templates": "A {{lang|fr|''x''}} b. ''{{lang|fr|y}}'' c. '''{{z}}''' d.",
    "nested templates": "{{Infobox|a={{nested|{{deep}}}}|b=[[x|y]]}}Lead text here.",
    "templates and a table in a table": 'Text.\n{| class="wikitable"\n|-\n| {{flag|FR}} || cell\n|-\n'
                                        "| {{a|\n{| \n| inner\n|}\n}}\n|}\nAfter the table.",
    "arguments": "Before {{{param|default {{x}}}}} after {{{{{y}}}}} end.",
    "file caption with a link, a template and an external link":
        "See [[File:A.jpg|thumb|A [[b|c]] {{d}} caption [http://e.org f]]] here. [[Category:X]] [[:Category:Y]]",
    "nowiki": "x <nowiki>{{not a template}} [[nor a link]]</nowiki> y",
    "text-only tags": "<pre>{{</pre> z {{t}} w <math>}}</math> v <syntaxhighlight lang=python>{{ [[</syntaxhighlight> u",
    "comment with brackets": "a <!-- {{ [[ --> b {{t}} c",
    "'|}' closing a template": "{{a|b\n|}}\nc",
    "unicode": "Ünïcödé {{ä|ö}} [[Ärger|Ä]] text.",
    "line starts after a template": "{{x}}* not a list\n{{y}}== not a heading ==\n",
    "unclosed template": "{{a}} Unclosed {{template at the end [[link]] and {{more}}",
    "unclosed table": "Text {{a}}.\n{| class=x\n| cell {{b}}",
    "plain links": "x [[Foo#Bar]] y [[Foo_bar|baz qux]] z [[ Foo ]] [[#Sec]] [[a]]'s <[[b]]> &[[amp]];",
    "template in a tag's attribute": '<span style="{{x}}">styled</span> text',
    "stray brackets after a file link": "[[File:A.jpg|thumb|caption]]]] tail",
}


@pytest.mark.parametrize("text", TRICKY.values(), ids=TRICKY.keys())
def test_prerender_renders_like_the_tree_alone(text, monkeypatch):
    expected = WikitextCleaner().sections(text)
    monkeypatch.setattr(wikitext, "prerender", lambda text, link_prefixes: text)
    assert WikitextCleaner().sections(text) == expected


def test_prerender_cuts():
    cut = wikitext._DROPPED
    assert prerender("a {{b|{{c}}}} {{{d}}} e", LINKS) == f"a {cut} {cut} e"
    # A "|}" inside a template does not close the table around it.
    assert prerender("x\n{|\n| {{a|\n|}}\n|}\ny", LINKS) == f"x\n{cut}\ny"
    assert prerender("[[File:a.jpg|A [[b]] {{c}} [http://d e]]] f [[category:G]]", LINKS) == f"{cut} f {cut}"
    # Text-only tags: their content is never read for brackets; non-prose ones are cut.
    assert prerender("<nowiki>{{a}}</nowiki> <pre>}}</pre>{{b}}", LINKS) == f"<nowiki>{{{{a}}}}</nowiki> {cut}{cut}"
    assert prerender("[[Foo#Bar]], [[a b|c d]], [[:Category:X]], [[Ä|ö]]", LINKS) == "Foo, c d, [[:Category:X]], ö"


def test_prerender_leaves_what_follows_an_unclosed_opener():
    cut = wikitext._DROPPED
    assert prerender("{{a}} x {{b [[c]] {{d}}", LINKS) == f"{cut} x {{{{b [[c]] {{{{d}}}}"
    assert prerender("{{a}} x [[b {{c}}", LINKS) == f"{cut} x [[b {{{{c}}}}"
    assert prerender("{{a}} <pre>{{b}} x", LINKS) == f"{cut} <pre>{cut} x"  # an unclosed <pre> is text


def test_template_in_link_title_renders_as_nothing():
    # The tree alone shows "Foo{{x}}": the cut template leaves the title's text.
    sections = WikitextCleaner().sections("== Head {{x}} ==\nText [[Foo{{x}}]] and [[Foo{{x}}|label]].")
    assert [(s.heading, s.paragraphs) for s in sections] == [("Head", ["Text Foo and label."])]


# --- wikitext_scan: pages rendered without the parser must come out as the parser's tree renders them ---

def _scan_and_tree(cleaner: WikitextCleaner, text: str):
    """(the scan's sections or None where it leaves the page to the parser, the tree's sections) of a prerendered text."""
    blocks = plain_blocks(text, cleaner.link)
    scanned = cleaner._sections(blocks) if blocks is not None else None
    return scanned, cleaner._sections(cleaner._tree_blocks(text))


def test_scan_renders_the_bundled_dump_like_the_tree():
    from data_prep.dumps import DumpReader, skip_reason

    cleaner = WikitextCleaner()
    pages = [page for page in DumpReader(str(SAMPLE)).pages() if skip_reason(page) is None]
    scanned = 0
    for page in pages:
        text = prerender(wikitext._PRE_CUT.sub("", page.text), cleaner._dropped_links)
        by_scan, by_tree = _scan_and_tree(cleaner, text)
        if by_scan is not None:
            scanned += 1
            assert by_scan == by_tree, page.title
    assert scanned >= 0.8 * len(pages)  # 93 of 106 when written: the scan is what makes data_prep fast


# Pieces of wikitext, joined at random into pages: markup the scan renders, markup it must leave to the
# parser, and the edge cases where the two could part (quote runs of every length, tags closed across
# others, headings with surplus "=", text after a heading, stray closing tags, entities the parser rejects).
PIECES = ["word", "Other words.", " ", "\n", "\n\n", "''", "'''", "'''''", "''''", "'", "'s", "l'", "<b>", "</b>", "<I>",
          "</i>", '<span style="x">', "</span>", "<small>", "</small>", "<sup>1</sup>", "<br>", "<br />", "</br>", "</br >",
          '<br clear="all">', "<wbr>", "<b/>", "<div>", "</div>", "<div\nx>", "<blockquote>", "</blockquote>", "<p>", "</p>",
          "<p/>", "<center>", "</center>", "<span>\n", '<span a="b>c">', "<code>c ''x</code>", "<code>c</code>",
          "<CODE>x</code>", "<code>x", "<table>x</table>", "<references/>", "<li>", "<nowiki>x</nowiki>", "&amp;",
          "&amp;lt;", "&nbsp;", "&foo;", "&#65;", "&#0;", "&#x41;", "&#00065;", "&#1114112;", "&#x110000;", "&#12345678;",
          "&hellip;", "&apos;", "[[a]]", "[[a|b]]", "[[a|b]]s", "[[a|''b'']]", "[[a|''b]]", "[[de:Foo]]", "[[:Category:X]]",
          "[[wikt:x|y]]", "[[a|b|c]]", "[[a|]]", "[[//a.org c]]", "[[http://x.org/y]]", "[http://a.org b]", "[http://a.org]",
          "[//a.org c]", "[//a.org]", "[HTTP://a.org d]", "[http://a.org ''e'']", "[http://a.org ''f]", "[http://a.org/x\tb]",
          "[mailto:a@b.c x]", "http://x.org/y", "mailto:a@b", "Hotel:", "news:", "\n== H ==\n", "\n=== H2 ===\n",
          "\n==References==\n", "\n== ''I'' ==\n", "\n=== x ==\n", "\n====\n", "\n== a == \n", "\n==a== b\n", "\n=a=b",
          "\n= =\n", "\n======= a =======\n", "\n* ", "\n# ", "\n: ", "\n:: ", "\n*# ", "\n; ", "\n----\n", "\n**", "{{", "}}",
          "[[", "]]", "[", "]", "<!---->", "<!---->\n", "<", ">", " < ", "<3", "|", "=", "__TOC__", "(", ")", ",", ".", "é", "日本"]
# What makes the scan give up on the whole page, left out of the second set of pages so that most of them are scanned.
GIVE_UP = {"{{", "[[", "]]", "\n; ", "http://x.org/y", "mailto:a@b", "Hotel:", "news:", "<li>", "<nowiki>x</nowiki>",
           "''''", "[[a|''b]]", "[http://a.org ''f]"}


@pytest.mark.parametrize("pieces, least_scanned", [(PIECES, 300), ([p for p in PIECES if p not in GIVE_UP], 500)],
                         ids=["all pieces", "scannable"])
def test_scan_renders_generated_pages_like_the_tree(pieces, least_scanned):
    import random

    cleaner, rng = WikitextCleaner(), random.Random(19)
    scanned = 0
    for _ in range(4000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        by_scan, by_tree = _scan_and_tree(cleaner, text)
        if by_scan is not None:
            scanned += 1
            assert by_scan == by_tree, repr(text)
    assert scanned >= least_scanned  # 365 and 628 of the 4000 when written


@pytest.mark.parametrize("text, expected", [
    ("== a == b\nc", [("", []), ("a", ["b c"])]),  # a heading ends at its last "=" run; the rest of the line is text
    ("=== a ==\nb", [("= a", ["b"])]),  # surplus "=" belong to the title
    ("====\nb", [("", ["==== b"])]),  # one "=" run: text
    ("a <p/>b</p> ''c'' '''d'''s", [("", ["a", "b c ds"])]),  # a stray closing tag is text, stripped as the tree's is
    ("x &amp;lt; &apos; [[wikt:a|b]] [http://e.org f] [[de:Foo]] [[:Category:G]]", [("", ["x < ' b f Category:G"])]),
], ids=["text after a heading", "surplus =", "one = run", "block tags", "entities and links"])
def test_scan_cases(text, expected):
    cleaner = WikitextCleaner()
    by_scan, by_tree = _scan_and_tree(cleaner, text)
    assert [(s.heading, s.paragraphs) for s in by_scan] == [(h, p) for h, p in expected if p] == \
           [(s.heading, s.paragraphs) for s in by_tree]


@pytest.mark.parametrize("text", [
    "''a'''s b''",  # a bold run inside italics that never closes: the parser keeps it as text
    "'''a ''b''' c''",  # closed in another order than opened
    "a ''''b'''' c",  # four quotes: an apostrophe and bold
    "''a\n== h ==\nb''",  # quotes open across a heading: no heading to the parser
    "see http://free.url here",  # where a free URL ends is the parser's call
    "[[http://x.org]]", "<nowiki>''a''</nowiki>", "<li>a", "{{unclosed", "; term : definition",
])
def test_scan_leaves_to_the_parser(text):
    assert _scan_and_tree(WikitextCleaner(), text)[0] is None


def test_scan_leaves_only_kept_sections_to_the_parser():
    """A URL or definition line in a tail section (dropped anyway) does not send the page to the parser."""
    cleaner = WikitextCleaner()
    text = "Lead ''text''.\n== External links ==\n* [http://a.org A] http://b.org\n;Official"
    by_scan, by_tree = _scan_and_tree(cleaner, text)
    assert by_scan == by_tree == [wikitext.Section("", ["Lead text."])]
    assert _scan_and_tree(cleaner, text.replace("External links", "History"))[0] is None
