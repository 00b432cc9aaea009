"""Integrity end to end: checkpoints and exported folders record the sha256 of every file they hold
(SHA256SUMS, coreutils' format); resume falls back to the previous complete checkpoint when a file of
the newest is changed or missing, export and evaluate refuse a damaged folder.

The checkpoints are real: a DeepSpeed ZeRO-2 engine on two gloo ranks (CPU) writes them on file://
and on a real S3 server (moto on 127.0.0.1). tests/test_fault_tolerance.py resumes a whole run past
a damaged checkpoint and compares it bit for bit with an uninterrupted one.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import shutil
import subprocess
from typing import Callable

import pytest
import torch.multiprocessing as mp

from clsys import storage
from clsys.storage import integrity
from clsys.storage.integrity import SUMS, IntegrityError
from faults import RunsCodeWhenUnpickled, flip_a_byte
from tests.conftest import RankCheckpoints, free_port

OPTIM_RANK_1 = "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt"  # ZeRO-2: rank 1's optimizer partition


def test_sums_are_coreutils_format_and_name_every_bad_file(tmp_path):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(b"weights")
    (folder / "sub" / "b.json").write_text("{}")
    (folder / "config.json").write_text("{}")
    (folder / "README.md").write_text("card")
    integrity.write_folder_sums(folder, skip=lambda rel: rel == "README.md")
    assert sorted(integrity.parse_sums((folder / SUMS).read_bytes(), "x")) == ["a.bin", "config.json", "sub/b.json"]
    assert subprocess.run(["sha256sum", "--check", "--quiet", SUMS], cwd=folder).returncode == 0
    assert subprocess.run(["sha256sum", "--check", "--quiet", "COMPLETE"], cwd=folder).returncode == 0  # the seal
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
    from clsys.model.loading import resolve_model_path

    folder = tmp_path / "export"
    shutil.copytree(resolve_model_path("all-MiniLM-L6-v2"), folder)
    integrity.write_folder_sums(folder)
    flip = folder / "config.json"
    flip.write_text(flip.read_text().replace('"hidden_act"', '"hidden_act" '))
    with pytest.raises(SystemExit):
        main(["--model", str(folder), "--sts", "stsb-en-test"])
    assert "config.json: sha256" in capsys.readouterr().err


def _resume_after(ranks: RankCheckpoints, run: str, damage: Callable[[], object]) -> dict:
    """Rank 0 damages the run's checkpoints (``damage``'s answer is kept as "damage"); then every rank
    resumes the way a restarted worker does. What each saw, and whether step 4 was set aside."""
    import torch.distributed as dist

    from clsys.engine import checkpoint
    from clsys.engine.loop import _resume_candidates

    result = {"damage": damage()} if ranks.rank == 0 else {}
    dist.barrier()
    printed = io.StringIO()  # the records of clsys's loggers, one message a line
    handler, logger = logging.StreamHandler(printed), logging.getLogger("clsys")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        result["step"], result["loader"] = ranks.resume(_resume_candidates(run, None))
    except RuntimeError as err:
        result["error"] = str(err)
    finally:
        logger.removeHandler(handler)
    dist.barrier()
    result["complete"] = [step for step, _ in checkpoint.complete_checkpoints(run)]
    result["printed"] = printed.getvalue()
    corrupt = storage.join(checkpoint.step_url(run, 4), "CORRUPT")
    result["corrupt"] = storage.read_bytes(corrupt).decode() if storage.exists(corrupt) else None
    dist.barrier()  # every rank has read it before rank 0 writes the next step 4 over it (a race under load)
    return result


def _damage_and_resume(rank: int, port: int, tiny: str, runs: list[str], out: dict) -> None:
    from clsys.engine import checkpoint

    ranks = RankCheckpoints(rank, port, tiny)
    for run in runs:
        ranks.save(run, 2)
        step4 = ranks.save(run, 4)
        results = [_resume_after(ranks, run, lambda: flip_a_byte(storage.join(step4, OPTIM_RANK_1)))]
        ranks.save(run, 4)  # written again, over the set-aside folder
        # Only rank 1 downloads its own state file: the others learn of its loss from it.
        results.append(_resume_after(ranks, run, lambda: storage.delete(storage.join(step4, "rank-00001.pt"))))
        ranks.save(run, 4)

        def damage_both():
            flip_a_byte(storage.join(step4, OPTIM_RANK_1))
            storage.delete(storage.join(checkpoint.step_url(run, 2), SUMS))
        results.append(_resume_after(ranks, run, damage_both))
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


# An attacker's (or a careless tool's) edits of a folder's checksums. COMPLETE records SHA256SUMS's own
# sha256 ("<hex>  SHA256SUMS", coreutils' format); a checkpoint of the previous version has an empty one.
def _seal(sums_data: bytes) -> bytes:
    return f"{hashlib.sha256(sums_data).hexdigest()}  {SUMS}\n".encode()


def _rewrite_sums(folder: str, edit: Callable[[list[str]], list[str]], seal: bool) -> None:
    """``folder``'s SHA256SUMS replaced by ``edit`` of its lines; ``seal``: COMPLETE made to match it."""
    lines = storage.read_bytes(storage.join(folder, SUMS)).decode().splitlines(keepends=True)
    data = "".join(edit(lines)).encode()
    storage.write_bytes(storage.join(folder, SUMS), data)
    if seal:
        storage.write_bytes(storage.join(folder, "COMPLETE"), _seal(data))


