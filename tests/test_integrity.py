"""Integrity end to end: checkpoints and exported folders record the sha256 of every file they hold
(SHA256SUMS, coreutils' format); resume falls back to the previous complete checkpoint when a file of
the newest is changed or missing, export and evaluate refuse a damaged folder.

The checkpoints are real: a DeepSpeed ZeRO-2 engine on two gloo ranks (CPU) writes them on file://
and on a real S3 server (moto on 127.0.0.1). tests/test_fault_tolerance.py resumes a whole run past
a damaged checkpoint and compares it bit for bit with an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess

import pytest
import torch.multiprocessing as mp

from clsys import integrity, storage
from clsys.integrity import SUMS, IntegrityError
from faults import flip_a_byte
from tests.conftest import RankCheckpoints, free_port

OPTIM_RANK_1 = "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt"  # ZeRO-2: rank 1's optimizer partition


def test_sums_are_coreutils_format_and_name_every_bad_file(tmp_path):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(b"weights")
    (folder / "sub" / "b.json").write_text("{}")
    (folder / "README.md").write_text("card")
    integrity.write_folder_sums(folder, skip=lambda rel: rel == "README.md")
    assert sorted(integrity.parse_sums((folder / SUMS).read_bytes(), "x")) == ["a.bin", "sub/b.json"]
    assert subprocess.run(["sha256sum", "--check", "--quiet", SUMS], cwd=folder).returncode == 0
    assert integrity.check_folder(folder) is True

    (folder / "README.md").write_text("edited card")  # not recorded: free to edit
    assert integrity.check_folder(folder) is True
    (folder / "a.bin").write_bytes(b"weightz")
    (folder / "sub" / "b.json").unlink()
    with pytest.raises(IntegrityError) as err:
        integrity.check_folder(folder)
    assert "a.bin: sha256" in str(err.value) and "sub/b.json: missing" in str(err.value)
    assert subprocess.run(["sha256sum", "--check", "--quiet", SUMS], cwd=folder, capture_output=True).returncode != 0
    assert integrity.check_folder(tmp_path) is False  # no SHA256SUMS: nothing to check


@pytest.mark.parametrize("line, message", [
    ("abc  a.bin", "line 2: not '<sha256 hex>  <path>'"),
    (f"{'0' * 64}  ../../etc/passwd", "line 2: path '../../etc/passwd' leaves the folder"),
    (f"{'0' * 64}  /etc/passwd", "line 2: path '/etc/passwd' leaves the folder"),
])
def test_a_malformed_sums_file_is_refused_naming_its_line(line, message):
    with pytest.raises(IntegrityError, match=message):
        integrity.parse_sums(f"{'1' * 64}  ok\n{line}\n".encode(), "SUMS")


def test_evaluate_refuses_a_damaged_exported_folder(tmp_path, capsys):
    from clsys.evaluate import main
    from clsys.model.encoder import resolve_model_path

    folder = tmp_path / "export"
    shutil.copytree(resolve_model_path("all-MiniLM-L6-v2"), folder)
    integrity.write_folder_sums(folder)
    flip = folder / "config.json"
    flip.write_text(flip.read_text().replace('"hidden_act"', '"hidden_act" '))
    with pytest.raises(SystemExit):
        main(["--model", str(folder), "--sts", "stsb-en-test"])
    assert "config.json: sha256" in capsys.readouterr().err


def _damage_and_resume(rank: int, port: int, tiny: str, runs: list[str], out: dict) -> None:
    import torch.distributed as dist

    from clsys.engine import checkpoint
    from clsys.engine.loop import _resume_candidates

    ranks = RankCheckpoints(rank, port, tiny)

    def resume(run: str, damage) -> dict:
        """Rank 0 damages the run's checkpoints; then every rank resumes the way a restarted worker does."""
        if rank == 0:
            damage()
        dist.barrier()
        printed, result = io.StringIO(), {}
        try:
            with contextlib.redirect_stdout(printed):
                result["step"], result["loader"] = ranks.resume(_resume_candidates(run, None))
        except RuntimeError as err:
            result["error"] = str(err)
        dist.barrier()
        result["complete"] = [step for step, _ in checkpoint.complete_checkpoints(run)]
        result["printed"] = printed.getvalue()
        corrupt = storage.join(checkpoint.step_url(run, 4), "CORRUPT")
        result["corrupt"] = storage.read_bytes(corrupt).decode() if storage.exists(corrupt) else None
        return result

    for run in runs:
        ranks.save(run, 2)
        step4 = ranks.save(run, 4)
        results = [resume(run, lambda: flip_a_byte(storage.join(step4, OPTIM_RANK_1)))]
        ranks.save(run, 4)  # written again, over the set-aside folder
        # Only rank 1 downloads its own state file: the others learn of its loss from it.
        results.append(resume(run, lambda: storage.delete(storage.join(step4, "rank-00001.pt"))))
        ranks.save(run, 4)

        def damage_both():
            flip_a_byte(storage.join(step4, OPTIM_RANK_1))
            storage.delete(storage.join(checkpoint.step_url(run, 2), SUMS))
        results.append(resume(run, damage_both))
        out[(run, rank)] = results


