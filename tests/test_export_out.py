"""``python -m clsys.export``. ``--out DIR``: only a folder that is a clsys export as it was written (or an
empty one) is replaced, the new export is built beside it and swapped in, and a failed export leaves
the previous one whole. Before, DIR was deleted whatever it was (``--out ~/models`` or ``--out .``
wiped it), then whatever held a ``classifier.json`` or ``clsys_export.json`` (issue 53), and a copy
that failed half-way left half an export. A checkpoint whose clsys_state.json or files are not what clsys
writes (someone could write its storage, and its checksums with it) is refused by export and set aside by
resume, with one short line naming the field or file; before, raw tracebacks, a 10 MB error line, or an
export with exit 0 of whatever the field said.

The checkpoints are real: a DeepSpeed engine on one gloo rank (CPU) writes them; the S3 side is a real
S3 server (moto on 127.0.0.1).
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch.multiprocessing as mp

from clsys import storage
from clsys.export import main
from clsys.storage import integrity
from clsys.storage.integrity import check_folder
from faults import RunsCodeWhenUnpickled
from tests.conftest import RankCheckpoints, free_port


def _the_checkpoints(rank: int, port: int, tiny: str, run: str, zero_run: str) -> None:
    ranks = RankCheckpoints(rank, port, tiny, world=1, stage=0)
    ranks.save(run, 2)
    ranks.save(run, 4)
    RankCheckpoints(rank, port, tiny, world=1, stage=1).save(zero_run, 2)


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory) -> dict[int | str, str]:
    """Step → URL of the two checkpoints of a run (ZeRO stage 0: no optimizer partitions), and "zero-1" → a
    checkpoint of a ZeRO-1 run, which holds its optimizer state in per-rank partitions."""
    from clsys.engine.checkpoint import step_url

    runs = tmp_path_factory.mktemp("export-out")
    run, zero_run = f"file://{runs}/run", f"file://{runs}/zero-1"
    mp.spawn(_the_checkpoints, args=(free_port(), tiny, run, zero_run), nprocs=1, join=True)
    return {2: step_url(run, 2), 4: step_url(run, 4), "zero-1": step_url(zero_run, 2)}


def _files(folder) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _exported_step(out: str) -> int:
    return json.loads(storage.read_bytes(storage.join(out, "clsys_export.json")))["step"]


def _with_a_reranker(export):
    """The local ``export`` as an export with a reranker would have been: a file the next export (which has
    none) must not leave behind, listed in the folder's sealed SHA256SUMS as export lists its own."""
    (export / "reranker").mkdir()
    (export / "reranker" / "stale.bin").write_bytes(b"from an older export")
    integrity.write_folder_sums(export, skip=lambda rel: rel == integrity.MODEL_CARD)
    return export


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
    _with_a_reranker(out)
    assert main(["--checkpoint", checkpoints[4], "--out", str(out)]) == 0
    assert _exported_step(str(out)) == 4 and check_folder(out)
    assert not (out / "reranker").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no temporary folder left beside it