def _without(rel: str) -> Callable[[list[str]], list[str]]:
    return lambda lines: [line for line in lines if not line.endswith(f"  {rel}\n")]


def _replace_with_its_line(folder: str, rel: str, data: bytes) -> None:
    """``rel`` replaced by ``data`` and its line in SHA256SUMS made to match (COMPLETE left as it was)."""
    storage.write_bytes(storage.join(folder, rel), data)
    digest = hashlib.sha256(data).hexdigest()
    _rewrite_sums(folder, lambda lines: [f"{digest}  {rel}\n" if line.endswith(f"  {rel}\n") else line
                                         for line in lines], seal=False)


def _legacy(folder: str) -> None:
    """What the previous version wrote: the same files, an empty COMPLETE."""
    storage.write_bytes(storage.join(folder, "COMPLETE"), b"")


def _other_loader_state() -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save({"loader": {"rank": 99}}, buffer)
    return buffer.getvalue()


LIST_CHANGED = rf"{SUMS}: sha256 \S+ differs from the one recorded in COMPLETE"
# name → (damage of checkpoint folder, the problem named (a regular expression), the step resumed from)
CHECKPOINT_ATTACKS = {
    "emptied list": (lambda url: storage.write_bytes(storage.join(url, SUMS), b""), LIST_CHANGED, 2),
    "a line removed": (lambda url: _rewrite_sums(url, _without("rank-00001.pt"), seal=False), LIST_CHANGED, 2),
    "a file and its line replaced": (lambda url: _replace_with_its_line(url, "rank-00001.pt", _other_loader_state()),
                                     LIST_CHANGED, 2),
    "a line removed, COMPLETE to match": (lambda url: _rewrite_sums(url, _without("rank-00001.pt"), seal=True),
                                          rf"rank-00001\.pt: not listed in {SUMS}", 2),
    "an extra file": (lambda url: storage.write_bytes(storage.join(url, "ds/extra_model_states.pt"), b"x"),
                      rf"ds/extra_model_states\.pt: not listed in {SUMS}", 2),
    "a required file and its line removed, COMPLETE to match": (
        lambda url: (storage.delete(storage.join(url, OPTIM_RANK_1)), _rewrite_sums(url, _without(OPTIM_RANK_1), True)),
        rf"ds/\S*zero_pp_rank_1_\S*optim_states\.pt: required, not listed in {SUMS}", 2),
    "the previous version's checkpoint, a line removed": (
        lambda url: (_legacy(url), _rewrite_sums(url, _without("clsys_state.json"), seal=False)),
        rf"clsys_state\.json: not listed in {SUMS}", 2),
    "the previous version's checkpoint, intact": (_legacy, None, 4),
}


def _attack_resume_and_export(rank: int, port: int, tiny: str, runs: list[str], work: str, out: dict) -> None:
    from clsys.export import export

    ranks = RankCheckpoints(rank, port, tiny)
    for run in runs:
        ranks.save(run, 2)
        for number, (name, (damage, _, _)) in enumerate(CHECKPOINT_ATTACKS.items()):
            step4 = ranks.save(run, 4)  # anew, over the one set aside before

            def attack_then_export() -> str:
                damage(step4)
                try:
                    export(step4, os.path.join(work, f"export-{run.partition(':')[0]}-{number}"))
                    return "exported"
                except Exception as err:  # what a user of `python -m clsys.export` would see
                    return f"{type(err).__name__}: {err}"

            out[(run, name, rank)] = _resume_after(ranks, run, attack_then_export)


