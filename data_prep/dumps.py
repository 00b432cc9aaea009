"""Reading MediaWiki XML dumps, page by page, for ``data_prep wiki`` and ``data_prep align``.

``DumpReader`` decompresses and parses incrementally (``XMLPullParser`` fed 64 KiB chunks), so a
multi-GB dump never sits in memory, and it knows at every moment how many *input* bytes it has
consumed: that is the offset reported when a dump turns out to be truncated or corrupt.

Memory stays bounded on a hostile dump too. Each decompress call returns ``OUT_BYTES`` at most: a bz2 "bomb"
(611 bytes that decompress to 600 MiB) is read a piece at a time. A page's wikitext may take at most
``MAX_PAGE_BYTES``, MediaWiki's own limit on an article; a longer one is skipped (``Page.too_long``). Its
text is never held whole: where ``MAX_UNMARKED_BYTES`` reach the parser without an element starting or ending,
the rest of the page is skipped unparsed, and the pages after it are parsed afresh.

A Wikimedia *multistream* dump with its index is read by block instead: the index gives the byte
offset of each bz2 stream of 100 pages (``index_blocks``, checked by ``check_index``), and
``BlockReader`` decompresses and parses one such block with the same ``DumpReader`` code. Dumps and
indexes may be local files or objects (``s3://``, ``gs://``, … through ``clsys.storage``): a block is
then one ranged read, from its offset to the next listed one's, never a download of the whole dump.
"""
from __future__ import annotations

import bz2
import collections
import contextlib
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Generator, Iterator
from urllib.parse import urlparse
from xml.parsers import expat

from clsys import storage
from clsys.storage import StorageError
from data_prep.wikitext import CATEGORY_PREFIXES, MEDIA_PREFIXES


CHUNK_BYTES = 1 << 16  # small enough that a fault is located to within 64 KiB of input
OUT_BYTES = 1 << 20  # the most one decompress call returns
# MediaWiki's limit on an article's wikitext ($wgMaxArticleSize, 2048 KiB by default), in bytes of UTF-8: no wiki
# keeps a longer revision, so a longer text is not an article's.
MAX_PAGE_BYTES = 2048 * 1024
# The most XML bytes the parser is given without an element starting or ending: a text at MAX_PAGE_BYTES with
# every byte escaped (MediaWiki writes '"' as "&quot;", 6 bytes). More is a page too long, skipped unparsed.
MAX_UNMARKED_BYTES = 6 * MAX_PAGE_BYTES
# The most the header stream (the <siteinfo>) or the closing one of a multistream dump may hold: a few KiB.
MAX_SMALL_STREAM_BYTES = 1 << 24
_PAGE_END = b"</page>"

# Wikimedia project suffixes of a dbname ("enwiki", "dewiktionary", "zh_yuewiki") → language prefix.
_DBNAME_SUFFIXES = ("wiktionary", "wikibooks", "wikinews", "wikiquote", "wikisource", "wikiversity",
                    "wikivoyage", "wiki")
# Wikimedia's dump file names start with the dbname: "dewiki-20240601-pages-articles.xml.bz2".
_DUMP_FILE_DBNAME = re.compile(r"([a-z][a-z_]*)-")
# Hosts whose first label is a language: "fr.wikipedia.org", "de.wiktionary.org". Other wikis' hosts
# ("muppet.fandom.com", "wiki.example.com") say nothing about the language.
_WIKIMEDIA_HOST = re.compile(r"([a-z][a-z-]*)\.(?:wikipedia|%s)\.org" % "|".join(_DBNAME_SUFFIXES[:-1]))


class DumpError(Exception):
    """The input cannot be used at all (missing, empty, not XML, not a MediaWiki dump, a DOCTYPE in it)."""


class TruncatedDump(Exception):
    """Reading stopped early (corrupt/truncated bz2 or XML); pages before ``byte_offset`` are good."""

    def __init__(self, message: str, byte_offset: int):
        super().__init__(message, byte_offset)
        self.message, self.byte_offset = message, byte_offset


