"""``data_prep wiki``: MediaWiki XML dumps → sentence and passage shards.

Two parts: a streaming page reader, and the command that feeds articles through a process pool
(wikitext cleaning in ``wikitext.py``, sentence splitting in ``sentences.py``) into two
``ShardWriter`` streams. The reader decompresses and parses incrementally (``XMLPullParser`` fed
64 KiB chunks), so a multi-GB dump never sits in memory, and it knows at every moment how many
*input* bytes it has consumed: that is the offset reported when a dump turns out to be truncated
or corrupt.

A Wikimedia *multistream* dump with its index (``--index``) is read in parallel instead: the index
gives the byte offset of each bz2 stream of 100 pages, and pool workers each decompress and parse
one such block with the same ``DumpReader`` code.
"""
from __future__ import annotations

import argparse
import bz2
import collections
import dataclasses
import functools
import itertools
import multiprocessing
import os
import re
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Iterator
from urllib.parse import urlparse

from tqdm import tqdm

from clsys import storage
from clsys.storage import StorageError
from data_prep import __version__, cli
from data_prep.sentences import Passage, SplitStats, pack_passages, split_sentences
from data_prep.shards import ShardWriter, previous_shas
from data_prep.wikitext import CATEGORY_PREFIXES, MEDIA_PREFIXES, WikitextCleaner

CHUNK_BYTES = 1 << 16  # small enough that a fault is located to within 64 KiB of input

# Wikimedia project suffixes of a dbname ("enwiki", "dewiktionary", "zh_yuewiki") → language prefix.
_DBNAME_SUFFIXES = ("wiktionary", "wikibooks", "wikinews", "wikiquote", "wikisource", "wikiversity",
                    "wikivoyage", "wiki")


class DumpError(Exception):
    """The input cannot be used at all (missing, empty, not XML, not a MediaWiki dump)."""


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
    def lang(self) -> str:
        """Language code from ``<dbname>`` (``enwiki`` → ``en``), else from the ``<base>`` host."""
        if self.dbname:
            for suffix in _DBNAME_SUFFIXES:
                if self.dbname.endswith(suffix) and len(self.dbname) > len(suffix):
                    return self.dbname[: -len(suffix)].replace("_", "-")
        host = urlparse(self.base or "").hostname or ""
        return host.split(".")[0] if host.count(".") >= 2 else "und"


@dataclass
class Page:
    page_id: int
    title: str
    ns: int
    text: str
    redirect: bool
    redirect_target: str | None = None  # the <redirect title="..."/> of a redirect page


def _local(tag: str) -> str:
    """Tag name without the ``{namespace}``, so every export-0.x schema version matches."""
    return tag.rsplit("}", 1)[-1]


def _child_text(elem: ET.Element, name: str) -> str | None:
    for child in elem:
        if _local(child.tag) == name:
            return child.text
    return None


