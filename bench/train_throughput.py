"""SimCSE training throughput: a bare PyTorch loop, sentence-transformers, and clsys on 1 and 2 Ray workers.

    python bench/train_throughput.py [--steps 30] [--warmup 5] [--batch 64] [--max-length 32] [--profile]
                                     [--out runs/bench-throughput]

Same model (all-MiniLM-L6-v2, dropout 0.1), data (the bundled Wikipedia sample's sentences), global
batch, max length, lr (3e-5, AdamW, grad clip 1.0), CLS pooling, τ 0.05 and number of steps for:
  (a) bare: a plain loop, no framework: tokenise the batch, both dropout views in one padded forward,
      InfoNCE, backward, AdamW: the overhead floor;
  (b) sentence-transformers: bench/sts_recipes.py's arm (its model with CLS pooling and a training MLP,
      MultipleNegativesRankingLoss at scale 20 = 1/τ, both views in one forward, AdamW, clipping) on
      the same batches as (a), in a plain loop (no Trainer: its best case), fp32;
  (c) clsys: ``python -m clsys.pretrain`` (quickstart recipe: packed rows, ``model.packed``, DeepSpeed
      stage 0) through Ray Train with 1 worker (2 CPUs) and with 2 workers (1 CPU each), tokenisation in
      the loader workers; once more with 1 worker and ``model.packed=false`` (padded batches, as (a) and
      (b) run), and once with 1 worker and length-grouped batches (``data.length_group_batches`` = K =
      --length-group): the same sentences per step, less padding (an option the other ways lack;
      reported apart from the targets). Its batch lengths vary within each window of K steps, so it is
      timed over whole windows: K untimed steps, then the windows that --steps covers, rounded up,
      logged every K steps; and with 1 and 2 workers under ``data.transport=plain`` (a stock DataLoader and
      the tokenizer's own call: the loader's speed tricks off), reported apart from the targets.
Every row above computes in fp32 (``train.precision=fp32``). On a CPU with bf16 matrix units, four
more rows, apart from the targets: (a) under ``torch.autocast`` bf16, clsys with 1 and 2 workers at
``train.precision=auto`` (what the quickstart ships: bf16 autocast there, fp32 weights and AdamW), and
the 2-worker one again logging every step (``train.log_every=1``: what logging itself costs).
Every way runs --warmup untimed steps, then --steps timed ones. (a) and (b) run in this process with
all cores; (c)'s rate is the mean of its logged intervals (``perf/step_time_s``, one per --warmup steps,
or per step when logging every step) after the warm-up, start-up and the final checkpoint excluded.
(a), (b) read the same shuffled sentences; clsys reads the same shards in its own seeded order. Prints
a table, then ``ratio`` lines (targets: clsys 1 worker ≥ 1.2× sentence-transformers and ≥ 1.0× bare,
2 workers ≥ 0.9× bare; logging every step ≥ 0.95× logging every 5).

--profile: the clsys runs log where their step's time goes (``train.profile``: forward + backward,
optimizer, communication, loader wait, other), printed per row beside the bare loop's own split. On a
CPU this adds no synchronisation, so the rows' rates stay comparable. Not part of the test suite.
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
from clsys.recipes import load_config  # noqa: E402
from clsys.shards.reader import load_shards, read_shard  # noqa: E402
from clsys.engine.deepspeed import bf16_matmul_units  # noqa: E402
from clsys.model.encoder import load_encoder, load_tokenizer  # noqa: E402
from sample_data import SAMPLE_SHARDS as SHARDS, sample_shards  # noqa: E402
from sts_recipes import MODEL, logged_mean, sentence_transformers_simcse, step_time  # noqa: E402


def bare_loop(batches: list[list[str]], max_length: int, warmup: int, bf16: bool = False) -> tuple[float, dict]:
    """Seconds for the plain loop's SimCSE steps (one per batch of sentences) after the first ``warmup``,
    and their split: seconds per step by phase, and the share of padding in the batches. ``bf16``: the
    forward under torch.autocast (bf16), as a user would add it."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(MODEL)
    model = load_encoder(MODEL, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5)
    model.train()
    split = {"tokenize": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
    real = padded = 0
    for step, texts in enumerate(batches):
        if step == warmup:
            start = time.perf_counter()
            split = dict.fromkeys(split, 0.0)
        marks = [time.perf_counter()]
        inputs = tokenizer(texts * 2, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        real, padded = real + int(inputs["attention_mask"].sum()), padded + inputs["attention_mask"].numel()
        marks.append(time.perf_counter())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            cls = model(**inputs).last_hidden_state[:, 0].float()
        z1, z2 = F.normalize(cls, dim=-1).chunk(2)
        loss = F.cross_entropy(z1 @ z2.T / 0.05, torch.arange(len(texts)))
        optimizer.zero_grad()
        loss.backward()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        marks.append(time.perf_counter())
        for phase, begin, end in zip(split, marks, marks[1:]):
            split[phase] += end - begin
    timed = len(batches) - warmup
    return time.perf_counter() - start, {**{k: v / timed for k, v in split.items()}, "padding": 1 - real / padded}


PHASE_TAGS = [f"perf/time_{phase}_s" for phase in ("forward_backward", "optimizer", "communication", "loader_wait",
                                                    "other")]

# The ratio lines: (name, way, reference): the reference's s/step over the way's (> 1: the way is faster).
RATIOS = [("clsys_1w_over_sentence_transformers", "1w", "st"), ("clsys_1w_over_bare", "1w", "bare"),
          ("clsys_2w_over_bare", "2w", "bare"), ("clsys_1w_padded_over_bare", "1w_padded", "bare"),
          ("clsys_1w_packed_over_padded", "1w", "1w_padded"),
          ("clsys_1w_grouped_over_sentence_transformers", "1w_grouped", "st"),
          ("clsys_1w_grouped_over_bare", "1w_grouped", "bare"),
          ("clsys_1w_bf16_over_bare_bf16", "1w_bf16", "bare_bf16"), ("clsys_1w_bf16_over_bare", "1w_bf16", "bare"),
          ("clsys_2w_bf16_over_bare", "2w_bf16", "bare"), ("clsys_1w_bf16_over_sentence_transformers", "1w_bf16", "st"),
          ("clsys_2w_bf16_logging_every_step_over_every_5", "2w_bf16_log1", "2w_bf16"),
          ("clsys_1w_fast_over_plain_transport", "1w", "1w_plain"), ("clsys_2w_fast_over_plain_transport", "2w", "2w_plain")]


def clsys_run(workers: int, steps: int, batch: int, max_length: int, warmup: int, out: str,
              length_group: int = 0, packed: bool = True, precision: str = "fp32",
              profile: bool = False, log_every: int = 0, transport: str = "fast") -> tuple[float, dict]:
    """Seconds per step of a clsys run: the mean of its logged intervals (every ``log_every`` steps,
    default ``warmup``) after the first ``warmup`` steps; and with ``profile``, its seconds per step by
    phase (means of the same intervals)."""
    log_every = log_every or warmup
    name = f"simcse-{workers}w-k{length_group}-{'packed' if packed else 'padded'}-{precision}-log{log_every}-{transport}"
    subprocess.run([sys.executable, "-m", "clsys.pretrain", "--config", "quickstart", f"data.url={SHARDS}",
                    f"train.run_root={out}", f"train.name={name}", f"train.steps={steps}", f"train.batch_size={batch}",
                    f"data.max_length={max_length}", "optim.lr=3e-5", "optim.warmup_steps=0", "model.dropout=0.1",
                    f"train.log_every={log_every}", f"train.ckpt_every={steps}", "eval.sts_dev=", "eval.sts_test=",
                    f"cluster.num_workers={workers}", f"cluster.cpus_per_worker={max(1, (os.cpu_count() or 2) // workers)}",
                    f"data.length_group_batches={length_group}", f"model.packed={str(packed).lower()}",
                    f"train.precision={precision}", f"data.transport={transport}",
                    f"train.profile={str(profile).lower()}"],
                   cwd=REPO, check=True)
    run = os.path.join(out, name)
    skip = max(1, warmup // log_every)
    split = {tag[len("perf/time_"):-2]: logged_mean(run, tag, skip=skip) for tag in PHASE_TAGS} if profile else {}
    return step_time(run, skip=skip), split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps of every way")
    parser.add_argument("--batch", type=int, default=64, help="global batch (sentences per step)")
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--out", default="runs/bench-throughput", help="run root of the clsys runs (replaced)")
    parser.add_argument("--length-group", type=int, default=16, help="K of the length-grouped clsys row")
    parser.add_argument("--profile", action="store_true", help="print where each clsys row's step time goes")
    args = parser.parse_args()
    if args.max_length != 32:
        sys.exit("train_throughput: the sentence-transformers arm (bench/sts_recipes.py) is fixed at max length 32")

    sample_shards()
    out = str(REPO / args.out)
    shutil.rmtree(out, ignore_errors=True)
    total, timed = args.warmup + args.steps, args.steps
    # (a) and (b) read the same batches: the sentences shuffled once, taken in turn (wrapping around).
    samples = [(s["__key__"], s["txt"]) for shard in load_shards(storage.join(str(SHARDS), "sentences"))
               for s in read_shard(shard)]
    random.Random(0).shuffle(samples)
    batches = [samples[step * args.batch % len(samples):][:args.batch] for step in range(total)]
    texts = [[text for _, text in batch] for batch in batches]
    random.seed(0)

    k = args.length_group
    labels = {"bare": "bare PyTorch loop", "st": "sentence-transformers MNRL",
              "1w": "clsys, Ray + DeepSpeed, 1 worker", "2w": "clsys, Ray + DeepSpeed, 2 workers",
              "1w_padded": "clsys, 1 worker, padded (packed=false)",
              "1w_grouped": f"clsys, 1 worker, length-grouped (K={k})",
              "1w_plain": "clsys, 1 worker, data.transport=plain", "2w_plain": "clsys, 2 workers, data.transport=plain",
              "bare_bf16": "bare PyTorch loop, bf16 autocast", "1w_bf16": "clsys, 1 worker, bf16 (precision=auto)",
              "2w_bf16": "clsys, 2 workers, bf16 (precision=auto)",
              "2w_bf16_log1": "clsys, 2 workers, bf16, logging every step"}
    bare_seconds, bare_split = bare_loop(texts, args.max_length, args.warmup)
    per_step = {"bare": bare_seconds / timed}
    st_cfg = load_config("quickstart", [f"train.steps={total}", f"train.batch_size={args.batch}",
                                        f"data.max_length={args.max_length}", "optim.lr=3e-5", "optim.warmup_steps=0",
                                        f"eval.every={total}"])
    with tempfile.TemporaryDirectory() as tmp:
        per_step["st"] = sentence_transformers_simcse(str(SHARDS), [[key for key, _ in batch] for batch in batches],
                                                      st_cfg, tmp, "fp32", warmup=args.warmup)
    same = dict(steps=total, batch=args.batch, max_length=args.max_length, warmup=args.warmup, out=out)
    clsys_rows = {"1w": dict(workers=1, **same), "2w": dict(workers=2, **same),
                  "1w_padded": dict(workers=1, packed=False, **same),
                  # The loader's speed tricks off (a stock DataLoader, the tokenizer's own call): what they are worth.
                  "1w_plain": dict(workers=1, transport="plain", **same), "2w_plain": dict(workers=2, transport="plain", **same),
                  "1w_grouped": dict(same, workers=1, steps=k * (1 + -(-args.steps // k)), warmup=k, length_group=k)}
    # Apart from the targets (other arithmetic than the rows above): bf16 autocast, which the quickstart's
    # train.precision: auto picks on a CPU with bf16 matrix units, against a bare loop that autocasts too.
    if bf16_matmul_units(use_gpu=False):
        per_step["bare_bf16"] = bare_loop(texts, args.max_length, args.warmup, bf16=True)[0] / timed
        clsys_rows.update({f"{w}w_bf16": dict(same, workers=w, precision="auto") for w in (1, 2)})
        # Logging every step must cost nothing either (it once waited on Ray's report queue: ~2 s a step).
        clsys_rows["2w_bf16_log1"] = dict(same, workers=2, precision="auto", log_every=1)
    splits = {}
    for way, run_args in clsys_rows.items():
        per_step[way], splits[way] = clsys_run(**run_args, profile=args.profile)

    print(f"\nSimCSE on {MODEL}, global batch {args.batch}, max length {args.max_length}, {args.steps} timed steps after "
          f"{args.warmup}, {os.cpu_count()} CPU cores; padding {100 * bare_split['padding']:.1f}% of the padded batches' "
          f"tokens")
    print(f"{'way':<42} {'s/step':>7} {'steps/s':>8} {'sentences/s':>12}")
    for way in labels:
        if way in per_step:
            seconds = per_step[way]
            print(f"{labels[way]:<42} {seconds:>7.3f} {1 / seconds:>8.3f} {args.batch / seconds:>12.1f}")
    if args.profile:
        print("\nwhere the step goes, s/step (bare: its own marks; clsys: train.profile)")
        print(f"{'way':<42} {'fwd+bwd':>8} {'optim':>7} {'comm':>7} {'loader':>7} {'other':>7}")
        print(f"{'bare PyTorch loop (tokenising: loader)':<42} {bare_split['forward_backward']:>8.3f} "
              f"{bare_split['optimizer']:>7.3f} {0:>7.3f} {bare_split['tokenize']:>7.3f} {0:>7.3f}")
        for way, split in splits.items():
            print(f"{labels[way]:<42} {split['forward_backward']:>8.3f} {split['optimizer']:>7.3f} "
                  f"{split['communication']:>7.3f} {split['loader_wait']:>7.3f} {split['other']:>7.3f}")
    print()
    for name, way, reference in RATIOS:
        if way in per_step and reference in per_step:
            print(f"ratio {name} {per_step[reference] / per_step[way]:.3f}")


if __name__ == "__main__":
    main()
