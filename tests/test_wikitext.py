"""data_prep.wikitext's prerender pass: it must not change what the reader sees, only how fast it is parsed."""
from __future__ import annotations

import pytest

from data_prep import wikitext
from data_prep.wikitext import WikitextCleaner, prerender

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
