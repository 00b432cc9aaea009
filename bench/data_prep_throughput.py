"""``data_prep wiki`` against WikiExtractor on one large dump: pages/s, MB/s per core, peak memory.

    python bench/data_prep_throughput.py [--dump-mb 200] [--small-mb 50] [--work-dir /tmp/dpbench]

Needs WikiExtractor in the venv (``pip install -e '.[bench]'``, or ``pip install wikiextractor``). The
dump: the bundled sample's pages (data_prep/samples, real enwiki XML) written over and over with fresh
page and revision ids until the XML is at least --dump-mb MB (1 MB = 10^6 bytes), bz2-compressed as
real dumps are (both tools read .bz2); it is built once, streamed page by page, and cached in
--work-dir with its XML size, page and article counts. Both tools run as subprocesses on the same
file, with 1 and 2 processes each:
  data_prep:     ``python -m data_prep wiki --workers N``; N = 1 is one process doing everything,
                 N > 1 is a main process (bz2 + XML reading, shard writing) feeding N parser processes;
  WikiExtractor: ``python -m wikiextractor.WikiExtractor --no-templates --quiet --processes N``; always
                 a main process (bz2 reading, page splitting) and a writer process besides the N
                 extractor processes, so N = 1 is already 3 processes.
Each tool and N runs --repeat times (3), the tools alternating; a row is the run with the least CPU
time (one command's CPU time varies by ±15% from run to run on this VM, more than the changes measured).
The "procs" column is the most processes seen at once in each run's tree. Rates are XML MB (and dump
pages) over wall seconds. Cores are counted two ways: "MB/s/core" divides by the N requested (the
issue's figure, blind to helper processes); "MB/CPU-s" divides the XML MB by the user + system CPU
seconds of the whole process tree (from ``os.wait4``, which sums every reaped descendant): the fairer
figure, and the one least disturbed by other load on the machine. Memory: "tree PSS" is the peak of
the tree's summed proportional set size (shared pages of forked workers counted once), sampled every
0.2 s with psutil; "max RSS" is the kernel's peak resident size of the largest single process. An extra
row times data_prep's reader alone (``DumpReader.pages()``: bz2 + XML, no wikitext parsing), a lower
bound on the main process's serial share of ``--workers N`` (it also writes the shards). Memory flat in
dump size: data_prep with 1 process also runs on a --small-mb dump (default a quarter) and its max RSS
is compared. Peak memory follows the longest page read, so both dumps must hold a whole pass over the
sample (6.1 MB). A dump made by repetition has few, long pages (about 36 per MB, half of
them redirects), so state that grows per article is barely exercised.
Cleanliness is measured too: the share of output sentences that still hold wiki markup (any of
``RESIDUE``), for data_prep's sentences stream and for WikiExtractor's text split into sentences by
the same splitter (sentencex; data_prep also drops sentences under 3 words or 15 characters and over
1,000 characters, WikiExtractor's are all counted, which can only lower its share).
Prints a table, the residue line (target: data_prep's share at most WikiExtractor's), then ``ratio``
lines (targets: data_prep ≥ 1× WikiExtractor per CPU-second, big/small peak memory ≈ 1). Not part of
the test suite.

Then (alone with ``--ray-only``) ``--ray``: the same pages as Wikimedia multistream dumps with their index
(100 pages a bz2 stream, cached too), of --dump-mb and --small-mb MB, each read with ``--index`` by one
process and by ``--ray`` on a local Ray cluster of 2 CPUs on 127.0.0.1 started beforehand by this script
(as a cluster is there before `ray job submit`: its agents done starting, its object store sized as `ray
start` sizes it; the run joins it through RAY_ADDRESS, and the cluster starts the job's workers), --repeat
times each, alternating, a row being the run with the least wall time. The cluster's workers run at nice 0
like the one-process run (Ray's default is 15). The Ray rows give the driver's CPU (its tree), the
workers' (psutil, read every 0.5 s: they exit with the job), the core-seconds the machine spent idle
(/proc/stat) and the rest of 2 × wall ("other": Ray's daemons, this script's polling, anything else on the
machine): where the Ray run's core-seconds went; and the largest peak RSS of a worker (the kernel's VmHWM,
reset before each run), i.e. of a task. All runs' manifests of a dump must be identical. These runs' trees
are not sampled for PSS (that costs a few percent of a core, which the Ray run, keeping both cores busy,
would pay and the one-process run would not). From the two sizes, each way's wall time is split into a
fixed part and a part per MB. Ratio lines: ``ray_2cpu_over_1proc`` (wall time on the big dump; target ≥
1.8), ``ray_2cpu_over_1proc_per_mb`` (the per-MB parts: what much bigger dumps approach) and
``ray_task_peak_rss_big_over_small`` (target ≈ 1). Last, ``--ray`` on the same pages in a dump without an
index (a streaming task reads it, the driver only admits and writes), --repeat times, fastest kept:
``ray_no_index_total_cpu_over_driver_cpu`` is the run's CPU over its driver's, the most a cluster can speed
up when several such dumps are read at once (the driver, one process, being the part that does not spread).
"""
from __future__ import annotations