class DumpReader:
    """Streams the pages of one dump file (.xml, or .bz2 including multistream / concatenated bz2)."""

    def __init__(self, path: str):
        self.path = path
        self.bytes_read = 0  # input (compressed) bytes consumed so far
        self.siteinfo = SiteInfo()

    def _raw_chunks(self) -> Iterator[bytes]:
        """Decompressed bytes; a bz2 fault becomes ``TruncatedDump`` at the current input offset."""
        try:
            f = open(self.path, "rb")
        except OSError as err:
            raise DumpError(f"cannot open: {err.strerror}") from None
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
                    out = dec.decompress(chunk)
                    # A multistream dump is many bz2 streams back to back: restart on each boundary.
                    while dec.eof and dec.unused_data:
                        rest, dec = dec.unused_data, bz2.BZ2Decompressor()
                        out += dec.decompress(rest)
                except (OSError, EOFError) as err:
                    raise TruncatedDump(f"corrupt bz2 data ({err})", self.bytes_read) from None
                self.bytes_read += len(chunk)
                if out:
                    yield out
                chunk = f.read(CHUNK_BYTES)
            if not dec.eof:
                raise TruncatedDump("bz2 stream ends before its end-of-stream marker (truncated file)",
                                    self.bytes_read)

    def _events(self) -> Iterator[tuple[str, ET.Element]]:
        """(event, element) pairs; checks that the root is ``<mediawiki>``."""
        parser = ET.XMLPullParser(events=("start", "end"))
        root_seen = False
        n_bytes = 0
        try:
            for data in self._raw_chunks():
                n_bytes += len(data)
                parser.feed(data)
                for event, elem in parser.read_events():
                    if not root_seen:
                        if _local(elem.tag) != "mediawiki":
                            raise DumpError(f"XML root element is <{_local(elem.tag)}>, not <mediawiki>: "
                                            "not a MediaWiki XML dump")
                        root_seen = True
                    yield event, elem
            if n_bytes == 0:
                raise DumpError("the file decompresses to nothing")
            parser.close()
        except ET.ParseError as err:
            if not root_seen:
                raise DumpError(f"not an XML file ({err})") from None
            raise TruncatedDump(f"XML ends or breaks early ({err})", self.bytes_read) from None

    def read_siteinfo(self) -> SiteInfo:
        """Read only the head of the file: validates it (``DumpError``) and returns its ``<siteinfo>``.

        A fault after the ``<mediawiki>`` root is left for ``pages()`` to report as truncation.
        """
        try:
            for event, elem in self._events():
                if event == "end" and _local(elem.tag) == "siteinfo":
                    self._set_siteinfo(elem)
                    break
                if event == "start" and _local(elem.tag) == "page":
                    break
        except TruncatedDump:
            pass
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
    def _page(elem: ET.Element) -> Page:
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
        return Page(page_id=page_id, title=title, ns=ns, text=text, redirect=redirect, redirect_target=target)


def skip_reason(page: Page) -> str | None:
    """Why a page is not an article to keep (a ``skipped`` key), or None."""
    if page.redirect:
        return "redirect"
    return "non_article" if page.ns != 0 else None


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


def read_bz2_stream(path: str, offset: int) -> tuple[bytes, int]:
    """Decompress the one bz2 stream starting at byte ``offset``: (its data, the offset just past it).

    A fault raises ``TruncatedDump`` at ``offset``: the whole stream is lost, so that is where the loss starts.
    """
    dec, parts, pos = bz2.BZ2Decompressor(), [], offset
    with open(path, "rb") as f:
        f.seek(offset)
        while not dec.eof:
            chunk = f.read(CHUNK_BYTES)
            if not chunk:
                raise TruncatedDump("bz2 stream ends before its end-of-stream marker (truncated file)", offset)
            try:
                parts.append(dec.decompress(chunk))
            except (OSError, EOFError) as err:
                raise TruncatedDump(f"corrupt bz2 data ({err})", offset) from None
            pos += len(chunk)
    return b"".join(parts), pos - len(dec.unused_data)


class BlockReader(DumpReader):
    """The pages of one bz2 stream of a multistream dump: ``DumpReader``'s parsing inside a synthetic root
    (the stream holds bare ``<page>`` elements; the ``<siteinfo>`` is read once, from the dump's first stream)."""

    def __init__(self, path: str, offset: int):
        super().__init__(path)
        self.offset = offset
        self.end: int | None = None  # offset just past the stream, once read

    def _raw_chunks(self) -> Iterator[bytes]:
        self.bytes_read = self.offset  # a fault anywhere in the stream loses all of it
        data, self.end = read_bz2_stream(self.path, self.offset)
        yield b"<mediawiki>"
        yield data
        yield b"</mediawiki>"


def _index_entry(raw: bytes, index: str, line: int) -> tuple[int, int]:
    """(offset, page id) of one ``OFFSET:PAGE_ID:TITLE`` line (titles may hold ':' and are not needed)."""
    parts = raw.rstrip(b"\r\n").split(b":", 2)
    if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
        return int(parts[0]), int(parts[1])
    raise BadIndex(f"{index}:{line}: expected OFFSET:PAGE_ID:TITLE, got {raw[:80]!r}")


