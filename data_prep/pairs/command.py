"""``python -m data_prep pairs``: (query, positive, negatives) data → one format 2 stream per source.

Inputs (JSONL, CSV/TSV with a header, Parquet, Arrow IPC, a Hugging Face ``save_to_disk`` folder) are checked
first, then cut into parts by ``read`` (in this process, or with ``--ray`` by a streaming task per input)
and dealt in turn to the workers (``worker.PairsWorker`` in a ``stateful_pool.StatefulPool``: processes,
Ray actors with ``--ray``, or this process for one worker). A worker turns a part's rows into records (as
``rows`` says a row means), keeps them, and answers with their 8-byte digests and counts. This process
takes the answers in input order (``wiki_tasks.ordered_map``, as ``data_prep wiki`` does), holds the digests of
every source's pairs so far, counts, and tells each worker which of its part's pairs are duplicates: exact
duplicates are dropped across the whole input, whichever workers read them. The worker writes the others with
its own ``ShardWriter`` per source, so no record crosses a process boundary. What a worker writes depends on
the input and the number of workers alone (parts are dealt in turn); the pairs written and the counts do not
depend on the number of workers. Streams are ``OUT/pairs/<source>``; their manifests, listing every worker's
shards, are written last, once every worker's shards are published, so a failed run leaves none.

A record's text is the query (a format 2 text is one line: its line breaks become spaces, counted as
``query_line_breaks``); its metadata ``{positive, negatives, source, instruction}`` (``instruction`` is ""
when the row has none: a block's records share their fields).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import itertools
import logging
import os
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

from clsys import storage
from clsys.shards.blocks import FORMAT_V2, MAX_BLOCK_RECORDS
from clsys.shards.manifest import previous_shas
from clsys.shards.writer import remove_staged, write_manifest
from clsys.storage import StorageError
from data_prep import __version__, cli
from data_prep.pairs.dedup import DIGEST, DigestSet
from data_prep.pairs.read import PairsInput, Unreadable, check_source, default_source, open_input, read_parts
from data_prep.pairs.rows import SKIP_REASONS, InputError, PartResult
from data_prep.pairs.worker import PairsWorker, WrittenShards
from data_prep.process_pool import WorkerDied
from data_prep.ray_pool import RayPool
from data_prep.stateful_pool import StatefulPool
from data_prep.wiki_tasks import ordered_map

log = logging.getLogger(__name__)

COUNTS = ("rows", "pairs", "duplicates", "query_line_breaks")  # a source's counts, before its skip reasons
WARNINGS = 5  # skipped rows whose message is printed
MAX_SOURCES = 256  # --max-sources' default: far more than a training mix names, far fewer than a runaway column


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
    """State of one run: per source, the digests of the pairs written, the counts, and what each worker wrote."""

    def __init__(self, args: argparse.Namespace, tmp_dir: str, reports: list[InputReport]):
        self.args, self.tmp_dir, self.reports = args, tmp_dir, reports
        # The digests of the pairs written, per source (8 bytes a pair, 16 at most: bench/pairs_memory.py).
        self.seen: dict[str, DigestSet] = {}
        self.counts: dict[str, dict[str, int]] = {}
        # Per source with pairs: its old manifest's shards, read before any worker writes to it; the workers
        # told them so far, as (worker, source).
        self.previous: dict[str, dict[str, str]] = {}
        self.told: set[tuple[int, str]] = set()
        self.written: dict[str, list[WrittenShards]] = {}  # per source: what each worker wrote, in worker order
        self.messages: list[str] = []
        self.skipped_messages = 0
        self.workers = 1

    def source_counts(self, source: str) -> dict[str, int]:
        counts = self.counts.get(source)
        if counts is None:
            counts = self.counts[source] = dict.fromkeys(COUNTS + SKIP_REASONS, 0)
        return counts

    def url(self, source: str) -> str:
        return storage.join(self.args.out, "pairs", source)

    def take(self, worker: int, result: PartResult) -> tuple[dict[str, list[int]], dict[str, dict[str, str]]]:
        """A part's result, in input order: its rows and skipped rows counted, its pairs' digests checked
        against every pair before it. Returns what ``PairsWorker.admit`` takes: the places of its duplicates
        per source, and the old manifest's shards of each source that ``worker`` is to write first."""
        report = self.reports[result.input]
        self.check_sources(result, report)
        for source, counter in result.counts.items():
            counts = self.source_counts(source)
            for key, n in counter.items():
                counts[key] += n
                if key == "rows":
                    report.rows += n
                elif key in report.skipped:
                    report.skipped[key] += n
        duplicates, previous = {}, {}
        for source, digests in result.digests.items():
            seen = self.seen.get(source)
            if seen is None:
                seen = self.seen[source] = DigestSet()
            pairs = len(digests) // DIGEST.itemsize
            dropped = seen.add(np.frombuffer(digests, DIGEST)).tolist()
            counts = self.source_counts(source)
            counts["pairs"] += pairs - len(dropped)
            counts["duplicates"] += len(dropped)
            if dropped:
                duplicates[source] = dropped
            if pairs > len(dropped) and (worker, source) not in self.told:
                if source not in self.previous:
                    self.previous[source] = previous_shas(self.url(source))
                previous[source] = self.previous[source]
                self.told.add((worker, source))
        self.skipped_messages += sum(v for c in result.counts.values() for k, v in c.items() if k in SKIP_REASONS)
        self.messages += result.messages[:WARNINGS - len(self.messages)]
        return duplicates, previous

    def check_sources(self, result: PartResult, report: InputReport) -> None:
        """``InputError`` naming the first row of the part's first source past ``--max-sources``: each is a
        stream, with its own shard files and shuffle window in every worker that writes it (a 1 MB file naming
        20,000 sources wrote 40,000 files in 165 s), so a source column that names without end stops the run."""
        new = [source for source in result.counts if source not in self.counts]
        most = self.args.max_sources
        if len(self.counts) + len(new) <= most:
            return
        source = new[most - len(self.counts)]
        where = result.first_rows.get(source, report.file)
        what = f"source {source!r} (the input's)" if source == report.source else f"column 'source': {source!r}"
        raise InputError(f"{where}: {what} would be source {most + 1} of this run, over --max-sources {most} (a "
                         "stream, a shuffle window and shard files each): raise --max-sources if the data means it")

    def run(self, inputs: list[PairsInput]) -> None:
        """Every input's parts in input order, dealt to the workers in turn (processes, Ray actors, or this
        process); each part admitted as its result comes, in input order; then every worker's shards finished."""
        ray = RayPool(self.args.workers or os.cpu_count() or 1, "pairs") if self.args.ray else None
        pool = StatefulPool(functools.partial(PairsWorker, self.args, self.tmp_dir), self.args.workers or 1, ray)
        self.workers = pool.size
        window = 2 * pool.size
        if ray is not None:
            parts = itertools.chain.from_iterable(ray.stream(read_parts, (inp,), ahead=window) for inp in inputs)
        else:
            parts = itertools.chain.from_iterable(read_parts(inp) for inp in inputs)
        bar = tqdm(total=sum(inp.size for inp in inputs), unit="B", unit_scale=True, file=sys.stderr,
                   mininterval=0.5, dynamic_ncols=True)
        try:
            for call, result in enumerate(ordered_map(pool, PairsWorker.parse, parts, window)):
                worker = pool.worker(call)
                pool.submit(worker, PairsWorker.admit, self.take(worker, result))
                bar.update(result.nbytes)
            closing = [pool.submit(worker, PairsWorker.close, ()) for worker in range(pool.size)]
            for reply in closing:
                for source, written in reply.get().items():
                    self.written.setdefault(source, []).append(written)
        finally:
            bar.close()
            pool.terminate()
            # What a failed run's writers, ended above, were building, and what an earlier run killed with
            # kill -9 (whose own cleanup never ran) left in the streams of this one.
            for source in self.previous:
                remove_staged(self.url(source))

    def write_manifest(self, source: str) -> str:
        """The stream's manifest, listing every worker's shards in worker order: its source's counts, and every
        input's."""
        counts = self.counts[source]
        shards = [shard for written in self.written[source] for shard in written.shards]
        extra = {"tool": f"data_prep {__version__}", "source": source,
                 "shuffle": {"window_mb": self.args.shuffle_window_mb, "seed": self.args.seed},
                 "counts": {**{k: counts[k] for k in COUNTS}, "skipped": {r: counts[r] for r in SKIP_REASONS}},
                 "inputs": [dataclasses.asdict(r) for r in self.reports]}
        return write_manifest(self.url(source), shards, sum(s.samples for s in shards), FORMAT_V2, extra,
                              self.previous[source])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="pairs data: .jsonl/.json (JSON lines), .csv, .tsv (a header line), each also compressed "
                        "(.jsonl.gz, .csv.zst, ...), .parquet, .arrow, or a Hugging Face datasets save_to_disk "
                        "folder; local paths")
    p.add_argument("--out", required=True, metavar="URL",
                   help="output root: s3://bucket/prefix, file:///abs or a path; streams go to OUT/pairs/<source>")
    p.add_argument("--source", metavar="NAME",
                   help="the source of every input (default: each file's name without its extension); a row's "
                        "'source' column overrides it")
    p.add_argument("--max-sources", type=cli.positive(int), default=MAX_SOURCES, metavar="N",
                   help="stop the run (exit 2, naming the row) at a source beyond the first N of the run: each source "
                        f"is a stream, with shard files and a shuffle window of its own (default: {MAX_SOURCES})")
    p.add_argument("--skip-bad", action="store_true",
                   help="count bad rows and unreadable inputs (by reason, in the manifests and the summary) instead "
                        "of stopping at the first with an error")
    cli.add_parallelism(p, "parse rows and write shards, each its own (shard-<worker>-NNNNNN; one worker: "
                        "shard-NNNNNN)",
                        "the workers as Ray actors, one per CPU of the cluster (each input cut into parts by a "
                        "streaming task)", "the inputs, and a local --out, must be on a file system every node sees",
                        "any N writes the same pairs and counts; the same N, the same shards",
                        "a failed actor stops the run; output identical to a run with --workers N, N the cluster's "
                        "CPUs")
    p.add_argument("--shard-size-mb", type=cli.positive(float), default=64.0, metavar="N",
                   help="roll shards over at this size in MiB, fractions allowed (default: 64)")
    p.add_argument("--shuffle-window-mb", type=cli.positive(float, allow_zero=True), default=64.0, metavar="N",
                   help="each worker writes its pairs of each stream in a seeded shuffled order, a window at a time; "
                        "its windows, one a stream, hold N MiB together, a pair counted as the characters of its "
                        "query, positive, negatives, source and instruction + 16 (64 MiB: ~30,000 pairs of 2 KB); "
                        "0: input order (default: 64)")
    p.add_argument("--block-records", type=cli.positive(int, most=MAX_BLOCK_RECORDS), default=256, metavar="N",
                   help="pairs per tar sample of the shards (format 2; default: 256)")
    p.add_argument("--compress", choices=("none", "gzip"), default="none",
                   help="gzip: shards as .tar.gz (gzip level 1); --shard-size-mb then counts the tar inside")
    p.add_argument("--seed", type=int, default=0, help="seed of that shuffle (default: 0)")


