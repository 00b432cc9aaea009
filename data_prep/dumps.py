"""Reading MediaWiki XML dumps, page by page, for ``data_prep wiki`` and ``data_prep align``.

``DumpReader`` decompresses and parses incrementally (``XMLPullParser`` fed 64 KiB chunks), so a
multi-GB dump never sits in memory, and it knows at every moment how many *input* bytes it has
consumed: that is the offset reported when a dump turns out to be truncated or corrupt.

Memory stays bounded on a hostile dump too. The bz2 data is decompressed a bounded piece at a time, a bz2
"bomb" included (``bz2_streams.inflate``). A page's wikitext may take at most
``MAX_PAGE_BYTES``, MediaWiki's own limit on an article; a longer one is skipped (``Page.too_long``). Its
text is never held whole: where ``MAX_UNMARKED_BYTES`` reach the parser without an element starting or ending,
the rest of the page is skipped unparsed, and the pages after it are parsed afresh.

A Wikimedia *multistream* dump with its index is read by block instead: ``bz2_streams`` finds each bz2 stream
of 100 pages by the index and decompresses it by one ranged read, local or in object storage, and
``BlockReader`` parses its pages with the same ``DumpReader`` code.
"""
from __future__ import annotations

import bz2
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Iterator
from urllib.parse import urlparse
from xml.parsers import expat

from clsys import storage
from clsys.storage import StorageError
from data_prep.bz2_streams import CHUNK_BYTES, Block, DumpError, TruncatedDump, bz2_stream, inflate
from data_prep.wikitext import CATEGORY_PREFIXES, MEDIA_PREFIXES

# MediaWiki's limit on an article's wikitext ($wgMaxArticleSize, 2048 KiB by default), in bytes of UTF-8: no wiki
# keeps a longer revision, so a longer text is not an article's.
MAX_PAGE_BYTES = 2048 * 1024
# The most XML bytes the parser is given without an element starting or ending: a text at MAX_PAGE_BYTES with
# every byte escaped (MediaWiki writes '"' as "&quot;", 6 bytes). More is a page too long, skipped unparsed.
MAX_UNMARKED_BYTES = 6 * MAX_PAGE_BYTES
_PAGE_END = b"</page>"

# Wikimedia project suffixes of a dbname ("enwiki", "dewiktionary", "zh_yuewiki") → language prefix.
_DBNAME_SUFFIXES = ("wiktionary", "wikibooks", "wikinews", "wikiquote", "wikisource", "wikiversity",
                    "wikivoyage", "wiki")
# Wikimedia's dump file names start with the dbname: "dewiki-20240601-pages-articles.xml.bz2".
_DUMP_FILE_DBNAME = re.compile(r"([a-z][a-z_]*)-")
# Hosts whose first label is a language: "fr.wikipedia.org", "de.wiktionary.org". Other wikis' hosts
# ("muppet.fandom.com", "wiki.example.com") say nothing about the language.
_WIKIMEDIA_HOST = re.compile(r"([a-z][a-z-]*)\.(?:wikipedia|%s)\.org" % "|".join(_DBNAME_SUFFIXES[:-1]))


@dataclass
class SiteInfo:
    dbname: str | None = None
    base: str | None = None
    media_prefixes: set[str] = field(default_factory=lambda: set(MEDIA_PREFIXES))
    category_prefixes: set[str] = field(default_factory=lambda: set(CATEGORY_PREFIXES))

    @property
    def lang(self) -> str | None:
        """Language code from ``<dbname>`` (``enwiki`` → ``en``), else from a Wikimedia ``<base>`` host
        (``https://fr.wikipedia.org/…`` → ``fr``); None when neither tells."""
        lang = dbname_lang(self.dbname or "")
        if lang is None and (host := _WIKIMEDIA_HOST.fullmatch(urlparse(self.base or "").hostname or "")):
            lang = host.group(1)
        return lang