def test_resume_falls_back_past_a_damaged_checkpoint_on_file_and_s3(tiny, s3_bucket, tmp_path):
    from clsys.engine.checkpoint import step_url
    from clsys.export import check_checkpoint

    runs = [f"file://{tmp_path}/run", f"{s3_bucket}/run"]
    out = mp.Manager().dict()
    mp.spawn(_damage_and_resume, args=(free_port(), tiny, runs, out), nprocs=2, join=True)
    for run in runs:
        flipped, deleted, both = out[(run, 0)]
        for rank in (0, 1):
            assert out[(run, rank)][0]["step"] == out[(run, rank)][1]["step"] == 2
            assert out[(run, rank)][0]["loader"] == out[(run, rank)][1]["loader"] == {"rank": rank}
        # The damaged checkpoint is set aside with the reason, named in the warning, and written anew later.
        assert flipped["complete"] == deleted["complete"] == [2]
        assert f"{OPTIM_RANK_1}: sha256" in flipped["corrupt"] and f"{OPTIM_RANK_1}: sha256" in flipped["printed"]
        assert f"checkpoint {step_url(run, 4)} is damaged" in flipped["printed"]
        assert f"resuming from {step_url(run, 2)} instead" in flipped["printed"]
        # The storage's own "not found", for the one file named.
        assert deleted["corrupt"].count("\n") == 1 and "step-00000004/rank-00001.pt: " in deleted["corrupt"]
        assert re.search(r"rank-00001.pt: (No such file|no such object)", deleted["corrupt"]), deleted["corrupt"]
        # Nothing intact to fall back to: an error on every rank naming both, and nothing set aside.
        for rank in (0, 1):
            error = out[(run, rank)][2]["error"]
            assert error.startswith("no intact checkpoint to resume from") and f"{OPTIM_RANK_1}: sha256" in error
            assert f"{step_url(run, 2)}/{SUMS}: " in error
        assert both["complete"] == [2, 4] and both["corrupt"] is None

        # Export checks the same checksums.
        local = tmp_path / f"download-{run.partition(':')[0]}"
        storage.download_dir(step_url(run, 4), str(local))
        with pytest.raises(IntegrityError, match=f"damaged checkpoint.*{OPTIM_RANK_1}: sha256"):
            check_checkpoint(step_url(run, 4), str(local), storage.read_json(str(local / "clsys_state.json")))


def test_an_s3_key_with_dot_dot_cannot_write_outside_the_download_folder(s3_bucket, tmp_path):
    """S3 keys are free text: ``step/ds/../../../x`` is a valid key. Downloading a checkpoint or an
    export folder must not follow it out of the local folder (it did before: the file landed two
    levels above)."""
    storage.write_bytes(f"{s3_bucket}/ckpt/a.txt", b"fine")
    storage.s3_client().put_object(Bucket=s3_bucket[5:], Key="ckpt/sub/../../../escaped.txt", Body=b"evil")
    with pytest.raises(storage.StorageError, match=r"ckpt/sub/\.\./\.\./\.\./escaped\.txt: the object's name leaves"):
        storage.download_dir(f"{s3_bucket}/ckpt", str(tmp_path / "download" / "in"))
    assert not list(tmp_path.rglob("escaped.txt"))


class _Payload:
    """What a hostile checkpoint file holds: unpickling it runs code (here: creates a file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return Path.touch, (Path(self.marker),)


def test_deepspeed_checkpoint_loads_never_run_code_from_the_files(tmp_path):
    """DeepSpeed unpickles its checkpoint files with weights_only=False. clsys loads them (resume,
    export, the universal conversion) with every torch.load restricted to tensors, containers and
    DeepSpeed's record classes: a file replaced on shared storage (its SHA256SUMS with it) is refused,
    never run. Before, export ran the payload."""
    import pickle

    import torch

    from clsys.export import checkpoint_weights

    marker = tmp_path / "pwned"
    ds = tmp_path / "ckpt" / "ds"
    ds.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"optimizer_state_dict": _Payload(str(marker)), "module": _Payload(str(marker))}, ds / name)
    (tmp_path / "ckpt" / "latest").write_text("ds")
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        checkpoint_weights(str(tmp_path / "ckpt"))
    assert not marker.exists(), "loading the checkpoint ran code from it"
    assert torch.load.__module__ == "torch.serialization", "the restriction outlived the load"
