"""The pairs recipe against sentence-transformers, like for like: the very same batches, several seeds each.

    python bench/pairs_recipes.py [--seeds 6] [--first-seed 42] [--steps 24] [--batch 16] [--cache-factor 8]
                                  [--out runs/bench] [--no-cached] [--no-two-workers]

all-MiniLM-L6-v2 trained from two sources of (query, positive, hard negative) pairs, written by
``python -m data_prep pairs`` from the bundled files:
  nli    SNLI development-set premises → their entailed hypothesis, the contradicted one as the hard negative
         (data_prep/samples/snli-dev-triplets.parquet, 2943 triplets);
  xquad  XQuAD questions of articles 0-23 → their paragraph, the lexically closest paragraph of another article as
         the hard negative (data_prep/samples/xquad-en-train.parquet, its first negative of three).
One hard negative a pair, so that no random draw separates the two systems. Per seed, two settings:
  1. the batch that fits: clsys's ``pairs`` recipe (1 Ray worker, each batch from one source, τ 0.02, Matryoshka
     384/256/128/64, the recipe's AdamW, clipping, warm-up and linear decay, its step precision) for ``--steps``
     steps of ``--batch`` pairs, logging the keys it consumed; then sentence-transformers on those batches in that
     order: MatryoshkaLoss over MultipleNegativesRankingLoss (scale 1/τ), the same optimizer, schedule, clipping and
     precision, one process;
  2. a global batch ``--cache-factor`` times that, the same pairs in as many fewer steps: clsys with GradCache
     (``objective.grad_cache.chunk_size`` = the rows of a ``--batch`` batch) against CachedMultipleNegativesRanking-
     Loss (``mini_batch_size`` = ``--batch``) on clsys's batches.
Both systems' last models are evaluated alike: nDCG@10 on the test split of the bundled BEIR folder ``xquad-en``
(the 558 questions of articles 24-47, which training never read, among all 240 paragraphs) and STS-B test Spearman,
mean pooling. Prints a row per arm (mean ± std, every seed, s/step: clsys's logged step time, sentence-transformers'
timed the same way, the first step left out), the untrained model's figures, the paired differences clsys minus
sentence-transformers, the s/step ratio, and pairs/s of a 2-worker clsys run. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from clsys import storage  # noqa: E402
from clsys.eval.beir import evaluate_beir, load_beir, resolve_beir  # noqa: E402
from clsys.eval.sts import evaluate_sts  # noqa: E402
from clsys.eval.sts_data import load_sts, resolve_sts  # noqa: E402
from clsys.model.encoder import load_encoder, load_tokenizer  # noqa: E402
from clsys.shards.reader import load_shards, read_shard  # noqa: E402
from sts_recipes import consumed_batches, mean_std, run, st_optimizer, step_time  # noqa: E402

MODEL = "all-MiniLM-L6-v2"
SAMPLES = REPO / "data_prep" / "samples"


def write_sources(out: Path, name: str = "pairs-bench", shard_mb: float = 64.0) -> str:
    """The two sources as JSON lines of one hard negative a pair, then ``data_prep pairs`` over them into
    ``out/shards/<name>`` with shards of ``shard_mb``: the data root."""
    import pyarrow.parquet as pq

    inputs = out / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    nli = pq.read_table(SAMPLES / "snli-dev-triplets.parquet").to_pylist()
    xquad = pq.read_table(SAMPLES / "xquad-en-train.parquet").to_pylist()
    rows = {"nli": [(r["anchor"], r["positive"], r["negative"]) for r in nli],
            "xquad": [(r["query"], r["positive"], r["negatives"][0]) for r in xquad]}
    for source, triplets in rows.items():
        with open(inputs / f"{source}.jsonl", "w", encoding="utf-8") as f:
            for query, positive, negative in triplets:
                f.write(json.dumps({"query": query, "positive": positive, "negatives": [negative]}) + "\n")
    root = out / "shards" / name
    subprocess.run(["rm", "-rf", str(root)], check=True)
    run("-m", "data_prep", "pairs", "--input", str(inputs / "nli.jsonl"), str(inputs / "xquad.jsonl"),
        "--out", str(root), "--shard-size-mb", str(shard_mb))
    return str(root)


def pair_records(root: str) -> dict[str, tuple[str, str, str]]:
    """``<stream>/<sample key>`` (as ``train.log_sample_keys`` writes a source's keys) → (query, positive, hard
    negative), over both streams under ``root``."""
    records: dict[str, tuple[str, str, str]] = {}
    for stream in ("pairs/nli", "pairs/xquad"):
        for shard in load_shards(storage.join(root, stream)):
            for sample in read_shard(shard):
                record = sample["json"]
                records[f"{stream}/{sample['__key__']}"] = (sample["txt"], record["positive"], record["negatives"][0])
    return records


def scores(model_dir: str) -> tuple[float, float]:
    """(nDCG@10 on xquad-en's test split, STS-B test Spearman) ×100, mean pooling, of a model folder."""
    encoder, tokenizer = load_encoder(model_dir), load_tokenizer(model_dir)
    ndcg = evaluate_beir(encoder, tokenizer, load_beir(resolve_beir("xquad-en"), "test"), pooling="mean")["ndcg@10"]
    sts = evaluate_sts(encoder, tokenizer, load_sts(resolve_sts("stsb-en-test")), pooling="mean")["spearman"]
    return ndcg, sts


def sentence_transformers_pairs(records: dict[str, tuple[str, str, str]], batches: list[list[str]], cfg,
                                out: str, precision: str, cached_mini_batch: int) -> float:
    """The pairs recipe through sentence-transformers on the batches a clsys run consumed: columns (query, positive,
    hard negative), MatryoshkaLoss over MultipleNegativesRankingLoss with scale 1/τ, or over CachedMultipleNegatives-
    RankingLoss of ``cached_mini_batch`` pairs a chunk when > 0; clsys's optimizer, schedule, clipping and step
    precision. Saves the last model to ``out``; returns seconds per step, the first step left out."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import (CachedMultipleNegativesRankingLoss,
                                                                   MatryoshkaLoss, MultipleNegativesRankingLoss)
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    from clsys.model.loading import resolve_model_path

    torch.manual_seed(cfg.train.seed)
    word = Transformer(resolve_model_path(cfg.model.name), max_seq_length=cfg.data.max_length)
    model = SentenceTransformer(modules=[word, Pooling(word.get_embedding_dimension(), cfg.objective.pooling)],
                                device="cpu")
    scale = 1.0 / cfg.objective.temperature
    if cached_mini_batch:
        base = CachedMultipleNegativesRankingLoss(model, scale=scale, mini_batch_size=cached_mini_batch)
    else:
        base = MultipleNegativesRankingLoss(model, scale=scale)
    dims = list(cfg.objective.matryoshka_dims)
    loss = MatryoshkaLoss(model, base, dims, [1] * len(dims)) if dims else base
    optimizer, schedule = st_optimizer(model, cfg)
    seconds = 0.0
    model.train()
    for step, keys in enumerate(batches, 1):
        start = time.perf_counter()
        columns = [model.preprocess([records[k][column] for k in keys]) for column in range(3)]
        # The cached loss runs its second forward inside backward(): both under the step's precision.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            value = loss(columns, None)
            optimizer.zero_grad()
            value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        schedule.step()
        if step > 1:
            seconds += time.perf_counter() - start
    word.auto_model.save_pretrained(out)
    model.tokenizer.save_pretrained(out)
    return seconds / max(1, len(batches) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=6,
                        help="runs per arm, seeds --first-seed, +1, ... (0: the 2-worker run alone)")
    parser.add_argument("--first-seed", type=int, default=42)
    parser.add_argument("--steps", type=int, default=24, help="steps of the batch that fits")
    parser.add_argument("--batch", type=int, default=16, help="pairs a step in the batch that fits")
    parser.add_argument("--cache-factor", type=int, default=8, help="the GradCache setting's global batch / --batch")
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--no-cached", action="store_true", help="leave the GradCache setting out")
    parser.add_argument("--no-two-workers", action="store_true", help="leave the 2-worker clsys run out")
    args = parser.parse_args()
    out = Path(os.path.abspath(args.out))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from clsys.engine.deepspeed import step_precision
    from clsys.recipes import load_config

    root = write_sources(out)
    records = pair_records(root)
    seeds = [args.first_seed + i for i in range(args.seeds)]
    settings = [("batch", args.batch, args.steps, 0)]  # name, pairs a step, steps, GradCache pairs a chunk
    if not args.no_cached:
        big = args.batch * args.cache_factor
        settings.append((f"GradCache {args.cache_factor}x", big, max(1, args.steps // args.cache_factor), args.batch))
    arms: dict[str, list[tuple[float, float, float]]] = {}  # arm → (nDCG@10, STS-B, s/step) per seed

    def clsys_run(name: str, seed: int, batch: int, steps: int, chunk: int, *extra: str,
                  data: str = root) -> tuple[object, str]:
        run_name = f"bench-pairs-{name}-{seed}"
        subprocess.run(["rm", "-rf", str(out / run_name)], check=True)
        overrides = [f"data.url={data}", f"train.name={run_name}", f"train.run_root={out}", f"train.seed={seed}",
                     f"train.steps={steps}", f"train.batch_size={batch}", f"optim.warmup_steps={steps // 10}",
                     f"train.ckpt_every={steps}", f"train.log_every={max(1, steps // 8)}", "train.log_sample_keys=true",
                     "eval.sts_dev=", "objective.negatives=1",
                     f"objective.grad_cache.chunk_size={chunk * 3}", *extra]
        run("-m", "clsys.pretrain", "--config", "pairs", *overrides)
        return load_config("pairs", overrides), str(out / run_name)

    for seed in seeds:
        for name, batch, steps, chunk in settings:
            cfg, run_dir = clsys_run(name.split()[0].lower(), seed, batch, steps, chunk)
            clsys_arm, st_arm = f"clsys pairs, {name} {batch}", f"sentence-transformers {'Cached' if chunk else ''}MNRL, {name} {batch}"
            arms.setdefault(clsys_arm, []).append((*scores(os.path.join(run_dir, "export")),
                                                   step_time(run_dir, skip=1)))
            batches = consumed_batches(run_dir, cfg.cluster.num_workers, cfg.micro_batch, steps)
            st_dir = str(out / f"bench-pairs-st-{name.split()[0].lower()}-{seed}")
            per_step = sentence_transformers_pairs(records, batches, cfg, st_dir, step_precision(cfg), chunk)
            arms.setdefault(st_arm, []).append((*scores(st_dir), per_step))
            for arm in (clsys_arm, st_arm):
                ndcg, sts, per = arms[arm][-1]
                print(f"seed {seed}: {arm}: nDCG@10 {ndcg:.2f} STS-B {sts:.2f} ({per:.2f} s/step)", flush=True)

    two_workers = ""
    if not args.no_two_workers:
        # Two ranks read a stream's shards apart: each source in shards of 0.25 MB (one shard each above).
        several = write_sources(out, "pairs-bench-2workers", shard_mb=0.25)
        cfg, run_dir = clsys_run("2workers", args.first_seed, args.batch, args.steps, 0, "cluster.num_workers=2",
                                 "cluster.cpus_per_worker=1", data=several)
        two_workers = f"{args.batch / step_time(run_dir, skip=1):.1f} pairs/s"

    base_ndcg, base_sts = scores(MODEL)
    print(f"\nall-MiniLM-L6-v2 fine-tuned on nli + xquad pairs, mean ± std over seeds {seeds}; ×100, mean pooling: "
          f"nDCG@10 on xquad-en test (558 held-out questions, 240 paragraphs), STS-B test Spearman (1379 pairs)")
    print(f"{'arm':<46} {'nDCG@10':>14} {'per seed':>36} {'STS-B':>14} {'per seed':>36} {'s/step':>7}")
    print(f"{'untrained':<46} {base_ndcg:>14.2f} {'':>36} {base_sts:>14.2f}")
    for arm, results in arms.items():
        ndcgs, stss = [r[0] for r in results], [r[1] for r in results]
        print(f"{arm:<46} {mean_std(ndcgs):>14} {' '.join(f'{x:.2f}' for x in ndcgs):>36} "
              f"{mean_std(stss):>14} {' '.join(f'{x:.2f}' for x in stss):>36} "
              f"{statistics.mean(r[2] for r in results):>7.2f}")
    # Seed by seed the two systems share their batches: the per-seed difference is the paired measurement.
    names = list(arms)
    for clsys_arm, st_arm in zip(names[::2], names[1::2]):
        for metric, column in (("nDCG@10", 0), ("STS-B", 1)):
            differences = [a[column] - b[column] for a, b in zip(arms[clsys_arm], arms[st_arm])]
            error = statistics.stdev(differences) / len(differences) ** 0.5 if len(differences) > 1 else float("nan")
            print(f"{clsys_arm} minus {st_arm}: {metric} {statistics.mean(differences):+.2f} (standard error "
                  f"{error:.2f}; per seed {' '.join(f'{d:+.2f}' for d in differences)})")
        speed = statistics.mean(b[2] for b in arms[st_arm]) / statistics.mean(a[2] for a in arms[clsys_arm])
        print(f"{clsys_arm}: speed {speed:.2f}x sentence-transformers' (its s/step over clsys's)")
    if two_workers:
        one = f"1 worker {args.batch / statistics.mean(r[2] for r in arms[names[0]]):.1f} pairs/s, " if names else ""
        print(f"clsys pairs, batch {args.batch}: {one}2 workers (1 CPU each) {two_workers}")


if __name__ == "__main__":
    main()
