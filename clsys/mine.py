"""``python -m clsys.mine``: hard negatives for (query, positive) pairs, mined with a text encoder on Ray workers.

    python -m clsys.mine --model all-MiniLM-L6-v2 --data s3://bucket/pairs-root --out s3://bucket/mined
    python -m clsys.mine --model runs/e5/export --data /data/pairs-root --corpus /data/wiki/documents \\
        --out /data/mined --k 15 --keep-given

Input: the ``pairs/<source>`` streams under ``--data`` (what ``data_prep pairs`` writes). Output: the same
streams under ``--out``, each pair with ``--k`` mined negatives in place of its given ones (``--keep-given``: after
them), written through the project's ``ShardWriter`` (format 2) with their manifests last.

How (``clsys/retrieval/``): every worker embeds its slice of the corpus (the distinct positives and given
negatives of the streams, or ``--corpus``'s passages and the positives: ``corpus.py``) and holds it; nothing holds
the whole corpus. The queries go out in batches: each worker embeds its share of a batch, every worker scores the
whole batch against its slice and returns its best candidates (``worker.py``), and this process merges them into
the corpus's best (``topk.py``: exactly the ranking one process would make of the whole corpus, ties by id) and
keeps the first ``--k`` that are not false negatives (``negatives.py``, NV-Retriever's TopK-PercPos). A shard's
negatives are saved as soon as its queries are done, and the workers' slices once they are embedded (``work.py``):
the same command run again after a failure continues from there.

Exit codes: 0 done; 2 bad options or input, an ``--out`` that overlaps an input, progress of other settings
under ``--out``, a storage error; 1 a worker that failed (run the same command again to continue).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import math
import os
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from clsys import __version__, logs, storage
from clsys.engine.launch import init_ray_for_tasks
from clsys.model.declared import default_max_length, folder_pooling, folder_prompts
from clsys.model.encoder import POOLINGS
from clsys.model.loading import checked_model_path, resolve_model_path
from clsys.retrieval import topk, work
from clsys.retrieval.corpus import PAIRS, corpus_shards, pair_streams, text_id
from clsys.retrieval.negatives import DROP_REASONS, choose_negatives
from clsys.retrieval.worker import Encoding, Found, MiningWorker
from clsys.shards.blocks import Record
from clsys.shards.manifest import previous_shas, read_manifest
from clsys.shards.reader import COMPRESSED, Shard, ShardError, load_shards, read_shard
from clsys.shards.writer import ShardWriter
from clsys.storage import StorageError

log = logs.module_logger(__name__, __spec__)

PROG = "clsys.mine"
# Settings the workers need, handed over in Ray's runtime_env by init_ray_for_tasks, but one whose value holds a
# secret (AWS_ENDPOINT_URL with a password: launch.handed_env); credentials come from each worker's own
# environment or role.
WORKER_ENV = ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")
IN_FLIGHT = 3  # query batches sent out before the oldest one's candidates are taken: the workers never wait


class Refused(Exception):
    """What makes the run stop before or while it writes, in one line (exit 2)."""


def positive(kind):
    """An argparse type: a number of ``kind`` above 0."""
    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            number = None
        if number is None or not number > 0 or (kind is float and not math.isfinite(number)):
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} above 0, got {value!r}")
        return number
    return parse


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, metavar="DIR",
                   help="the encoder: a clsys export, a sentence-transformers or Hugging Face folder, or a packaged "
                        "alias (all-MiniLM-L6-v2)")
    p.add_argument("--data", required=True, metavar="URL",
                   help="the root of the pairs streams (data_prep pairs --out): every URL/pairs/<source> is mined")
    p.add_argument("--out", required=True, metavar="URL",
                   help="output root: the streams go to OUT/pairs/<source>, the run's progress to OUT/.mining; apart "
                        "from every input")
    p.add_argument("--corpus", metavar="URL",
                   help="where negatives come from: a stream whose records' text is a passage (documents, "
                        "sentences), or a root of pairs streams (their positives and negatives); the pairs' "
                        "positives are always in it (default: the positives and given negatives of --data)")
    p.add_argument("--k", type=positive(int), default=7, help="mined negatives per pair (default: 7)")
    p.add_argument("--depth", type=positive(int), metavar="N",
                   help="candidates ranked per pair, besides its positives and kept given negatives, to find the k "
                        "among (default: 4 x k)")
    p.add_argument("--max-score-ratio", type=positive(float), default=0.95, metavar="R",
                   help="drop a candidate scoring above R x its pair's positive's score as a false negative "
                        "(NV-Retriever's TopK-PercPos; default: 0.95)")
    p.add_argument("--keep-given", action="store_true",
                   help="keep each pair's given negatives and add the mined ones after them (default: the mined ones "
                        "replace them)")
    p.add_argument("--pooling", choices=POOLINGS,
                   help="default: the model's (its 1_Pooling/config.json)")
    p.add_argument("--query-prefix", help="default: the model's 'query' prompt (config_sentence_transformers.json)")
    p.add_argument("--passage-prefix",
                   help="default: the model's 'document', 'passage' or 'corpus' prompt (config_sentence_transformers.json)")
    p.add_argument("--max-length", type=positive(int), metavar="N",
                   help="tokens per text; default: the model's sentence_bert_config.json, else its position limit")
    p.add_argument("--workers", type=positive(int), metavar="N",
                   help="Ray workers, each holding a slice of the corpus (default: the cluster's CPUs / "
                        "--cpus-per-worker)")
    p.add_argument("--cpus-per-worker", type=positive(int), default=1, metavar="N", help="default: 1")
    p.add_argument("--gpus-per-worker", type=positive(float), metavar="N",
                   help="give each worker a GPU (or a share of one): the model and its slice go there (default: none)")
    p.add_argument("--batch-size", type=positive(int), default=64, metavar="N", help="texts per forward pass (default: 64)")
    p.add_argument("--query-batch", type=positive(int), default=1024, metavar="N",
                   help="queries sent to the workers at a time (default: 1024)")
    p.add_argument("--shard-size-mb", type=positive(float), default=64.0, metavar="N",
                   help="roll output shards over at this size in MiB (default: 64)")
    p.add_argument("--block-records", type=positive(int), default=256, metavar="N",
                   help="pairs per tar sample of the output shards (format 2; default: 256)")
    logs.add_level_option(p)
    return p, p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Checks before anything runs


def encoding_of(args: argparse.Namespace) -> Encoding:
    """The model folder and how it embeds: options, else what the folder declares. ``Refused`` for a model that is
    not a folder, fails the checks of ``checked_model_path`` (here, before any worker loads it) or declares no
    usable pooling."""
    from transformers import AutoConfig

    path = resolve_model_path(args.model)
    if not os.path.isdir(path):
        raise Refused(f"--model {args.model}: not a folder (give a model folder or a packaged alias)")
    try:
        config = AutoConfig.from_pretrained(checked_model_path(path), trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise Refused(f"--model {args.model}: {str(err).splitlines()[0]}") from None
    pooling = args.pooling or folder_pooling(path)
    if pooling is None:
        raise Refused(f"--model {args.model} declares no pooling to take (1_Pooling/config.json with one of "
                      f"{', '.join(POOLINGS)}, only Normalize after it): give --pooling")
    query_prefix, passage_prefix = folder_prompts(path)
    return Encoding(model=os.path.abspath(path), pooling=pooling,
                    max_length=args.max_length or default_max_length(path, config),
                    query_prefix=query_prefix if args.query_prefix is None else args.query_prefix,
                    passage_prefix=passage_prefix if args.passage_prefix is None else args.passage_prefix,
                    batch_size=args.batch_size, threads=args.cpus_per_worker,
                    device="cuda" if args.gpus_per_worker else "cpu")


def check_out(args: argparse.Namespace, model: str) -> None:
    """``--out`` apart from every input: the writers replace the shards of their folders as they go."""
    for option, read in (("--data", args.data), ("--corpus", args.corpus), ("--model", model)):
        if read is not None and storage.overlaps(args.out, read):
            raise Refused(f"--out {args.out} is, holds or lies inside {option} {read}; writing there would replace "
                          f"what is being read: choose an --out apart from every input")


def inputs_sha256(streams: dict[str, list[Shard]]) -> str:
    """sha256 of every shard's URL and checksum: what the inputs of a run were."""
    listed = [[name, storage.redact(shard.url), shard.sha256] for name, shards in streams.items() for shard in shards]
    return hashlib.sha256(storage.json_bytes(listed)).hexdigest()


