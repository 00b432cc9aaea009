"""STS recipes side by side, several seeds each: clsys SimCSE and SG-OPT against sentence-transformers.

    python bench/sts_recipes.py [--steps 200] [--sg-steps 200] [--seeds 3] [--first-seed 42] [--out runs/bench]
                                [--override KEY=VALUE ...] [--no-st]

On all-MiniLM-L6-v2, STS-B test Spearman ×100 with CLS pooling, mean ± std over --seeds seeds (42, 43, ...
by default):
  1. unsupervised SimCSE (clsys, the quickstart recipe: 2 Ray workers, DeepSpeed stage 0, best STS-B dev
     checkpoint) on the bundled Wikipedia sample, each run logging the sample keys it consumed;
  2. the same recipe through sentence-transformers, like for like: the very batches, in the order
     that seed's clsys run consumed them, MultipleNegativesRankingLoss (scale 1/τ) over one forward
     of both dropout views, the training MLP as a Dense(tanh) module initialised as SimCSE does and
     dropped for evaluation, AdamW with the recipe's weight decay/betas/eps, clipping and linear
     decay, the step's precision (bf16 autocast where the recipe's `auto` resolves to it), and the
     best STS-B dev checkpoint at the same evaluation steps; one process;
  3. SG-OPT (clsys, the sg_opt recipe) on the unlabeled STS-B train+dev+test sentences (SG-BERT's protocol);
  4. Korean (KR-BERT-SimCSE's setting): unsupervised SimCSE on the KorSTS train sentences, unlabeled,
     on multilingual-e5-small (rebuilt by bench/e5_model.py), KorSTS test before and after.
Prints a table (mean ± std, every seed, s/step), then the SimCSE difference clsys minus
sentence-transformers. ``--override`` changes the clsys SimCSE runs one setting at a time (a variant:
``cluster.num_workers=1``, ``train.precision=fp32``, ``model.packed=false``, …); the sentence-transformers arm
follows the variant's configuration where it has the same setting (its batches, precision, optimizer), and
``--no-st`` leaves it out. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from clsys import storage  # noqa: E402
from clsys.shards.reader import load_shards, read_shard  # noqa: E402
from clsys.eval.sts import evaluate_sts  # noqa: E402
from clsys.model.encoder import load_encoder, load_tokenizer  # noqa: E402
from clsys.eval.sts_data import load_sts, resolve_sts  # noqa: E402
from clsys.shards.writer import ShardWriter  # noqa: E402
from sample_data import sample_shards  # noqa: E402

MODEL = "all-MiniLM-L6-v2"
SIMCSE_ARM = "clsys SimCSE (quickstart recipe)"
ST_ARM = "sentence-transformers MNRL (same batches, same recipe)"


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


def sts_sentence_stream(out: str, splits: list[str]) -> str:
    """The distinct sentences of the bundled STS ``splits`` as a `sentences` stream (scores unused)."""
    sentences = []
    for split in splits:
        sts = load_sts(resolve_sts(split))
        sentences += sts.sent1 + sts.sent2
    sentences = sorted(set(sentences))
    url = storage.join(out, "sentences")
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter(url, tmp, max_bytes=2 << 20)  # several shards: 2 ranks need one each at least
        for i, text in enumerate(sentences):
            writer.write(f"sts-{i:06d}", text, {})
        writer.close()
        writer.write_manifest({})
    return out


def consumed_batches(run_dir: str, ranks: int, micro_batch: int, steps: int) -> list[list[str]]:
    """The sample keys of each global batch a clsys run trained on (``train.log_sample_keys``): rank r's
    micro-batch of step s is keys[s·mb:(s+1)·mb] of its files, the global batch the ranks' in rank order."""
    per_rank = []
    for rank in range(ranks):
        folder = Path(run_dir) / "sample_keys" / f"rank-{rank:05d}"
        per_rank.append([key for f in sorted(folder.iterdir()) for key in f.read_text().split()])
    return [[key for keys in per_rank for key in keys[s * micro_batch:(s + 1) * micro_batch]] for s in range(steps)]


