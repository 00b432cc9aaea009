"""``data_prep wiki``: MediaWiki XML dumps → sentence and passage shards, one stream pair per language.

The command feeds the articles of each dump (read by ``dumps.DumpReader``) through a process pool
(wikitext cleaning in ``wikitext.py``, sentence splitting in ``sentences.py``) into two
``ShardWriter`` streams, in page order, so the output is identical for any number of workers. The
writers shuffle each ``--shuffle-window-mb`` of samples with ``--seed`` before writing them: batches
then mix many articles (in-batch negatives from one article are often false negatives).
A Wikimedia *multistream* dump with its index (``--index``) is read in parallel too: pool workers
each decompress, parse and process one bz2 block (``dumps.BlockReader``). What the workers run is in
``wiki_tasks.py``. With ``--ray`` the same work runs as Ray tasks over a cluster's CPUs
(``ray_pool.RayPool``), the driver still writing in input order; a dump without an index is then read
by a streaming task of its own rather than by the driver.

Output folders are independent (one per language in the per-language layout): up to
``--parallel-languages`` of them are prepared at once, each in a thread with its own writers, all
sharing one budget of tasks in flight, so that several dumps are read at the same time.

The shards are format 2 (``clsys.shards.blocks``): blocks of up to ``--block-records`` records a tar sample.
The workers return each article's records (``EncodedPage``: texts and one metadata dict per article, pickled
once); the main process, which has to write every record in order by itself, only admits pages (duplicates
across inputs are only known there), counts, and hands the records to the writers, which shuffle them and
pack them into blocks, a tar header per block rather than two per sentence.

Each dump's language comes from its ``<siteinfo>`` or its Wikimedia file name (``DumpReader.lang``).
Dumps of several languages give ``OUT/<lang>/sentences`` and ``OUT/<lang>/documents`` (``--layout``); one
language keeps the plain ``OUT/sentences`` and ``OUT/documents``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from tqdm import tqdm

from clsys import storage
from clsys.storage import StorageError
from data_prep import __version__, cli
from data_prep.bz2_streams import (BadIndex, DumpError, TruncatedDump, check_index, index_blocks,
                                   read_bz2_stream)
from data_prep.dumps import DumpReader
from data_prep.process_pool import ProcessPool, WorkerDied
from data_prep.ray_pool import RayPool
from clsys.shards.manifest import previous_shas
from clsys.shards.blocks import MAX_BLOCK_RECORDS
from clsys.shards.writer import ShardWriter
from data_prep.wiki_tasks import BlockTask, EncodedPage, ordered_map, process_batch, process_block, read_batches

log = logging.getLogger(__name__)

STREAMS = ("sentences", "documents")
# The first five count pages (page_too_long: longer than MediaWiki keeps an article), the last three sentences.
SKIP_REASONS = ("redirect", "non_article", "duplicate", "page_too_long", "empty", "too_short", "too_long", "markup")
# What a folder or prefix given as --input contributes: Wikimedia's names ("…-pages-articles.xml.bz2",
# "…-pages-articles1.xml-p1p41242.bz2") and plain exports ("export.xml"); indexes ("…-index.txt.bz2") are not dumps.
DUMP_NAME = re.compile(r"\.xml(?:-p\d+p\d+[\w-]*)?(?:\.bz2)?$")


@dataclass
class SourceReport:
    """One input file, as recorded in the manifest's ``sources``."""

    file: str
    lang: str
    dbname: str | None
    pages_read: int = 0
    articles: int = 0
    bytes_read: int = 0  # of the (compressed) file
    status: str = "complete"  # "truncated": reading stopped early; "corrupt": some multistream blocks unreadable
    error: str | None = None
    byte_offset: int | None = None
    pages_lost: int = 0  # pages of unreadable multistream blocks (counted from the index)


@dataclass
class Counts:
    """One language's totals: its row of the summary table and its ``counts`` in its manifests."""

    files: int = 0
    pages: int = 0
    articles: int = 0
    sentences: int = 0
    passages: int = 0
    bytes_read: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))