# ---------------------------------------------------------------------------------------------
# Ray


def start_ray(cpus: int) -> str:
    """Join the cluster at RAY_ADDRESS, else start one of ``cpus`` CPUs on 127.0.0.1; says which."""
    joining = init_ray_for_tasks(cpus, WORKER_ENV)
    return f"the Ray cluster at {os.environ['RAY_ADDRESS']}" if joining else "a local Ray cluster on 127.0.0.1"


def remote_cause(err: Exception) -> Exception:
    """A worker's own exception where Ray wrapped one (a bad shard, a storage error), else ``err``."""
    import ray

    return err.cause if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None else err


# ---------------------------------------------------------------------------------------------
# Mining


def query_positives(streams: dict[str, list[Shard]]) -> dict[int, frozenset[int]]:
    """query id → the ids of its distinct positives, for the queries (by text, over every stream) that have more
    than one: 16 bytes of memory per pair while they are counted."""
    queries, positives = array("q"), array("q")
    for shards in streams.values():
        for shard in shards:
            for record in read_shard(shard):
                queries.append(text_id(record["txt"]))
                positives.append(text_id(record["json"]["positive"]))
    q, p = np.frombuffer(queries, np.int64), np.frombuffer(positives, np.int64)
    order = np.lexsort((p, q))
    q, p = q[order], p[order]
    distinct = np.ones(len(q), bool)
    distinct[1:] = (q[1:] != q[:-1]) | (p[1:] != p[:-1])
    q, p = q[distinct], p[distinct]
    starts = np.flatnonzero(np.r_[True, q[1:] != q[:-1]]) if len(q) else np.empty(0, np.int64)
    ends = np.r_[starts[1:], len(q)]
    return {int(q[s]): frozenset(p[s:e].tolist()) for s, e in zip(starts, ends) if e - s > 1}