def index_blocks(index: str, dump: str) -> Iterator[Block]:
    """The blocks of a multistream index (.txt or .txt.bz2), in file order, streamed: enwiki's has ~24 M lines.

    Checks every line's form, that offsets ascend, and that each offset is within ``dump`` and starts a bz2 stream.
    """
    size = os.path.getsize(dump)
    try:
        f = open(index, "rb")
    except OSError as err:
        raise BadIndex(f"{index}: cannot open: {err.strerror}") from None
    with f, open(dump, "rb") as d:
        compressed = f.read(3) == b"BZh"
        f.seek(0)
        block, line = None, 0
        try:
            for line, raw in enumerate(bz2.open(f) if compressed else f, 1):
                offset, page_id = _index_entry(raw, index, line)
                if block is not None and offset == block.offset:
                    block.page_ids.append(page_id)
                    continue
                if block is not None:
                    if offset < block.offset:
                        raise BadIndex(f"{index}:{line}: offset {offset} is below the previous line's {block.offset}; "
                                       "an index lists the streams in file order")
                    yield block
                if offset >= size:
                    raise BadIndex(f"{index}:{line}: offset {offset} is beyond the end of {dump} ({size} bytes)")
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
    with open(dump, "rb") as d:
        if not _BZ2_STREAM_START.fullmatch(d.read(10)):
            raise BadIndex(f"{index}: a multistream index, but {dump} is not a bz2 file")
    try:
        header, end = read_bz2_stream(dump, 0)
    except TruncatedDump as err:
        raise DumpError(f"its first bz2 stream (the header): {err.message}") from None
    if end != first.offset or b"<page>" in header:
        raise BadIndex(f"{index}:{first.line}: the dump's first bz2 stream (ending at byte {end}) should be its "
                       f"<siteinfo> header alone, ending where this first listed block starts ({first.offset})")


# ----------------------------------------------------------------------------- the `wiki` command

@dataclass
class SourceReport:
    """One input file, as recorded in the manifest's ``sources``."""

    file: str
    lang: str
    dbname: str | None
    pages_read: int = 0
    articles: int = 0
    status: str = "complete"  # "truncated": reading stopped early; "corrupt": some multistream blocks unreadable
    error: str | None = None
    byte_offset: int | None = None
    pages_lost: int = 0  # pages of unreadable multistream blocks (counted from the index)


@dataclass
class PageTask:
    lang: str
    page_id: int
    title: str
    text: str
    media_prefixes: frozenset[str]
    category_prefixes: frozenset[str]
    passage_words: int


@dataclass
class PageResult:
    lang: str
    page_id: int
    title: str
    sections: list[tuple[str, list[str], list[Passage]]]  # (heading, sentences, passages)
    stats: SplitStats


@functools.lru_cache(maxsize=16)
def _cleaner(media: frozenset[str], category: frozenset[str]) -> WikitextCleaner:
    return WikitextCleaner(media, category)


def process_page(task: PageTask) -> PageResult:
    """wikitext → sections → filtered sentences → passages. Runs in the worker processes."""
    stats = SplitStats()
    sections = []
    for section in _cleaner(task.media_prefixes, task.category_prefixes).sections(task.text):
        sentences = [s for p in section.paragraphs for s in split_sentences(task.lang, p, stats)]
        if sentences:
            sections.append((section.heading, sentences, pack_passages(sentences, task.passage_words)))
    return PageResult(task.lang, task.page_id, task.title, sections, stats)


@dataclass
class BlockTask:
    dump: str
    index: str
    block: Block
    lang: str
    media_prefixes: frozenset[str]
    category_prefixes: frozenset[str]
    passage_words: int


