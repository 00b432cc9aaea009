"""``python -m data_prep pairs``: (query, positive, negatives) data → one format 2 stream per source.

Inputs (JSONL, CSV/TSV with a header, Parquet, Arrow IPC, a Hugging Face ``save_to_disk`` folder) are checked
first, then read in parts by ``pairs_read`` (workers turn rows into records, as ``pairs_rows`` says a row
means, with a process pool as ``data_prep wiki`` has, or Ray tasks with ``--ray``: ``ray_pool.RayPool``, fed by
a streaming task per input). This process takes their results in input order (``wiki_tasks.ordered_map``),
drops exact duplicate pairs of a source by their 16-byte digest, counts, and hands the records to one
``ShardWriter`` per source, as ``wiki`` writes its sentences: shuffled by ``--shuffle-window-mb`` windows, blocks
of ``--block-records``. The output is therefore identical for any number of workers. Streams are
``OUT/pairs/<source>``; their manifests are written last, once every stream's shards are published, so a failed
run leaves none.

A record's text is the query (a format 2 text is one line: its line breaks become spaces, counted as
``query_line_breaks``); its metadata ``{positive, negatives, source, instruction}`` (``instruction`` is ""
when the row has none: a block's records share their fields).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import multiprocessing
import os
import sys
import tempfile
import time

from tqdm import tqdm

from clsys import storage
from clsys.shards.manifest import previous_shas
from clsys.shards.blocks import MAX_BLOCK_RECORDS
from clsys.shards.writer import ShardWriter
from clsys.storage import StorageError
from data_prep import __version__, cli
from data_prep.pairs_read import (PairsInput, Unreadable, check_source, default_source, open_input, process_part,
                                  read_parts)
from data_prep.pairs_rows import SKIP_REASONS, InputError, PartResult
from data_prep.ray_pool import RayPool
from data_prep.wiki_tasks import ordered_map

COUNTS = ("rows", "pairs", "duplicates", "query_line_breaks")  # a source's counts, before its skip reasons
WARNINGS = 5  # skipped rows whose message is printed


@dataclasses.dataclass
class InputReport:
    """One input, as the manifests' ``inputs`` list it: its rows that gave pairs, and the ones skipped."""

    file: str
    format: str
    source: str  # its default source
    bytes: int
    rows: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))