class WikiJob:
    """State of one ``data_prep wiki`` run: readers in, two shard streams per output folder out.

    ``folders`` maps each language to its output folder; languages sharing one (``--layout flat``)
    share its streams.
    """

    def __init__(self, args: argparse.Namespace, tmp_dir: str, folders: dict[str, str]):
        self.args = args
        self.folders = folders
        max_bytes = int(args.shard_size_mb * 2**20)
        self.writers: dict[str, dict[str, ShardWriter]] = {}
        for folder in dict.fromkeys(folders.values()):
            self.writers[folder] = {name: ShardWriter(storage.join(folder, name), tmp_dir, max_bytes,
                                                      previous_shas(storage.join(folder, name)),
                                                      int(args.shuffle_window_mb * 2**20), args.seed,
                                                      args.block_records, args.compress == "gzip")
                                    for name in STREAMS}
        self.counts = {lang: Counts() for lang in folders}
        self.sources: list[SourceReport] = []
        self.seen: set[tuple[str, int]] = set()
        self.dumps_done, self.bytes_done, self.shown = 0, 0, 0.0
        self.reading: dict[str, int] = {}  # output folder -> bytes read of the dump it is reading now
        self.lock = threading.Lock()  # the folders' threads share the progress figures
        self.aborted = threading.Event()  # a folder failed: the others stop at their next result

    def admit(self, report: SourceReport, page_id: int, skip: str | None) -> bool:
        """Count one page read; True when it is a new article to write, else its skip is counted."""
        counts = self.counts[report.lang]
        report.pages_read += 1
        counts.pages += 1
        self.bar.update()
        if skip is None and (report.lang, page_id) in self.seen:
            skip = "duplicate"  # keys must stay unique across overlapping inputs
        if skip is not None:
            counts.skipped[skip] += 1
            return False
        self.seen.add((report.lang, page_id))
        report.articles += 1
        counts.articles += 1
        return True

    def progress(self, folder: str, dump_bytes: int, n_dumps: int, force: bool = False) -> None:
        """The bar's rate is pages/s; this adds the whole job's input read (``dump_bytes``: how far ``folder``'s
        current dump is read, as stored), its MB/s and the dumps done, at most twice a second (and when ``force``)."""
        with self.lock:
            self.reading[folder] = dump_bytes
            now = time.time()
            if force or now - self.shown >= 0.5:
                self.shown = now
                mb = (self.bytes_done + sum(self.reading.values())) / 1e6
                self.bar.set_postfix_str(f"{mb:.1f} MB, {mb / max(now - self.start, 1e-9):.2f} MB/s, dumps "
                                         f"{self.dumps_done}/{n_dumps}", refresh=force)

    def take(self, report: SourceReport, pages: list[tuple[int, str | EncodedPage]]) -> None:
        """Admit a task's pages in file order and write the new articles."""
        for page_id, outcome in pages:
            if isinstance(outcome, str):
                self.admit(report, page_id, outcome)
            elif self.admit(report, page_id, None):
                self.write(outcome)

    def read_pages(self, pool, slots: int, gate: threading.Semaphore, reader: DumpReader, report: SourceReport,
                   n_dumps: int) -> None:
        """A dump without an index: read in batches (``read_batches``) by a streaming Ray task of its own with
        ``--ray``, else by this process; the batches' articles processed by the workers."""
        info = reader.siteinfo
        args = (reader.path, report.lang, frozenset(info.media_prefixes), frozenset(info.category_prefixes),
                self.args.passage_words)
        batches = pool.stream(read_batches, args, ahead=2 * slots) if isinstance(pool, RayPool) else read_batches(*args)
        folder = self.folders[report.lang]
        for result in ordered_map(pool, process_batch, batches, 2 * slots, gate):
            if self.aborted.is_set():
                return
            self.take(report, result.pages)
            report.bytes_read = result.bytes_read
            self.progress(folder, result.bytes_read, n_dumps)
            if result.fault is not None:
                report.status = "truncated"
                report.error, report.byte_offset = result.fault

    def read_blocks(self, pool, slots: int, gate: threading.Semaphore, reader: DumpReader, index: str,
                    report: SourceReport, n_dumps: int) -> None:
        """A multistream dump with its index: workers read one bz2 stream each; blocks are written in file order.

        Each stream must end where the next listed one starts, and the last one where the closing stream starts,
        so no page escapes the index. An unreadable stream is skipped (its pages counted as lost), not fatal.
        """
        info = reader.siteinfo
        tasks = (BlockTask(reader.path, index, block, report.lang, frozenset(info.media_prefixes),
                           frozenset(info.category_prefixes), self.args.passage_words)
                 for block in index_blocks(index, reader.path))
        end, block, folder = None, None, self.folders[report.lang]
        for result in ordered_map(pool, process_block, tasks, 2 * slots, gate):
            if self.aborted.is_set():
                return
            block = result.block
            self.progress(folder, block.offset, n_dumps)
            if end is not None and block.offset != end:
                raise BadIndex(f"{index}:{block.line}: the previous bz2 stream ends at byte {end}, but this line lists "
                               f"{block.offset}: the dump holds a stream the index does not list")
            end = result.end
            if result.error is not None:
                self.lose(report, result.error, block.offset, len(block.page_ids))
                continue
            self.take(report, result.pages)
        if end is None:  # the last block was unreadable: where the closing stream starts is unknown
            return
        try:
            footer, footer_end = read_bz2_stream(reader.path, end)
        except TruncatedDump as err:
            self.lose(report, err.message, end, 0)
            return
        if footer.strip() != b"</mediawiki>" or footer_end != storage.size(reader.path):
            raise BadIndex(f"{index}:{block.line}: the dump goes on after the bz2 stream of this last listed block "
                           f"with more than the closing </mediawiki>: pages the index does not list?")

    @staticmethod
    def lose(report: SourceReport, error: str, offset: int, pages: int) -> None:
        """Record an unreadable multistream block; the first one's error and offset are reported."""
        if report.status == "complete":
            report.status, report.error, report.byte_offset = "corrupt", error, offset
        report.pages_lost += pages

    def write(self, page: EncodedPage) -> None:
        """An admitted article's records, made by the worker: counted and handed to the writers."""
        counts, streams = self.counts[page.lang], self.writers[self.folders[page.lang]]
        for reason in ("too_short", "too_long", "markup"):
            counts.skipped[reason] += getattr(page.stats, reason)
        if not page.sentences:
            counts.skipped["empty"] += 1
            return
        streams["sentences"].write_records(page.sentences)
        streams["documents"].write_records(page.passages)
        counts.sentences += len(page.sentences)
        counts.passages += len(page.passages)

    def run(self, readers: list[DumpReader], indexes: list[str | None]) -> None:
        """Every output folder's dumps in input order, up to ``--parallel-languages`` folders at a time (each in
        a thread of its own, all sharing one budget of tasks in flight)."""
        workers = self.args.workers
        if self.args.ray:
            pool = RayPool(workers or os.cpu_count() or 1)
            slots = pool.slots
        else:
            slots = workers or 1
            pool = ProcessPool(slots) if slots > 1 else None
        # After the pool: rates leave out the start of a local Ray cluster (seconds).
        self.bar = tqdm(unit=" pages", file=sys.stderr, mininterval=0.5, dynamic_ncols=True)
        self.start = time.time()
        dumps: dict[str, list] = {}  # output folder -> its (reader, index, report), in input order
        for reader, index in zip(readers, indexes):
            report = SourceReport(os.path.basename(reader.path), reader.lang, reader.siteinfo.dbname)
            self.sources.append(report)
            dumps.setdefault(self.folders[reader.lang], []).append((reader, index, report))
        # Without workers the folders would only take turns on this process's one core.
        at_once = 1 if pool is None else min(self.args.parallel_languages, len(dumps))
        gate = threading.BoundedSemaphore(2 * slots)
        threads = ThreadPoolExecutor(at_once, thread_name_prefix="data_prep-folder")
        try:
            futures = [threads.submit(self.run_folder, pool, slots, gate, folder, folder_dumps, len(readers))
                       for folder, folder_dumps in dumps.items()]
            wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:  # the first failure in input order
                if future.done() and future.exception() is not None:
                    raise future.exception()
        finally:
            # A folder failed (or Ctrl-C): the others stop at their next result, those not begun never begin.
            self.aborted.set()
            threads.shutdown(wait=True, cancel_futures=True)
            self.bar.close()
            if pool is not None:
                pool.terminate()

    def run_folder(self, pool, slots: int, gate: threading.Semaphore, folder: str, dumps: list, n_dumps: int) -> None:
        """One output folder's dumps in input order; its streams are closed after the last one, so that its
        shuffle windows (up to --shuffle-window-mb per stream) are written out then, not held until every
        language is read."""
        for reader, index, report in dumps:
            if self.aborted.is_set():
                return
            if index is not None:
                self.read_blocks(pool, slots, gate, reader, index, report, n_dumps)
                report.bytes_read = storage.size(reader.path)
            else:
                self.read_pages(pool, slots, gate, reader, report, n_dumps)
            with self.lock:
                self.dumps_done += 1
                self.bytes_done += report.bytes_read
                self.reading[folder] = 0
            self.progress(folder, 0, n_dumps, force=True)
            counts = self.counts[reader.lang]
            counts.files += 1
            counts.bytes_read += report.bytes_read
        if self.aborted.is_set():
            return
        for writer in self.writers[folder].values():
            writer.close()

    def languages(self, folder: str) -> list[str]:
        return sorted(lang for lang, f in self.folders.items() if f == folder)

    def manifest_extra(self, folder: str) -> dict:
        """What both manifests of ``folder`` record besides their shards: its languages' sources and counts."""
        langs = self.languages(folder)
        return {"tool": f"data_prep {__version__}", "languages": langs,
                "shuffle": {"window_mb": self.args.shuffle_window_mb, "seed": self.args.seed},
                "sources": [dataclasses.asdict(s) for s in self.sources if s.lang in langs],
                "skipped": {reason: sum(self.counts[lang].skipped[reason] for lang in langs)
                            for reason in SKIP_REASONS},
                "counts": {lang: dataclasses.asdict(self.counts[lang]) for lang in langs}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="DUMP",
                   help="MediaWiki XML dump(s): .xml or .bz2 (multistream ok), of one or more languages; or a folder "
                        "or s3://, file://, ... prefix: every *.xml, *.xml.bz2, *.xml-p…bz2 dump under it")
    p.add_argument("--index", nargs="+", metavar="INDEX",
                   help="multistream index (*-multistream-index*.txt.bz2), one per --input dump in the same order: "
                        "the dumps are then read in parallel by bz2 block too; output is identical")
    p.add_argument("--out", required=True, metavar="URL", help="output folder: s3://bucket/prefix, file:///abs or a path")
    p.add_argument("--layout", choices=("auto", "per-language", "flat"), default="auto",
                   help="per-language: OUT/<lang>/sentences and OUT/<lang>/documents; flat: OUT/sentences and "
                        "OUT/documents holding every language; auto (default): per-language when the inputs hold "
                        "more than one language, else flat")
    p.add_argument("--shard-size-mb", type=cli.positive(float), default=64.0, metavar="N",
                   help="roll shards over at this size in MiB, fractions allowed (default: 64)")
    cli.add_parallelism(p, "parse wikitext", "run the parsing (with --index: the reading of each bz2 block too, by "
                        "ranged reads from local or object storage) as Ray tasks")
    p.add_argument("--parallel-languages", type=cli.positive(int), default=4, metavar="N",
                   help="output folders (the languages of the per-language layout) prepared at the same time, each "
                        "reading its dumps in order; with --ray a dump without --index is read by a task of its "
                        "own, so N such dumps are read at once. Memory of this process: two shuffle windows per "
                        "folder (default: 4; with one worker and no --ray: 1)")
    p.add_argument("--passage-words", type=cli.positive(int), default=200, metavar="N",
                   help="word budget of a passage in the documents stream; a Chinese or Japanese character "
                        "counts as a word (default: 200)")
    p.add_argument("--shuffle-window-mb", type=cli.positive(float, allow_zero=True), default=64.0, metavar="N",
                   help="write the records of each N MiB of a stream's text in a seeded shuffled order, so that "
                        "shards mix the sentences of many articles (0: article order; default: 64, ~450,000 "
                        "sentences, ~2x that in this process's memory)")
    p.add_argument("--block-records", type=cli.positive(int, most=MAX_BLOCK_RECORDS), default=256, metavar="N",
                   help="records (sentences, passages) per tar sample of the shards (format 2; default: 256)")
    p.add_argument("--compress", choices=("none", "gzip"), default="none",
                   help="gzip: shards as .tar.gz (gzip level 1), ~0.5x the text's bytes where plain shards are "
                        "~1.1x; --shard-size-mb then counts the tar inside (default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of that shuffle (default: 0)")
    p.add_argument("--allow-truncated", action="store_true",
                   help="exit 0 (with a warning) when an input is truncated or corrupt; its good pages are kept")


