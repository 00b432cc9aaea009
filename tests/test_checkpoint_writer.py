"""The background checkpoint writer (train.async_checkpoint, clsys/engine/checkpoint_writer.py): what is
written is the state at the save, whatever training does meanwhile; at most one checkpoint is in flight;
COMPLETE comes last, after every rank's part; a failed write is raised in the step loop; in a file://
run folder DeepSpeed's state files are serialised in place, not copied.

Real parts: a DeepSpeed ZeRO-2 engine on two gloo ranks (CPU) writing to file://. The whole-run
equivalence (a run with background checkpoints resumed after kill -9 equals the uninterrupted run, bit
for bit) is tests/test_fault_tolerance.py's, which runs with the default, the background writer.
"""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.multiprocessing as mp

from clsys import storage
from clsys.storage import integrity
from tests.conftest import RankCheckpoints, free_port


def test_to_host_copies_every_tensor_and_leaf():
    from clsys.engine.checkpoint_writer import to_host

    weights, scaler = torch.arange(6.0).view(2, 3), {"scale": [1.0]}
    state = OrderedDict(w=weights, view=weights[:, 1], groups=[{"step": torch.tensor(3), "lr": 0.1}], scaler=scaler,
                        shape=(2, 3))
    copy = to_host(state)
    weights.add_(100)
    state["groups"][0]["step"].add_(1)
    scaler["scale"].append(2.0)
    assert type(copy) is OrderedDict and type(copy["shape"]) is tuple
    assert torch.equal(copy["w"], torch.arange(6.0).view(2, 3)) and torch.equal(copy["view"], torch.tensor([1.0, 4.0]))
    assert copy["groups"][0]["step"].item() == 3 and copy["scaler"] == {"scale": [1.0]}
    assert copy["view"].untyped_storage().nbytes() == 2 * 4  # the view alone, not its base's storage


def _train_while_writing(rank: int, port: int, tiny: str, run: str, out: dict) -> None:
    import torch.distributed as dist

    from clsys.engine.checkpoint_writer import CheckpointWriter

    ranks = RankCheckpoints(rank, port, tiny)
    engine = ranks.engine
    batch = engine.module.collate([{"txt": f"sentence {rank} {i}", "json": {}} for i in range(4)])

    def train_step() -> None:
        engine.backward(engine(batch).loss)
        engine.step()

    copied = []  # the files the writer copies from its staging folder to the run folder

    def recording_upload(local_path: str, url: str, upload=storage.upload_file) -> None:
        copied.append(url.rpartition("/")[2])
        upload(local_path, url)

    storage.upload_file = recording_upload
    train_step()
    at_save = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    writer = CheckpointWriter(engine, run, keep=10)
    first = writer.save(1, {"loader": {"rank": rank}}, {"world_size": 2}, lambda folder: None)
    for _ in range(3):  # the weights and Adam moments change while step 1 is written
        train_step()
    second = writer.save(4, {"loader": {"rank": rank}}, {"world_size": 2}, lambda folder: None)
    # Saving step 4 waited for step 1: on rank 0, that means step 1 is complete.
    out[f"first-complete-at-second-{rank}"] = storage.exists(storage.join(first, "COMPLETE"))
    writer.wait()
    dist.barrier()
    out[f"second-complete-{rank}"] = storage.exists(storage.join(second, "COMPLETE"))
    out[f"markers-{rank}"] = sorted(obj.rpartition("/")[2] for obj in storage.list_prefix(storage.join(first, "ranks")))
    out[f"resumed-{rank}"] = ranks.resume([first])
    out[f"equal-{rank}"] = all(torch.equal(p, at_save[name]) for name, p in engine.module.named_parameters())
    out[f"copied-{rank}"] = copied

    # A write that fails (the run folder's parent is a file, made by the test) is raised by wait(), in the step loop.
    dist.barrier()
    blocked = CheckpointWriter(engine, f"{run}-blocker/run", keep=10)
    blocked.save(5, {"loader": {}}, {"world_size": 2}, lambda folder: None)
    try:
        blocked.wait()
        out[f"failure-{rank}"] = "none"
    except storage.StorageError as err:
        out[f"failure-{rank}"] = str(err)