import argparse
import bz2
import functools
import html
import importlib.metadata
import itertools
import json
import os
import re
import shutil
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from sentencex import segment

from process_runs import Run, local_ray_cluster, measure, ray_workers  # bench/, beside this script

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data_prep" / "samples" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MB = 10**6
ID = re.compile(rb"<id>\d+</id>")
# Wiki markup and template residue that no reader should see in prose.
RESIDUE = ("{{", "}}", "[[", "]]", "{|", "|}", "<ref", "</ref", "&nbsp;", "''", "==", "<!--", "[http")


@functools.lru_cache(maxsize=1)
def sample_parts() -> tuple[bytes, list[bytes], bytes]:
    """The sample's XML (6 MB; the big dump is never held in memory) as (header, pages, footer)."""
    xml = bz2.decompress(SAMPLE.read_bytes())
    head_end = xml.index(b"</siteinfo>\n") + len(b"</siteinfo>\n")
    tail_start = xml.rindex(b"</page>\n") + len(b"</page>\n")
    pages = [p + b"</page>\n" for p in xml[head_end:tail_start].split(b"</page>\n")[:-1]]
    return xml[:head_end], pages, xml[tail_start:]


def repeated_pages(target_bytes: int, meta: dict) -> Iterator[bytes]:
    """The sample's pages over and over with fresh page and revision ids, until ``meta["xml_bytes"]`` (the
    header and footer counted) reaches ``target_bytes``; ``meta`` also counts pages and articles."""
    header, pages, footer = sample_parts()
    # What both tools call an article: namespace 0 and not a redirect.
    is_article = [b"<ns>0</ns>" in p and b"<redirect" not in p for p in pages]
    page_ids, revision_ids = itertools.count(1), itertools.count(1)
    meta.update(xml_bytes=len(header) + len(footer), pages=0, articles=0)
    for page, article in itertools.cycle(zip(pages, is_article)):
        if meta["xml_bytes"] >= target_bytes:
            return
        # The page's own <id> comes first; its revision's <id> is the first one after <revision>
        # (a contributor's <id> follows it). data_prep skips a repeated page id as a duplicate.
        head, revision = page.split(b"<revision>", 1)
        page = (ID.sub(b"<id>%d</id>" % next(page_ids), head, count=1) + b"<revision>"
                + ID.sub(b"<id>%d</id>" % next(revision_ids), revision, count=1))
        meta["xml_bytes"] += len(page)
        meta["pages"] += 1
        meta["articles"] += article
        yield page


def build_dump(path: Path, target_bytes: int) -> dict:
    """Write the repeated-sample dump to ``path`` (bz2); returns its XML size, pages and articles."""
    header, _, footer = sample_parts()
    meta: dict = {}
    tmp = path.with_suffix(".partial")
    with bz2.open(tmp, "wb") as out:
        out.write(header)
        for page in repeated_pages(target_bytes, meta):
            out.write(page)
        out.write(footer)
    tmp.rename(path)
    return meta


def build_multistream(path: Path, target_bytes: int) -> dict:
    """The same pages as a Wikimedia multistream dump (a header stream, streams of 100 pages, a closing
    stream) with its index beside it (``multistream_index``); returns what ``build_dump`` does."""
    header, _, footer = sample_parts()
    meta: dict = {}
    tmp, index = path.with_suffix(".partial"), []
    with open(tmp, "wb") as out:
        out.write(bz2.compress(header))
        pages = repeated_pages(target_bytes, meta)
        while block := list(itertools.islice(pages, 100)):
            offset = out.tell()
            for page in block:
                page_id = int(re.search(rb"<id>(\d+)</id>", page).group(1))
                title = html.unescape(re.search(rb"<title>(.*?)</title>", page).group(1).decode())
                index.append(f"{offset}:{page_id}:{title}\n")
            out.write(bz2.compress(b"".join(block)))
        out.write(bz2.compress(footer))
    multistream_index(path).write_bytes(bz2.compress("".join(index).encode()))
    tmp.rename(path)
    return meta


