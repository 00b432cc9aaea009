"""The loader's wait at epoch boundaries against its steady state, over several epochs of training steps.

    python bench/epoch_boundary.py [--epochs 4] [--batch 128] [--workers 2] [--model bert-mini] [--shards 4] [--bundle N]
        [--result-pipe-kib K] [--worker-niceness N]

Unsupervised SimCSE's loader (``ShardLoader`` + the objective's collate, MiniLM's tokenizer, max length 32) over
the bundled Wikipedia sample's sentence shards (its first --shards of 10, so that an epoch is short), consumed by real training steps of a small model in this
process (BERT-mini from scratch by default: a step short enough that the loader's boundary costs show). The
wait is the time each step spends in ``next(batches)``. ``boundary``: the first 10 steps of each epoch after the
first; ``steady``: the other steps, after the first epoch's first 10. Prints per-epoch figures, then ``ratio
boundary_over_steady_wait`` (target ≤ 2). Both sides share the machine's cores, as in training. Not a test.
"""
from __future__ import annotations

import argparse
import os
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from clsys.recipes import OBJECTIVES, load_config  # noqa: E402
from clsys.data.streaming import ShardLoader  # noqa: E402
from clsys.model.encoder import load_tokenizer  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
import loader_settings  # noqa: E402
from sample_data import sample_shards  # noqa: E402

MODELS = {"bert-mini": [f"model.name={REPO}/clsys/configs/models/bert-mini.json", "model.init=scratch",
                        "model.tokenizer=all-MiniLM-L6-v2"],
          "minilm": []}
AFTER_BOUNDARY = 10  # steps counted as the boundary's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default="bert-mini")
    parser.add_argument("--shards", type=int, default=4, help="shards of the sample read (an epoch's length)")
    parser.add_argument("--bundle", type=int, default=None,
                        help="batches a loader worker sends at once (default: the loader's, batches_per_transfer)")
    loader_settings.add_arguments(parser)
    args = parser.parse_args()
    settings = loader_settings.apply(args)

    # A stream of the sample's first --shards shards: its own manifest beside links to the shard files.
    source = sample_shards() / "sentences"
    stream = Path(tempfile.mkdtemp(prefix="clsys-epoch-boundary-"))
    manifest = json.loads((source / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:args.shards]
    manifest["samples"] = sum(s["samples"] for s in manifest["shards"])
    for shard in manifest["shards"]:
        (stream / shard["name"]).symlink_to(source / shard["name"])
    (stream / "manifest.json").write_text(json.dumps(manifest))
    url = f"file://{stream}"
    cfg = load_config("quickstart", ["data.max_length=32", *MODELS[args.model]])
    torch.manual_seed(0)
    objective = OBJECTIVES["simcse"](cfg, load_tokenizer(cfg.model.tokenizer or cfg.model.name))
    loader = ShardLoader(url, 0, 1, args.batch, objective.data.collate, seed=0, loader_workers=args.workers,
                         bundle=args.bundle)
    optimizer = torch.optim.AdamW(objective.parameters(), lr=3e-5)
    objective.train()

    waits: list[tuple[int, int, float, float]] = []  # (epoch, step within it, wait s, step s)
    batches, epoch, in_epoch = iter(loader), 0, 0
    while True:
        start = time.perf_counter()
        batch = next(batches)
        waited = time.perf_counter() - start
        if loader.state_dict()["epoch"] != epoch:
            epoch, in_epoch = loader.state_dict()["epoch"], 0
        if epoch == args.epochs:
            break
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        objective(tensors).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        waits.append((epoch, in_epoch, waited, time.perf_counter() - start))
        in_epoch += 1
    del batches

    boundary = [w for e, i, w, _ in waits if e > 0 and i < AFTER_BOUNDARY]
    steady = [w for e, i, w, _ in waits if i >= AFTER_BOUNDARY]
    step_s = statistics.median(s - w for _, _, w, s in waits)
    print(f"\nSimCSE loader, {args.model}, batch {args.batch}, {args.workers} loader worker(s), bundles of "
          f"{loader.transport.bundle}, {settings}, {len(waits)} steps over {args.epochs} epochs; "
          f"median step without the wait {step_s * 1000:.1f} ms")
    print(f"{'epoch':>5} {'steps':>5} {'wait first 10 ms':>16} {'wait rest ms/step':>17}")
    for e in range(args.epochs):
        first = [w for ep, i, w, _ in waits if ep == e and i < AFTER_BOUNDARY]
        rest = [w for ep, i, w, _ in waits if ep == e and i >= AFTER_BOUNDARY]
        print(f"{e:>5} {len(first) + len(rest):>5} {sum(first) * 1000:>16.1f} {statistics.mean(rest) * 1000:>17.2f}")
    print(f"\nratio boundary_over_steady_wait {statistics.mean(boundary) / statistics.mean(steady):.2f}")
    print(f"ratio steady_wait_over_step {statistics.mean(steady) / step_s:.3f}")


if __name__ == "__main__":
    main()