class PairsJob:
    """State of one run: a writer, a set of digests and counts per source."""

    def __init__(self, args: argparse.Namespace, tmp_dir: str, reports: list[InputReport]):
        self.args, self.tmp_dir, self.reports = args, tmp_dir, reports
        self.writers: dict[str, ShardWriter] = {}
        # 16-byte digests of the pairs written, per source: 83 bytes of memory a pair (the bytes object and its
        # set slot; bench/data_prep_pairs.py), what dropping duplicates costs.
        self.seen: dict[str, set[bytes]] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.messages: list[str] = []
        self.skipped_messages = 0

    def source_counts(self, source: str) -> dict[str, int]:
        counts = self.counts.get(source)
        if counts is None:
            counts = self.counts[source] = dict.fromkeys(COUNTS + SKIP_REASONS, 0)
        return counts

    def writer(self, source: str) -> ShardWriter:
        writer = self.writers.get(source)
        if writer is None:
            args = self.args
            url = storage.join(args.out, "pairs", source)
            writer = self.writers[source] = ShardWriter(
                url, self.tmp_dir, int(args.shard_size_mb * 2**20), previous_shas(url),
                int(args.shuffle_window_mb * 2**20), args.seed, args.block_records, args.compress == "gzip")
        return writer

    def take(self, result: PartResult) -> None:
        """A part's results, in input order: its new pairs written, duplicates and skipped rows counted."""
        report = self.reports[result.input]
        for source, counter in result.counts.items():
            counts = self.source_counts(source)
            for key, n in counter.items():
                counts[key] += n
                if key == "rows":
                    report.rows += n
                elif key in report.skipped:
                    report.skipped[key] += n
        for source, (digests, records) in result.pairs.items():
            seen, fresh = self.seen.setdefault(source, set()), []
            for digest, record in zip(digests, records):
                if digest not in seen:
                    seen.add(digest)
                    fresh.append(record)
            counts = self.source_counts(source)
            counts["pairs"] += len(fresh)
            counts["duplicates"] += len(records) - len(fresh)
            self.writer(source).write_records(fresh)
        self.skipped_messages += sum(v for c in result.counts.values() for k, v in c.items() if k in SKIP_REASONS)
        self.messages += result.messages[:WARNINGS - len(self.messages)]

    def run(self, inputs: list[PairsInput]) -> None:
        """Every input's parts in input order through the workers (a pool, Ray tasks, or this process)."""
        workers = self.args.workers
        if self.args.ray:
            pool = RayPool(workers or os.cpu_count() or 1, "pairs")
            slots = pool.slots
            parts = itertools.chain.from_iterable(pool.stream(read_parts, (inp,), ahead=2 * slots) for inp in inputs)
        else:
            slots = workers or 1
            pool = multiprocessing.Pool(slots) if slots > 1 else None
            parts = itertools.chain.from_iterable(read_parts(inp) for inp in inputs)
        bar = tqdm(total=sum(inp.size for inp in inputs), unit="B", unit_scale=True, file=sys.stderr,
                   mininterval=0.5, dynamic_ncols=True)
        try:
            for result in ordered_map(pool, process_part, parts, 2 * slots):
                self.take(result)
                bar.update(result.nbytes)
            for writer in self.writers.values():
                writer.close()
        finally:
            bar.close()
            if pool is not None:
                pool.terminate()

    def manifest_extra(self, source: str) -> dict:
        """What a stream's manifest records besides its shards: its source's counts, and every input's."""
        counts = self.counts[source]
        return {"tool": f"data_prep {__version__}", "source": source,
                "shuffle": {"window_mb": self.args.shuffle_window_mb, "seed": self.args.seed},
                "counts": {**{k: counts[k] for k in COUNTS}, "skipped": {r: counts[r] for r in SKIP_REASONS}},
                "inputs": [dataclasses.asdict(r) for r in self.reports]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="pairs data: .jsonl/.json (JSON lines), .csv, .tsv (a header line), .parquet, .arrow, or a "
                        "Hugging Face datasets save_to_disk folder; local paths")
    p.add_argument("--out", required=True, metavar="URL",
                   help="output root: s3://bucket/prefix, file:///abs or a path; streams go to OUT/pairs/<source>")
    p.add_argument("--source", metavar="NAME",
                   help="the source of every input (default: each file's name without its extension); a row's "
                        "'source' column overrides it")
    p.add_argument("--skip-bad", action="store_true",
                   help="count bad rows and unreadable inputs (by reason, in the manifests and the summary) instead "
                        "of stopping at the first with an error")
    cli.add_parallelism(p, "parse rows", "parse as Ray tasks (each input read by a streaming task; a Parquet row "
                        "group by the task that parses it)", "the inputs must be on a file system every node sees")
    p.add_argument("--shard-size-mb", type=cli.positive(float), default=64.0, metavar="N",
                   help="roll shards over at this size in MiB, fractions allowed (default: 64)")
    p.add_argument("--shuffle-window-mb", type=cli.positive(float, allow_zero=True), default=2.0, metavar="N",
                   help="write each stream's pairs in a seeded shuffled order, N MiB of queries at a time (counted "
                        "as the queries' bytes + 16 a pair, so a window holds ~30,000 pairs of 50-byte queries a "
                        "MiB, all their positives and negatives in this process's memory; 0: input order; "
                        "default: 2)")
    p.add_argument("--block-records", type=cli.positive(int, most=MAX_BLOCK_RECORDS), default=256, metavar="N",
                   help="pairs per tar sample of the shards (format 2; default: 256)")
    p.add_argument("--compress", choices=("none", "gzip"), default="none",
                   help="gzip: shards as .tar.gz (gzip level 1); --shard-size-mb then counts the tar inside")
    p.add_argument("--seed", type=int, default=0, help="seed of that shuffle (default: 0)")


