"""How many articles a training batch mixes: the quickstart's loader plan against a global shuffle.

    python bench/batch_diversity.py [--steps 200] [--config quickstart]

In-batch negatives from the same article are often false negatives (two sentences about one town),
so a batch should hold sentences of as many articles as a global shuffle of the corpus gives it.
The bundled Wikipedia sample is written by ``data_prep wiki`` twice, with its default shuffle window
(``--shuffle-window-mb 64``) and with ``--shuffle-window-mb 0`` (article order, as data_prep wrote
before the window existed); each is read by the loader every training rank runs (``ShardLoader``
with the recipe's ranks, micro-batch, seed, loader workers and shuffle buffer), rank by rank, and
the global batch of each step is the ranks' micro-batches together. The reference is a uniform
random permutation of all the sample's sentences cut into global batches (mean over 5 seeds).
Per way, over --steps steps: distinct articles per global batch (mean), the most sentences of one
article in a batch (mean over batches), and articles seen in the --steps steps. Prints a table,
then ``ratio`` lines (each way's figure over the global shuffle's; target >= 0.95 for the default).
Not part of the test suite.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from clsys.recipes import load_config  # noqa: E402
from clsys.shards.reader import load_shards, read_shard  # noqa: E402
from clsys.data.streaming import ShardLoader  # noqa: E402


def articles(stream: str) -> dict[str, tuple[str, int]]:
    """Each sentence's article, (lang, page_id), by the key the loader gives it."""
    return {s["__key__"]: (s["json"]["lang"], s["json"]["page_id"]) for shard in load_shards(stream)
            for s in read_shard(shard)}


def write_sample(out: Path, window_mb: float) -> str:
    subprocess.run([sys.executable, "-m", "data_prep", "wiki", "--input",
                    *map(str, sorted((REPO / "data_prep" / "samples").glob("*.bz2"))), "--out", str(out),
                    "--shard-size-mb", "0.25", "--shuffle-window-mb", str(window_mb)],
                   cwd=REPO, check=True, capture_output=True)
    return str(out / "sentences")


def nothing(samples: list[dict]) -> dict:
    """The collate of a loader read for its keys alone (module level: loader workers get it pickled)."""
    return {}


def loader_batches(stream: str, cfg, steps: int) -> list[list[str]]:
    """The keys of each step's global batch, as the recipe's ranks would read them."""
    per_rank = []
    for rank in range(cfg.cluster.num_workers):
        loader = ShardLoader(stream, rank, cfg.cluster.num_workers, cfg.micro_batch, nothing,
                             cfg.train.seed, cfg.data.loader_workers, cfg.data.shuffle_buffer)
        batches = iter(loader)
        per_rank.append([next(batches)["keys"] for _ in range(steps)])
    return [[key for rank in per_rank for key in rank[step]] for step in range(steps)]


def global_shuffle(stream: str, batch: int, steps: int, seed: int) -> list[list[str]]:
    keys = [sample["__key__"] for shard in load_shards(stream) for sample in read_shard(shard)]
    random.Random(seed).shuffle(keys)
    return [keys[i * batch:(i + 1) * batch] for i in range(steps)]


def figures(batches: list[list[str]], article: dict[str, tuple[str, int]]) -> dict[str, float]:
    counts = [collections.Counter(article[key] for key in keys) for keys in batches]
    return {"distinct_per_batch": statistics.mean(len(c) for c in counts),
            "most_of_one_article": statistics.mean(max(c.values()) for c in counts),
            "articles_seen": len(set().union(*counts))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--config", default="quickstart")
    args = parser.parse_args()
    cfg = load_config(args.config, [])
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-diversity-") as tmp:
        default = write_sample(Path(tmp) / "default", 64.0)
        ordered = write_sample(Path(tmp) / "ordered", 0.0)
        by_key, by_key_ordered = articles(default), articles(ordered)
        rows["global shuffle (5 seeds)"] = {
            k: statistics.mean(f[k] for f in (figures(global_shuffle(default, cfg.train.batch_size, args.steps, s),
                                                      by_key) for s in range(5)))
            for k in ("distinct_per_batch", "most_of_one_article", "articles_seen")}
        rows["data_prep default (window 64 MB)"] = figures(loader_batches(default, cfg, args.steps), by_key)
        rows["article order (window 0)"] = figures(loader_batches(ordered, cfg, args.steps), by_key_ordered)
    print(f"{args.config}: {cfg.cluster.num_workers} ranks x {cfg.micro_batch} sentences, loader shuffle buffer "
          f"{cfg.data.shuffle_buffer}, {cfg.data.loader_workers} loader worker(s), {args.steps} steps")
    print(f"{'way':<36} {'articles/batch':>15} {'most of one':>12} {'articles seen':>14}")
    for name, f in rows.items():
        print(f"{name:<36} {f['distinct_per_batch']:>15.1f} {f['most_of_one_article']:>12.2f} {f['articles_seen']:>14.1f}")
    reference = rows["global shuffle (5 seeds)"]
    for label, name in (("default", "data_prep default (window 64 MB)"), ("article_order", "article order (window 0)")):
        for key in ("distinct_per_batch", "articles_seen"):
            print(f"ratio {key}_{label}_over_global {rows[name][key] / reference[key]:.3f}")


if __name__ == "__main__":
    main()