class BadIndex(Exception):
    """A multistream index that is malformed or does not describe its dump; the message names file:line."""


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


def _inflate(dec: bz2.BZ2Decompressor, data: bytes) -> Iterator[bytes]:
    """What ``dec`` makes of ``data``, ``OUT_BYTES`` at most a piece, up to its stream's end (what follows the end
    is left in ``dec.unused_data``). Raises what ``dec`` raises on corrupt data (OSError, EOFError)."""
    out = dec.decompress(data, OUT_BYTES)
    while True:
        if out:
            yield out
        if dec.eof or dec.needs_input:
            return
        out = dec.decompress(b"", OUT_BYTES)


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
                    yield from _inflate(dec, chunk)
                    # A multistream dump is many bz2 streams back to back: restart on each boundary.
                    while dec.eof and dec.unused_data:
                        rest, dec = dec.unused_data, bz2.BZ2Decompressor()
                        yield from _inflate(dec, rest)
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


# ----------------------------------------------------------------------------- multistream dumps and their index

# A bz2 stream starts with "BZh", the block size digit and the magic of its first block (or of its
# end-of-stream marker, for an empty stream). Ten bytes are enough to tell an offset that is a few
# bytes off.
_BZ2_STREAM_START = re.compile(rb"BZh[1-9](?:1AY&SY|\x17rE8P\x90)")


@dataclass
class Block:
    """One bz2 stream of a multistream dump, as its index lists it."""

    offset: int
    line: int  # the index line of its first page
    page_ids: list[int]
    next_offset: int | None = None  # where the next listed stream starts; None for the last one


def bz2_stream(path: str, offset: int, end: int | None = None) -> Generator[bytes, None, int]:
    """The one bz2 stream starting at byte ``offset``, decompressed, ``OUT_BYTES`` at most a piece; returns the
    offset just past it. ``end``: where it should end at the latest (reads from object storage ask for no more).

    A fault raises ``TruncatedDump`` at ``offset``: the whole stream is lost, so that is where the loss starts.
    A storage error (after ``clsys.storage``'s retries) raises ``StorageError``: the stream may be readable later.
    """
    dec, pos = bz2.BZ2Decompressor(), offset
    with storage.open_read(path, offset, end) as f:
        while not dec.eof:
            # Never past ``end``, local files included, so that a stream without its end-of-stream marker is
            # reported alike wherever the dump is stored.
            chunk = f.read(CHUNK_BYTES if end is None else min(CHUNK_BYTES, end - pos))
            if not chunk:
                raise TruncatedDump("bz2 stream ends before its end-of-stream marker (truncated file)", offset)
            try:
                yield from _inflate(dec, chunk)
            except (OSError, EOFError) as err:
                raise TruncatedDump(f"corrupt bz2 data ({err})", offset) from None
            pos += len(chunk)
    return pos - len(dec.unused_data)


def read_bz2_stream(path: str, offset: int, end: int | None = None) -> tuple[bytes, int]:
    """``bz2_stream`` whole: (its data, the offset just past it), for the streams of a few KiB, a multistream
    dump's header and closing one. One that holds more than ``MAX_SMALL_STREAM_BYTES`` raises ``TruncatedDump``."""
    parts, size = [], 0
    with contextlib.closing(bz2_stream(path, offset, end)) as stream:
        while True:
            try:
                part = next(stream)
            except StopIteration as stop:
                return b"".join(parts), stop.value
            size += len(part)
            if size > MAX_SMALL_STREAM_BYTES:
                raise TruncatedDump(f"the bz2 stream holds more than {MAX_SMALL_STREAM_BYTES >> 20} MiB, where a "
                                    f"dump's header or closing stream holds a few KiB", offset)
            parts.append(part)


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