def st_optimizer(model: torch.nn.Module, cfg) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The recipe's optimizer for a sentence-transformers arm: AdamW with its learning rate, betas, eps and weight
    decay, and its warm-up and decay schedule (clsys's own ``lr_lambda``), stepped once an optimizer step."""
    from clsys.engine.deepspeed import lr_lambda

    o = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def sentence_transformers_simcse(shards: str, batches: list[list[str]], cfg, out: str, precision: str,
                                 warmup: int = 0) -> float:
    """The clsys SimCSE recipe through sentence-transformers, on the batches a clsys run consumed.

    Same as clsys: the batches and their order, one forward over both dropout views, the training MLP
    (a Dense + tanh module, SimCSE's initialisation) dropped after training, AdamW with the recipe's
    weight decay, betas, eps, clipping and linear decay, the step's precision (``bf16``: forward and
    loss under bf16 autocast, as clsys's step; ``fp32``), and the best STS-B dev checkpoint (raw CLS,
    evaluated at the same steps) kept. The loss is MultipleNegativesRankingLoss (scale 1/τ).
    Returns seconds per step after the first ``warmup`` (evaluations excluded); the selected model is
    saved to ``out``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Transformer

    from clsys.model.loading import resolve_model_path

    torch.manual_seed(cfg.train.seed)
    text = {s["__key__"]: s["txt"] for shard in load_shards(storage.join(shards, "sentences")) for s in read_shard(shard)}
    word = Transformer(resolve_model_path(cfg.model.name), max_seq_length=cfg.data.max_length)
    dim = word.get_embedding_dimension()
    mlp = Dense(dim, dim, activation_function=torch.nn.Tanh())
    torch.nn.init.normal_(mlp.linear.weight, std=word.auto_model.config.initializer_range)
    torch.nn.init.zeros_(mlp.linear.bias)
    model = SentenceTransformer(modules=[word, Pooling(dim, "cls"), mlp], device="cpu")
    loss = MultipleNegativesRankingLoss(model, scale=1.0 / cfg.objective.temperature)
    optimizer, schedule = st_optimizer(model, cfg)
    dev = load_sts(resolve_sts(cfg.eval.sts_dev))
    best, best_state, seconds = -float("inf"), None, 0.0
    for step, keys in enumerate(batches, 1):
        model.train()
        start = time.perf_counter()
        texts = [text[k] for k in keys]
        features = model.preprocess(texts + texts)  # both views in one forward: independent dropout masks
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            embeddings = model(features)["sentence_embedding"]
        # The similarities in fp32, as clsys's loss computes them.
        value = loss.compute_loss_from_embeddings(list(embeddings.float().chunk(2)), None)
        optimizer.zero_grad()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        schedule.step()
        if step > warmup:
            seconds += time.perf_counter() - start
        if step % cfg.eval.every == 0 or step == len(batches):
            score = evaluate_sts(word.auto_model, model.tokenizer, dev, pooling="cls")["spearman"]
            if score > best:
                best, best_state = score, {k: v.detach().clone() for k, v in word.auto_model.state_dict().items()}
    word.auto_model.load_state_dict(best_state)
    word.auto_model.save_pretrained(out)
    model.tokenizer.save_pretrained(out)
    return seconds / (len(batches) - warmup)


def korean_simcse(out: str, seeds: list[int], steps: int) -> None:
    """KR-BERT-SimCSE's setting on the multilingual base: unsupervised SimCSE (the quickstart recipe with
    mean pooling, e5's own) on the KorSTS train sentences as unlabeled text, KorSTS dev selecting the
    checkpoint; KorSTS test Spearman (mean pooling, no e5 prefixes) before and after, per seed."""
    from e5_model import build_e5_small

    base = build_e5_small(os.path.join(out, "models", "multilingual-e5-small"))
    korean = sts_sentence_stream(os.path.join(out, "shards", "korsts-sentences"), ["korsts-train"])
    test = load_sts(resolve_sts("korsts-test"))

    def spearman(model_dir: str) -> float:
        return evaluate_sts(load_encoder(model_dir), load_tokenizer(model_dir), test, pooling="mean")["spearman"]

    after = []
    for seed in seeds:
        run_name = f"bench-korean-{seed}"
        subprocess.run(["rm", "-rf", os.path.join(out, run_name)], check=True)
        run("-m", "clsys.pretrain", "--config", "quickstart", f"model.name={base}", f"data.url={korean}",
            f"train.name={run_name}", f"train.steps={steps}", f"train.seed={seed}", f"train.run_root={out}",
            "objective.pooler=mean", "objective.export_pooling=mean", "eval.sts_dev=korsts-dev", "eval.pooling=mean",
            "eval.sts_test=")
        after.append(spearman(os.path.join(out, run_name, "export")))
    print(f"\nKorSTS test (1379 pairs), mean pooling, Spearman ×100, multilingual-e5-small: before {spearman(base):.2f}, "
          f"after unsupervised SimCSE on KorSTS train sentences ({steps} steps) {mean_std(after)} "
          f"({' '.join(f'{x:.2f}' for x in after)})")


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200,
                        help="SimCSE steps (clsys and sentence-transformers; 0: leave SimCSE out)")
    parser.add_argument("--sg-steps", type=int, default=200, help="SG-OPT steps (0: leave SG-OPT out)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per arm, seeds --first-seed, +1, ...")
    parser.add_argument("--first-seed", type=int, default=42, help="the first seed (default 42)")
    parser.add_argument("--korean-steps", type=int, default=200,
                        help="Korean SimCSE steps on multilingual-e5-small (0: leave the Korean row out)")
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the clsys SimCSE runs (repeatable): the variant measured")
    parser.add_argument("--shards", default="", metavar="DIR",
                        help="data_prep wiki output the SimCSE arms train on (default: the bundled sample, as "
                             "data_prep writes it now)")
    parser.add_argument("--no-st", action="store_true", help="leave the sentence-transformers arm out")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from clsys.recipes import load_config
    from clsys.engine.deepspeed import step_precision

    wiki = args.shards or str(sample_shards(Path(out) / "shards" / "enwiki-sample"))
    stsb = sts_sentence_stream(os.path.join(out, "shards", "stsb-sentences"), ["stsb-en-train", "stsb-en-dev",
                                                                                "stsb-en-test"])
    seeds = [args.first_seed + i for i in range(args.seeds)]
    arms: dict[str, list[tuple[float, float]]] = {}  # name -> (STS-B test CLS, s/step) per seed

    simcse_arm = f"{SIMCSE_ARM} {' '.join(args.override)}".strip()
    recipes = [(simcse_arm, "quickstart", wiki, args.steps)] if args.steps else []
    if args.sg_steps:
        recipes.append(("clsys SG-OPT (sg_opt recipe, STS-B sentences)", "sg_opt", stsb, args.sg_steps))
    for name, recipe, data, steps in recipes:
        for seed in seeds:
            run_name = f"bench-{recipe}-{seed}"
            subprocess.run(["rm", "-rf", os.path.join(out, run_name)], check=True)
            overrides = [f"data.url={data}", f"train.name={run_name}", f"train.steps={steps}", f"train.seed={seed}",
                         "train.log_sample_keys=true", "eval.sts_test=", f"train.run_root={out}",
                         *(args.override if recipe == "quickstart" else [])]
            run("-m", "clsys.pretrain", "--config", recipe, *overrides)
            run_dir = os.path.join(out, run_name)
            arms.setdefault(name, []).append((cls_spearman(os.path.join(run_dir, "export")), step_time(run_dir, skip=1)))
            print(f"seed {seed}: {name}: {arms[name][-1][0]:.2f} ({arms[name][-1][1]:.2f} s/step)", flush=True)
            if recipe == "quickstart" and not args.no_st:
                cfg = load_config(recipe, overrides)
                batches = consumed_batches(run_dir, cfg.cluster.num_workers, cfg.micro_batch, steps)
                st_dir = os.path.join(out, f"bench-st-{seed}")
                per_step = sentence_transformers_simcse(wiki, batches, cfg, st_dir, step_precision(cfg))
                arms.setdefault(ST_ARM, []).append((cls_spearman(st_dir), per_step))
                print(f"seed {seed}: {ST_ARM}: {arms[ST_ARM][-1][0]:.2f} ({per_step:.2f} s/step)", flush=True)

    if args.korean_steps:
        korean_simcse(out, seeds, args.korean_steps)

    print(f"\nSTS-B test (1379 pairs), CLS pooling, Spearman ×100, mean ± std over seeds {seeds}; "
          f"all-MiniLM-L6-v2 before training: {cls_spearman(MODEL):.2f}")
    print(f"{'arm':<56} {'CLS':>14} {'per seed':>24} {'s/step':>7}")
    for name, results in arms.items():
        scores = [r[0] for r in results]
        print(f"{name:<56} {mean_std(scores):>14} {' '.join(f'{x:.2f}' for x in scores):>24} "
              f"{statistics.mean(r[1] for r in results):>7.2f}")
    if args.steps and not args.no_st:
        # Seed by seed the arms share their batches, so the per-seed difference is the paired measurement;
        # its standard error says how far apart two equal systems land over this many seeds.
        differences = [a[0] - b[0] for a, b in zip(arms[simcse_arm], arms[ST_ARM])]
        error = statistics.stdev(differences) / len(differences) ** 0.5 if len(differences) > 1 else float("nan")
        print(f"difference clsys_simcse_minus_sentence_transformers {statistics.mean(differences):+.2f} "
              f"(standard error {error:.2f}; per seed {' '.join(f'{d:+.2f}' for d in differences)})")


if __name__ == "__main__":
    main()
