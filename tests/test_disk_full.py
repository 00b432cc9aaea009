"""A full disk while writing a checkpoint or a shard: a clear error naming what could not be written,
the previous state intact, no temporary files left behind, and a rerun with room completes.

The disk is real: a small tmpfs mounted for the test (root, as in CI), holding the run folder or
data_prep's output. The checkpoint is written by a real DeepSpeed ZeRO-2 engine on two gloo ranks.
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch.multiprocessing as mp

from clsys import storage
from tests.conftest import RankCheckpoints, free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "data_prep", "samples",
                      "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")


def leftovers(folder) -> list[str]:
    return [str(p) for p in folder.rglob("*.tmp-*")]


def test_data_prep_on_a_full_disk_fails_clearly_and_a_rerun_completes(small_disk):
    disk, resize = small_disk
    out = disk / "shards"
    cmd = [sys.executable, "-m", "data_prep", "wiki", "--input", SAMPLE, "--out", str(out), "--shard-size-mb", "0.25"]
    full = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert full.returncode == 2, full.stderr[-2000:]
    assert "shard-0" in full.stderr and "writing failed: No space left on device" in full.stderr, full.stderr[-2000:]
    assert not list(out.rglob("manifest.json")), "a manifest was written for an incomplete stream"
    assert not leftovers(out)
    resize("64m")
    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    from clsys.shards.reader import load_shards, read_shard

    for stream in ("sentences", "documents"):
        for shard in load_shards(f"file://{out / stream}"):
            read_shard(shard)  # size and sha256 checked against the manifest


def _fill_then_save(rank: int, port: int, tiny: str, run: str, disk: str, out: dict) -> None:
    import torch.distributed as dist

    from clsys.engine import checkpoint

    ranks = RankCheckpoints(rank, port, tiny)
    ranks.save(run, 2)
    filler = os.path.join(disk, "filler")
    if rank == 0:  # the disk fills up: nothing more fits
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
    dist.barrier()
    try:
        ranks.save(run, 4)
        out[rank] = "saved"
    except storage.StorageError as err:
        out[rank] = str(err)
    dist.barrier()
    if rank == 0:
        os.remove(filler)
        out["complete"] = [step for step, _ in checkpoint.complete_checkpoints(run)]
    dist.barrier()
    out[f"resumed-{rank}"] = ranks.resume([url for _, url in reversed(checkpoint.complete_checkpoints(run))])


def test_a_checkpoint_on_a_full_disk_fails_clearly_and_the_previous_one_resumes(tiny, small_disk):
    disk, resize = small_disk
    resize("48m")  # room for the first checkpoint of the tiny model
    run = f"file://{disk}/run"
    out = mp.Manager().dict()
    mp.spawn(_fill_then_save, args=(free_port(), tiny, run, str(disk), out), nprocs=2, join=True)
    for rank in (0, 1):
        assert f"{run}/checkpoints/step-00000004/" in out[rank] and "writing failed: No space left on device" in \
            out[rank], out[rank]
        assert out[f"resumed-{rank}"] == (2, {"rank": rank})
    assert out["complete"] == [2]
    assert not leftovers(disk)