@dataclass
class ShardJob:
    """An input shard being mined: as its batches come back, its records' negatives and the counts."""

    stream: str
    shard: Shard
    negatives: list[list[str]]  # a list per record
    dropped: collections.Counter
    short: int = 0
    batches_left: int = 0


@dataclass
class Batch:
    """Up to ``--query-batch`` consecutive records of a shard, sent to the workers."""

    job: ShardJob
    start: int
    depth: int
    exclusions: list[tuple[int, frozenset[int], frozenset[int]]]  # per record: positive, other positives, given
    found: list  # the workers' ``search`` results, as Ray references


class Miner:
    """The driver's side of mining: batches out, candidates merged and filtered, parts saved."""

    def __init__(self, args: argparse.Namespace, workers: list, positives_of: dict[int, frozenset[int]]):
        self.args, self.workers, self.positives_of = args, workers, positives_of
        self.depth = args.depth or 4 * args.k

    def batches(self, pending: list[tuple[str, Shard]]) -> Iterator[Batch]:
        """Every pending shard's records, ``--query-batch`` at a time, sent out as they are made."""
        for stream, shard in pending:
            records = list(read_shard(shard))
            job = ShardJob(stream, shard, [[] for _ in records], collections.Counter())
            starts = range(0, len(records), self.args.query_batch)
            job.batches_left = len(starts)
            if not records:
                self.commit(job)
            for start in starts:
                yield self.send(job, start, records[start:start + self.args.query_batch])

    def send(self, job: ShardJob, start: int, records: list[dict]) -> Batch:
        exclusions = []
        for record in records:
            meta = record["json"]
            own = text_id(meta["positive"])
            others = self.positives_of.get(text_id(record["txt"]), frozenset()) - {own}
            given = frozenset(map(text_id, meta["negatives"])) if self.args.keep_given else frozenset()
            exclusions.append((own, others, given))
        # Deep enough for the k after every candidate known to be dropped: the positive, the others, the given.
        depth = self.depth + max(1 + len(others) + len(given) for _, others, given in exclusions)
        queries = [record["txt"] for record in records]
        shares = np.array_split(np.arange(len(queries)), len(self.workers))
        vectors = [w.embed_queries.remote([queries[i] for i in share]) for w, share in zip(self.workers, shares)]
        positives = [own for own, _, _ in exclusions]
        found = [w.search.remote(depth, positives, *vectors) for w in self.workers]
        return Batch(job, start, depth, exclusions, found)

    def take(self, batch: Batch) -> ShardJob | None:
        """A batch's candidates merged and filtered into its shard's negatives; the shard when it is complete."""
        import ray

        found: list[Found] = ray.get(batch.found)
        scores, ids = topk.merge([(f.scores, f.ids) for f in found], batch.depth)
        texts = {i: t for f in found for i, t in f.texts.items()}
        positive_scores = torch.stack([f.positive_scores for f in found]).nan_to_num(float("-inf")).amax(0)
        job, args = batch.job, self.args
        for row, (own, others, given) in enumerate(batch.exclusions):
            candidates = list(zip(scores[row].tolist(), ids[row].tolist()))
            chosen = choose_negatives(candidates, own, positive_scores[row].item(), others, given, args.k,
                                      args.max_score_ratio, job.dropped)
            job.negatives[batch.start + row] = [texts[c] for c in chosen]
            job.short += len(chosen) < args.k
        job.batches_left -= 1
        return job if job.batches_left == 0 else None

    def commit(self, job: ShardJob) -> None:
        work.save_part(part_of(self.args, job.stream, job.shard), work.Part(job.negatives, dict(job.dropped), job.short))

    def run(self, pending: list[tuple[str, Shard]], total_queries: int) -> tuple[float, float]:
        """Mine the ``pending`` shards; the seconds it took, and this process's CPU seconds (the serial part)."""
        start, cpu = time.perf_counter(), time.process_time()
        in_flight: collections.deque[Batch] = collections.deque()
        done = 0
        with tqdm(total=total_queries, unit="query", file=sys.stderr, mininterval=1.0, dynamic_ncols=True) as bar:
            def take_oldest() -> None:
                nonlocal done
                batch = in_flight.popleft()
                job = self.take(batch)
                bar.update(len(batch.exclusions))
                if job is not None:
                    self.commit(job)
                    done += 1
                    bar.write(f"{PROG}: {job.stream}/{job.shard.url.rsplit('/', 1)[-1]}: {len(job.negatives)} pairs "
                              f"mined ({done}/{len(pending)} shards)", file=sys.stderr)
            for batch in self.batches(pending):
                in_flight.append(batch)
                if len(in_flight) >= IN_FLIGHT:
                    take_oldest()
            while in_flight:
                take_oldest()
        return time.perf_counter() - start, time.process_time() - cpu