def test_the_background_writer_saves_the_state_at_the_save_while_training_goes_on(tiny, tmp_path):
    run = f"file://{tmp_path}/run"
    (tmp_path / "run-blocker").write_text("not a folder")
    out = mp.Manager().dict()
    mp.spawn(_train_while_writing, args=(free_port(), tiny, run, out), nprocs=2, join=True)
    assert out["first-complete-at-second-0"] is True
    for rank in (0, 1):
        assert out[f"second-complete-{rank}"] is True
        assert out[f"markers-{rank}"] == ["rank-00000", "rank-00001"]
        assert out[f"resumed-{rank}"] == (1, {"rank": rank})
        assert out[f"equal-{rank}"] is True, "restored weights differ from the weights at the save"
        assert "-blocker/run/checkpoints/step-00000005" in out[f"failure-{rank}"], out[f"failure-{rank}"]
        # In a file:// run folder DeepSpeed's (large) state files are serialised in place, never copied.
        assert f"rank-0000{rank}.pt" in out[f"copied-{rank}"] and \
            not [name for name in out[f"copied-{rank}"] if name.endswith("_states.pt")], out[f"copied-{rank}"]


def _stage_0_save_or_resume(rank: int, port: int, tiny: str, run: str, world: int, out: dict) -> None:
    ranks = RankCheckpoints(rank, port, tiny, world=world, stage=0)
    engine = ranks.engine
    if world == 2:  # write: one step, then the checkpoint
        batch = engine.module.collate([{"txt": f"sentence {rank} {i}", "json": {}} for i in range(4)])
        engine.backward(engine(batch).loss)
        engine.step()
        out["url"] = ranks.save(run, 1)
    else:
        out["fresh"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        out["resumed"] = ranks.resume([f"{run}/checkpoints/step-00000001"])
    out[f"weights-{world}-{rank}"] = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out[f"moments-{world}-{rank}"] = {n: engine.optimizer.state[p]["exp_avg"].clone()
                                      for n, p in engine.module.named_parameters() if p in engine.optimizer.state}


def test_a_zero_stage_0_checkpoint_resumes_on_another_rank_count(tiny, tmp_path):
    # Stage 0 keeps the whole model and Adam state in one file, which DeepSpeed's universal converter cannot
    # read (it looks for ZeRO's partition files: elastic resume of stage 0 used to fail); it loads as it is.
    out, run = mp.Manager().dict(), f"file://{tmp_path}/run"
    mp.spawn(_stage_0_save_or_resume, args=(free_port(), tiny, run, 2, out), nprocs=2, join=True)
    mp.spawn(_stage_0_save_or_resume, args=(free_port(), tiny, run, 1, out), nprocs=1, join=True)
    assert out["resumed"] == (1, {"rank": 0})
    assert not storage.exists(storage.join(out["url"], "universal/COMPLETE"))
    for kind in ("weights", "moments"):
        saved, restored = out[f"{kind}-2-0"], out[f"{kind}-1-0"]
        assert len(saved) > 20 and saved.keys() == restored.keys()
        assert all(torch.equal(saved[n], restored[n]) for n in saved), kind
    assert not all(torch.equal(out["fresh"][n], out["weights-2-0"][n]) for n in out["fresh"])  # it can fail


def test_rank_markers_count_by_name_not_by_what_the_folder_holds(tmp_path):
    """Rank 0 merges the ranks' checksums once every rank's marker is there. On a filesystem a marker is first
    written under a temporary name beside it (rank-00001.tmp-PID), then renamed: that file must not count as
    rank 1's marker (it was once listed, then read after its rename, failing a checkpoint in CI)."""
    from clsys.engine.checkpoint_writer import RANK_MARKERS, merged_rank_sums

    url = f"file://{tmp_path}/step-00000004"
    sums = {0: {"rank-00000.pt": "0" * 64}, 1: {"rank-00001.pt": "1" * 64}}
    storage.write_bytes(storage.join(url, RANK_MARKERS, "rank-00000"), integrity.format_sums(sums[0]))
    (tmp_path / "step-00000004" / RANK_MARKERS / "rank-00001.tmp-4242").write_bytes(b"half a line")
    with pytest.raises(RuntimeError, match="1 of 2 ranks did not finish writing their part"):
        merged_rank_sums(url, world=2, wait_s=0.3)
    storage.write_bytes(storage.join(url, RANK_MARKERS, "rank-00001"), integrity.format_sums(sums[1]))
    assert merged_rank_sums(url, world=2, wait_s=0.3) == {**sums[0], **sums[1]}