def find_dumps(inputs: list[str]) -> list[str]:
    """The dump files of ``--input``: a file as given; a folder or object-store prefix → every dump under it,
    by name (``DUMP_NAME``). Raises ``DumpError`` for a folder or prefix without any."""
    dumps = []
    for entry in inputs:
        if storage.is_local(entry):
            path = storage.parse(entry).path
            if not os.path.isdir(path):  # a file, or a missing one: DumpReader reports it by the name given
                dumps.append(entry if "://" not in entry else path)
                continue
        elif storage.exists(entry):  # an object, not a prefix
            dumps.append(entry)
            continue
        found = [url for url, _ in storage.list_sizes(entry) if DUMP_NAME.search(url)]
        if not found:
            raise DumpError(f"{entry}: no MediaWiki dump (*.xml, *.xml.bz2, *.xml-p…bz2) in this folder or "
                            "under this prefix")
        dumps.extend(storage.parse(url).path if storage.is_local(url) else url for url in found)
    return dumps


def main(args: argparse.Namespace) -> int:
    """Run ``wiki``; returns the exit code (0 ok, 1 a worker died, 2 unusable input, index or storage, 3 truncated or
    corrupt input)."""
    start = time.time()
    try:
        storage.check_bucket(args.out)
        try:
            inputs = find_dumps(args.input)
        except DumpError as err:
            return cli.fail("wiki", str(err))
        indexes = args.index or [None] * len(inputs)
        if len(indexes) != len(inputs):
            return cli.fail("wiki", f"--index: {len(indexes)} index files for {len(inputs)} --input dumps; give "
                                    "one per dump, in the same order (a folder's dumps come in name order)")
        readers = [DumpReader(path) for path in inputs]
        for reader, index in zip(readers, indexes):  # validate every input before anything is written
            try:
                reader.read_siteinfo()
                if index is not None:
                    check_index(index, reader.path)
            except DumpError as err:
                return cli.fail("wiki", f"{reader.path}: {err}")
            if reader.lang is None and reader.head_fault is not None:
                fault = reader.head_fault
                return cli.fail("wiki", f"{reader.path}: {fault.message} (reading stopped at byte "
                                        f"{fault.byte_offset}) before its <siteinfo> ended: neither its pages nor "
                                        "its language can be read", 3)
            if reader.lang is None:
                return cli.fail("wiki", f"{reader.path}: cannot tell the dump's language: its <siteinfo> has no "
                                        "Wikimedia <dbname> (dewiki) or <base> (https://de.wikipedia.org/...) and its "
                                        "file name does not start with a dbname (name it like "
                                        "dewiki-latest-pages-articles.xml.bz2)")
        langs = list(dict.fromkeys(reader.lang for reader in readers))
        per_language = args.layout == "per-language" or (args.layout == "auto" and len(langs) > 1)
        folders = {lang: storage.join(args.out, lang) if per_language else args.out for lang in langs}
        # The streams, not OUT: a dump beside them is never written over (nor listed again: not a dump's name).
        streams = [storage.join(folder, name) for folder in dict.fromkeys(folders.values()) for name in STREAMS]
        if problem := cli.out_problem(args.out, streams, [*inputs, *filter(None, indexes)]):
            return cli.fail("wiki", problem)
        with tempfile.TemporaryDirectory(prefix="data_prep-") as tmp:
            job = WikiJob(args, tmp, folders)
            job.run(readers, indexes)
            faulty = [s for s in job.sources if s.status != "complete"]
            level = "warning" if args.allow_truncated else "error"
            for s, path in zip(job.sources, inputs):
                if s.status == "truncated":
                    log.warning(storage.redact(f"data_prep wiki: {level}: {path}: {s.error} (reading stopped at byte "
                                               f"{s.byte_offset}); kept the {s.pages_read} complete pages before it"))
                elif s.status == "corrupt":
                    log.warning(storage.redact(f"data_prep wiki: {level}: {path}: {s.error} in the bz2 block at byte "
                                               f"{s.byte_offset} (the first unreadable one); lost {s.pages_lost} pages, "
                                               f"kept the {s.pages_read} pages of the other blocks"))
            # A folder without text gets no manifest (so it cannot be trained on by mistake); the other
            # languages of the run are written all the same.
            empty = [folder for folder, writers in job.writers.items() if writers["sentences"].samples == 0]
            for folder in empty:
                langs = job.languages(folder)
                files = [path for path, s in zip(inputs, job.sources) if s.lang in langs]
                cli.fail("wiki", f"{', '.join(files)}: no article text found (articles: "
                                 f"{sum(job.counts[lang].articles for lang in langs)}); nothing written")
            # Manifests last, once every shard of every stream is uploaded.
            urls = {(folder, name): writer.write_manifest(job.manifest_extra(folder))
                    for folder, writers in job.writers.items() if folder not in empty
                    for name, writer in writers.items()}
    except (StorageError, BadIndex) as err:  # a BadIndex found while reading: no manifest is written
        return cli.fail("wiki", str(err))
    except (WorkerDied, OSError) as err:  # OSError: the local folder shards are built in before the upload
        return cli.failed_run("wiki", err)
    _summary(job, urls, time.time() - start)
    if empty:
        return 3 if faulty else 2
    return 3 if faulty and not args.allow_truncated else 0