def test_a_checkpoint_whose_list_is_cut_edited_or_incomplete_is_refused_on_resume_and_export(tiny, s3_bucket,
                                                                                            tmp_path):
    """An emptied SHA256SUMS, a line removed, an unlisted file, a list that no longer matches COMPLETE,
    a required file gone with its line: resume sets the checkpoint aside and goes on from the previous
    one, export refuses it, each naming the folder and the file. Before, every one of them passed: only
    the listed files were compared, and a file without a line was never looked at. A checkpoint of the
    previous version (an empty COMPLETE) still resumes, with every file it holds listed."""
    from clsys.engine.checkpoint import step_url

    runs = [f"file://{tmp_path}/run", f"{s3_bucket}/run"]
    out = mp.Manager().dict()
    mp.spawn(_attack_resume_and_export, args=(free_port(), tiny, runs, str(tmp_path), out), nprocs=2, join=True)
    for run in runs:
        step4 = step_url(run, 4)
        for name, (_, problem, resumed) in CHECKPOINT_ATTACKS.items():
            for rank in (0, 1):
                assert out[(run, name, rank)]["step"] == resumed, (run, name, out[(run, name, rank)])
                assert out[(run, name, rank)]["loader"] == {"rank": rank}, (run, name)
            seen = out[(run, name, 0)]
            if problem is None:
                assert seen["corrupt"] is None and seen["damage"] == "exported", (name, seen["damage"])
                continue
            assert re.search(problem, seen["corrupt"]), (run, name, seen["corrupt"])
            assert f"checkpoint {step4} is damaged" in seen["printed"] and re.search(problem, seen["printed"])
            assert f"resuming from {step_url(run, 2)} instead" in seen["printed"], (name, seen["printed"])
            assert seen["damage"].startswith(f"IntegrityError: damaged checkpoint {step4}: "), (name, seen["damage"])
            assert re.search(problem, seen["damage"]), (run, name, seen["damage"])


def _write_then_fetch_elsewhere(rank: int, port: int, tiny: str, run: str, world: int, out: dict) -> None:
    from clsys.engine import checkpoint

    ranks = RankCheckpoints(rank, port, tiny, world=world)
    step2 = checkpoint.step_url(run, 2)
    if world == 2:
        ranks.save(run, 2)
        return
    fetched = checkpoint.fetch_intact([step2], world)  # converts it to the universal form, for one rank
    shutil.rmtree(fetched.folder)
    universal = storage.join(step2, "universal")
    out["universal"] = fetched.universal
    out["sealed"] = storage.read_bytes(storage.join(universal, "COMPLETE")) == \
        _seal(storage.read_bytes(storage.join(universal, SUMS)))
    storage.write_bytes(storage.join(universal, "ds/extra.pt"), b"x")
    try:
        checkpoint.fetch_intact([step2], world)
        out["refetched"] = "fetched"
    except RuntimeError as err:
        out["refetched"] = str(err)


def test_the_universal_form_is_sealed_and_an_unlisted_file_in_it_refused(tiny, tmp_path):
    """Elastic resume's conversion (2 ranks' ZeRO-2 checkpoint → 1 rank) writes ``universal/`` with its own
    SHA256SUMS sealed in its COMPLETE, and a file slipped into it afterwards is found."""
    from clsys.engine.checkpoint import step_url

    run, out = f"file://{tmp_path}/run", mp.Manager().dict()
    for world in (2, 1):
        mp.spawn(_write_then_fetch_elsewhere, args=(free_port(), tiny, run, world, out), nprocs=world, join=True)
    assert out["universal"] is True and out["sealed"] is True
    assert out["refetched"].startswith(f"no intact checkpoint to resume from: {step_url(run, 2)}: "), out["refetched"]
    assert f"universal/ds/extra.pt: not listed in {SUMS}" in out["refetched"], out["refetched"]


# name → (damage of an exported folder, the problem named)
MODEL_FOLDER_ATTACKS = {
    "emptied list": (lambda folder: storage.write_bytes(storage.join(folder, SUMS), b""), LIST_CHANGED),
    "a line removed": (lambda folder: _rewrite_sums(folder, _without("tokenizer.json"), seal=False), LIST_CHANGED),
    "a file and its line replaced": (lambda folder: _replace_with_its_line(folder, "1_Pooling/config.json", b"{}"),
                                     LIST_CHANGED),
    "a line removed, COMPLETE to match": (lambda folder: _rewrite_sums(folder, _without("tokenizer.json"), seal=True),
                                          rf"tokenizer\.json: not listed in {SUMS}"),
    "an extra file": (lambda folder: storage.write_bytes(storage.join(folder, "pytorch_model.bin"), b"x"),
                      rf"pytorch_model\.bin: not listed in {SUMS}"),
    "config.json and its line removed, COMPLETE to match": (
        lambda folder: (os.remove(os.path.join(folder, "config.json")),
                        _rewrite_sums(folder, _without("config.json"), seal=True)),
        rf"config\.json: required, not listed in {SUMS}"),
    "the previous version's export, an extra file": (
        lambda folder: (os.remove(os.path.join(folder, "COMPLETE")),
                        storage.write_bytes(storage.join(folder, "2_Dense/config.json"), b"{}")),
        rf"2_Dense/config\.json: not listed in {SUMS}"),
}


