"""``data_prep wiki``: MediaWiki XML dumps → sentence and passage shards.

Two parts: a streaming page reader, and the command that feeds articles through a process pool
(wikitext cleaning in ``wikitext.py``, sentence splitting in ``sentences.py``) into two
``ShardWriter`` streams. The reader decompresses and parses incrementally (``XMLPullParser`` fed
64 KiB chunks), so a multi-GB dump never sits in memory, and it knows at every moment how many
*input* bytes it has consumed: that is the offset reported when a dump turns out to be truncated
or corrupt.
"""
from __future__ import annotations

import argparse
import bz2
import collections
import dataclasses
import functools
import multiprocessing
import os
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


# ----------------------------------------------------------------------------- the `wiki` command

@dataclass
class SourceReport:
    """One input file, as recorded in the manifest's ``sources``."""

    file: str
    lang: str
    dbname: str | None
    pages_read: int = 0
    articles: int = 0
    status: str = "complete"
    error: str | None = None
    byte_offset: int | None = None


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

    def tasks(self, reader: DumpReader, report: SourceReport) -> Iterator[PageTask]:
        """Articles to parse; skips are counted here, and a read fault ends the file (not the run)."""
        info = reader.siteinfo
        media, category = frozenset(info.media_prefixes), frozenset(info.category_prefixes)
        try:
            for page in reader.pages():
                report.pages_read += 1
                self.bar.update()
                if page.redirect:
                    self.skipped["redirect"] += 1
                elif page.ns != 0:
                    self.skipped["non_article"] += 1
                elif (report.lang, page.page_id) in self.seen:
                    self.skipped["duplicate"] += 1  # keys must stay unique across overlapping inputs
                else:
                    self.seen.add((report.lang, page.page_id))
                    report.articles += 1
                    yield PageTask(report.lang, page.page_id, page.title, page.text, media, category,
                                   self.args.passage_words)
        except TruncatedDump as err:
            report.status, report.error, report.byte_offset = "truncated", err.message, err.byte_offset

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

    def run(self, readers: list[DumpReader]) -> None:
        workers = self.args.workers
        pool = multiprocessing.Pool(workers) if workers > 1 else None
        try:
            for reader in readers:
                info = reader.siteinfo
                report = SourceReport(os.path.basename(reader.path), info.lang, info.dbname)
                self.sources.append(report)
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
    """Run ``wiki``; returns the exit code (0 ok, 2 unusable input or storage, 3 truncated input)."""
    start = time.time()
    try:
        storage.check_bucket(args.out)
        readers = [DumpReader(path) for path in args.input]
        for reader in readers:  # validate every input before anything is written
            try:
                reader.read_siteinfo()
            except DumpError as err:
                return cli.fail("wiki", f"{reader.path}: {err}")
        with tempfile.TemporaryDirectory(prefix="data_prep-") as tmp:
            job = WikiJob(args, tmp)
            job.run(readers)
            truncated = [s for s in job.sources if s.status == "truncated"]
            for s, path in zip(job.sources, args.input):
                if s.status == "truncated":
                    level = "warning" if args.allow_truncated else "error"
                    print(f"data_prep wiki: {level}: {path}: {s.error} (reading stopped at byte {s.byte_offset}); "
                          f"kept the {s.pages_read} complete pages before it", file=sys.stderr)
            if job.streams["sentences"].samples == 0:
                return cli.fail("wiki", f"{', '.join(args.input)}: no article text found (articles: "
                             f"{sum(s.articles for s in job.sources)}); nothing written", 3 if truncated else 2)
            for writer in job.streams.values():
                writer.close()
            # Manifests last, once every shard of both streams is uploaded.
            urls = {name: writer.write_manifest(job.manifest_extra()) for name, writer in job.streams.items()}
    except StorageError as err:
        return cli.fail("wiki", str(err))
    _summary(job, urls, time.time() - start)
    return 3 if truncated and not args.allow_truncated else 0


def _summary(job: WikiJob, urls: dict[str, str], seconds: float) -> None:
    pages = sum(s.pages_read for s in job.sources)
    print(f"pages read: {pages}, articles: {sum(s.articles for s in job.sources)} "
          f"in {seconds:.1f}s ({pages / max(seconds, 1e-9):.0f} pages/s)")
    for name, writer in job.streams.items():
        label = "sentences" if name == "sentences" else "passages"
        print(f"{label}: {writer.samples} in {len(writer.shards)} shards "
              f"({writer.uploaded} uploaded, {writer.unchanged} unchanged: upload skipped) -> {urls[name]}")
    print("skipped: " + ", ".join(f"{k}={v}" for k, v in job.skipped.items()))
