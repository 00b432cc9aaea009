"""STS recipes side by side: clsys SimCSE and SG-OPT against a sentence-transformers baseline.

    python bench/sts_recipes.py [--steps 200] [--sg-steps 200] [--out runs/bench]

On all-MiniLM-L6-v2, STS-B test Spearman ×100 with CLS pooling, before and after:
  1. unsupervised SimCSE (clsys, quickstart recipe: 2 Ray workers, ZeRO-2) on the bundled Wikipedia sample;
  2. SG-OPT (clsys, sg_opt recipe) on the unlabeled STS-B train+dev+test sentences (the SG-BERT protocol);
  3. the same SimCSE recipe through sentence-transformers: MultipleNegativesRankingLoss (scale 20 = 1/τ)
     over identical sentence pairs (dropout is the only augmentation), same model, global batch, steps,
     lr, linear decay, seed and sentences, CLS pooling, one process (a plain loop over its model and loss).
Wall times are measured in this one run on this machine. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from clsys import storage  # noqa: E402
from clsys.data.shard_reader import load_shards, read_shard  # noqa: E402
from clsys.evaluate import STS_ASSETS, evaluate_sts, load_sts, resolve_sts  # noqa: E402
from clsys.model.encoder import load_encoder, load_tokenizer  # noqa: E402
from data_prep.shards import ShardWriter  # noqa: E402
from sample_data import sample_shards  # noqa: E402

MODEL = "all-MiniLM-L6-v2"


def run(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=REPO, check=True)
    return time.perf_counter() - start


def cls_spearman(model_dir: str) -> float:
    test = load_sts(resolve_sts("stsb-en-test"))
    return evaluate_sts(load_encoder(model_dir), load_tokenizer(model_dir), test, pooling="cls")["spearman"]


def logged_mean(run_dir: str, tag: str, skip: int = 0) -> float:
    """The mean of a scalar the run logged to TensorBoard, leaving out its first ``skip`` values (warm-up)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    values = [e.value for e in events.Scalars(tag)][skip:]
    return sum(values) / len(values)


def step_time(run_dir: str, skip: int = 0) -> float:
    """Mean seconds per optimizer step that the run logged (perf/step_time_s), evaluations excluded,
    leaving out the first ``skip`` logged intervals (warm-up)."""
    return logged_mean(run_dir, "perf/step_time_s", skip)


def sts_sentence_stream(out: str) -> str:
    """The distinct sentences of STS-B train+dev+test as a `sentences` stream (scores unused)."""
    sentences = []
    for split in ("train", "dev", "test"):
        sts = load_sts(STS_ASSETS / f"stsb-en-{split}.csv")
        sentences += sts.sent1 + sts.sent2
    sentences = sorted(set(sentences))
    url = storage.join(out, "sentences")
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter(url, tmp, max_bytes=2 << 20)  # several shards: 2 ranks need one each at least
        for i, text in enumerate(sentences):
            writer.write(f"stsb-{i:06d}", text, {"lang": "en"})
        writer.close()
        writer.write_manifest({"languages": ["en"]})
    return out


def sentence_transformers_simcse(shards: str, steps: int, batch: int, lr: float, seed: int, out: str,
                                 warmup: int = 0) -> float:
    """Seconds for the steps after the first ``warmup`` ones; the trained model is saved to ``out``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    from clsys.model.encoder import resolve_model_path

    torch.manual_seed(seed)
    random.seed(seed)
    sentences = [s["txt"] for shard in load_shards(storage.join(shards, "sentences")) for s in read_shard(shard)]
    random.shuffle(sentences)
    word = Transformer(resolve_model_path(MODEL), max_seq_length=32)
    model = SentenceTransformer(modules=[word, Pooling(word.get_embedding_dimension(), "cls")], device="cpu")
    loss = MultipleNegativesRankingLoss(model, scale=20.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, (steps - step) / steps))
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        texts = sentences[step * batch % len(sentences):][:batch]
        features = [model.preprocess(texts), model.preprocess(texts)]  # two forwards: two dropout masks
        value = loss(features, None)
        optimizer.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    elapsed = time.perf_counter() - start
    model[0].auto_model.save_pretrained(out)
    model.tokenizer.save_pretrained(out)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="SimCSE steps (clsys and sentence-transformers)")
    parser.add_argument("--sg-steps", type=int, default=200, help="SG-OPT steps")
    parser.add_argument("--out", default="runs/bench")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    wiki = str(sample_shards(Path(out) / "shards" / "enwiki-sample"))
    stsb = sts_sentence_stream(os.path.join(out, "shards", "stsb-sentences"))
    quiet = ["eval.sts_dev=", "eval.sts_test=", f"train.run_root={out}"]
    rows = [("all-MiniLM-L6-v2 (no training)", "-", "-", "-", cls_spearman(MODEL))]

    for name, recipe, data, steps in [("clsys SimCSE (Wikipedia sample)", "quickstart", wiki, args.steps),
                                      ("clsys SG-OPT (STS-B sentences)", "sg_opt", stsb, args.sg_steps)]:
        run_name = f"bench-{recipe}"
        subprocess.run(["rm", "-rf", os.path.join(out, run_name)], check=True)
        seconds = run("-m", "clsys.pretrain", "--config", recipe, f"data.url={data}", f"train.name={run_name}",
                      f"train.steps={steps}", *quiet)
        run_dir = os.path.join(out, run_name)
        rows.append((name, steps, seconds, step_time(run_dir), cls_spearman(os.path.join(run_dir, "export"))))

    st_dir = os.path.join(out, "bench-st")
    seconds = sentence_transformers_simcse(wiki, args.steps, batch=32, lr=3e-5, seed=42, out=st_dir)
    rows.append(("sentence-transformers MNRL (same SimCSE recipe)", args.steps, seconds, seconds / args.steps,
                 cls_spearman(st_dir)))

    print("\nSTS-B test (1379 pairs), CLS pooling, Spearman ×100; wall = whole command incl. start-up")
    print(f"{'run':<50} {'steps':>6} {'wall s':>8} {'s/step':>7} {'CLS':>7}")
    for name, steps, seconds, per_step, score in rows:
        wall = f"{seconds:.0f}" if isinstance(seconds, float) else seconds
        per = f"{per_step:.2f}" if isinstance(per_step, float) else per_step
        print(f"{name:<50} {steps!s:>6} {wall:>8} {per:>7} {score:>7.2f}")
    print(f"\nstep-time ratio, clsys SimCSE (2 Ray workers, ZeRO-2) / sentence-transformers (1 process): "
          f"{rows[1][3] / rows[3][3]:.2f}")


if __name__ == "__main__":
    main()