@dataclass
class BlockResult:
    block: Block
    end: int | None  # offset just past the stream; None when it could not be read
    pages: list[tuple[int, str | PageResult]]  # (page id, skip reason or the processed article), in file order
    error: str | None = None


def process_block(task: BlockTask) -> BlockResult:
    """Read one bz2 stream of a multistream dump and process its articles. Runs in the worker processes."""
    block = task.block
    reader = BlockReader(task.dump, block.offset)
    try:
        pages = list(reader.pages())
    except TruncatedDump as err:
        return BlockResult(block, None, [], err.message)
    ids = [page.page_id for page in pages]
    if ids != block.page_ids:
        i = next(i for i, (a, b) in enumerate(itertools.zip_longest(ids, block.page_ids)) if a != b)
        found, listed = (seq[i] if i < len(seq) else "nothing" for seq in (ids, block.page_ids))
        raise BadIndex(f"{task.index}:{block.line + min(i, len(block.page_ids) - 1)}: the bz2 stream at byte "
                       f"{block.offset} holds page id {found} as its page {i + 1}, the index lists {listed}")
    results: list[tuple[int, str | PageResult]] = []
    for page in pages:
        # Duplicates of earlier inputs are only known in the main process: it drops their results.
        reason = skip_reason(page)
        if reason is not None:
            results.append((page.page_id, reason))
        else:
            results.append((page.page_id, process_page(PageTask(
                task.lang, page.page_id, page.title, page.text, task.media_prefixes, task.category_prefixes,
                task.passage_words))))
    return BlockResult(block, reader.end, results)