def main(args: argparse.Namespace) -> int:
    """Run ``pairs``; returns the exit code (0 ok, 2 a bad input or row, no pairs, or a storage error)."""
    start = time.time()
    try:
        if args.source is not None:
            check_source("--source", args.source, True)
        storage.check_bucket(args.out)
        if problem := cli.out_problem(args.out, [storage.join(args.out, "pairs")], args.input):
            return cli.fail("pairs", problem)
        inputs, reports = [], []
        for index, path in enumerate(args.input):  # every input checked before anything is written
            try:
                inputs.append(open_input(index, path, args.source, args.skip_bad))
                reports.append(InputReport(path, inputs[-1].format, inputs[-1].source, inputs[-1].size))
            except Unreadable as err:
                if not args.skip_bad:
                    raise
                inputs.append(None)
                report = InputReport(path, "unreadable", default_source(path, args.source), 0)
                report.skipped["unreadable"] = 1
                reports.append(report)
                print(f"data_prep pairs: warning: {err} (skipped)", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="data_prep-") as tmp:
            job = PairsJob(args, tmp, reports)
            for report in reports:
                if report.format == "unreadable":
                    job.source_counts(report.source)["unreadable"] += 1
            job.run([inp for inp in inputs if inp is not None])
            for message in job.messages:
                print(f"data_prep pairs: warning: {message} (skipped)", file=sys.stderr)
            if job.skipped_messages > len(job.messages):
                print(f"data_prep pairs: warning: ... {job.skipped_messages - len(job.messages)} more skipped rows "
                      "(counted by reason in the manifests)", file=sys.stderr)
            written = sorted(source for source, writer in job.writers.items() if writer.samples)
            if not written:
                return cli.fail("pairs", f"{', '.join(args.input)}: no pairs ({_skipped(reports)}); nothing written")
            # Manifests last, once every stream's shards are published.
            urls = {source: job.writers[source].write_manifest(job.manifest_extra(source)) for source in written}
    except (InputError, StorageError) as err:
        return cli.fail("pairs", str(err))
    except OSError as err:  # shards are built in a local temporary folder before they are uploaded
        return cli.fail("pairs", f"{err.filename or 'a local file'}: {err.strerror or err} (shards are built in "
                                 f"{tempfile.gettempdir()} before the upload: set TMPDIR to a disk with room)")
    _summary(job, urls, sum(r.bytes for r in reports), time.time() - start)
    return 0


def _skipped(reports: list[InputReport]) -> str:
    totals = collections.Counter()
    for report in reports:
        totals.update(report.skipped)
    return "skipped: " + (", ".join(f"{k}={v}" for k, v in totals.items() if v) or "none")


def _summary(job: PairsJob, urls: dict[str, str], nbytes: int, seconds: float) -> None:
    print(f"input: {nbytes / 1e6:.1f} MB in {seconds:.1f}s ({nbytes / 1e6 / max(seconds, 1e-9):.1f} MB/s)")
    for source, url in urls.items():
        writer = job.writers[source]
        print(storage.redact(f"pairs/{source}: {writer.samples} pairs in {len(writer.shards)} shards "
                             f"({writer.uploaded} uploaded, {writer.unchanged} unchanged: upload skipped) -> {url}"))
    print(summary_table(job.counts))


def summary_table(counts: dict[str, dict[str, int]]) -> str:
    """One row per source (a source without pairs too: it has no stream) and a total."""
    keys = COUNTS + SKIP_REASONS
    rows = [[source, *(counts[source][k] for k in keys)] for source in sorted(counts)]
    rows.append(["total", *(sum(row[i + 1] for row in rows) for i in range(len(keys)))])
    lines = [["source", *keys], *([str(v) for v in row] for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join([line[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(line[1:], widths[1:])])
                     for line in lines)