def _index_entry(raw: bytes, index: str, line: int) -> tuple[int, int]:
    """(offset, page id) of one ``OFFSET:PAGE_ID:TITLE`` line (titles may hold ':' and are not needed)."""
    parts = raw.rstrip(b"\r\n").split(b":", 2)
    if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
        return int(parts[0]), int(parts[1])
    raise BadIndex(f"{index}:{line}: expected OFFSET:PAGE_ID:TITLE, got {raw[:80]!r}")


def _index_lines(index: str) -> Iterator[bytes]:
    """The lines of an index file (.txt or .txt.bz2; a local file or an object), streamed."""
    try:
        with storage.open_read(index, 0, 3) as f:
            compressed = f.read(3) == b"BZh"
        f = storage.open_read(index)
    except StorageError as err:
        raise BadIndex(f"{index}: cannot open: {str(err).removeprefix(f'{index}: ')}") from None
    with f:
        source = bz2.open(f) if compressed else f
        rest = b""
        while chunk := source.read(CHUNK_BYTES):
            *lines, rest = (rest + chunk).split(b"\n")
            yield from lines
        if rest:
            yield rest


def index_blocks(index: str, dump: str) -> Iterator[Block]:
    """The blocks of a multistream index (.txt or .txt.bz2), in file order, streamed: enwiki's has ~24 M lines.

    Checks every line's form, that offsets ascend, and that each offset is within ``dump``; for a local dump, that
    each starts a bz2 stream too. A dump in object storage is not read here (that would be one request per block):
    an offset that does not start a stream is found when the blocks are read, each having to end where the next
    listed one starts.
    """
    size = storage.size(dump)
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(open(dump, "rb")) if "://" not in dump else None
        block, line = None, 0
        try:
            for line, raw in enumerate(_index_lines(index), 1):
                offset, page_id = _index_entry(raw, index, line)
                if block is not None and offset == block.offset:
                    block.page_ids.append(page_id)
                    continue
                if block is not None:
                    if offset < block.offset:
                        raise BadIndex(f"{index}:{line}: offset {offset} is below the previous line's {block.offset}; "
                                       "an index lists the streams in file order")
                    block.next_offset = offset
                    yield block
                if offset >= size:
                    raise BadIndex(f"{index}:{line}: offset {offset} is beyond the end of {dump} ({size} bytes)")
                if d is not None:
                    d.seek(offset)
                    if not _BZ2_STREAM_START.fullmatch(d.read(10)):
                        raise BadIndex(f"{index}:{line}: offset {offset} is not the start of a bz2 stream in {dump}: "
                                       "not this dump's index?")
                block = Block(offset, line, [page_id])
        except (OSError, EOFError) as err:  # a corrupt .bz2 index
            raise BadIndex(f"{index}:{line + 1}: cannot read ({err})") from None
    if block is None:
        raise BadIndex(f"{index}: no index lines")
    yield block


def check_index(index: str, dump: str) -> None:
    """Read the whole index once, before anything is written (``index_blocks`` checks each line), and check that
    the dump's first bz2 stream (the ``<siteinfo>`` header, no pages) ends where the first listed block starts."""
    blocks = index_blocks(index, dump)
    first = next(blocks)
    collections.deque(blocks, maxlen=0)
    with storage.open_read(dump, 0, 10) as d:
        if not _BZ2_STREAM_START.fullmatch(d.read(10)):
            raise BadIndex(f"{index}: a multistream index, but {dump} is not a bz2 file")
    try:
        header, end = read_bz2_stream(dump, 0)
    except TruncatedDump as err:
        raise DumpError(f"its first bz2 stream (the header): {err.message}") from None
    if end != first.offset or b"<page>" in header:
        raise BadIndex(f"{index}:{first.line}: the dump's first bz2 stream (ending at byte {end}) should be its "
                       f"<siteinfo> header alone, ending where this first listed block starts ({first.offset})")
