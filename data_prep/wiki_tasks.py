"""What ``data_prep wiki``'s workers run (pool processes or Ray tasks), and the ordered map that feeds them.

A worker cleans and splits the pages of a batch read from a dump without an index (``read_batches``, run
by a Ray task of its own or by the driver; ``process_batch``), or reads a whole multistream bz2 block
itself (``process_block``), and returns each
page's records (``encode_page``): the driver, which writes in input order and alone, then only admits, counts
and hands them to the writers, which pack them into blocks. ``ordered_map`` keeps a bounded window of tasks in
flight and yields their results in input order, which is what makes the output independent of the
number of workers.
"""
from __future__ import annotations

import collections
import functools
import itertools
import threading
from dataclasses import dataclass
from typing import Iterator

from data_prep.bz2_streams import BadIndex, Block, TruncatedDump
from data_prep.dumps import BlockReader, DumpReader, skip_reason
from clsys.data.sentences import Passage, SplitStats, counted_sentences, pack_passages
from clsys.shards.blocks import Record
from data_prep.wikitext import WikitextCleaner


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


@dataclass
class EncodedPage:
    """One article's records for the ``sentences`` and ``documents`` streams, in page order; ``stats``: its
    sentences skipped. No sentences: an empty article."""

    lang: str
    page_id: int
    sentences: list[Record]
    passages: list[Record]
    stats: SplitStats


# A batch of a dump without an index holds up to this much articles' wikitext (or one longer page), and up to
# this many pages (a run of redirects has next to no text), so that a task's memory does not depend on the
# dump and the task overhead is paid per batch, not per page.
BATCH_CHARS = 1 << 20
BATCH_PAGES = 10_000


@dataclass
class PageBatch:
    """Consecutive pages of a dump read without an index: each page's id with its skip reason or its task.
    ``bytes_read``: how far into the (compressed) file reading got; ``fault``: the ``TruncatedDump`` that
    ended the reading, as (message, byte offset), on the last batch only."""

    pages: list[tuple[int, str | PageTask]]
    bytes_read: int
    fault: tuple[str, int] | None = None


@dataclass
class BatchResult:
    pages: list[tuple[int, str | EncodedPage]]  # (page id, skip reason or the encoded article), in file order
    bytes_read: int
    fault: tuple[str, int] | None = None


@functools.lru_cache(maxsize=16)
def _cleaner(media: frozenset[str], category: frozenset[str]) -> WikitextCleaner:
    return WikitextCleaner(media, category)


def process_page(task: PageTask) -> PageResult:
    """wikitext → sections → filtered sentences → passages. Runs in the worker processes."""
    stats = SplitStats()
    sections = []
    for section in _cleaner(task.media_prefixes, task.category_prefixes).sections(task.text):
        counted = [c for p in section.paragraphs for c in counted_sentences(task.lang, p, stats)]
        if counted:
            sections.append((section.heading, [sentence for sentence, _ in counted],
                             pack_passages(counted, task.passage_words)))
    return PageResult(task.lang, task.page_id, task.title, sections, stats)


def encode_page(result: PageResult) -> EncodedPage:
    """The page's records as the shards hold them. A sentence names its article (``lang``, ``page_id``: the
    same dict for all, pickled once); a passage also its title, its section's heading and its length."""
    sentence_meta = {"lang": result.lang, "page_id": result.page_id}
    sentences: list[Record] = []
    passages: list[Record] = []
    for heading, section_sentences, section_passages in result.sections:
        sentences += [Record(sentence, sentence_meta) for sentence in section_sentences]
        meta = {**sentence_meta, "title": result.title, "section": heading}
        passages += [Record(p.text, {**meta, "n_chars": len(p.text)}) for p in section_passages]
    return EncodedPage(result.lang, result.page_id, sentences, passages, result.stats)


def prepare_page(task: PageTask) -> EncodedPage:
    """``process_page`` and ``encode_page``: what a worker returns for an article."""
    return encode_page(process_page(task))


def read_batches(path: str, lang: str, media_prefixes: frozenset[str], category_prefixes: frozenset[str],
                 passage_words: int) -> Iterator[PageBatch]:
    """A dump without an index, read from the start in batches of up to ``BATCH_CHARS`` of articles' wikitext.
    Runs where the dump is read: a Ray task of its own with ``--ray`` (so several dumps are read at once),
    else the main process. Always ends with one batch (empty if need be) that says how reading ended."""
    reader = DumpReader(path)
    pages: list[tuple[int, str | PageTask]] = []
    chars = 0
    try:
        for page in reader.pages():
            # Duplicates of earlier inputs are only known in the main process: it drops their results.
            reason = skip_reason(page)
            size = 0 if reason is not None else len(page.text)
            if len(pages) >= BATCH_PAGES or (chars and chars + size > BATCH_CHARS):
                yield PageBatch(pages, reader.bytes_read)
                pages, chars = [], 0
            pages.append((page.page_id, reason or PageTask(lang, page.page_id, page.title, page.text, media_prefixes,
                                                           category_prefixes, passage_words)))
            chars += size
    except TruncatedDump as err:
        yield PageBatch(pages, reader.bytes_read, (err.message, err.byte_offset))
        return
    yield PageBatch(pages, reader.bytes_read)


def process_batch(batch: PageBatch) -> BatchResult:
    """Process the articles of a batch. Runs in the worker processes."""
    return BatchResult([(page_id, task if isinstance(task, str) else prepare_page(task))
                        for page_id, task in batch.pages], batch.bytes_read, batch.fault)


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
    pages: list[tuple[int, str | EncodedPage]]  # (page id, skip reason or the encoded article), in file order
    error: str | None = None


def process_block(task: BlockTask) -> BlockResult:
    """Read one bz2 stream of a multistream dump and process its articles. Runs in the worker processes."""
    block = task.block
    reader = BlockReader(task.dump, block)
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
    results: list[tuple[int, str | EncodedPage]] = []
    for page in pages:
        # Duplicates of earlier inputs are only known in the main process: it drops their results.
        reason = skip_reason(page)
        if reason is not None:
            results.append((page.page_id, reason))
        else:
            results.append((page.page_id, prepare_page(PageTask(
                task.lang, page.page_id, page.title, page.text, task.media_prefixes, task.category_prefixes,
                task.passage_words))))
    return BlockResult(block, reader.end, results)


def ordered_map(pool, fn, items: Iterator, window: int, gate: threading.Semaphore | None = None) -> Iterator:
    """Like ``pool.imap`` but with at most ``window`` tasks in flight, and each of them holding a permit of
    ``gate`` when given (one budget of tasks in flight shared by the maps that run side by side in threads).

    ``Pool.imap`` drains its input eagerly, which would pull a whole multi-GB dump into memory.
    """
    if pool is None:
        yield from map(fn, items)
        return
    pending: collections.deque = collections.deque()

    def oldest():
        task = pending.popleft()
        try:
            return task.get()
        finally:
            if gate is not None:
                gate.release()

    try:
        for item in items:
            # Wait for a permit only with nothing of ours in flight; else take our oldest result to free one:
            # a map waiting for a permit while holding some would wait for the others forever if they did too.
            while gate is not None and not gate.acquire(blocking=not pending):
                yield oldest()
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= window:
                yield oldest()
        while pending:
            yield oldest()
    finally:  # stopped early (an error, the run aborted): the permits of what is left go back
        if gate is not None:
            for _ in pending:
                gate.release()