def main(args: argparse.Namespace) -> int:
    """Run ``pairs``; returns the exit code (0 ok, 1 a worker died, 2 a bad input or row, no pairs, or a storage
    error)."""
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
                log.warning(f"data_prep pairs: warning: {err} (skipped)")
        with tempfile.TemporaryDirectory(prefix="data_prep-") as tmp:
            job = PairsJob(args, tmp, reports)
            for report in reports:
                if report.format == "unreadable":
                    job.source_counts(report.source)["unreadable"] += 1
            job.run([inp for inp in inputs if inp is not None])
            for message in job.messages:
                log.warning(f"data_prep pairs: warning: {message} (skipped)")
            if job.skipped_messages > len(job.messages):
                more = job.skipped_messages - len(job.messages)
                log.warning(f"data_prep pairs: warning: ... {more} more skipped rows (counted by reason in the manifests)")
            written = sorted(source for source, counts in job.counts.items() if counts["pairs"])
            if not written:
                return cli.fail("pairs", f"{', '.join(args.input)}: no pairs ({_skipped(reports)}); nothing written")
            # Manifests last, once every worker has published its shards (its close).
            urls = {source: job.write_manifest(source) for source in written}
    except (InputError, StorageError) as err:
        return cli.fail("pairs", str(err))
    except (WorkerDied, OSError) as err:  # OSError: the local folder shards are built in before the upload
        return cli.failed_run("pairs", err)
    _summary(job, urls, sum(r.bytes for r in reports), time.time() - start)
    return 0


def _skipped(reports: list[InputReport]) -> str:
    totals = collections.Counter()
    for report in reports:
        totals.update(report.skipped)
    return "skipped: " + (", ".join(f"{k}={v}" for k, v in totals.items() if v) or "none")


def _summary(job: PairsJob, urls: dict[str, str], nbytes: int, seconds: float) -> None:
    rate = nbytes / 1e6 / max(seconds, 1e-9)
    print(f"input: {nbytes / 1e6:.1f} MB in {seconds:.1f}s ({rate:.1f} MB/s: {rate / job.workers:.1f} MB/s per "
          f"worker, {job.workers} worker{'s' * (job.workers > 1)})")
    for source, url in urls.items():
        written = job.written[source]
        shards = [shard for w in written for shard in w.shards]
        print(storage.redact(f"pairs/{source}: {sum(s.samples for s in shards)} pairs in {len(shards)} shards "
                             f"({sum(w.uploaded for w in written)} uploaded, {sum(w.unchanged for w in written)} "
                             f"unchanged: upload skipped) -> {url}"))
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