def multistream_index(path: Path) -> Path:
    return path.with_name(path.name.replace(".xml.bz2", "-index.txt.bz2"))


def dump(work: Path, mb: float, multistream: bool = False) -> tuple[Path, dict]:
    """The cached dump of at least ``mb`` MB of XML (a multistream one with its index), built first if missing."""
    path = work / f"enwiki-repeated-{mb:g}MB{'-multistream' if multistream else ''}.xml.bz2"
    meta_path = path.with_name(path.name + ".json")
    if not (path.exists() and meta_path.exists()):
        print(f"building {path} ({mb:g} MB of XML) ...", flush=True)
        meta_path.write_text(json.dumps((build_multistream if multistream else build_dump)(path, int(mb * MB))))
    return path, json.loads(meta_path.read_text())


@dataclass
class Residue:
    """How many output sentences hold any of ``RESIDUE``, of how many."""

    dirty: int = 0
    sentences: int = 0

    def count(self, sentence: str) -> None:
        self.dirty += any(mark in sentence for mark in RESIDUE)
        self.sentences += 1

    def __str__(self) -> str:
        return f"{100 * self.dirty / max(self.sentences, 1):.3f}% ({self.dirty:,} of {self.sentences:,} sentences)"


def run_data_prep(path: Path, workers: int, work: Path, residue: bool = True) -> tuple[Run, int, int, Residue | None]:
    """(run, pages read, articles, residue of its sentences stream, unless not asked for) of ``data_prep wiki``."""
    out = work / f"data_prep-{workers}w"
    shutil.rmtree(out, ignore_errors=True)
    run = measure([sys.executable, "-m", "data_prep", "wiki", "--input", str(path), "--out", str(out),
                   "--workers", str(workers)], out)
    residue = Residue() if residue else None
    for shard in sorted((out / "sentences").glob("*.tar")) if residue else []:
        with tarfile.open(shard) as tar:
            for member in tar:
                if member.name.endswith(".txt"):
                    residue.count(tar.extractfile(member).read().decode())
    shutil.rmtree(out)
    pages, articles = map(int, re.search(r"pages read: (\d+), articles: (\d+)", run.stdout).groups())
    return run, pages, articles, residue


def ray_comparison_run(path: Path, work: Path, ray_address: str | None = None,
                       index: bool = True) -> tuple[Run, int, int, bytes]:
    """(run, pages, articles, its two manifests) of ``data_prep wiki --index`` on a multistream dump (or of
    ``data_prep wiki`` on a dump without an index when not ``index``): in one process, or as Ray tasks on
    the cluster at ``ray_address`` (joined as `ray job submit` would)."""
    out = work / f"data_prep-ray-comparison-{'ray' if ray_address else '1proc'}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "data_prep", "wiki", "--input", str(path), "--out", str(out)]
    if index:
        cmd += ["--index", str(multistream_index(path))]
    if ray_address:
        run = measure([*cmd, "--ray"], out, {**os.environ, "RAY_ADDRESS": ray_address}, ray_workers, sample_tree=False)
    else:
        run = measure(cmd, out, sample_tree=False)
    manifests = b"".join((out / stream / "manifest.json").read_bytes() for stream in ("sentences", "documents"))
    shutil.rmtree(out)
    pages, articles = map(int, re.search(r"pages read: (\d+), articles: (\d+)", run.stdout).groups())
    return run, pages, articles, manifests