def ordered_map(pool, fn, items: Iterator, window: int) -> Iterator:
    """Like ``pool.imap`` but with at most ``window`` tasks in flight.

    ``Pool.imap`` drains its input eagerly, which would pull a whole multi-GB dump into memory.
    """
    if pool is None:
        yield from map(fn, items)
        return
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class WikiJob:
    """State of one ``data_prep wiki`` run: readers in, two shard streams out."""

    def __init__(self, args: argparse.Namespace, tmp_dir: str):
        self.args = args
        max_bytes = int(args.shard_size_mb * 2**20)
        self.streams = {name: ShardWriter(storage.join(args.out, name), tmp_dir, max_bytes,
                                          previous_shas(storage.join(args.out, name)))
                        for name in ("sentences", "documents")}
        self.skipped = dict.fromkeys(("redirect", "non_article", "duplicate", "empty", "too_short", "too_long", "markup"), 0)
        self.sources: list[SourceReport] = []
        self.seen: set[tuple[str, int]] = set()
        self.bar = tqdm(unit=" pages", file=sys.stderr, mininterval=0.5, dynamic_ncols=True)

    def admit(self, report: SourceReport, page_id: int, skip: str | None) -> bool:
        """Count one page read; True when it is a new article to write, else its skip is counted."""
        report.pages_read += 1
        self.bar.update()
        if skip is None and (report.lang, page_id) in self.seen:
            skip = "duplicate"  # keys must stay unique across overlapping inputs
        if skip is not None:
            self.skipped[skip] += 1
            return False
        self.seen.add((report.lang, page_id))
        report.articles += 1
        return True

    def tasks(self, reader: DumpReader, report: SourceReport) -> Iterator[PageTask]:
        """Articles to parse; a read fault ends the file (not the run)."""
        info = reader.siteinfo
        media, category = frozenset(info.media_prefixes), frozenset(info.category_prefixes)
        try:
            for page in reader.pages():
                if self.admit(report, page.page_id, skip_reason(page)):
                    yield PageTask(report.lang, page.page_id, page.title, page.text, media, category,
                                   self.args.passage_words)
        except TruncatedDump as err:
            report.status, report.error, report.byte_offset = "truncated", err.message, err.byte_offset

    def read_blocks(self, pool, reader: DumpReader, index: str, report: SourceReport) -> None:
        """A multistream dump with its index: workers read one bz2 stream each; blocks are written in file order.

        Each stream must end where the next listed one starts, and the last one where the closing stream starts,
        so no page escapes the index. An unreadable stream is skipped (its pages counted as lost), not fatal.
        """
        info = reader.siteinfo
        tasks = (BlockTask(reader.path, index, block, report.lang, frozenset(info.media_prefixes),
                           frozenset(info.category_prefixes), self.args.passage_words)
                 for block in index_blocks(index, reader.path))
        end, block = None, None
        for result in ordered_map(pool, process_block, tasks, window=2 * self.args.workers):
            block = result.block
            if end is not None and block.offset != end:
                raise BadIndex(f"{index}:{block.line}: the previous bz2 stream ends at byte {end}, but this line lists "
                               f"{block.offset}: the dump holds a stream the index does not list")
            end = result.end
            if result.error is not None:
                self.lose(report, result.error, block.offset, len(block.page_ids))
                continue
            for page_id, outcome in result.pages:
                if isinstance(outcome, str):
                    self.admit(report, page_id, outcome)
                elif self.admit(report, page_id, None):
                    self.write(outcome)
        if end is None:  # the last block was unreadable: where the closing stream starts is unknown
            return
        try:
            footer, footer_end = read_bz2_stream(reader.path, end)
        except TruncatedDump as err:
            self.lose(report, err.message, end, 0)
            return
        if footer.strip() != b"</mediawiki>" or footer_end != os.path.getsize(reader.path):
            raise BadIndex(f"{index}:{block.line}: the dump goes on after the bz2 stream of this last listed block "
                           f"with more than the closing </mediawiki>: pages the index does not list?")

    @staticmethod
    def lose(report: SourceReport, error: str, offset: int, pages: int) -> None:
        """Record an unreadable multistream block; the first one's error and offset are reported."""
        if report.status == "complete":
            report.status, report.error, report.byte_offset = "corrupt", error, offset
        report.pages_lost += pages

    def write(self, result: PageResult) -> None:
        self.skipped["too_short"] += result.stats.too_short
        self.skipped["too_long"] += result.stats.too_long
        self.skipped["markup"] += result.stats.markup
        if not result.sections:
            self.skipped["empty"] += 1
            return
        n_sent = n_doc = 0
        for heading, sentences, passages in result.sections:
            meta = {"lang": result.lang, "page_id": result.page_id, "title": result.title, "section": heading}
            key = f"{result.lang}-{result.page_id}"
            for sentence in sentences:
                self.streams["sentences"].write(f"{key}-{n_sent:05d}", sentence, meta)
                n_sent += 1
            for passage in passages:
                self.streams["documents"].write(f"{key}-{n_doc:05d}", passage.text,
                                                {**meta, "n_chars": len(passage.text)})
                n_doc += 1

    def run(self, readers: list[DumpReader], indexes: list[str | None]) -> None:
        workers = self.args.workers
        pool = multiprocessing.Pool(workers) if workers > 1 else None
        try:
            for reader, index in zip(readers, indexes):
                info = reader.siteinfo
                report = SourceReport(os.path.basename(reader.path), info.lang, info.dbname)
                self.sources.append(report)
                if index is not None:
                    self.read_blocks(pool, reader, index, report)
                    continue
                for result in ordered_map(pool, process_page, self.tasks(reader, report), window=32 * workers):
                    self.write(result)
        finally:
            self.bar.close()
            if pool is not None:
                pool.terminate()

    def manifest_extra(self) -> dict:
        return {"tool": f"data_prep {__version__}", "languages": sorted({s.lang for s in self.sources}),
                "sources": [dataclasses.asdict(s) for s in self.sources], "skipped": dict(self.skipped)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="DUMP",
                   help="MediaWiki XML dump(s): .xml or .bz2 (multistream ok)")
    p.add_argument("--index", nargs="+", metavar="INDEX",
                   help="multistream index (*-multistream-index*.txt.bz2), one per --input in the same order: "
                        "the dumps are then read in parallel by bz2 block too; output is identical")
    p.add_argument("--out", required=True, metavar="URL", help="output folder: s3://bucket/prefix, file:///abs or a path")
    p.add_argument("--shard-size-mb", type=cli.positive(float), default=64.0, metavar="N",
                   help="roll shards over at this size in MiB, fractions allowed (default: 64)")
    p.add_argument("--workers", type=cli.positive(int), default=1, metavar="N",
                   help="processes parsing wikitext; output is identical for any N (default: 1)")
    p.add_argument("--passage-words", type=cli.positive(int), default=200, metavar="N",
                   help="word budget of a passage in the documents stream (default: 200)")
    p.add_argument("--allow-truncated", action="store_true",
                   help="exit 0 (with a warning) when an input is truncated or corrupt; its good pages are kept")


