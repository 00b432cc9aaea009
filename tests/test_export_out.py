"""``python -m clsys.export --out DIR``: only a folder that is a clsys export (or an empty one) is
replaced, the new export is built beside it and swapped in, and a failed export leaves the previous
one whole. Before, DIR was deleted whatever it was (``--out ~/models`` or ``--out .`` wiped it) and a
copy that failed half-way left half an export.

The checkpoints are real: a DeepSpeed engine on one gloo rank (CPU) writes them; the S3 side is a real
S3 server (moto on 127.0.0.1).
"""
from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch.multiprocessing as mp

from clsys import storage
from clsys.export import main
from clsys.storage.integrity import check_folder
from tests.conftest import RankCheckpoints, free_port


def _two_checkpoints(rank: int, port: int, tiny: str, run: str) -> None:
    ranks = RankCheckpoints(rank, port, tiny, world=1, stage=0)
    ranks.save(run, 2)
    ranks.save(run, 4)


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory) -> dict[int, str]:
    """Step → URL of the two checkpoints of a run."""
    from clsys.engine.checkpoint import step_url

    run = f"file://{tmp_path_factory.mktemp('export-out')}/run"
    mp.spawn(_two_checkpoints, args=(free_port(), tiny, run), nprocs=1, join=True)
    return {step: step_url(run, step) for step in (2, 4)}


def _files(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _exported_step(out: str) -> int:
    return json.loads(storage.read_bytes(storage.join(out, "clsys_export.json")))["step"]


def test_a_folder_that_is_not_an_export_is_refused_and_kept(checkpoints, tmp_path, capsys):
    models = tmp_path / "models"
    models.mkdir()
    (models / "notes.txt").write_text("a user's file")
    assert main(["--checkpoint", checkpoints[4], "--out", str(models)]) == 2
    error = capsys.readouterr().err
    assert f"{models}: not a clsys export" in error and "refusing to replace it" in error, error
    assert _files(models) == {"notes.txt": b"a user's file"}
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    assert main(["--checkpoint", checkpoints[4], "--out", str(a_file)]) == 2
    assert f"{a_file}: not a folder" in capsys.readouterr().err and a_file.read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "weights.bin"]  # nothing left beside them


def test_an_empty_folder_is_used_and_a_previous_export_replaced(checkpoints, tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    assert main(["--checkpoint", checkpoints[2], "--out", str(out)]) == 0
    assert _exported_step(str(out)) == 2 and check_folder(out)
    (out / "reranker").mkdir()
    (out / "reranker" / "stale.bin").write_bytes(b"from an older export")
    assert main(["--checkpoint", checkpoints[4], "--out", str(out)]) == 0
    assert _exported_step(str(out)) == 4 and check_folder(out)
    assert not (out / "reranker").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary folder left beside it


def test_an_export_that_fails_half_way_leaves_the_previous_one_whole(checkpoints, tmp_path, monkeypatch, capsys):
    out = tmp_path / "export"
    assert main(["--checkpoint", checkpoints[2], "--out", str(out)]) == 0
    before = _files(out)
    real_copyfile, copied = shutil.copyfile, []

    def disk_fills_up(src, dst, *args, **kwargs):
        """The disk of ``--out`` fills up after two files (the export's own work folder is elsewhere)."""
        if str(dst).startswith(str(tmp_path)):
            if len(copied) == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(dst))
            copied.append(dst)
        return real_copyfile(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", disk_fills_up)
    assert main(["--checkpoint", checkpoints[4], "--out", str(out)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert len(copied) == 2, "the failure was not injected where the export is written"
    assert _files(out) == before and check_folder(out)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary folder left beside it


def test_on_s3_only_an_export_is_replaced_and_nothing_of_the_old_one_stays(checkpoints, s3_bucket):
    mine = storage.join(s3_bucket, "models")
    storage.write_bytes(storage.join(mine, "notes.txt"), b"a user's object")
    assert main(["--checkpoint", checkpoints[4], "--out", mine]) == 2
    assert list(storage.list_prefix(mine)) == [storage.join(mine, "notes.txt")]

    out = storage.join(s3_bucket, "export")
    assert main(["--checkpoint", checkpoints[2], "--out", out]) == 0
    storage.write_bytes(storage.join(out, "reranker/stale.bin"), b"from an older export")
    assert main(["--checkpoint", checkpoints[4], "--out", out]) == 0
    assert _exported_step(out) == 4 and not storage.exists(storage.join(out, "reranker/stale.bin"))
    assert storage.exists(storage.join(out, "COMPLETE"))
