"""``data_prep pairs`` on a generated JSONL file: input MB/s with 1 and 2 processes.

    python bench/data_prep_pairs.py [--mb 75] [--repeat 3] [--compress none|gz|zst] [--work-dir /tmp/pairs-bench]

The input: --mb MB (10^6 bytes) of JSON lines ``{"query", "positive", "negatives": [3]}`` whose texts are
words drawn with a fixed seed from a vocabulary of 5,000 made-up words (a query 5-15 words, a passage 50-90:
~2.1 KB a line, about MS MARCO's hard-negative rows), 1% of the lines repeating an earlier one (dropped as
duplicates); built once and cached in --work-dir, and with --compress gzip or zstd compressed (level 3), read
as such. ``python -m data_prep pairs`` runs on it as a subprocess
with ``--workers 1`` (one process doing everything) and ``--workers 2`` (two worker processes that read and
parse the parts dealt to them and write their own shards, and the main one, which cuts the input into parts
and drops duplicates by the digests the workers send), alternating, --repeat times each; a row is the run
with the least wall time. Columns: wall seconds, input MB/s, MB/s per process (over the N requested), CPU
seconds of the whole tree (user + system, ``os.wait4``) and MB per CPU-second, the cores the run had (its CPU
seconds and the machine's idle core-seconds during it, over its wall seconds: on a machine shared with other
jobs, 2 processes cannot run at 2× one on fewer than 2), peak RSS of the largest process and peak summed PSS
of the tree; the load average before and after. Every run must write the same pairs (read back, compared as
a sorted list) with the same counts, and the runs of one N identical manifests. Then ``ratio
pairs_2w_over_1w`` (MB/s of 2 processes over 1; the target is ≥ 1.7). Memory: ``bench/pairs_memory.py``. Not
part of the test suite.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path

from clsys.shards.reader import load_shards, read_shard
from process_runs import measure  # bench/, beside this script

MB = 10**6


def build_input(path: Path, target_bytes: int) -> int:
    """Write the JSONL input; returns its line count."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocabulary = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) for _ in range(5000)]

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choices(vocabulary, k=rng.randint(lo, hi)))

    lines: list[str] = []
    size = 0
    tmp = path.with_suffix(".partial")
    with open(tmp, "w") as out:
        while size < target_bytes:
            if lines and rng.random() < 0.01:
                line = rng.choice(lines[-1000:])
            else:
                line = json.dumps({"query": text(5, 15) + "?", "positive": text(50, 90),
                                   "negatives": [text(50, 90) for _ in range(3)]}) + "\n"
            lines.append(line)
            out.write(line)
            size += len(line.encode())
    tmp.rename(path)
    return len(lines)


def compressed(data: bytes, how: str) -> bytes:
    if how == "gz":
        return gzip.compress(data, compresslevel=3)
    import zstandard

    return zstandard.ZstdCompressor(level=3).compress(data)


def pairs_written(stream: Path) -> str:
    """The sha256 of a stream's pairs, sorted: the same for any order and any shards they are written in."""
    lines = sorted(json.dumps([s["txt"], s["json"]], sort_keys=True) for shard in load_shards(str(stream), "pairs")
                   for s in read_shard(shard))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=75.0, help="input size in MB (default: 75)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each process count (default: 3)")
    parser.add_argument("--compress", choices=("none", "gz", "zst"), default="none",
                        help="read the input gzip or zstd compressed (default: none)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/pairs-bench"))
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    plain = path = args.work_dir / f"pairs-{args.mb:g}MB.jsonl"
    if not plain.exists():
        print(f"building {plain} ...", flush=True)
        build_input(plain, int(args.mb * MB))
    if args.compress != "none":
        path = plain.with_name(f"{plain.name}.{args.compress}")
        if not path.exists():
            path.write_bytes(compressed(plain.read_bytes(), args.compress))
        print(f"input compressed: {path.stat().st_size / MB:.1f} MB ({args.compress})")
    size = plain.stat().st_size  # MB/s: of the text read, compressed or not
    print("load average before: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    best: dict[int, object] = {}
    manifests: dict[int, set[str]] = {1: set(), 2: set()}
    written = set()
    for _ in range(args.repeat):
        for workers in (1, 2):
            out = args.work_dir / f"out-{workers}w"
            shutil.rmtree(out, ignore_errors=True)
            run = measure([sys.executable, "-m", "data_prep", "pairs", "--input", str(path), "--out", str(out),
                           "--workers", str(workers)], out)
            stream = out / "pairs" / plain.stem
            manifest = (stream / "manifest.json").read_text()
            manifests[workers].add(manifest)
            written.add((json.dumps({k: json.loads(manifest)[k] for k in ("samples", "counts", "inputs")}),
                         pairs_written(stream)))
            shutil.rmtree(out)
            if workers not in best or run.wall_s < best[workers].wall_s:
                best[workers] = run
    assert all(len(m) == 1 for m in manifests.values()), "runs of one --workers differ"
    assert len(written) == 1, "the runs wrote different pairs or counts"
    counts = json.loads(manifests[1].pop())["counts"]
    print(f"input: {size / MB:.1f} MB, {counts['rows']:,} rows -> {counts['pairs']:,} pairs "
          f"({counts['duplicates']:,} duplicates dropped); best of {args.repeat}")
    header = ["procs", "wall s", "MB/s", "MB/s/proc", "CPU s", "MB/CPU-s", "cores had", "max RSS MB",
              "tree PSS MB"]
    print("  ".join(f"{h:>11}" for h in header))
    for workers, run in best.items():
        rate = size / MB / run.wall_s
        row = [workers, f"{run.wall_s:.1f}", f"{rate:.2f}", f"{rate / workers:.2f}", f"{run.cpu_s:.1f}",
               f"{size / MB / run.cpu_s:.2f}", f"{(run.cpu_s + run.idle_core_s) / run.wall_s:.2f}",
               f"{run.max_rss_mb:.0f}", f"{run.tree_pss_mb:.0f}"]
        print("  ".join(f"{v:>11}" for v in row))
    print("load average after: " + ", ".join(f"{v:.2f}" for v in os.getloadavg()))
    print(f"ratio pairs_2w_over_1w {best[1].wall_s / best[2].wall_s:.2f} (target >= 1.7)")


if __name__ == "__main__":
    main()