def main(args: argparse.Namespace) -> int:
    """Run ``wiki``; returns the exit code (0 ok, 2 unusable input, index or storage, 3 truncated or corrupt input)."""
    start = time.time()
    try:
        indexes = args.index or [None] * len(args.input)
        if len(indexes) != len(args.input):
            return cli.fail("wiki", f"--index: {len(indexes)} index files for {len(args.input)} --input dumps; "
                                    "give one per dump, in the same order")
        storage.check_bucket(args.out)
        readers = [DumpReader(path) for path in args.input]
        for reader, index in zip(readers, indexes):  # validate every input before anything is written
            try:
                reader.read_siteinfo()
                if index is not None:
                    check_index(index, reader.path)
            except DumpError as err:
                return cli.fail("wiki", f"{reader.path}: {err}")
        with tempfile.TemporaryDirectory(prefix="data_prep-") as tmp:
            job = WikiJob(args, tmp)
            job.run(readers, indexes)
            faulty = [s for s in job.sources if s.status != "complete"]
            level = "warning" if args.allow_truncated else "error"
            for s, path in zip(job.sources, args.input):
                if s.status == "truncated":
                    print(f"data_prep wiki: {level}: {path}: {s.error} (reading stopped at byte {s.byte_offset}); "
                          f"kept the {s.pages_read} complete pages before it", file=sys.stderr)
                elif s.status == "corrupt":
                    print(f"data_prep wiki: {level}: {path}: {s.error} in the bz2 block at byte {s.byte_offset} "
                          f"(the first unreadable one); lost {s.pages_lost} pages, kept the {s.pages_read} pages "
                          "of the other blocks", file=sys.stderr)
            if job.streams["sentences"].samples == 0:
                return cli.fail("wiki", f"{', '.join(args.input)}: no article text found (articles: "
                             f"{sum(s.articles for s in job.sources)}); nothing written", 3 if faulty else 2)
            for writer in job.streams.values():
                writer.close()
            # Manifests last, once every shard of both streams is uploaded.
            urls = {name: writer.write_manifest(job.manifest_extra()) for name, writer in job.streams.items()}
    except (StorageError, BadIndex) as err:  # a BadIndex found while reading: no manifest is written
        return cli.fail("wiki", str(err))
    _summary(job, urls, time.time() - start)
    return 3 if faulty and not args.allow_truncated else 0


def _summary(job: WikiJob, urls: dict[str, str], seconds: float) -> None:
    pages = sum(s.pages_read for s in job.sources)
    print(f"pages read: {pages}, articles: {sum(s.articles for s in job.sources)} "
          f"in {seconds:.1f}s ({pages / max(seconds, 1e-9):.0f} pages/s)")
    for name, writer in job.streams.items():
        label = "sentences" if name == "sentences" else "passages"
        print(f"{label}: {writer.samples} in {len(writer.shards)} shards "
              f"({writer.uploaded} uploaded, {writer.unchanged} unchanged: upload skipped) -> {urls[name]}")
    print("skipped: " + ", ".join(f"{k}={v}" for k, v in job.skipped.items()))
