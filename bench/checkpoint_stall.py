"""How long training stalls per checkpoint: the background writer (train.async_checkpoint) against the synchronous one.

    python bench/checkpoint_stall.py [--world 2] [--steps-between 8] [--checkpoints 3] [--batch 64] [--zero 2] [--repeats 3]

SimCSE on all-MiniLM-L6-v2 (max length 32) in a real gloo group of --world processes (one torch thread
each) with DeepSpeed ZeRO engines on the CPU, as every Ray Train worker builds them, checkpointing through ``clsys.engine.checkpoint_writer``
to a file:// run folder (model, optimizer, RNG and loader state, SHA256SUMS, COMPLETE, as in training).
Three ways over the same batches, each in fresh processes: no checkpoint, synchronous
(``train.async_checkpoint: false``), background (the default). A run is --checkpoints checkpoints,
each after --steps-between steps, then --steps-between more steps and the wait for the last one, so
the background writer has the same steps to overlap after every checkpoint.

The stall per checkpoint is what checkpointing adds to the whole loop's wall time (rank 0, between
barriers), divided by the number of checkpoints: for the synchronous way the write itself, for the
background way the snapshot plus whatever the writing thread slows the steps it overlaps. With
--world 2 on this 2-core machine every core is busy with a step, so the thread competes with the steps
for them; --world 1 leaves a core to it, as a GPU machine's host cores are left while the GPU steps.
Also printed: the time ``save`` blocks the step loop (the snapshot, for the background way). The ways
run interleaved, --repeats times; each figure is the median over the repeats of that repeat's
difference to its own no-checkpoint run. Target: stall <= 10% of the synchronous one. Not part of the
test suite.
"""
from __future__ import annotations

import argparse
import os
import statistics
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
import torch.multiprocessing as mp  # noqa: E402

from sample_data import free_port, sentences  # noqa: E402

WAYS = ("none", "sync", "background")


def batches(objective, rank: int, world: int, n: int, per_rank: int) -> list[dict]:
    """This rank's ``n`` collated batches of ``per_rank`` sample sentences (the ranks' texts are disjoint)."""
    texts = sentences(world * n * per_rank)[rank * n * per_rank:]
    return [objective.collate([{"txt": t, "json": {}} for t in texts[i * per_rank:(i + 1) * per_rank]])
            for i in range(n)]


def run_way(rank: int, port: int, way: str, args, run_url: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(args.world), LOCAL_WORLD_SIZE=str(args.world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from clsys import storage
    from clsys.recipes import OBJECTIVES, load_config
    from clsys.engine import checkpoint
    from clsys.engine.checkpoint_writer import CheckpointWriter
    from clsys.engine.deepspeed import build_engine, init_distributed
    from clsys.model.encoder import load_tokenizer

    init_distributed()
    cfg = load_config(None, ["objective.name=simcse", "model.name=all-MiniLM-L6-v2", f"cluster.num_workers={args.world}",
                             f"train.batch_size={args.batch}", f"train.zero_stage={args.zero}", "data.max_length=32",
                             "train.precision=fp32"])
    torch.manual_seed(0)
    objective = OBJECTIVES["simcse"](cfg, load_tokenizer(cfg.model.name))
    engine = build_engine(objective, cfg)
    engine.train()
    steps = args.steps_between * (args.checkpoints + 1)
    data = batches(objective, rank, args.world, steps, args.batch // args.world)
    writer = CheckpointWriter(engine, run_url, keep=2, background=way == "background")
    blocked = []
    for batch in data[:2]:  # warm-up, untimed
        engine.backward(engine(batch).loss)
        engine.step()
    dist.barrier()
    start = time.perf_counter()
    for step, batch in enumerate(data, 1):
        engine.backward(engine(batch).loss)
        engine.step()
        if way != "none" and step % args.steps_between == 0 and step < steps:
            began = time.perf_counter()
            writer.save(step, {"loader": {"rank": rank}}, {"world_size": args.world}, lambda folder: None)
            blocked.append(time.perf_counter() - began)
    writer.wait()
    dist.barrier()
    if rank == 0:
        out["seconds"] = time.perf_counter() - start
        out["blocked"] = statistics.mean(blocked) if blocked else 0.0
        newest = checkpoint.complete_checkpoints(run_url)[-1:]
        out["size_mb"] = sum(size for _, url in newest for _, size in storage.list_sizes(url)) / 2**20
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks (one torch thread each)")
    parser.add_argument("--steps-between", type=int, default=8)
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="global batch (sentences), split over the ranks")
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    results: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:  # interleaved, so that a change in the machine's speed hits every way alike
            out = mp.Manager().dict()
            with tempfile.TemporaryDirectory(prefix="clsys-stall-") as folder:
                mp.spawn(run_way, args=(free_port(), way, args, f"file://{folder}/run", out), nprocs=args.world,
                         join=True)
            results[way].append(dict(out))
    print(f"checkpoint_stall: SimCSE, all-MiniLM-L6-v2, ZeRO-{args.zero}, {args.world} gloo rank(s) on the CPU, "
          f"global batch {args.batch}, {args.checkpoints} checkpoints of {results['sync'][0]['size_mb']:.0f} MB each "
          f"{args.steps_between} steps apart, file://, medians of {args.repeats} interleaved repeats")
    print(f"\n{'way':<11} {'loop s':>7} {'stall/ckpt s':>13} {'save blocks s':>14}")
    median = statistics.median
    stall, blocked = {}, {}
    for way in WAYS:
        stall[way] = median((run["seconds"] - base["seconds"]) / args.checkpoints
                            for run, base in zip(results[way], results["none"]))
        blocked[way] = median(run["blocked"] for run in results[way])
        print(f"{way:<11} {median(r['seconds'] for r in results[way]):>7.2f} {stall[way]:>13.3f} {blocked[way]:>14.3f}")
    print()
    print(f"ratio stall_background_over_sync {stall['background'] / stall['sync']:.3f}")
    print(f"ratio blocked_background_over_sync {blocked['background'] / blocked['sync']:.3f}")


if __name__ == "__main__":
    main()