@pytest.mark.parametrize("attack", MODEL_FOLDER_ATTACKS)
def test_an_exported_folder_whose_list_is_cut_edited_or_incomplete_is_refused(attack, tmp_path):
    """What ``clsys.evaluate`` and training from an exported folder read it through."""
    from clsys.model.loading import checked_model_path, resolve_model_path

    folder = tmp_path / "export"
    shutil.copytree(resolve_model_path("all-MiniLM-L6-v2"), folder)
    integrity.write_folder_sums(folder, skip=lambda rel: rel == "README.md")
    damage, problem = MODEL_FOLDER_ATTACKS[attack]
    damage(str(folder))
    with pytest.raises(IntegrityError, match=f"^{re.escape(str(folder))}: .*{problem}"):
        checked_model_path(str(folder))


def test_an_exported_folder_takes_a_card_edit_and_hidden_files_and_the_previous_version_still_loads(tmp_path):
    """The model card is meant to be edited, and hidden files come with a hub download or a git clone
    (.gitattributes, .cache/, .git/): none of them is read as the model, none needs a line."""
    from clsys.model.loading import checked_model_path, resolve_model_path

    folder = tmp_path / "export"
    shutil.copytree(resolve_model_path("all-MiniLM-L6-v2"), folder)
    integrity.write_folder_sums(folder, skip=lambda rel: rel == "README.md")
    assert (folder / "COMPLETE").read_bytes() == _seal((folder / SUMS).read_bytes())
    (folder / "README.md").write_text("an edited card")
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "download.lock").write_text("")
    assert checked_model_path(str(folder)) == str(folder)
    (folder / "COMPLETE").unlink()  # an export of the previous version
    assert checked_model_path(str(folder)) == str(folder)


def test_an_s3_key_with_dot_dot_cannot_write_outside_the_download_folder(s3_bucket, tmp_path):
    """S3 keys are free text: ``step/ds/../../../x`` is a valid key. Downloading a checkpoint or an
    export folder must not follow it out of the local folder (it did before: the file landed two
    levels above)."""
    storage.write_bytes(f"{s3_bucket}/ckpt/a.txt", b"fine")
    storage.s3_client().put_object(Bucket=s3_bucket[5:], Key="ckpt/sub/../../../escaped.txt", Body=b"evil")
    with pytest.raises(storage.StorageError, match=r"ckpt/sub/\.\./\.\./\.\./escaped\.txt: the object's name leaves"):
        storage.download_dir(f"{s3_bucket}/ckpt", str(tmp_path / "download" / "in"))
    assert not list(tmp_path.rglob("escaped.txt"))


def test_deepspeed_checkpoint_loads_never_run_code_from_the_files(tmp_path):
    """DeepSpeed unpickles its checkpoint files with weights_only=False. clsys loads them (resume,
    export, the universal conversion) with every torch.load restricted to tensors, containers and
    DeepSpeed's record classes: a file replaced on shared storage (its SHA256SUMS with it) is refused,
    never run, with an error that names it (torch's UnpicklingError did not). Before, export ran the payload."""
    import torch

    from clsys.engine.checkpoint import CheckpointError
    from clsys.engine.checkpoint import checkpoint_weights

    marker = tmp_path / "pwned"
    ds = tmp_path / "ckpt" / "ds"
    ds.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"optimizer_state_dict": RunsCodeWhenUnpickled(str(marker)),
                    "module": RunsCodeWhenUnpickled(str(marker))}, ds / name)
    (tmp_path / "ckpt" / "latest").write_text("ds")
    with pytest.raises(CheckpointError, match=r"^s3://b/step/ds/\S+_states\.pt: refused: .*weights_only"):
        checkpoint_weights(str(tmp_path / "ckpt"), "s3://b/step")
    assert not marker.exists(), "loading the checkpoint ran code from it"
    assert torch.load.__module__ == "torch.serialization", "the restriction outlived the load"
