"""The largest contrastive batch in a fixed memory budget: plain in-batch negatives vs GradCache.

    python bench/big_batch.py [--budget-gb 1.3] [--chunk 32] [--max-batch 1024] [--zero 1 2]

SimCSE on all-MiniLM-L6-v2 (max length 32, both dropout views, negatives gathered from both ranks)
in a real 2-process gloo group with DeepSpeed ZeRO-1 and ZeRO-2 engines, as every Ray Train worker
builds them. For each way (plain: one forward and backward of the whole micro-batch; GradCache:
``objective.grad_cache.chunk_size`` = --chunk rows) the global batch doubles until a rank's peak
resident memory (ru_maxrss, the whole process: libraries, model, optimizer, DeepSpeed buffers,
activations; about 1 GiB before the first step) passes --budget-gb, each size in fresh processes
running 2 steps. Plain starts at 16; GradCache at plain's largest batch (smaller ones fit a fortiori)
and stops at --max-batch, as a GradCache step costs time in proportion to the batch (3 forwards).
Then the gradient check: GradCache against the full-batch gradient in float64 on a batch that fits
(plain torch autograd with the data-parallel average, since DeepSpeed reduces fp32/bf16/fp16 gradients
only; tests/test_grad_cache.py also checks it through ZeRO-1/2 engines to float32 rounding). Prints a
table, then ``ratio`` lines (target: GradCache's batch ≥ 16× plain's at the same budget). Not part of
the test suite.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from sample_data import free_port, sentences  # noqa: E402

WORLD = 2


def _rank(rank: int, port: int, batch: int, chunk: int, zero: int, texts: list[str], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from clsys.recipes import OBJECTIVES, load_config
    from clsys.engine.deepspeed import build_engine, init_distributed
    from clsys.engine.grad_cache import grad_cache_backward
    from clsys.model.encoder import load_tokenizer

    init_distributed()
    cfg = load_config("quickstart", [f"train.batch_size={batch}", f"cluster.num_workers={WORLD}",
                                     f"train.zero_stage={zero}", f"objective.grad_cache.chunk_size={chunk}"])
    torch.manual_seed(0)
    objective = OBJECTIVES["simcse"](cfg, load_tokenizer(cfg.model.name))
    engine = build_engine(objective, cfg)
    engine.train()
    micro = batch // WORLD
    start = time.perf_counter()
    for step in range(2):
        mine = texts[(step * batch + rank * micro) % len(texts):][:micro]
        data = objective.collate([{"txt": t} for t in mine])
        if chunk:
            grad_cache_backward(engine, data, chunk, 1)
        else:
            engine.backward(engine(data).loss)
        engine.step()
    out[rank] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, (time.perf_counter() - start) / 2)
    torch.distributed.destroy_process_group()  # a live gloo group can abort the process at exit


def measure(batch: int, chunk: int, zero: int, texts: list[str]) -> tuple[float, float]:
    """(largest peak RSS of the ranks in GiB, seconds per step)."""
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(free_port(), batch, chunk, zero, texts, out), nprocs=WORLD, join=True)
    return max(v[0] for v in out.values()), max(v[1] for v in out.values())


def _float64_check(rank: int, port: int, batch: int, chunk: int, texts: list[str], out: dict) -> None:
    import torch.distributed as dist

    from clsys.recipes import OBJECTIVES, load_config
    from clsys.engine.grad_cache import grad_cache
    from clsys.model.encoder import load_tokenizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    cfg = load_config("quickstart", [f"train.batch_size={batch}", f"cluster.num_workers={WORLD}", "model.dropout=0"])
    torch.manual_seed(0)
    objective = OBJECTIVES["simcse"](cfg, load_tokenizer(cfg.model.name)).double().train()
    micro = batch // WORLD
    data = objective.collate([{"txt": t} for t in texts[rank * micro:(rank + 1) * micro]])

    def averaged_grads() -> dict:
        grads = {}
        for name, p in objective.named_parameters():
            dist.all_reduce(p.grad)
            grads[name] = p.grad / WORLD
            p.grad = None
        return grads

    objective.embedding_loss(objective.embed(data), data).loss.backward()
    plain = averaged_grads()
    grad_cache(objective, data, chunk, lambda rows, part: objective.grad_cache_part(rows, part, data),
               lambda surrogate, last: surrogate.backward())
    cached = averaged_grads()
    if rank == 0:
        diff = max((cached[n] - g).abs().max().item() for n, g in plain.items())
        scale = max(g.abs().max().item() for g in plain.values())
        out["check"] = (diff, scale)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gb", type=float, default=1.3, help="peak resident memory per rank")
    parser.add_argument("--chunk", type=int, default=32, help="GradCache rows per chunk")
    parser.add_argument("--max-batch", type=int, default=1024)
    parser.add_argument("--zero", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    texts = sentences(args.max_batch * 2)

    rows, largest = [], {}
    for zero in args.zero:
        for way, chunk in (("plain", 0), ("GradCache", args.chunk)):
            batch = largest.get((zero, "plain"), 16) if chunk else 16
            while batch <= args.max_batch:
                peak, seconds = measure(batch, chunk, zero, texts)
                fits = peak <= args.budget_gb
                rows.append((zero, way, batch, peak, seconds, fits))
                print(f"ZeRO-{zero} {way:<9} batch {batch:>5}: peak {peak:.2f} GiB, {seconds:.1f} s/step"
                      f"{'' if fits else '  (over budget)'}", flush=True)
                if not fits:
                    break
                largest[(zero, way)] = batch
                batch *= 2

    out = mp.Manager().dict()
    mp.spawn(_float64_check, args=(free_port(), 32, 16, texts, out), nprocs=WORLD, join=True)
    diff, scale = out["check"]

    print(f"\nSimCSE, all-MiniLM-L6-v2, max length 32, {WORLD} ranks (gloo), budget {args.budget_gb} GiB peak RSS per "
          f"rank, GradCache chunk {args.chunk} rows")
    print(f"{'ZeRO':>4} {'way':<9} {'batch':>6} {'peak GiB':>9} {'s/step':>7} {'fits':>5}")
    for zero, way, batch, peak, seconds, fits in rows:
        print(f"{zero:>4} {way:<9} {batch:>6} {peak:>9.2f} {seconds:>7.1f} {'yes' if fits else 'no':>5}")
    print(f"\nfloat64 gradient, batch 32, chunk 16 rows: max |GradCache − full batch| = {diff:.2e} "
          f"(largest gradient entry {scale:.2e})\n")
    for zero in args.zero:
        plain, cached = largest.get((zero, "plain")), largest.get((zero, "GradCache"))
        if plain and cached:
            if cached * 2 > args.max_batch:  # never went over budget: the true largest batch is larger
                print(f"(ZeRO-{zero}: GradCache still fits at --max-batch {cached}, so its ratio is a lower bound)")
            print(f"ratio grad_cache_batch_over_plain_zero{zero} {cached / plain:.1f}")
    print(f"ratio float64_gradient_max_abs_diff {diff:.3e}")


if __name__ == "__main__":
    main()