def ray_comparison(work: Path, mb: float, small_mb: float, repeat: int) -> None:
    """``--ray`` on a 2-CPU local cluster against one process, on the same multistream dumps (``mb`` and
    ``small_mb`` big), ``repeat`` times each, alternating (a row is the run with the least wall time): the
    speed-up, where the Ray run's core-seconds go, its cost split into a fixed part and a part per MB (from
    the two sizes), and the Ray workers' peak memory on both sizes, to show that it does not grow with the
    dump; then ``--ray`` on the same pages in a dump without an index (read by a streaming task: the
    driver's CPU is what bounds a big cluster's speed)."""
    sizes = {"big": dump(work, mb, multistream=True), "small": dump(work, small_mb, multistream=True)}
    plain, plain_meta = dump(work, mb)
    load = os.getloadavg()[0]
    runs: dict[tuple[str, str], list] = {(size, way): [] for size in sizes for way in ("one", "ray")}
    with local_ray_cluster(2) as address:
        for _ in range(repeat):
            for size, (path, _) in sizes.items():
                runs[size, "one"].append(ray_comparison_run(path, work))
                runs[size, "ray"].append(ray_comparison_run(path, work, address))
        on_ray_plain = min((ray_comparison_run(plain, work, address, index=False) for _ in range(repeat)),
                           key=lambda run: run[0].wall_s)
    fastest = {key: min(found, key=lambda run: run[0].wall_s)[0] for key, found in runs.items()}
    checks = [(f"{way} {size}", run, sizes[size][1]) for (size, way), found in runs.items() for run in found]
    for label, (run, pages, articles, manifests), want in [*checks, ("ray no index", on_ray_plain, plain_meta)]:
        if (pages, articles) != (want["pages"], want["articles"]):
            sys.exit(f"data_prep_throughput: {label}: {pages} pages, {articles} articles, expected {want['pages']}, "
                     f"{want['articles']}")
    for size in sizes:
        if len({run[3] for run in runs[size, "one"] + runs[size, "ray"]}) != 1:
            sys.exit(f"data_prep_throughput: the manifests of the Ray runs and the one-process runs differ ({size} dump)")
    meta = sizes["big"][1]
    xml_mb = {size: found[1]["xml_bytes"] / MB for size, found in sizes.items()}
    print(f"\nmultistream dumps (+ index) of {xml_mb['big']:.1f} and {xml_mb['small']:.1f} MB XML ({meta['pages']} and "
          f"{sizes['small'][1]['pages']} pages); {os.cpu_count()} CPU cores, load average {load:.1f} at start; "
          f"manifests of all runs of a dump identical; each row the least wall time of {repeat} runs, alternating")
    print(f"{'data_prep wiki':<42} {'wall s':>7} {'MB/s':>6} {'driver CPU s':>12} {'tasks CPU s':>11} "
          f"{'idle core-s':>11} {'other core-s':>12} {'driver RSS MB':>13} {'task RSS MB':>11}")
    one, on_ray = "--index, one process", "--index --ray, 2-CPU local cluster"
    rows = [(one, "big", fastest["big", "one"]), (on_ray, "big", fastest["big", "ray"]),
            (one, "small", fastest["small", "one"]), (on_ray, "small", fastest["small", "ray"]),
            ("--ray without index", "big", on_ray_plain[0])]
    for label, size, run in rows:
        idle = other = "-"
        if run.task_cpu_s:  # a Ray run: where its cores' time went besides the driver and the tasks
            idle = f"{run.idle_core_s:.1f}"
            # Ray's daemons and anything else running on the machine
            other = f"{os.cpu_count() * run.wall_s - run.cpu_s - run.task_cpu_s - run.idle_core_s:.1f}"
        print(f"{f'{label}, {xml_mb[size]:.0f} MB':<42} {run.wall_s:>7.1f} {xml_mb[size] / run.wall_s:>6.2f} "
              f"{run.cpu_s:>12.1f} {run.task_cpu_s:>11.1f} {idle:>11} {other:>12} {run.max_rss_mb:>13.0f} "
              f"{run.task_rss_mb:>11.0f}")
    # Wall time = a fixed part (start-up: joining the cluster, the job's workers starting; the end: the last
    # windows written) + a part per MB, from the two sizes: the per-MB parts' ratio is what --ray approaches on
    # dumps much bigger than these.
    per_mb = {way: (fastest["big", way].wall_s - fastest["small", way].wall_s) / (xml_mb["big"] - xml_mb["small"])
              for way in ("one", "ray")}
    fixed = {way: fastest["small", way].wall_s - per_mb[way] * xml_mb["small"] for way in per_mb}
    print(f"wall = fixed + per MB: one process {fixed['one']:.2f} s + {per_mb['one'] * 1000:.1f} ms/MB; "
          f"--ray {fixed['ray']:.2f} s + {per_mb['ray'] * 1000:.1f} ms/MB")
    task_rss = {size: max(run[0].task_rss_mb for run in runs[size, "ray"]) for size in sizes}
    print(f"memory check: largest Ray worker peak RSS on {xml_mb['small']:.1f} MB {task_rss['small']:.0f} MB, on "
          f"{xml_mb['big']:.1f} MB {task_rss['big']:.0f} MB")
    print(f"ratio ray_2cpu_over_1proc {fastest['big', 'one'].wall_s / fastest['big', 'ray'].wall_s:.2f}")
    print(f"ratio ray_2cpu_over_1proc_per_mb {per_mb['one'] / per_mb['ray']:.2f}")
    print(f"ratio ray_task_peak_rss_big_over_small {task_rss['big'] / task_rss['small']:.2f}")
    # What a cluster of any size can do at most on dumps without an index: the driver's share is serial.
    print(f"ratio ray_no_index_total_cpu_over_driver_cpu "
          f"{(on_ray_plain[0].cpu_s + on_ray_plain[0].task_cpu_s) / on_ray_plain[0].cpu_s:.1f}")