def build_slices(workers: list, items: list) -> tuple[bool, float]:
    """Every worker's slice of the corpus: saved ones taken up, the others read and embedded. (Whether all were
    saved ones, seconds.)"""
    import ray

    start = time.perf_counter()
    loaded = ray.get([w.load_slice.remote() for w in workers])
    if not all(loaded):
        n = len(workers)
        # Each worker reads every n-th shard and sorts its texts by owner; Ray takes each owner's maps to it.
        if n == 1:
            readers = [[workers[0].bucket.remote(items)]]
        else:
            readers = [w.bucket.options(num_returns=n).remote(items[r::n]) for r, w in enumerate(workers)]
        ray.get([w.build.remote(*[reader[b] for reader in readers]) for b, w in enumerate(workers) if not loaded[b]])
    return all(loaded), time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Output


def write_output(args: argparse.Namespace, data: dict[str, list[Shard]], settings: work.Settings,
                 corpus_rows: int) -> dict[str, dict]:
    """Every stream with its mined negatives under ``--out``, its manifest written once every stream's shards are
    published; each stream's counts."""
    counts: dict[str, dict] = {}
    writers: dict[str, ShardWriter] = {}
    with tempfile.TemporaryDirectory(prefix="clsys-mine-") as tmp:
        for stream, shards in data.items():
            url = storage.join(args.out, stream)
            writer = writers[stream] = ShardWriter(
                url, tmp, int(args.shard_size_mb * 2**20), previous_shas(url), block_records=args.block_records,
                compress=bool(shards) and shards[0].url.endswith(COMPRESSED))
            stream_counts = counts[stream] = {"pairs": 0, "negatives": 0, "short": 0,
                                              "dropped": dict.fromkeys(DROP_REASONS, 0)}
            for shard in shards:
                part = work.load_part(part_of(args, stream, shard), shard.samples)
                records = []
                for record, mined in zip(read_shard(shard), part.negatives):
                    meta = dict(record["json"])
                    meta["negatives"] = meta["negatives"] + mined if args.keep_given else mined
                    records.append(Record(record["txt"], meta))
                writer.write_records(records)
                stream_counts["pairs"] += len(records)
                stream_counts["negatives"] += sum(map(len, part.negatives))
                stream_counts["short"] += part.short
                for reason, n in part.dropped.items():
                    stream_counts["dropped"][reason] += n
            writer.close()
        # Manifests last, once every stream's shards are published.
        for stream, writer in writers.items():
            manifest = read_manifest(storage.join(args.data, stream))
            given = {k: v for k, v in manifest.items() if k not in ("format", "stream", "shards", "samples")}
            mining = {k: v for k, v in dataclasses.asdict(settings).items() if k not in ("data", "inputs")}
            extra = {"tool": f"{PROG} {__version__}", **({"source": given["source"]} if "source" in given else {}),
                     "mining": {**mining, "corpus_texts": corpus_rows, "counts": counts[stream]},
                     "input": {"url": storage.redact(storage.join(args.data, stream)), **given}}
            writer.write_manifest(extra)
    return counts


