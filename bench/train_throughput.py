"""SimCSE training throughput: a bare PyTorch loop, sentence-transformers, and clsys on 1 and 2 Ray workers.

    python bench/train_throughput.py [--steps 30] [--warmup 5] [--batch 64] [--max-length 32] [--out runs/bench-throughput]

Same model (all-MiniLM-L6-v2, dropout 0.1), data (the bundled Wikipedia sample's sentences), global
batch, max length, lr (3e-5, AdamW, grad clip 1.0), CLS pooling, τ 0.05 and number of steps for:
  (a) bare: a plain loop, no framework: tokenise the batch, both dropout views in one forward,
      InfoNCE, backward, AdamW: the overhead floor;
  (b) sentence-transformers: its model and MultipleNegativesRankingLoss (scale 20 = 1/τ) on identical
      sentence pairs, in a plain loop over them (no Trainer: its best case; one forward per view);
  (c) clsys: ``python -m clsys.pretrain`` (quickstart recipe) through Ray Train + DeepSpeed ZeRO-2 with
      1 worker (2 CPUs) and with 2 workers (1 CPU each), tokenisation in the loader workers; and once more
      with 1 worker and length-grouped batches (``data.length_group_batches`` = K = --length-group): the
      same sentences per step, less padding (an option the other ways lack; reported apart from the
      targets). Its batch lengths vary within each window of K steps, so it is timed over whole windows:
      K untimed steps, then the windows that --steps covers, rounded up, logged every K steps.
Every way runs --warmup untimed steps, then --steps timed ones. (a) and (b) run in this process with
all cores; (c)'s rate is the mean of its logged intervals (``perf/step_time_s``, one per --warmup steps)
after the first, start-up and the final checkpoint excluded. (a), (b) read
the same shuffled sentences; clsys reads the same shards in its own seeded order. Prints a table, then
``ratio`` lines (targets: clsys 1 worker ≥ 1.2× sentence-transformers and ≥ 0.9× bare). Not part of the
test suite.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from clsys import storage  # noqa: E402
from clsys.data.shard_reader import load_shards, read_shard  # noqa: E402
from clsys.model.encoder import load_encoder, load_tokenizer  # noqa: E402
from sample_data import SAMPLE_SHARDS as SHARDS, sample_shards  # noqa: E402
from sts_recipes import MODEL, sentence_transformers_simcse, step_time  # noqa: E402


def bare_loop(sentences: list[str], steps: int, batch: int, max_length: int, warmup: int) -> float:
    """Seconds for the SimCSE steps of the plain loop after the first ``warmup``."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(MODEL)
    model = load_encoder(MODEL, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)
    model.train()
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        texts = sentences[step * batch % len(sentences):][:batch]
        inputs = tokenizer(texts * 2, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        cls = model(**inputs).last_hidden_state[:, 0]
        z1, z2 = F.normalize(cls, dim=-1).chunk(2)
        loss = F.cross_entropy(z1 @ z2.T / 0.05, torch.arange(len(texts)))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return time.perf_counter() - start


def clsys_run(workers: int, steps: int, batch: int, max_length: int, warmup: int, out: str,
              length_group: int = 0) -> float:
    """Seconds per step of a clsys run: the mean of its logged intervals (``warmup`` steps each) after the first."""
    name = f"simcse-{workers}w-k{length_group}"
    subprocess.run([sys.executable, "-m", "clsys.pretrain", "--config", "quickstart", f"data.url={SHARDS}",
                    f"train.run_root={out}", f"train.name={name}", f"train.steps={steps}", f"train.batch_size={batch}",
                    f"data.max_length={max_length}", "optim.lr=3e-5", "optim.warmup_steps=0", "model.dropout=0.1",
                    f"train.log_every={warmup}", f"train.ckpt_every={steps}", "eval.sts_dev=", "eval.sts_test=",
                    f"cluster.num_workers={workers}", f"cluster.cpus_per_worker={max(1, (os.cpu_count() or 2) // workers)}",
                    f"data.length_group_batches={length_group}"],
                   cwd=REPO, check=True)
    return step_time(os.path.join(out, name), skip=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps of every way")
    parser.add_argument("--batch", type=int, default=64, help="global batch (sentences per step)")
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--out", default="runs/bench-throughput", help="run root of the clsys runs (replaced)")
    parser.add_argument("--length-group", type=int, default=16, help="K of the length-grouped clsys row")
    args = parser.parse_args()
    if args.max_length != 32:
        sys.exit("train_throughput: the sentence-transformers arm (bench/sts_recipes.py) is fixed at max length 32")

    sample_shards()
    out = str(REPO / args.out)
    shutil.rmtree(out, ignore_errors=True)
    # (a) reads the sentences in the order (b) shuffles them to (same seed, same list).
    sentences = [s["txt"] for shard in load_shards(storage.join(str(SHARDS), "sentences")) for s in read_shard(shard)]
    random.Random(0).shuffle(sentences)
    random.seed(0)

    total, timed = args.warmup + args.steps, args.steps
    per_step = {"bare PyTorch loop": bare_loop(sentences, total, args.batch, args.max_length, args.warmup) / timed}
    with tempfile.TemporaryDirectory() as tmp:
        per_step["sentence-transformers MNRL"] = sentence_transformers_simcse(
            str(SHARDS), total, args.batch, 3e-5, 0, tmp, warmup=args.warmup) / timed
    for workers in (1, 2):
        per_step[f"clsys, Ray + DeepSpeed, {workers} worker{'s' * (workers > 1)}"] = clsys_run(
            workers, total, args.batch, args.max_length, args.warmup, out)
    k = args.length_group
    per_step[f"clsys, 1 worker, length-grouped (K={k})"] = clsys_run(
        1, k * (1 + -(-args.steps // k)), args.batch, args.max_length, k, out, k)

    print(f"\nSimCSE on {MODEL}, global batch {args.batch}, max length {args.max_length}, {args.steps} timed steps after {args.warmup}, "
          f"{os.cpu_count()} CPU cores")
    print(f"{'way':<42} {'s/step':>7} {'steps/s':>8} {'sentences/s':>12}")
    for way, seconds in per_step.items():
        print(f"{way:<42} {seconds:>7.3f} {1 / seconds:>8.3f} {args.batch / seconds:>12.1f}")
    bare, st, one, two, grouped = per_step.values()
    print()
    print(f"ratio clsys_1w_over_sentence_transformers {st / one:.3f}")
    print(f"ratio clsys_1w_over_bare {bare / one:.3f}")
    print(f"ratio clsys_2w_over_bare {bare / two:.3f}")
    print(f"ratio clsys_1w_grouped_over_sentence_transformers {st / grouped:.3f}")
    print(f"ratio clsys_1w_grouped_over_bare {bare / grouped:.3f}")


if __name__ == "__main__":
    main()
