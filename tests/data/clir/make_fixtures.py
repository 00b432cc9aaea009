"""Build the ``data_prep align`` test fixtures from XQuAD, whose paragraphs are real Wikipedia text.

    python tests/data/clir/make_fixtures.py --xquad /work/shared/data/crosslingual/xquad --out tests/data/clir

XQuAD (deepmind/xquad@60cac411) has 48 articles of 5 paragraphs each, professionally translated, so
paragraph p of an article is parallel across languages. Only articles 0..23 are used: 24..47 are
held out for evaluation and must never appear here. Each article becomes one page per language:
paragraph 0 is the lead, every further paragraph its own ``== heading ==`` section, headed by its
first words in that language (so headings differ the way translated headings do).

Everything that exercises the aligner is hard-coded below and recorded in ``expected.json``:
localized titles, redirects, a double redirect, links missing from one side, a missing target,
dropped, inserted (non-parallel) and swapped sections. The output is byte-identical on every run
(bz2 and gzip carry no timestamps).
"""
from __future__ import annotations

import argparse
import bz2
import gzip
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

LANGS = ("en", "de", "es")
ARTICLES = range(24)  # 24..47 are the held-out evaluation articles
DATE = "20261101"
TIMESTAMP = "2026-11-01T00:00:00Z"
PAGE_ID = {"en": lambda k: 1100 + k, "de": lambda k: 2200 + 2 * k, "es": lambda k: 3300 + 3 * k}

# Localized titles (real article names); other articles keep the English title in every language.
TITLES = {
    "de": {1: "Warschau", 2: "Normannen", 5: "Lehrer", 8: "Sky UK", 11: "Dampfmaschine", 12: "Sauerstoff",
           13: "Ölkrise", 16: "Amazonas-Regenwald", 20: "Schwarzer Tod"},
    "es": {1: "Varsovia", 2: "Normandos", 5: "Docente", 11: "Máquina de vapor", 12: "Oxígeno",
           13: "Crisis del petróleo de 1973", 16: "Selva amazónica", 20: "Peste negra", 21: "Geología"},
}
# de redirect pages: title -> target. "British Sky Broadcasting" is a double redirect (not followed).
DE_REDIRECTS = {"Warszawa": "Warschau", "Normanne": "Normannen", "British Sky Broadcasting": "BSkyB",
                "BSkyB": "Sky UK"}
# en -> de links that point at a redirect instead of the article.
EN_DE_VIA_REDIRECT = {1: "Warszawa", 2: "Normanne", 8: "British Sky Broadcasting"}  # 8: only de links it
EN_DE_UNLINKED = {6}  # en file has no de link for Martin Luther: only the de file links the pair
DE_EN_UNLINKED = {5, 9}  # de file has no en link for these: only the en file links the pair
ES_NO_LANGLINK = 20  # Peste negra: nothing links to it
ES_MISSING = {21: "Geología (ciencia)"}  # en -> es link to a title that is not in the es dump
# de perturbations: article -> XQuAD paragraph left out; article -> (donor article, paragraph, position)
# of an inserted section from a different article; article -> two paragraphs whose order is swapped.
DE_DROP = {2: 3, 9: 2, 16: 1}
DE_INSERT = {2: (1, 2, 2), 13: (19, 3, 3)}
DE_SWAP = {4: (1, 3)}
# Links to languages that are not aligned (must be ignored); one title has an apostrophe.
OTHER_LANGS = {"en": [(15, "fr", "Droit de l'Union européenne"), (1, "fr", "Varsovie"), (1, "ja", "ワルシャワ"),
                      (12, "ja", "酸素")],
               "de": [(2, "fr", "Normands"), (14, "fr", "Programme Apollo")]}
# "See also" links between related articles (both directions), for the hard negatives.
RELATED = [(6, 10), (7, 18), (11, 13), (12, 21), (16, 21), (19, 4), (22, 23), (14, 12), (8, 0), (3, 11)]
SEE_ALSO = {"en": "See also", "de": "Siehe auch", "es": "Véase también"}
NAMESPACES = {"en": {6: "File", 10: "Template", 14: "Category"},
              "de": {6: "Datei", 10: "Vorlage", 14: "Kategorie"},
              "es": {6: "Archivo", 10: "Plantilla", 14: "Categoría"}}