def summary_table(counts: dict[str, dict]) -> str:
    """One row per stream and a total: pairs, negatives mined, pairs short of k, candidates dropped by reason."""
    keys = ("pairs", "negatives", "short")
    rows = [[stream, *(c[k] for k in keys), *(c["dropped"][r] for r in DROP_REASONS)] for stream, c in counts.items()]
    rows.append(["total", *(sum(row[i] for row in rows) for i in range(1, len(keys) + len(DROP_REASONS) + 1))])
    lines = [["stream", *keys, *(f"dropped:{r}" for r in DROP_REASONS)], *([str(v) for v in row] for row in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join([line[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(line[1:], widths[1:])])
                     for line in lines)


def worker_lines(reports: list[dict], seconds: tuple[float, float], queries: int) -> list[str]:
    """Each worker's slice, memory and work (wall and CPU seconds); the queries per second of the run and per
    worker, and the CPU seconds of this process's merging."""
    lines = []
    for r in reports:
        wall, cpu = r["seconds"], r["cpu_seconds"]

        def took(phase: str) -> str:
            return f"{wall[phase]:.1f} s ({cpu[phase]:.1f} CPU-s)"
        lines.append(f"worker {r['rank']}/{len(reports)}: {r['rows']} texts ({r['embedding_bytes'] / 2**20:.1f} MiB of "
                     f"embeddings, {r['text_bytes'] / 2**20:.1f} MiB of text), peak RSS "
                     f"{r['peak_rss_bytes'] / 2**20:.0f} MiB; corpus {took('corpus')}, {r['embedded']} queries "
                     f"embedded in {took('queries')}, {r['searched']} searched in {took('search')}")
    if queries:
        rate = queries / max(seconds[0], 1e-9)
        lines.append(f"mining: {queries} queries in {seconds[0]:.1f} s: {rate:.1f} queries/s, "
                     f"{rate / len(reports):.1f} per worker ({len(reports)} workers); merging {seconds[1]:.1f} CPU-s")
    return lines


# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    start = time.time()
    encoding = encoding_of(args)
    check_out(args, encoding.model)
    storage.check_bucket(args.out)
    names = pair_streams(args.data)
    if not names:
        raise Refused(f"--data {args.data}: no pairs streams ({PAIRS}/<source>/manifest.json) under it; give the "
                      f"--out of data_prep pairs")
    data = {name: load_shards(url, PAIRS) for name, url in names.items()}
    items = corpus_shards(data, args.corpus)
    positives_of = query_positives(data)  # reads every pair: a bad shard stops the run before Ray starts
    import ray

    where = start_ray(max(args.cpus_per_worker * (args.workers or 1), os.cpu_count() or 1))
    try:
        n = args.workers or max(1, int(ray.cluster_resources().get("CPU", 1)) // args.cpus_per_worker)
        settings = settings_of(args, encoding, {**data, "corpus": [item.shard for item in items]}, n)
        resumed = work.start(args.out, settings)
        pending = [(stream, shard) for stream, shards in data.items() for shard in shards
                   if work.load_part(part_of(args, stream, shard), shard.samples) is None]
        log.info(f"{PROG}: {n} workers on {where}; {len(pending)} of {sum(map(len, data.values()))} shards to mine"
                 f"{' (continuing the run under --out)' if resumed else ''}")
        reports, seconds = [], (0.0, 0.0)
        if pending:
            actor = ray.remote(num_cpus=args.cpus_per_worker, num_gpus=args.gpus_per_worker or 0)(MiningWorker)
            workers = [actor.remote(encoding, r, n, work.slice_stem(args.out, r, n)) for r in range(n)]
            loaded, corpus_seconds = build_slices(workers, items)
            log.info(f"{PROG}: corpus: {work.saved_rows(args.out, n)} texts on {n} workers, "
                     f"{'taken up from the run under --out' if loaded else 'embedded'} in {corpus_seconds:.1f} s")
            seconds = Miner(args, workers, positives_of).run(pending, sum(s.samples for _, s in pending))
            reports = ray.get([w.report.remote() for w in workers])
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
        cause = remote_cause(err)
        if isinstance(cause, (StorageError, ShardError, ValueError)):
            raise Refused(str(cause)) from None
        print(f"{PROG}: error: a worker failed: {str(cause).strip().splitlines()[-1]}; run the same command "
              "again to continue from the shards done", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    counts = write_output(args, data, settings, work.saved_rows(args.out, n))
    work.finish(args.out)
    for stream, c in counts.items():
        print(storage.redact(f"{stream}: {c['pairs']} pairs, {c['negatives']} negatives mined -> "
                             f"{storage.join(args.out, stream)}"))
    print(summary_table(counts))
    for line in worker_lines(reports, seconds, sum(shard.samples for _, shard in pending)):
        print(line)
    print(f"{PROG}: done in {time.time() - start:.1f} s")
    return 0


def part_of(args: argparse.Namespace, stream: str, shard: Shard) -> str:
    """Where the part of an input shard of ``stream`` is kept."""
    return work.part_url(args.out, stream, shard.url.rsplit("/", 1)[-1])


def settings_of(args: argparse.Namespace, encoding: Encoding, read: dict[str, list[Shard]],
                workers: int) -> work.Settings:
    return work.Settings(
        data=storage.redact(args.data), corpus=None if args.corpus is None else storage.redact(args.corpus),
        inputs=inputs_sha256(read), model=encoding.model, model_sha256=work.folder_sha256(encoding.model),
        pooling=encoding.pooling, max_length=encoding.max_length, query_prefix=encoding.query_prefix,
        passage_prefix=encoding.passage_prefix, device=encoding.device, k=args.k, depth=args.depth or 4 * args.k,
        max_score_ratio=args.max_score_ratio, keep_given=args.keep_given, workers=workers)


def main(argv: list[str] | None = None) -> int:
    _, args = parse_args(argv)
    logs.configure(args.log_level, progress_stream="stderr")  # stdout is the summary of what was mined
    try:
        return run(args)
    except (Refused, StorageError, ShardError, ValueError) as err:
        print(f"{PROG}: error: {storage.redact(str(err))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
