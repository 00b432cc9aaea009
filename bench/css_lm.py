"""CSS-LM against plain fine-tuning on a few-shot task, seeds averaged; then bank scoring throughput.

    python bench/css_lm.py [--task acl-arc|sst5] [--seeds 5] [--workers 1] [--out runs/bench-css-lm] [--no-scoring]

Both arms run the bundled ``css_lm`` recipe through ``python -m clsys.pretrain`` (Ray Train, DeepSpeed
ZeRO-2) on all-MiniLM-L6-v2 with 16 examples per class drawn per seed, and report test accuracy at
the best dev epoch, mean ± std over the seeds:
  1. plain fine-tuning: ``objective.method=finetune`` (CE on the task head, ``objective.task.warmup_epochs`` epochs);
  2. CSS-LM: stage A (same epochs), the bank from the bundled Wikipedia sample's sentences (the
     first ``objective.corpus.bank_size`` with >= 15 tokens), stage C (``objective.task.epochs`` epochs).
Seed i of both arms draws the same few-shot sample. The default task is ACL-ARC (6 classes; its
small dev and test sets keep per-epoch evaluation cheap on CPU); runs are resumed (complete seeds
skipped) when the command is repeated. Then ``bench/css_bank_scoring.py`` at 40k and 1M rows.
Prints a table, then ``ratio <name> <value>`` lines. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sample_data import sample_shards

REPO = Path(__file__).resolve().parents[1]
TASKS = {
    "acl-arc": ("clsys/assets/labeled/acl-arc/train.txt", "clsys/assets/labeled/acl-arc/dev.txt",
                "clsys/assets/labeled/acl-arc/test.txt"),
    "sst5": ("clsys/assets/labeled/sst5/stsa.fine.train", "clsys/assets/labeled/sst5/stsa.fine.dev",
             "clsys/assets/labeled/sst5/stsa.fine.test"),
}
SHARDS = "runs/shards/enwiki-sample"


def python(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=REPO, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="acl-arc")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=1, help="Ray Train workers per run")
    parser.add_argument("--out", default="runs/bench-css-lm", help="run root (resumed when it exists)")
    parser.add_argument("--no-scoring", action="store_true", help="skip the bank scoring throughput part")
    parser.add_argument("overrides", nargs="*", help="extra overrides for both arms, e.g. objective.task.epochs=5")
    args = parser.parse_args()

    sample_shards(REPO / SHARDS)
    train, dev, test = TASKS[args.task]
    rows = []
    for method in ("finetune", "css_lm"):
        name = f"{args.task}-{method}"
        seconds = python("-m", "clsys.pretrain", "--config", "css_lm", "--repeats", str(args.seeds), "--resume", "latest",
                         f"objective.method={method}", f"objective.task.train={train}", f"objective.task.dev={dev}",
                         f"objective.task.test={test}", f"objective.corpus.url={SHARDS}", f"train.name={name}",
                         f"train.run_root={args.out}", f"cluster.num_workers={args.workers}", *args.overrides)
        with open(REPO / args.out / name / "summary.json") as f:
            summary = json.load(f)
        rows.append((method, summary, seconds))

    print(f"\n{args.task}, 16 per class, all-MiniLM-L6-v2, {args.seeds} seeds, {args.workers} worker(s): "
          f"test accuracy ×100 at the best dev epoch")
    print(f"{'method':<22} {'mean':>6} {'std':>6}   per seed{'':<30} wall (this run)")

    def line(name: str, tests: list[float], seconds: str) -> None:
        mean, std = statistics.mean(tests), statistics.stdev(tests) if len(tests) > 1 else 0.0
        print(f"{name:<22} {100 * mean:>6.2f} {100 * std:>6.2f}   {' '.join(f'{100 * t:5.1f}' for t in tests):<38} {seconds}")

    for method, summary, seconds in rows:
        line(method, [s["test_accuracy"] for s in summary["seeds"]], f"{seconds:>7.0f} s")
        if method == "css_lm":  # its stage A alone: fine-tuning plus the pairwise heads' losses
            line("css_lm stage A only", [s["warmup"]["test_accuracy"] for s in summary["seeds"]], "")
    (_, finetune, _), (_, css, _) = rows
    print(f"ratio css_lm_over_finetune_test_accuracy {css['test_accuracy_mean'] / finetune['test_accuracy_mean']:.3f}")
    print(f"ratio css_lm_minus_finetune_test_accuracy_points "
          f"{100 * (css['test_accuracy_mean'] - finetune['test_accuracy_mean']):.2f}")
    if not args.no_scoring:
        python(str(REPO / "bench" / "css_bank_scoring.py"))


if __name__ == "__main__":
    main()
