"""Hard-negative mining throughput and memory per worker: ``python -m clsys.mine`` with 1 and 2 Ray workers.

    python bench/mine_throughput.py [--queries 2000] [--corpus 6000] [--max-length 64]

The data: XQuAD questions (en, de, es, ... until ``--queries``) as queries, each with its paragraph as the
positive (``data_prep pairs``), and a ``sentences`` stream of ``--corpus`` distinct STS sentences as ``--corpus``
(the bundled STS-B and KorSTS sets); the packaged all-MiniLM-L6-v2. Three runs, each on its own local Ray
cluster (``--workers`` of 1 CPU each):

  1 worker,  corpus N    the baseline
  2 workers, corpus N    the queries/s ratio to the baseline (the target: >= 1.7)
  2 workers, corpus 2N   each worker holds N texts again: its memory is the baseline worker's, not twice it

Printed: each run's mining figures as the command prints them (queries/s of the mining phase, after the corpus is
embedded; the CPU seconds this process spent merging; each worker's texts, bytes of embeddings and text, peak RSS,
and CPU time per query), the machine's load average around it, and ``ratio <name> <value>`` lines: the queries/s
of 2 workers over 1, measured, and as the workers' CPU time allows it (the single worker's CPU per query over the
busiest of the two's: the ratio with a core for each worker and one for this process, which a loaded 2-core
machine does not give), and each worker's embedding bytes and peak RSS over the single worker's. Not part of the
test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from clsys.eval.retrieval import bundled_xquad, load_xquad  # noqa: E402
from clsys.eval.sts_data import read_sts  # noqa: E402
from clsys.shards.blocks import Record  # noqa: E402
from clsys.shards.writer import ShardWriter  # noqa: E402
from data_prep.__main__ import main as data_prep  # noqa: E402

MINING = re.compile(r"mining: (\d+) queries in ([\d.]+) s: ([\d.]+) queries/s.*; merging ([\d.]+) CPU-s")
WORKER = re.compile(r"worker (\d+)/(\d+): (\d+) texts \(([\d.]+) MiB of embeddings, ([\d.]+) MiB of text\), "
                    r"peak RSS (\d+) MiB; .* queries embedded in [\d.]+ s \(([\d.]+) CPU-s\), \d+ searched in "
                    r"[\d.]+ s \(([\d.]+) CPU-s\)")


def write_inputs(folder: Path, queries: int, corpus: int) -> tuple[str, dict[int, str]]:
    """The pairs root (``queries`` questions and their paragraphs) and a sentences stream of each corpus size."""
    rows = []
    for lang in bundled_xquad():
        xs = load_xquad(lang)
        rows += [{"query": q, "pos": [xs.paragraphs[g]]} for q, g in zip(xs.questions, xs.gold)]
    (folder / "q.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[:queries]))
    assert data_prep(["pairs", "--input", str(folder / "q.jsonl"), "--out", str(folder / "data")]) == 0
    sentences = list(dict.fromkeys(s for name in ("stsb-en-train", "korsts-train", "stsb-de-test", "stsb-en-test")
                                   for sts in read_sts(name).sets for s in (*sts.sent1, *sts.sent2)))
    if len(sentences) < 2 * corpus:
        raise SystemExit(f"--corpus {corpus}: the bundled STS sets hold {len(sentences)} distinct sentences, "
                         f"{2 * corpus} are needed")
    streams = {}
    for size in (corpus, 2 * corpus):
        url = str(folder / f"corpus-{size}" / "sentences")
        writer = ShardWriter(url, str(folder), 64 << 20, block_records=256)
        writer.write_records([Record(s, {}) for s in sentences[:size]])
        writer.close()
        writer.write_manifest({})
        streams[size] = url
    return str(folder / "data"), streams


def mine(data: str, corpus: str, out: str, workers: int, max_length: int, model: str = "all-MiniLM-L6-v2") -> dict:
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "clsys.mine", "--model", model, "--data", data,
                             "--corpus", corpus, "--out", out, "--workers", str(workers), "--max-length",
                             str(max_length)], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
                                 "TOKENIZERS_PARALLELISM": "false"})
    if result.returncode != 0:
        raise SystemExit(f"clsys.mine failed ({result.returncode}):\n{result.stderr[-3000:]}")
    mining = MINING.search(result.stdout)
    return {"workers": workers, "queries": int(mining[1]), "seconds": float(mining[2]), "qps": float(mining[3]),
            "merging_cpu": float(mining[4]), "wall": time.perf_counter() - start, "load": (load, os.getloadavg()[0]),
            "per_worker": [{"texts": int(m[3]), "embedding_mib": float(m[4]), "text_mib": float(m[5]),
                            "rss_mib": int(m[6]), "query_cpu": float(m[7]) + float(m[8])}
                           for m in WORKER.finditer(result.stdout)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--corpus", type=int, default=6000, help="N: the corpus sentences of the first two runs")
    p.add_argument("--max-length", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mine-bench-") as tmp:
        data, corpus = write_inputs(Path(tmp), args.queries, args.corpus)
        runs = {}
        for name, workers, size in (("1w N", 1, args.corpus), ("2w N", 2, args.corpus), ("2w 2N", 2, 2 * args.corpus)):
            run = runs[name] = mine(data, corpus[size], str(Path(tmp) / f"out-{name.replace(' ', '-')}"), workers,
                                    args.max_length)
            print(f"{name}: {run['queries']} queries in {run['seconds']:.1f} s: {run['qps']:.1f} queries/s, "
                  f"{run['qps'] / workers:.1f} per worker; this process merging {run['merging_cpu']:.1f} CPU-s "
                  f"(run {run['wall']:.0f} s, load average {run['load'][0]:.1f} -> {run['load'][1]:.1f})", flush=True)
            for rank, w in enumerate(run["per_worker"]):
                print(f"  worker {rank}: {w['texts']} texts, {w['embedding_mib']:.1f} MiB of embeddings, "
                      f"{w['text_mib']:.1f} MiB of text, peak RSS {w['rss_mib']} MiB; queries "
                      f"{1000 * w['query_cpu'] / run['queries']:.1f} CPU-ms each", flush=True)
    base = runs["1w N"]
    print(f"ratio two_workers_over_one {runs['2w N']['qps'] / base['qps']:.2f}")
    # What the workers' own CPU time allows, each on a core of its own: the busiest worker's CPU per query.
    busiest = max(w["query_cpu"] for w in runs["2w N"]["per_worker"])
    print(f"ratio two_workers_over_one_by_worker_cpu {base['per_worker'][0]['query_cpu'] / busiest:.2f}")
    for name in ("2w N", "2w 2N"):
        per_worker = max(w["embedding_mib"] for w in runs[name]["per_worker"])
        rss = max(w["rss_mib"] for w in runs[name]["per_worker"])
        print(f"ratio {name.replace(' ', '_')}_embedding_per_worker_over_1w_N "
              f"{per_worker / base['per_worker'][0]['embedding_mib']:.2f}")
        print(f"ratio {name.replace(' ', '_')}_peak_rss_per_worker_over_1w_N {rss / base['per_worker'][0]['rss_mib']:.2f}")


if __name__ == "__main__":
    main()