def run_wikiextractor(path: Path, processes: int, work: Path, residue: bool = True) -> tuple[Run, int, Residue | None]:
    """(run, articles: the <doc> elements it wrote, residue of its text lines split into sentences, unless
    not asked for)."""
    out = work / f"wikiextractor-{processes}p"
    shutil.rmtree(out, ignore_errors=True)
    run = measure([sys.executable, "-m", "wikiextractor.WikiExtractor", str(path), "--no-templates", "--quiet",
                   "--processes", str(processes), "-o", str(out)], out)
    docs, counted = 0, Residue()
    for file in sorted(out.rglob("wiki_*")):
        with open(file, encoding="utf-8") as f:
            title_next = False  # a <doc> starts with the article's title on a line of its own
            for line in f:
                if line.startswith("<doc "):
                    docs, title_next = docs + 1, True
                elif title_next:
                    title_next = False
                elif residue and line.strip() and line.strip() != "</doc>":
                    for sentence in segment("en", line.strip()):
                        if sentence.strip():
                            counted.count(sentence.strip())
    shutil.rmtree(out)
    return run, docs, counted if residue else None


def run_reader(path: Path, work: Path) -> tuple[Run, int]:
    """(run, pages) of data_prep's ``DumpReader`` alone: decompression and XML, nothing else."""
    code = ("import sys; from data_prep.dumps import DumpReader; "
            "print(sum(1 for _ in DumpReader(sys.argv[1]).pages()))")
    run = measure([sys.executable, "-c", code, str(path)], work / "reader")
    return run, int(run.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump-mb", type=float, default=200, help="XML size of the big dump, MB")
    parser.add_argument("--small-mb", type=float, help="XML size of the memory-check dump, MB (default: a quarter; "
                        "at least one pass over the sample, 6.1)")
    parser.add_argument("--work-dir", default="/tmp/dpbench", help="cached dumps, outputs and logs")
    parser.add_argument("--ray-only", action="store_true", help="only the --ray comparison (no WikiExtractor)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each tool and N, the tools alternating; each row is its run with the least "
                             "CPU time (default 3: on this VM one command's CPU time varies by ±15%% run to run)")
    args = parser.parse_args()
    small_mb = args.small_mb or args.dump_mb / 4
    # Peak memory follows the longest page read so far: a smaller dump must still hold every page.
    header, sample_pages, footer = sample_parts()
    one_pass_mb = (len(header) + sum(map(len, sample_pages)) + len(footer)) / MB
    if min(small_mb, args.dump_mb) < one_pass_mb:
        parser.error(f"--dump-mb and --small-mb must be at least {one_pass_mb:.1f} (one pass over the sample)")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.ray_only:
        ray_comparison(work, args.dump_mb, small_mb, args.repeat)
        return
    try:
        wikiextractor_version = importlib.metadata.version("wikiextractor")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("data_prep_throughput: WikiExtractor is missing: pip install -e '.[bench]' "
                 "(or pip install wikiextractor)")

    big, big_meta = dump(work, args.dump_mb)
    small, small_meta = dump(work, small_mb)
    load = os.getloadavg()[0]

    # N → (run, pages, articles) with the least CPU time of the --repeat runs; (tool, N) → Residue (first run)
    ours, theirs, residues = {}, {}, {}
    for repeat in range(args.repeat):
        for n in (1, 2):  # the tools alternate, so that a slow spell of the machine hits both
            run, pages, articles, residue = run_data_prep(big, n, work, residue=not repeat)
            if n not in ours or run.cpu_s < ours[n][0].cpu_s:
                ours[n] = (run, pages, articles)
            run, docs, their_residue = run_wikiextractor(big, n, work, residue=not repeat)
            if n not in theirs or run.cpu_s < theirs[n][0].cpu_s:
                theirs[n] = (run, big_meta["pages"], docs)  # it reports no page count: the dump's
            if not repeat:
                residues["data_prep", n], residues["wikiextractor", n] = residue, their_residue
    reader_run, reader_pages = run_reader(big, work)
    small_run, small_pages, small_articles, _ = run_data_prep(small, 1, work)
    rows = ([("data_prep wiki", n, *ours[n]) for n in (1, 2)]
            + [("WikiExtractor --no-templates", n, *theirs[n]) for n in (1, 2)]
            + [("data_prep reader only", 1, reader_run, reader_pages, None)])

    xml_mb = big_meta["xml_bytes"] / MB
    print(f"\ndump {big} : {xml_mb:.1f} MB XML, {big_meta['pages']} pages, {big_meta['articles']} articles; "
          f"WikiExtractor {wikiextractor_version}, Python {sys.version.split()[0]}, {os.cpu_count()} CPU cores, "
          f"load average {load:.1f} at start")
    print(f"{'tool':<29} {'N':>2} {'procs':>5} {'wall s':>7} {'pages/s':>8} {'MB/s':>6} {'MB/s/core':>9} "
          f"{'CPU s':>7} {'MB/CPU-s':>8} {'tree PSS MB':>11} {'max RSS MB':>10} {'articles':>8}")
    for label, n, run, pages, articles in rows:
        print(f"{label:<29} {n:>2} {run.procs:>5} {run.wall_s:>7.1f} {pages / run.wall_s:>8.1f} "
              f"{xml_mb / run.wall_s:>6.2f} {xml_mb / run.wall_s / n:>9.2f} {run.cpu_s:>7.1f} "
              f"{xml_mb / run.cpu_s:>8.2f} {run.tree_pss_mb:>11.0f} {run.max_rss_mb:>10.0f} "
              f"{'-' if articles is None else articles:>8}")
    small_xml_mb = small_meta["xml_bytes"] / MB
    print(f"memory check: data_prep wiki, 1 process, on {small_xml_mb:.1f} MB ({small_articles} articles): "
          f"max RSS {small_run.max_rss_mb:.0f} MB; on {xml_mb:.1f} MB: {ours[1][0].max_rss_mb:.0f} MB")

    # Every row must have read the whole dump, or its rate means nothing.
    expected = [(big_meta["pages"], big_meta["articles"])] * 4 + [(big_meta["pages"], None)]
    wrong = [f"{label} N={n}: {pages} pages, {articles} articles" for (label, n, _, pages, articles), want
             in zip(rows, expected) if (pages, articles) != want]
    if (small_pages, small_articles) != (small_meta["pages"], small_meta["articles"]):
        wrong.append(f"data_prep on the small dump: {small_pages} pages, {small_articles} articles")
    if wrong:
        sys.exit(f"data_prep_throughput: expected {big_meta['pages']} pages and {big_meta['articles']} articles "
                 f"({small_meta['pages']} and {small_meta['articles']} on the small dump), got: " + "; ".join(wrong))

    print(f"markup residue (sentences holding any of {' '.join(RESIDUE)}): data_prep wiki "
          f"{residues['data_prep', 1]}, WikiExtractor --no-templates {residues['wikiextractor', 1]}")

    print()
    for n in (1, 2):  # same MB and N on both sides: MB/s/core and MB/CPU-s ratios are time ratios
        print(f"ratio data_prep_over_wikiextractor_per_core_{n}proc {theirs[n][0].wall_s / ours[n][0].wall_s:.2f}")
        print(f"ratio data_prep_over_wikiextractor_per_cpu_s_{n}proc {theirs[n][0].cpu_s / ours[n][0].cpu_s:.2f}")
    print(f"ratio data_prep_peak_rss_big_over_small {ours[1][0].max_rss_mb / small_run.max_rss_mb:.2f}")
    ray_comparison(work, args.dump_mb, small_mb, args.repeat)


if __name__ == "__main__":
    main()