def test_an_export_that_fills_the_disk_half_way_leaves_the_previous_one_whole(checkpoints, small_disk, capsys):
    """A real full disk (a tmpfs with room for one export and a half) under ``--out``; the export's own work
    folder is elsewhere. Before, the error was shutil.copytree's list of every file's (source, target, reason)."""
    disk, resize = small_disk
    resize("8m")
    out = disk / "export"
    assert main(["--checkpoint", checkpoints[2], "--out", str(out)]) == 0
    before = _files(out)
    assert sum(map(len, before.values())) > 4 << 20, "the export no longer fills the disk: resize it"
    capsys.readouterr()
    assert main(["--checkpoint", checkpoints[4], "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: {out}: no space left on device (writing model.safetensors); "
                                       "the previous export is unchanged\n")
    assert _files(out) == before and check_folder(out)
    assert [p.name for p in disk.iterdir()] == ["export"]  # no temporary folder left beside it


def test_a_checkpoint_without_its_tokenizer_is_refused(checkpoints, tmp_path, capsys):
    """A checkpoint whose hf/ holds no vocabulary (its checksums rewritten to match) exported with exit 0 a
    tokenizer of its 5 special tokens for an embedding of 30,522 rows."""
    def without_the_tokenizer(folder: Path) -> None:
        for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
            (folder / "hf" / name).unlink(missing_ok=True)

    step = _hostile(checkpoints[4], tmp_path / "step", without_the_tokenizer)
    assert main(["--checkpoint", step, "--out", str(tmp_path / "export")]) == 2
    _refused(capsys.readouterr().err, rf"^error: {re.escape(step)}: its tokenizer \(hf/: config.json\) has 5 tokens "
                                      r"but the embedding 30,522 rows: hf/ lacks the vocabulary")
    assert not (tmp_path / "export").exists()


def test_on_s3_only_an_export_is_replaced_and_nothing_of_the_old_one_stays(checkpoints, s3_bucket, tmp_path):
    mine = storage.join(s3_bucket, "models")
    storage.write_bytes(storage.join(mine, "notes.txt"), b"a user's object")
    assert main(["--checkpoint", checkpoints[4], "--out", mine]) == 2
    assert list(storage.list_prefix(mine)) == [storage.join(mine, "notes.txt")]

    out = storage.join(s3_bucket, "export")
    local = tmp_path / "older-export"
    assert main(["--checkpoint", checkpoints[2], "--out", str(local)]) == 0
    integrity.upload_sealed(str(_with_a_reranker(local)), out)
    assert main(["--checkpoint", checkpoints[4], "--out", out]) == 0
    assert _exported_step(out) == 4 and not storage.exists(storage.join(out, "reranker/stale.bin"))
    assert storage.exists(storage.join(out, "COMPLETE"))


# A user's thesis folder that happens to hold a classifier.json (or a clsys_export.json) at its top.
THESIS = {"classifier.json": b"{}", "thesis.tex": b"\\documentclass{article}",
          **{f"photos/{number:02d}.jpg": b"jpeg" for number in range(12)}}


def _one_line_naming(error: str, out: str, *names: str, more: int | None = None) -> None:
    """``error`` is one line that names ``out`` and the files ``names``, and how many more it does not name."""
    assert error.count("\n") == 1 and error.startswith(f"error: {out}: "), error
    assert "refusing to replace it" in error and all(name in error for name in names), error
    assert more is None or f"and {more} more" in error, error


def test_a_folder_with_an_export_record_among_a_users_files_is_refused_naming_them(checkpoints, tmp_path, capsys):
    """Issue 53: a folder counted as a clsys export when it merely held ``classifier.json`` or
    ``clsys_export.json`` at its top, and was replaced whole (exit 0): a thesis, its photos. Only a folder
    whose sealed SHA256SUMS lists every file it holds is one; the refusal names what would be lost."""
    for record in ("classifier.json", "clsys_export.json"):
        thesis = tmp_path / record.partition(".")[0]
        files = {record if rel == "classifier.json" else rel: data for rel, data in THESIS.items()}
        for rel, data in files.items():
            (thesis / rel).parent.mkdir(parents=True, exist_ok=True)
            (thesis / rel).write_bytes(data)
        assert main(["--checkpoint", checkpoints[4], "--out", str(thesis)]) == 2
        error = capsys.readouterr().err
        # Sorted names, the first few shown: 14 files, 5 named.
        _one_line_naming(error, str(thesis), "not a clsys export", record, "photos/00.jpg", more=9)
        assert _files(thesis) == files


def test_a_previous_export_with_a_users_files_added_or_changed_is_refused_and_kept(checkpoints, tmp_path, capsys):
    """A real export to which the user added a file of their own, or in which they changed one of its
    files, is no longer only the export: replacing it would lose their work (it did: only the record was
    looked at). The model card (README.md, meant to be edited) and hidden files (.gitattributes of a
    hub clone) are what the export's own check lets through, and do not stop it."""
    out = tmp_path / "export"
    assert main(["--checkpoint", checkpoints[2], "--out", str(out)]) == 0
    (out / "my-eval.csv").write_text("model,spearman\n")
    before = _files(out)
    assert main(["--checkpoint", checkpoints[4], "--out", str(out)]) == 2
    _one_line_naming(capsys.readouterr().err, str(out), "my-eval.csv", "not listed in its SHA256SUMS")
    assert _files(out) == before

    (out / "my-eval.csv").unlink()
    tokenizer = (out / "tokenizer_config.json").read_bytes()
    (out / "tokenizer_config.json").write_bytes(tokenizer.replace(b"{", b'{"model_max_length": 128, ', 1))
    assert main(["--checkpoint", checkpoints[4], "--out", str(out)]) == 2
    _one_line_naming(capsys.readouterr().err, str(out), "tokenizer_config.json", "changed since")
    assert _exported_step(str(out)) == 2

    (out / "tokenizer_config.json").write_bytes(tokenizer)
    (out / "README.md").write_text("an edited card")
    (out / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    assert main(["--checkpoint", checkpoints[4], "--out", str(out)]) == 0
    assert _exported_step(str(out)) == 4 and check_folder(out)


def test_on_s3_a_users_folder_or_an_export_with_a_users_object_is_refused_and_kept(checkpoints, s3_bucket, capsys):
    """The same on object storage (s3:// --out), where "replacing" deletes the objects the new export lacks."""
    thesis = storage.join(s3_bucket, "thesis")
    for rel, data in THESIS.items():
        storage.write_bytes(storage.join(thesis, rel), data)
    assert main(["--checkpoint", checkpoints[4], "--out", thesis]) == 2
    _one_line_naming(capsys.readouterr().err, thesis, "not a clsys export", "classifier.json", more=9)
    assert {rel: storage.read_bytes(obj) for obj, rel in storage.list_relative(thesis)} == THESIS

    out = storage.join(s3_bucket, "export")
    assert main(["--checkpoint", checkpoints[2], "--out", out]) == 0
    storage.write_bytes(storage.join(out, "notes/my-eval.csv"), b"model,spearman\n")
    before = {rel: storage.read_bytes(obj) for obj, rel in storage.list_relative(out)}
    assert main(["--checkpoint", checkpoints[4], "--out", out]) == 2
    _one_line_naming(capsys.readouterr().err, out, "notes/my-eval.csv", "not listed in its SHA256SUMS")
    assert {rel: storage.read_bytes(obj) for obj, rel in storage.list_relative(out)} == before

    # An upload cut short leaves no COMPLETE (publish deletes it first): a list nothing seals could be
    # anyone's, so that folder is refused too, with the hint to delete it.
    storage.delete(storage.join(out, "notes/my-eval.csv"))
    storage.delete(storage.join(out, "COMPLETE"))
    assert main(["--checkpoint", checkpoints[4], "--out", out]) == 2
    _one_line_naming(capsys.readouterr().err, out, "sealed by no COMPLETE: an upload cut short", "clsys_export.json")
    assert _exported_step(out) == 2


def _hostile(url: str, folder: Path, damage: Callable[[Path], None]) -> str:
    """A copy of checkpoint ``url`` in ``folder``, ``damage``d, its SHA256SUMS and COMPLETE rewritten to
    match: what someone who can write the checkpoint's storage makes of it (the checksums pass)."""
    from clsys.engine.checkpoint import listed_apart

    storage.download_dir(url, str(folder))
    damage(folder)
    integrity.write_folder_sums(folder, skip=listed_apart)
    return str(folder)


def _state(fields: dict) -> Callable[[Path], None]:
    """The damage that sets ``fields`` of clsys_state.json (dotted names: inside its sections)."""
    def damage(folder: Path) -> None:
        state = json.loads((folder / "clsys_state.json").read_text())
        for dotted, value in fields.items():
            *sections, key = dotted.split(".")
            inner = state
            for section in sections:
                inner = inner[section]
            inner[key] = value
        (folder / "clsys_state.json").write_text(json.dumps(state))
    return damage


INJECTION = "../../../../tmp/evil\n| injected | row |"
# name → (fields of clsys_state.json, the problem named: a regular expression)
HOSTILE_STATES = {
    # One rank wrote it: 199999 ranks' state files are missing, counted, 5 of them named.
    "a world size of 200000": ({"world_size": 200000}, r"rank-00001\.pt: required, not listed in SHA256SUMS; .*; "
                                                       r"rank-NNNNN\.pt of 199994 more ranks: required"),
    "a world size that is a string": ({"world_size": "2"}, r"world_size: expected a positive integer, got '2'"),
    "a step that is a list": ({"step": [4]}, r"step: expected an integer >= 0, got \[4\]"),
    "a config that is a list": ({"config": []}, r"config: expected a mapping, got \[\]"),
    "a model name with a table row": ({"config.model.name": INJECTION},
                                      r"config\.model\.name: expected a string of printable characters, got "),
    "a head map that is a list": ({"export_head_map": ["pooler.dense.weight"]},
                                  r"export_head_map: expected a mapping of names to names, got \['pooler"),
    "a head map naming no weight": ({"export_head_map": {"pooler.dense.weight": "no.such.weight"}},
                                    r"export_head_map: pooler\.dense\.weight: no weight 'no\.such\.weight'"),
    "an encoder prefix that is a number": ({"encoder_prefix": 3}, r"encoder_prefix: expected a string .*, got 3"),
    "prompts that are a list": ({"export_prompts": ["query: "]},
                                r"export_prompts: expected a mapping of prompt names to strings, got \['query: '\]"),
    "a prompt named with a table row": ({"export_prompts": {INJECTION: "query: "}},
                                        r"export_prompts: expected a mapping of prompt names to strings, got "),
    "Matryoshka dimensions that are strings": ({"export_matryoshka_dims": ["64"]},
                                               r"export_matryoshka_dims: expected a list of positive integers, "
                                               r"got \['64'\]"),
    "a pooling that is a path and a table row": (
        {"export_pooling": INJECTION},
        r"export_pooling: expected cls, mean, max or cls_mlp, got '\.\./\.\./\.\./\.\./tmp/evil\\n\| injected"),
}


def _refused(error: str, problem: str) -> None:
    """``error`` is one short line (no traceback) that names ``problem``."""
    assert error.count("\n") == 1 and error.startswith("error: ") and len(error) < 600, error[:2000]
    assert re.search(problem, error), error


@pytest.mark.parametrize("hostile", HOSTILE_STATES)
def test_export_refuses_a_checkpoint_whose_state_is_hostile_naming_the_field(hostile, checkpoints, tmp_path,
                                                                             capsys):
    """Issue 53: wrong types gave raw tracebacks, a world size of 200000 an error line of 10 MB after 7.5 s,
    and a pooling that was a path with a table row in it an export (exit 0) with a broken pooling config
    and the row in its model card."""
    fields, problem = HOSTILE_STATES[hostile]
    step = _hostile(checkpoints[4], tmp_path / "step", _state(fields))
    assert main(["--checkpoint", step, "--out", str(tmp_path / "export")]) == 2
    _refused(capsys.readouterr().err, problem)
    assert not (tmp_path / "export").exists()


def test_prompts_and_matryoshka_dims_of_a_checkpoint_are_exported_and_an_older_ones_absence_is_none(
        checkpoints, tmp_path):
    """What a checkpoint records of ExportSpec's prompts and Matryoshka dimensions reaches the export's
    config_sentence_transformers.json and model card; a checkpoint written before they were recorded lacks both
    keys and exports as it did then: no prompts, no default prompt, no Matryoshka row."""
    def without_them(folder: Path) -> None:
        state = json.loads((folder / "clsys_state.json").read_text())
        del state["export_prompts"], state["export_matryoshka_dims"]
        (folder / "clsys_state.json").write_text(json.dumps(state))

    prompts = {"query": "query: ", "passage": "passage: ", "nq": "Instruct: answer\nQuery: "}
    for name, damage in (("recorded", _state({"export_prompts": prompts, "export_matryoshka_dims": [32, 16]})),
                         ("older", without_them)):
        step = _hostile(checkpoints[4], tmp_path / f"step-{name}", damage)
        assert main(["--checkpoint", step, "--out", str(tmp_path / name)]) == 0
        st_config = json.loads((tmp_path / name / "config_sentence_transformers.json").read_text())
        card = (tmp_path / name / "README.md").read_text()
        assert st_config["default_prompt_name"] is None
        if name == "recorded":
            assert st_config["prompts"] == prompts
            assert "| prompts | `query`, `passage`, `nq` (in `config_sentence_transformers.json`) |" in card
            assert "| Matryoshka dimensions | 32, 16 (trained to be used truncated to each) |" in card
        else:
            assert st_config["prompts"] == {} and "| prompts |" not in card and "Matryoshka" not in card


def test_export_refuses_a_pickle_in_zero_optimizer_states_naming_the_file(checkpoints, tmp_path, capsys):
    """A ZeRO optimizer partition that holds more than tensors is refused, never unpickled (clsys loads
    with weights_only), and now by name: torch's UnpicklingError came out as a raw traceback."""
    import torch

    marker = tmp_path / "pwned"

    def pickle_in_optimizer_states(folder: Path) -> None:
        torch.save({"optimizer_state_dict": RunsCodeWhenUnpickled(str(marker))},
                   folder / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")

    step = _hostile(checkpoints["zero-1"], tmp_path / "step", pickle_in_optimizer_states)
    assert main(["--checkpoint", step, "--out", str(tmp_path / "export")]) == 2
    _refused(capsys.readouterr().err, rf"{re.escape(step)}/ds/zero_pp_rank_0_mp_rank_00_optim_states\.pt: refused")
    assert not marker.exists() and not (tmp_path / "export").exists()


@contextlib.contextmanager
def _one_rank_group():
    """A real gloo process group of one rank, in this process: what resume's collectives need."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_resume_sets_a_checkpoint_whose_state_is_hostile_aside_naming_the_field(checkpoints, tmp_path, caplog):
    """Resume reads the world size, step and ZeRO stage of the newest checkpoint: a hostile one is set aside
    with a short reason and the run goes on from the previous one. Before, the world size of 200000 took
    seconds and printed megabytes, and a wrong type crashed every rank with a traceback."""
    from clsys.engine.checkpoint import fetch_intact

    hostile = {**{name: HOSTILE_STATES[name] for name in ("a world size of 200000", "a step that is a list")},
               "a ZeRO stage that is a string": ({"config.train.zero_stage": "0"},
                                                 r"config\.train\.zero_stage: expected 0, 1, 2 or 3, got '0'")}
    with _one_rank_group():
        for number, (fields, problem) in enumerate(hostile.values()):
            bad = _hostile(checkpoints[4], tmp_path / f"step-{number}", _state(fields))
            fetched = fetch_intact([bad, checkpoints[2]], world=1)
            shutil.rmtree(fetched.folder)
            printed = "".join(f"{r.getMessage()}\n" for r in caplog.records)
            caplog.clear()
            assert fetched.step == 2 and f"checkpoint {bad} is damaged" in printed, printed[:2000]
            assert printed.count("\n") == 1 and len(printed) < 800 and re.search(problem, printed), printed[:2000]


def test_an_export_from_a_url_with_a_token_writes_no_file_holding_it(checkpoints, tmp_path, capsys):
    """The checkpoint is read through an FTP server on 127.0.0.1 whose user name is a token (as many services
    take one). The export records where its checkpoint came from, in clsys_export.json and the model card
    (what a user uploads to the Hub): as ``ftp://***@…``; no file of the folder and no line printed holds
    the token."""
    from tests.conftest import ftp_server

    token = "T0KEN-as-user"
    step = Path(storage.parse(checkpoints[4]).path)
    with ftp_server(step.parents[2], token, "") as ftp:
        url = f"{ftp.replace('ftp://', f'ftp://{token}@')}/{step.relative_to(step.parents[2]).as_posix()}"
        assert main(["--checkpoint", url, "--out", str(tmp_path / "export")]) == 0
    files = _files(tmp_path / "export")
    assert not [name for name, data in files.items() if token.encode() in data], "files holding the token"
    assert token not in "".join(capsys.readouterr())
    redacted = url.replace(token, "***")
    assert json.loads(files["clsys_export.json"])["checkpoint"] == redacted
    assert f"| exported checkpoint | `{redacted}` (the given step folder) |" in files["README.md"].decode()


# ---- symbolic links: listed under their own names; one that leaves the folder is refused, naming it -----------

def _linked_out(folder: Path, name: str, outside: Path) -> Callable[[Path], None]:
    """The damage that makes ``name`` of a checkpoint a symbolic link to ``outside`` (a file of the machine that
    reads it), holding the same bytes, so that the checksums pass."""
    def damage(folder: Path) -> None:
        outside.write_bytes((folder / name).read_bytes())
        (folder / name).unlink()
        (folder / name).symlink_to(outside)
    return damage


def test_a_link_in_a_folder_is_listed_under_its_own_name_and_one_leaving_it_is_refused(tmp_path):
    """The names came from the link's target cut at the folder's length: ``hf/vocab.txt`` linking outside was
    listed as ``s``, and ``download_dir`` copied the target (a file the folder's writer chose) under that name."""
    folder, outside = tmp_path / "folder", tmp_path / "outside"
    (folder / "real").mkdir(parents=True)
    outside.mkdir()
    (folder / "real" / "a.txt").write_text("a")
    (folder / "b.txt").symlink_to(folder / "real" / "a.txt")
    (folder / "real" / "to-real").symlink_to(folder / "real")  # a folder inside: not followed, not refused
    assert [rel for _, rel in storage.list_relative(str(folder))] == ["b.txt", "real/a.txt"]
    storage.download_dir(str(folder), str(tmp_path / "copy"))
    assert _files(tmp_path / "copy") == {"b.txt": b"a", "real/a.txt": b"a"}
    (outside / "secret").write_text("the reader's own")
    for link, target in [("real/s", outside / "secret"), ("real/dir", outside)]:
        (folder / link).symlink_to(target)
        for call in (lambda: list(storage.list_relative(str(folder))),
                     lambda: storage.download_dir(f"file://{folder}", str(tmp_path / "copy-2"))):
            with pytest.raises(storage.StorageError) as err:
                call()
            assert str(err.value) == (f"file://{folder}/{link}: a symbolic link to {target}, outside the folder "
                                      f"file://{folder} being read: refused (copy the file into it instead)")
        (folder / link).unlink()
    assert not (tmp_path / "copy-2").exists()


def test_export_and_resume_refuse_a_checkpoint_whose_link_leaves_it_naming_the_link(checkpoints, tmp_path, capsys,
                                                                                     caplog):
    from clsys.engine.checkpoint import fetch_intact, listed_apart

    outside = tmp_path / "a-file-of-the-reader.txt"
    step = _hostile(checkpoints[4], tmp_path / "step", _linked_out(tmp_path / "step", "hf/tokenizer.json", outside))
    refusal = (rf"file://{re.escape(step)}/hf/tokenizer\.json: a symbolic link to {re.escape(str(outside))}, outside "
               rf"the folder file://{re.escape(step)} being read: refused")
    with _one_rank_group():
        fetched = fetch_intact([step, checkpoints[2]], world=1)
    shutil.rmtree(fetched.folder)
    printed = "".join(f"{r.getMessage()}\n" for r in caplog.records)
    assert fetched.step == 2 and f"checkpoint {step} is damaged" in printed and re.search(refusal, printed), printed
    (Path(step) / "CORRUPT").unlink()  # what resume's set_aside did: the same checkpoint again, for export
    integrity.write_folder_sums(step, skip=listed_apart)
    assert main(["--checkpoint", step, "--out", str(tmp_path / "export")]) == 2
    _refused(capsys.readouterr().err, refusal)
    assert not (tmp_path / "export").exists()


def test_an_export_folder_with_links_is_replaced_only_as_check_replaceable_sees_them_by_name(checkpoints, tmp_path,
                                                                                             capsys):
    """A link inside the previous export was listed under its target's name, so an added ``extra.json`` linking
    to its ``config.json`` was taken for the export's own file; one linking outside was listed by a made-up name."""
    out = tmp_path / "export"
    assert main(["--checkpoint", checkpoints[2], "--out", str(out)]) == 0
    (out / "extra.json").symlink_to(out / "config.json")
    assert main(["--checkpoint", checkpoints[4], "--out", str(out)]) == 2
    _refused(capsys.readouterr().err, r"files not listed in its SHA256SUMS: extra\.json; choose another --out")
    (out / "extra.json").unlink()
    (tmp_path / "notes.txt").write_text("a user's notes")
    (out / "notes.txt").symlink_to(tmp_path / "notes.txt")
    assert main(["--checkpoint", checkpoints[4], "--out", str(out)]) == 2
    _refused(capsys.readouterr().err, rf"file://{re.escape(str(out))}/notes\.txt: a symbolic link to "
                                      rf"{re.escape(str(tmp_path))}/notes\.txt, outside the folder")
    assert _exported_step(str(out)) == 2 and (tmp_path / "notes.txt").read_text() == "a user's notes"
