"""``data_prep pairs``' memory against its input: the duplicate check per distinct pair, and the shuffle windows.

    python bench/pairs_memory.py [--pairs 1e6 3e6 1e7 3e7] [--command-rows 1000000] [--window-mb 50 150]
                                 [--work-dir /tmp/pairs-memory]

``dedup``: the main process's structure (``data_prep.pairs.dedup.DigestSet``) alone, in a process of its own per size, fed
--pairs distinct random digests in parts of --batch, as the workers' answers come; its peak RSS (VmHWM) growth
over the process's before the first part, per pair, and the seconds spent. ``command``: the real command
(``--workers 1 --shuffle-window-mb 0``) on --command-rows short rows, every pair distinct, against the same
rows repeating 1,000 pairs (the same parsing and writing): the peak RSS difference per distinct pair.
``windows``: the real command with its default --shuffle-window-mb (64) on --window-mb MB of pairs of an 8 KB
positive with a 12-character query, with a 4,000-character query, and with 12-character queries in 100
sources row by row in turn: peak RSS, which must not grow with the input. Peak RSS is the largest process's
(``process_runs.measure``); the timings depend on the machine's load. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from process_runs import measure  # bench/, beside this script

MB = 10**6

# One size of ``dedup``, in a fresh process: prints its peak RSS growth (bytes) and its seconds.
DEDUP = """
import sys, time
import numpy as np
import psutil
from process_runs import peak_rss
from data_prep.pairs.dedup import DigestSet
pairs, batch = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
seen, me = DigestSet(), psutil.Process()
seen.add(rng.integers(0, 2**64, 1, dtype=np.uint64))  # numpy's first allocations, before the baseline
before, start = peak_rss(me), time.perf_counter()
for done in range(0, pairs, batch):
    assert not len(seen.add(rng.integers(0, 2**64, min(batch, pairs - done), dtype=np.uint64)))
print(peak_rss(me) - before, time.perf_counter() - start)
"""


def dedup(pairs: int, batch: int) -> tuple[float, float]:
    """Bytes a distinct pair and seconds, for ``pairs`` pairs."""
    out = subprocess.run([sys.executable, "-c", DEDUP, str(pairs), str(batch)], check=True, capture_output=True,
                         text=True, cwd=Path(__file__).parent).stdout.split()
    return int(out[0]) / pairs, float(out[1])


def pairs_command(path: Path, out: Path, *args: str):
    shutil.rmtree(out, ignore_errors=True)
    run = measure([sys.executable, "-m", "data_prep", "pairs", "--input", str(path), "--out", str(out),
                   "--workers", "1", *args], out.with_suffix(".log"))
    shutil.rmtree(out)
    return run


def write_lines(path: Path, lines) -> None:
    with open(path, "w") as f:
        f.writelines(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=float, nargs="*", default=[1e6, 3e6, 1e7, 3e7])
    parser.add_argument("--batch", type=int, default=1000, help="digests a part (default: 1000)")
    parser.add_argument("--command-rows", type=int, default=1_000_000)
    parser.add_argument("--window-mb", type=float, nargs="*", default=[50, 150])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/pairs-memory"))
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    for pairs in map(int, args.pairs):
        per_pair, seconds = dedup(pairs, args.batch)
        print(f"dedup {pairs:>11,} pairs: {per_pair:5.1f} bytes a pair (peak RSS growth), {seconds:.1f} s", flush=True)
    if args.command_rows:
        rows, peaks = args.command_rows, {}
        for name, distinct in (("distinct", args.command_rows), ("repeated", 1000)):
            path = args.work_dir / f"{name}-{rows}.jsonl"
            write_lines(path, (f'{{"query": "q{i % distinct:09d}", "positive": "p"}}\n' for i in range(rows)))
            peaks[name] = pairs_command(path, args.work_dir / "out", "--shuffle-window-mb", "0").max_rss_mb
        per_pair = (peaks["distinct"] - peaks["repeated"]) * 2**20 / (rows - 1000)
        print(f"command {rows:,} distinct pairs: peak RSS {peaks['distinct']:.0f} MiB, {rows:,} rows of 1,000 pairs "
              f"{peaks['repeated']:.0f} MiB: {per_pair:.1f} bytes a distinct pair", flush=True)
    positive = "p" * 8000
    kinds = {"12-char queries": lambda i: {"query": f"q{i:011d}", "positive": f"{i}{positive}"},
             "4,000-char queries": lambda i: {"query": f"q{i:011d}" * 333, "positive": f"{i}{positive[4000:]}"},
             "100 sources": lambda i: {"query": f"q{i:011d}", "positive": f"{i}{positive}", "source": f"s{i % 100}"}}
    for mb in args.window_mb:
        for kind, row in kinds.items():
            path = args.work_dir / "windows.jsonl"
            rows = int(mb * MB / (len(json.dumps(row(0))) + 1))
            write_lines(path, (json.dumps(row(i)) + "\n" for i in range(rows)))
            run = pairs_command(path, args.work_dir / "out")
            print(f"windows {mb:g} MB, {kind}: peak RSS {run.max_rss_mb:.0f} MiB, {run.wall_s:.1f} s", flush=True)


if __name__ == "__main__":
    main()