def dbname_lang(dbname: str) -> str | None:
    """``enwiki`` → ``en``, ``zh_yuewiki`` → ``zh-yue``, ``dewiktionary`` → ``de``; None for other names."""
    for suffix in _DBNAME_SUFFIXES:
        if dbname.endswith(suffix) and len(dbname) > len(suffix):
            return dbname[: -len(suffix)].replace("_", "-")
    return None


@dataclass
class Page:
    page_id: int
    title: str
    ns: int
    text: str
    redirect: bool
    redirect_target: str | None = None  # the <redirect title="..."/> of a redirect page
    too_long: bool = False  # its text is longer than MAX_PAGE_BYTES: not kept (``text`` is empty)


def _local(tag: str) -> str:
    """Tag name without the ``{namespace}``, so every export-0.x schema version matches."""
    return tag.rsplit("}", 1)[-1]


def _child_text(elem: ET.Element, name: str) -> str | None:
    for child in elem:
        if _local(child.tag) == name:
            return child.text
    return None


class _RootReached(Exception):
    """Stops ``_PrologCheck``'s parser at the root element: the prolog is over."""


class _PrologCheck:
    """Refuses a DOCTYPE: reads what comes before the root element with a bare expat parser of its own, which
    raises ``DumpError`` at the start of a DOCTYPE, before anything in it is parsed (expat stops at a handler's
    exception), and before the dump's own parser is given those bytes.

    MediaWiki dumps never carry one, and what one declares is what a hostile dump would use: entities that
    expand without bound ("billion laughs": expat's own limit still lets them grow to 100 times the input), that
    name a local file or URL, or whose text would go into the shards as if an article held it. A DOCTYPE may
    only come before the root element, so the check is done at it; the rest of the dump costs nothing.
    """

    def __init__(self) -> None:
        self.done = False
        self._parser = expat.ParserCreate()
        self._parser.StartDoctypeDeclHandler = self._doctype
        self._parser.StartElementHandler = self._root

    @staticmethod
    def _doctype(name: str, *_) -> None:
        raise DumpError(f"it has a DOCTYPE declaration (<!DOCTYPE {name} ...>), which MediaWiki dumps never "
                        "have: refused, so that no entity it may declare is expanded or read from a file")

    @staticmethod
    def _root(*_) -> None:
        raise _RootReached

    def feed(self, data: bytes) -> None:
        try:
            self._parser.Parse(data, False)
        except (_RootReached, expat.ExpatError):  # a malformed prolog is the dump's parser's to report
            self.done = True