MAIN_PAGE = {"en": "Main_Page", "de": "Wikipedia:Hauptseite", "es": "Wikipedia:Portada"}


@dataclass
class PageOut:
    page_id: int
    title: str
    sections: list[tuple[str, str]]  # (heading, paragraph); heading "" = lead
    origin: list[list[int]]  # per section: [xquad article, xquad paragraph]
    see_also: list[str] = field(default_factory=list)


def title_of(lang: str, k: int, xquad_title: str) -> str:
    return TITLES.get(lang, {}).get(k, xquad_title.replace("_", " "))


def heading(text: str) -> str:
    """The paragraph's first four words, without punctuation that wikitext headings would keep."""
    return " ".join(re.findall(r"\w[\w'’-]*", text)[:4])


def clean(text: str) -> str:
    # XQuAD lost subscripts (O\n2) and some es files start with a BOM; a paragraph is one line here.
    return re.sub(r"\s+", " ", text.replace("\ufeff", "")).strip()


def build_pages(xquad: dict[str, list[dict]]) -> dict[str, list[PageOut]]:
    pages: dict[str, list[PageOut]] = {}
    for lang in LANGS:
        pages[lang] = []
        for k in ARTICLES:
            article = xquad[lang][k]
            paragraphs = [clean(p["context"]) for p in article["paragraphs"]]
            order = list(range(len(paragraphs)))
            origin = [[k, p] for p in order]
            if lang == "de":
                if k in DE_SWAP:
                    a, b = DE_SWAP[k]
                    order[a], order[b] = order[b], order[a]
                if k in DE_DROP:
                    order.remove(DE_DROP[k])
                origin = [[k, p] for p in order]
                if k in DE_INSERT:
                    donor, p, at = DE_INSERT[k]
                    origin.insert(at, [donor, p])
            texts = [clean(xquad[lang][a]["paragraphs"][p]["context"]) for a, p in origin]
            sections = [("" if i == 0 else heading(t), t) for i, t in enumerate(texts)]
            pages[lang].append(PageOut(PAGE_ID[lang](k), title_of(lang, k, article["title"]), sections, origin))
    for lang in LANGS:
        titles = [p.title for p in pages[lang]]
        for a, b in RELATED:
            pages[lang][a].see_also.append(titles[b])
            pages[lang][b].see_also.append(titles[a])
    return pages


def link_mentions(text: str, titles: list[str], own: str) -> str:
    """Wikilink the first mention of another fixture article's title, as editors do.

    MediaWiki titles are case-insensitive in their first letter, so ``[[oxygen]]`` links "Oxygen".
    """
    for title in titles:
        if title != own:
            first = f"[{title[0].upper()}{title[0].lower()}]"
            text = re.sub(rf"(?<![\[\w]){first}{re.escape(title[1:])}\b(?!\]\])", r"[[\g<0>]]", text, count=1)
    return text


def wikitext(page: PageOut, lang: str, titles: list[str]) -> str:
    parts = []
    for head, text in page.sections:
        body = link_mentions(text, titles, page.title)
        parts.append(body if not head else f"== {head} ==\n{body}")
    if page.see_also:
        parts.append(f"== {SEE_ALSO[lang]} ==\n" + "\n".join(f"* [[{t}]]" for t in page.see_also))
    return "\n\n".join(parts) + "\n"


def sha1_base36(text: str) -> str:
    """MediaWiki's <sha1>: the SHA-1 of the text in base 36, 31 digits."""
    n, digits = int(hashlib.sha1(text.encode()).hexdigest(), 16), ""
    while n:
        n, r = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[r] + digits
    return digits.rjust(31, "0")


def page_xml(page_id: int, title: str, text: str, redirect: str | None = None) -> str:
    lines = ["  <page>", f"    <title>{escape(title)}</title>", "    <ns>0</ns>", f"    <id>{page_id}</id>"]
    if redirect:
        lines.append(f"    <redirect title={quoteattr(redirect)} />")
    lines += ["    <revision>", f"      <id>{page_id * 1000 + 7}</id>", f"      <timestamp>{TIMESTAMP}</timestamp>",
              "      <contributor>", "        <username>XQuAD fixture</username>", "        <id>1</id>",
              "      </contributor>", "      <model>wikitext</model>", "      <format>text/x-wiki</format>",
              f'      <text xml:space="preserve" bytes="{len(text.encode())}">{escape(text)}</text>',
              f"      <sha1>{sha1_base36(text)}</sha1>", "    </revision>", "  </page>"]
    return "\n".join(lines) + "\n"


