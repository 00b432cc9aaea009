"""Model FLOP utilisation of a BERT-style encoder on one GPU: SimCSE and TaCL (masked LM) steps, bf16.

    python bench/gpu_mfu.py [--batch 256] [--seq 128] [--min-words N] [--steps 20] [--zero 0] [--compile]
                            [--padded | --packed-attention padded|nested] [--peak-tflops auto] [--model bert-base]

A random-init BERT-base (clsys/configs/models/bert-base.json: 12 layers, d 768, vocab 30,522; ``--model
minilm-l6``: all-MiniLM-L6-v2's shape, 6 layers, d 384) trains
on sequences of --seq tokens (random words of a generated word-level vocabulary, so no hub download);
with --min-words N each row has N to seq-2 words (uniform), so the batch has pads as real text does. Per objective, two ways of stepping the same objective module on the same batches:

- clsys: the product's step, ``engine(batch)`` → ``engine.backward`` → ``engine.step`` on the DeepSpeed
  engine that ``clsys.engine.deepspeed.build_engine`` builds (``train.precision: bf16``, ZeRO --zero,
  ``train.compile`` with --compile, one process, AdamW, grad clipping, the lr schedule), i.e. what each Ray Train worker runs per step;
- bare: torch.autocast(bf16) with fp32 weights and a fused torch AdamW, no framework: the floor.

FLOPs per step are counted by ``torch.utils.flop_counter.FlopCounterMode`` on one forward+backward
of the objective as executed (a padded step's pad tokens count too: compare tokens/s across layouts) (matmuls and attention as executed: SimCSE's 2 views, TaCL's student, frozen teacher
forward and MLM head on the masked positions). MFU = FLOPs per step × steps/s ÷ the GPU's dense bf16
peak (H100/H200 SXM: 989 TFLOP/s). Prints a table, then ``ratio <name> <value>`` lines. Where no CUDA
GPU is present it says so and measures nothing. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clsys.recipes import OBJECTIVES, load_config  # noqa: E402
from clsys.engine.deepspeed import compile_models  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "clsys" / "configs" / "models"
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "GH200": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0,
                    "A10G": 70.0, "B200": 2250.0}
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def word_tokenizer(folder: str, vocab_size: int):
    """A BERT WordPiece tokenizer over the words w0, w1, … (one token each), written to ``folder``."""
    from transformers import AutoTokenizer

    (Path(folder) / "vocab.txt").write_text("\n".join(SPECIAL + [f"w{i}" for i in range(vocab_size - len(SPECIAL))]))
    (Path(folder) / "tokenizer_config.json").write_text('{"tokenizer_class": "BertTokenizer"}')
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def samples(n: int, min_words: int, max_words: int, vocab_size: int, rng: random.Random) -> list[dict]:
    """Shard-like samples (``txt`` + ``json``) of ``min_words`` to ``max_words`` random words."""
    return [{"txt": " ".join(f"w{rng.randrange(vocab_size - len(SPECIAL))}"
                             for _ in range(rng.randint(min_words, max_words))),
             "json": {"lang": "en", "page_id": i}, "__key__": f"{i:08d}"} for i in range(n)]


def build_objective(name: str, tokenizer_dir: str, args, tokenizer):
    overrides = [f"objective.name={name}", f"model.name={MODELS / args.model}.json", "model.init=scratch",
                 f"model.tokenizer={tokenizer_dir}", f"data.max_length={args.seq}", "cluster.num_workers=1",
                 f"train.batch_size={args.batch}", f"train.precision={args.precision}",
                 f"train.zero_stage={args.zero}", f"train.compile={args.compile}",
                 f"train.steps={args.warmup + args.steps}", "optim.lr=1e-5",
                 f"model.packed={str(not args.padded).lower()}", f"model.packed_attention={args.packed_attention}"]
    if name == "tacl":
        overrides.append(f"objective.mask_cap={args.seq}")
    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    return cfg, OBJECTIVES[name](cfg, tokenizer)


def count_flops(objective, batch) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.autocast("cuda", dtype=torch.bfloat16):
        objective(batch).loss.backward()
    objective.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def timed(step, batches, warmup: int, steps: int) -> float:
    """Seconds per step after ``warmup`` untimed steps (one sync at each end of the timed span)."""
    for i in range(warmup):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def bare_stepper(objective):
    objective.cuda().train()
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-5, fused=True)

    def step(batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = objective(batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(objective.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def clsys_stepper(objective, cfg):
    from clsys.engine.deepspeed import build_engine

    engine = build_engine(objective, cfg)
    engine.train()

    def step(batch):
        out = engine(batch)
        engine.backward(out.loss)
        engine.step()
    return step


def single_process_group() -> None:
    """The env a one-rank DeepSpeed process group reads (what Ray Train sets on every worker)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from clsys.engine.deepspeed import init_distributed

    init_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="sequences per step (SimCSE: sentences, 2 views each)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--zero", type=int, default=0, help="DeepSpeed ZeRO stage of the clsys step (one GPU: 0, "
                        "the fastest there; 1-2 partition nothing on one rank)")
    parser.add_argument("--objectives", nargs="+", default=["simcse", "tacl"], choices=["simcse", "tacl"])
    parser.add_argument("--precision", default="bf16", choices=["bf16", "bf16_weights"],
                        help="train.precision of the clsys step (the bare loop always autocasts)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the models (train.compile: true)")
    parser.add_argument("--padded", action="store_true", help="model.packed: false (full-length rows have no pads, "
                        "so packing only adds its index work here)")
    parser.add_argument("--packed-attention", default="padded", choices=["padded", "nested"],
                        help="model.packed_attention: the packed rows' attention kernel")
    parser.add_argument("--min-words", type=int, default=0, help="rows of this many to seq-2 words; 0: all seq-2")
    parser.add_argument("--ways", nargs="+", default=["bare", "clsys"], choices=["bare", "clsys"])
    parser.add_argument("--model", default="bert-base", choices=["bert-base", "minilm-l6"],
                        help="the encoder's shape (clsys/configs/models/NAME.json), random init")
    parser.add_argument("--peak-tflops", default="auto", help="dense bf16 peak of the GPU; auto: by its name")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("gpu_mfu: no CUDA GPU on this machine, so nothing was measured (MFU needs a GPU; run this "
              "where one is present).")
        return
    name = torch.cuda.get_device_name()
    if args.peak_tflops == "auto":
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
        if peak is None:
            sys.exit(f"gpu_mfu: unknown dense bf16 peak for '{name}': pass --peak-tflops")
    else:
        peak = float(args.peak_tflops)
    torch.backends.cuda.matmul.allow_tf32 = True
    single_process_group()
    tokenizer_dir = tempfile.mkdtemp(prefix="clsys-mfu-tokenizer-")
    config = json.loads((MODELS / f"{args.model}.json").read_text())
    tokenizer = word_tokenizer(tokenizer_dir, config["vocab_size"])
    print(f"gpu_mfu: {name}, dense bf16 peak {peak:.0f} TFLOP/s, torch {torch.__version__}, {args.model} "
          f"(random init), seq {args.seq}, batch {args.batch}, {args.steps} timed steps after {args.warmup}, "
          f"{'padded' if args.padded else 'packed (' + args.packed_attention + ' attention)'}, "
          f"words per row {args.min_words or args.seq - 2}-{args.seq - 2}{', compiled' if args.compile else ''}")

    rows, ratios = [], {}
    rng = random.Random(0)
    for objective_name in args.objectives:
        cfg, objective = build_objective(objective_name, tokenizer_dir, args, tokenizer)
        attention = "sdpa" if args.padded else f"packed-{args.packed_attention}"
        # Collated by the objective itself ([CLS] + seq-2 words + [SEP] = seq tokens), moved to the GPU once.
        words = (args.min_words or args.seq - 2, args.seq - 2)
        batches = [{k: v.cuda() for k, v in objective.collate(samples(args.batch, *words, config["vocab_size"],
                                                                       rng)).items()} for _ in range(4)]
        tokens = sum(int(v.sum()) for batch in batches for k, v in batch.items()
                     if k.endswith("attention_mask")) / len(batches)
        objective.cuda().train()
        # Before compiling: the counter sees eager ops. Per step: the mean over the batches the steps cycle through.
        flops = sum(count_flops(objective, b) for b in batches) / len(batches)
        for way in args.ways:
            torch.cuda.reset_peak_memory_stats()
            if way == "bare":
                if args.compile:
                    compile_models(objective)
                step = bare_stepper(objective)
            else:  # a fresh module: the bare loop's model and optimizer state must not stay in memory
                step = objective = None
                objective = build_objective(objective_name, tokenizer_dir, args, tokenizer)[1].cuda()
                step = clsys_stepper(objective, cfg)
            seconds = timed(step, batches, args.warmup, args.steps)
            tflops = flops / seconds / 1e12
            rows.append((objective_name, way, attention, tokens / seconds, tflops, 100 * tflops / peak,
                         torch.cuda.max_memory_allocated() / 2**30))
            ratios[f"mfu_{objective_name}_{way}"] = tflops / peak
        del step, objective, batches
        torch.cuda.empty_cache()

    print(f"\n{'objective':<9} {'step':<6} {'attention':<13} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU %':>6} {'peak GiB':>9}")
    for objective_name, way, attention, tps, tflops, mfu, mem in rows:
        print(f"{objective_name:<9} {way:<6} {attention:<13} {tps:>10.0f} {tflops:>8.1f} {mfu:>6.1f} {mem:>9.1f}")
    print()
    for key, value in ratios.items():
        print(f"ratio {key} {value:.3f}")


if __name__ == "__main__":
    main()