class DumpReader:
    """Streams the pages of one dump file (.xml, or .bz2 including multistream / concatenated bz2)."""

    def __init__(self, path: str):
        self.path = path  # a local path, or an object-store URL (s3://, gs://, …) streamed through clsys.storage
        self.bytes_read = 0  # input (compressed) bytes consumed so far
        self.siteinfo = SiteInfo()
        self.head_fault: TruncatedDump | None = None

    @property
    def lang(self) -> str | None:
        """The dump's language: its ``<siteinfo>``'s (read first), else the dbname its Wikimedia file name
        starts with (``hewiki-20240601-pages-articles.xml.bz2`` → ``he``); None when neither tells."""
        name = _DUMP_FILE_DBNAME.match(os.path.basename(self.path))
        return self.siteinfo.lang or (dbname_lang(name.group(1)) if name else None)

    def _raw_chunks(self) -> Iterator[bytes]:
        """Decompressed bytes; a bz2 fault becomes ``TruncatedDump`` at the current input offset."""
        try:
            f = open(self.path, "rb") if "://" not in self.path else storage.open_read(self.path)
        except OSError as err:
            raise DumpError(f"cannot open: {err.strerror}") from None
        except StorageError as err:
            raise DumpError(f"cannot open: {err}") from None
        self.bytes_read = 0
        with f:
            head = f.read(CHUNK_BYTES)
            if not head:
                raise DumpError("the file is empty")
            if not head.startswith(b"BZh"):
                while head:
                    self.bytes_read += len(head)
                    yield head
                    head = f.read(CHUNK_BYTES)
                return
            dec, chunk = bz2.BZ2Decompressor(), head
            while chunk:
                try:
                    yield from inflate(dec, chunk)
                    # A multistream dump is many bz2 streams back to back: restart on each boundary.
                    while dec.eof and dec.unused_data:
                        rest, dec = dec.unused_data, bz2.BZ2Decompressor()
                        yield from inflate(dec, rest)
                except (OSError, EOFError) as err:
                    raise TruncatedDump(f"corrupt bz2 data ({err})", self.bytes_read) from None
                self.bytes_read += len(chunk)
                chunk = f.read(CHUNK_BYTES)
                if chunk and dec.eof:  # a stream ended with the chunk: the next chunk starts the next stream
                    dec = bz2.BZ2Decompressor()
            if not dec.eof:
                raise TruncatedDump("bz2 stream ends before its end-of-stream marker (truncated file)",
                                    self.bytes_read)

    def _events(self) -> Iterator[tuple[str, ET.Element]]:
        """(event, element) pairs; checks that there is no DOCTYPE (``_PrologCheck``) and that the root is
        ``<mediawiki>``. Where ``MAX_UNMARKED_BYTES`` go by without an element starting or ending inside a page,
        ("too_long", the page) instead: the rest of the page is skipped unparsed up to its ``</page>``, and the
        pages after it come from a parser of their own, in a root of its own (its "start" event comes next)."""
        parser = ET.XMLPullParser(events=("start", "end"))
        prolog = _PrologCheck()
        root_seen = False
        n_bytes = 0
        unmarked = 0  # bytes given to the parser since it last reported an element
        page = None  # the page being read

        def parsed() -> Iterator[tuple[str, ET.Element]]:
            nonlocal root_seen, unmarked, page
            for event, elem in parser.read_events():
                unmarked = 0
                name = _local(elem.tag)
                if not root_seen:
                    if name != "mediawiki":
                        raise DumpError(f"XML root element is <{name}>, not <mediawiki>: not a MediaWiki XML dump")
                    root_seen = True
                if name == "page":
                    page = elem if event == "start" else None
                yield event, elem

        chunks = self._raw_chunks()
        try:
            for data in chunks:
                n_bytes += len(data)
                if not prolog.done:
                    prolog.feed(data)
                parser.feed(data)
                unmarked += len(data)
                yield from parsed()
                if unmarked > MAX_UNMARKED_BYTES:
                    if page is None:
                        raise TruncatedDump(f"more than {MAX_UNMARKED_BYTES >> 20} MiB of XML without an element "
                                            f"starting or ending, outside any page", self.bytes_read)
                    yield "too_long", page
                    parser, unmarked, page = ET.XMLPullParser(events=("start", "end")), 0, None
                    parser.feed(b"<mediawiki>")
                    parser.feed(self._after_page_end(chunks, data[1 - len(_PAGE_END):]))
                    yield from parsed()
            if n_bytes == 0:
                raise DumpError("the file decompresses to nothing")
            parser.close()
        except ET.ParseError as err:
            if not root_seen:
                raise DumpError(f"not an XML file ({err})") from None
            raise TruncatedDump(f"XML ends or breaks early ({err})", self.bytes_read) from None

    def _after_page_end(self, chunks: Iterator[bytes], seen: bytes) -> bytes:
        """What follows the next ``</page>`` in ``chunks``, whose bytes up to it are read and dropped; ``seen``: the
        last bytes read before them. A page's text holds no "<" (it is escaped), so that is the page's end tag."""
        for data in chunks:
            data = seen + data
            if (at := data.find(_PAGE_END)) >= 0:
                return data[at + len(_PAGE_END):]
            seen = data[1 - len(_PAGE_END):]
        raise TruncatedDump(f"the dump ends inside a page longer than {MAX_PAGE_BYTES >> 20} MiB", self.bytes_read)

    def read_siteinfo(self) -> SiteInfo:
        """Read only the head of the file: validates it (``DumpError``) and returns its ``<siteinfo>``.

        A fault after the ``<mediawiki>`` root is left for ``pages()`` to report as truncation; one before the
        ``<siteinfo>`` ends is kept in ``head_fault`` too (the dump's language may then be unknown).
        """
        try:
            for event, elem in self._events():
                if event == "end" and _local(elem.tag) == "siteinfo":
                    self._set_siteinfo(elem)
                    break
                if event == "start" and _local(elem.tag) == "page":
                    break
        except TruncatedDump as err:
            self.head_fault = err
        return self.siteinfo

    def _set_siteinfo(self, elem: ET.Element) -> None:
        self.siteinfo.dbname = _child_text(elem, "dbname")
        self.siteinfo.base = _child_text(elem, "base")
        for child in elem:
            if _local(child.tag) == "namespaces":
                for ns in child:
                    key, name = ns.get("key"), (ns.text or "").strip().lower()
                    if name and key == "6":
                        self.siteinfo.media_prefixes.add(name)
                    elif name and key == "14":
                        self.siteinfo.category_prefixes.add(name)

    def pages(self) -> Iterator[Page]:
        """Every page, in file order. Raises ``TruncatedDump`` after the last complete page."""
        root = None
        for event, elem in self._events():
            if event == "too_long":
                yield self._page(elem, too_long=True)
                root = None  # the pages after it are parsed in a root of their own
                continue
            if root is None:
                root = elem
            if event != "end":
                continue
            name = _local(elem.tag)
            if name == "siteinfo":
                self._set_siteinfo(elem)
                root.clear()
            elif name == "page":
                yield self._page(elem)
                root.clear()  # drop finished pages so memory stays flat

    @staticmethod
    def _page(elem: ET.Element, too_long: bool = False) -> Page:
        """The page of a ``<page>`` element; ``too_long``: its text was skipped unparsed (the element ends there)."""
        title, ns, page_id, text, redirect, target = "", 0, 0, "", False, None
        for child in elem:
            name = _local(child.tag)
            if name == "title":
                title = child.text or ""
            elif name == "ns":
                ns = int(child.text or 0)
            elif name == "id":
                page_id = int(child.text or 0)
            elif name == "redirect":
                redirect, target = True, child.get("title")
            elif name == "revision":  # history dumps hold many revisions: the last one is current
                text = _child_text(child, "text") or ""
        redirect = redirect or text.lstrip()[:9].upper() == "#REDIRECT"
        # A character takes at most 4 bytes: only a text of more than a quarter of the limit is measured.
        if too_long or (len(text) > MAX_PAGE_BYTES // 4 and len(text.encode()) > MAX_PAGE_BYTES):
            text, too_long = "", True
        return Page(page_id=page_id, title=title, ns=ns, text=text, redirect=redirect, redirect_target=target,
                    too_long=too_long)


def skip_reason(page: Page) -> str | None:
    """Why a page is not an article to keep (a ``skipped`` key), or None."""
    if page.redirect:
        return "redirect"
    if page.ns != 0:
        return "non_article"
    return "page_too_long" if page.too_long else None


class BlockReader(DumpReader):
    """The pages of one bz2 stream of a multistream dump: ``DumpReader``'s parsing inside a synthetic root
    (the stream holds bare ``<page>`` elements; the ``<siteinfo>`` is read once, from the dump's first stream)."""

    def __init__(self, path: str, block: Block):
        super().__init__(path)
        self.block = block
        self.end: int | None = None  # offset just past the stream, once read

    def _raw_chunks(self) -> Iterator[bytes]:
        self.bytes_read = self.block.offset  # a fault anywhere in the stream loses all of it
        yield b"<mediawiki>"
        self.end = yield from bz2_stream(self.path, self.block.offset, self.block.next_offset)
        yield b"</mediawiki>"