def dump_xml(lang: str, pages: list[PageOut]) -> str:
    ns = NAMESPACES[lang]
    namespaces = ['      <namespace key="0" case="first-letter" />'] + [
        f'      <namespace key="{key}" case="first-letter">{name}</namespace>' for key, name in sorted(ns.items())]
    head = (f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" '
            f'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" '
            f'xsi:schemaLocation="http://www.mediawiki.org/xml/export-0.10/ '
            f'http://www.mediawiki.org/xml/export-0.10.xsd" version="0.10" xml:lang="{lang}">\n'
            f"  <siteinfo>\n    <sitename>Wikipedia</sitename>\n    <dbname>{lang}wiki</dbname>\n"
            f"    <base>https://{lang}.wikipedia.org/wiki/{MAIN_PAGE[lang]}</base>\n"
            f"    <generator>MediaWiki 1.46.0-wmf.1</generator>\n    <case>first-letter</case>\n"
            f"    <namespaces>\n" + "\n".join(namespaces) + "\n    </namespaces>\n  </siteinfo>\n")
    titles = [p.title for p in pages]
    body = "".join(page_xml(p.page_id, p.title, wikitext(p, lang, titles)) for p in pages)
    if lang == "de":  # redirect pages, ids after the articles'
        body += "".join(page_xml(2900 + n, src, f"#WEITERLEITUNG [[{dst}]]", redirect=dst)
                        for n, (src, dst) in enumerate(DE_REDIRECTS.items()))
    return head + body + "</mediawiki>\n"