def _summary(job: WikiJob, urls: dict[tuple[str, str], str], seconds: float) -> None:
    pages = sum(s.pages_read for s in job.sources)
    print(f"pages read: {pages}, articles: {sum(s.articles for s in job.sources)} "
          f"in {seconds:.1f}s ({pages / max(seconds, 1e-9):.0f} pages/s)")
    for (folder, name), url in urls.items():
        writer = job.writers[folder][name]
        print(storage.redact(f"{'sentences' if name == 'sentences' else 'passages'}: {writer.samples} in "
                             f"{len(writer.shards)} shards ({writer.uploaded} uploaded, {writer.unchanged} unchanged: "
                             f"upload skipped) -> {url}"))
    print(summary_table(job.counts))


def summary_table(counts: dict[str, Counts]) -> str:
    """One row per language and a total: files, pages, articles, sentences, passages, MB read, then the
    skipped pages (redirect … empty) and sentences (too_short, too_long, markup) by reason, and the share of
    the sentences split that were kept (a language whose script is split or measured badly stands out)."""
    header = ["lang", "files", "pages", "articles", "sentences", "passages", "MB read", *SKIP_REASONS, "kept %"]
    rows = [[c.files, c.pages, c.articles, c.sentences, c.passages, c.bytes_read, *c.skipped.values()]
            for c in counts.values()]
    table = [[lang, *row] for lang, row in zip(counts, rows)] + [["total", *map(sum, zip(*rows))]]
    for row in table:
        split = row[4] + sum(row[-3:])  # kept + SKIP_REASONS' last three: too_short, too_long, markup
        row.append(f"{100 * row[4] / split:.1f}" if split else "-")
        row[6] = f"{row[6] / 1e6:.1f}"  # bytes → MB
    lines = [header, *([str(v) for v in row] for row in table)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    # Language codes left-aligned, numbers right-aligned.
    return "\n".join("  ".join([line[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(line[1:], widths[1:])])
                     for line in lines)