def sql_string(s: str) -> str:
    """A MySQL string literal as mysqldump writes it."""
    for raw, esc in (("\\", "\\\\"), ("'", "\\'"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r"), ("\0", "\\0")):
        s = s.replace(raw, esc)
    return f"'{s}'"


def langlinks_sql(lang: str, rows: list[tuple[int, str, str]], per_line: int = 7) -> str:
    """``<lang>wiki-<date>-langlinks.sql`` in mysqldump's layout: header, CREATE TABLE, multi-row INSERTs."""
    rows = sorted(rows)
    inserts = []
    for start in range(0, len(rows), per_line):
        values = ",".join(f"({i},{sql_string(l)},{sql_string(t)})" for i, l, t in rows[start:start + per_line])
        inserts.append(f"INSERT INTO `langlinks` VALUES {values};")
    return "\n".join([
        "-- MySQL dump 10.19  Distrib 10.11.8-MariaDB, for debian-linux-gnu (x86_64)",
        "--",
        f"-- Host: db1234.eqiad.wmnet    Database: {lang}wiki",
        "-- ------------------------------------------------------",
        "-- Server version\t10.11.8-MariaDB-log",
        "",
        "/*!40101 SET @OLD_CHARACTER_SET_CLIENT=@@CHARACTER_SET_CLIENT */;",
        "/*!40101 SET NAMES utf8mb4 */;",
        "/*!40103 SET TIME_ZONE='+00:00' */;",
        "",
        "--",
        "-- Table structure for table `langlinks`",
        "--",
        "",
        "DROP TABLE IF EXISTS `langlinks`;",
        "/*!40101 SET @saved_cs_client     = @@character_set_client */;",
        "/*!40101 SET character_set_client = utf8 */;",
        "CREATE TABLE `langlinks` (",
        "  `ll_from` int(8) unsigned NOT NULL DEFAULT 0,",
        "  `ll_lang` varbinary(35) NOT NULL DEFAULT '',",
        "  `ll_title` varbinary(255) NOT NULL DEFAULT '',",
        "  PRIMARY KEY (`ll_from`,`ll_lang`),",
        "  KEY `ll_lang` (`ll_lang`,`ll_title`)",
        ") ENGINE=InnoDB DEFAULT CHARSET=binary ROW_FORMAT=COMPRESSED;",
        "/*!40101 SET character_set_client = @saved_cs_client */;",
        "",
        "--",
        "-- Dumping data for table `langlinks`",
        "--",
        "",
        "LOCK TABLES `langlinks` WRITE;",
        "/*!40000 ALTER TABLE `langlinks` DISABLE KEYS */;",
        *inserts,
        "/*!40000 ALTER TABLE `langlinks` ENABLE KEYS */;",
        "UNLOCK TABLES;",
        "",
        f"-- Dump completed on {TIMESTAMP[:10]}  4:12:31",
        "",
    ])


def langlink_rows(pages: dict[str, list[PageOut]]) -> dict[str, list[tuple[int, str, str]]]:
    en, de, es = (pages[lang] for lang in LANGS)
    rows: dict[str, list[tuple[int, str, str]]] = {"en": [], "de": []}
    for k in ARTICLES:
        if k not in EN_DE_UNLINKED:
            rows["en"].append((en[k].page_id, "de", EN_DE_VIA_REDIRECT.get(k, de[k].title)))
        if k != ES_NO_LANGLINK:
            rows["en"].append((en[k].page_id, "es", ES_MISSING.get(k, es[k].title)))
            rows["de"].append((de[k].page_id, "es", es[k].title))
        if k not in DE_EN_UNLINKED:
            rows["de"].append((de[k].page_id, "en", en[k].title))
    for lang, links in OTHER_LANGS.items():
        rows[lang] += [(pages[lang][k].page_id, other, title) for k, other, title in links]
    return rows


def linked(pair: str, k: int) -> bool:
    """Whether the article pair is linked in at least one direction, through at most one redirect."""
    if pair == "en-de":
        en_side = k not in EN_DE_UNLINKED and EN_DE_VIA_REDIRECT.get(k) != "British Sky Broadcasting"
        return en_side or k not in DE_EN_UNLINKED
    if pair == "en-es":
        return k != ES_NO_LANGLINK and k not in ES_MISSING
    return k != ES_NO_LANGLINK  # de-es


def expected(pages: dict[str, list[PageOut]]) -> dict:
    """Ground truth per pair: parallel section pairs, pairs that must not be aligned, unlinked articles."""
    out: dict = {"articles": list(ARTICLES), "pairs": {}}
    for pair in ("en-de", "en-es", "de-es"):
        a_lang, b_lang = pair.split("-")
        parallel, must_not, unlinked = [], [], []
        for k in ARTICLES:
            a, b = pages[a_lang][k], pages[b_lang][k]
            if not linked(pair, k):
                unlinked.append([a.page_id, b.page_id])
                continue
            for i, oa in enumerate(a.origin):
                for j, ob in enumerate(b.origin):
                    if oa == ob:
                        parallel.append([a.page_id, i, b.page_id, j])
                    # A section without a partner (dropped on the other side, or inserted from another
                    # article) must stay unaligned; where sections moved, the positional guess (i == j) is wrong.
                    elif oa not in b.origin or ob not in a.origin or i == j:
                        must_not.append([a.page_id, i, b.page_id, j])
        out["pairs"][pair] = {"parallel": parallel, "must_not": must_not, "unlinked": unlinked}
    out["pages"] = {lang: [{"page_id": p.page_id, "title": p.title, "origin": p.origin} for p in pages[lang]]
                    for lang in LANGS}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--xquad", required=True, help="folder with xquad.{en,de,es}.json")
    parser.add_argument("--out", required=True, help="fixture folder (tests/data/clir)")
    args = parser.parse_args()
    xquad = {lang: json.loads((Path(args.xquad) / f"xquad.{lang}.json").read_text(encoding="utf-8"))["data"]
             for lang in LANGS}
    assert all(len(xquad[lang]) == 48 for lang in LANGS)
    pages = build_pages(xquad)
    out = Path(args.out)
    for lang in LANGS:
        xml = dump_xml(lang, pages[lang]).encode()
        (out / f"{lang}wiki-{DATE}-pages-articles.xml.bz2").write_bytes(bz2.compress(xml, 9))
    for lang, rows in langlink_rows(pages).items():
        sql = langlinks_sql(lang, rows).encode()
        (out / f"{lang}wiki-{DATE}-langlinks.sql.gz").write_bytes(gzip.compress(sql, 9, mtime=0))
    (out / "expected.json").write_text(json.dumps(expected(pages), ensure_ascii=False, indent=1) + "\n",
                                       encoding="utf-8")


if __name__ == "__main__":
    main()
