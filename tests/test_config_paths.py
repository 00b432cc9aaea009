"""Local paths in a config are resolved by the driver (``python -m clsys.pretrain``), against the folder it
runs in, before any Ray worker starts: workers run in folders of their own. What ``--print-config``
prints is what the workers get; a path that names nothing fails there, naming its key."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def print_config(overrides: list[str], capsys) -> tuple[int, dict, str]:
    """``python -m clsys.pretrain --print-config OVERRIDES`` in this process: (exit code, printed config, stderr)."""
    from clsys.pretrain import main

    code = main(["--print-config", *overrides])
    captured = capsys.readouterr()
    return code, (yaml.safe_load(captured.out) if code == 0 else {}), captured.err


@pytest.fixture
def user_folder(tmp_path, monkeypatch) -> Path:
    """A user's working folder holding a model, a tokenizer, an STS set, a Tatoeba pair, task files and a BEIR
    folder with a dev split, the driver started in it."""
    for folder in ("models/tiny", "tok", "runs", "shards", "ckpt/step-00000002"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "config.json").write_text("{}")
    (tmp_path / "sets").mkdir()
    (tmp_path / "sets" / "dev.csv").write_text("A cat sits.,A cat is sitting.,4.5\n")
    (tmp_path / "bitext").mkdir()
    for lang in ("deu", "eng"):
        (tmp_path / "bitext" / f"tatoeba.deu-eng.{lang}").write_text("a\n")
    (tmp_path / "beir" / "mine" / "qrels").mkdir(parents=True)
    (tmp_path / "beir" / "mine" / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\n")
    (tmp_path / "task").mkdir()
    for split in ("train", "dev", "test"):
        (tmp_path / "task" / f"{split}.tsv").write_text("label\ttext\npos\tgood\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_relative_paths_are_absolute_in_the_resolved_config(user_folder, capsys):
    code, cfg, err = print_config([
        "--config", "css_lm", "model.name=models/tiny", "model.tokenizer=./tok", "eval.sts_dev=sets/dev.csv",
        "eval.sts_test=sets/dev.csv", "eval.tatoeba=[bitext/tatoeba.deu-eng, fra-eng]",
        "objective.task.train=task/train.tsv", "objective.task.dev=task/dev.tsv", "task.test=task/test.tsv",
        "data.url=shards", "train.run_root=runs", "objective.corpus.url=shards",
        "train.resume=ckpt/step-00000002", "eval.retrieval_dev=beir/mine"], capsys)
    assert code == 0, err
    assert cfg["model"]["name"] == str(user_folder / "models" / "tiny")
    assert cfg["model"]["tokenizer"] == str(user_folder / "tok")
    assert cfg["eval"]["sts_dev"] == cfg["eval"]["sts_test"] == str(user_folder / "sets" / "dev.csv")
    # A Tatoeba path is a prefix of its two files; a bundled pair stays a name.
    assert cfg["eval"]["tatoeba"] == [str(user_folder / "bitext" / "tatoeba.deu-eng"), "fra-eng"]
    task = cfg["objective"]["task"]
    assert [task[s] for s in ("train", "dev", "test")] == [str(user_folder / "task" / f"{s}.tsv")
                                                           for s in ("train", "dev", "test")]
    assert cfg["data"]["url"] == cfg["objective"]["corpus"]["url"] == str(user_folder / "shards")
    assert cfg["train"]["run_root"] == str(user_folder / "runs")
    assert cfg["train"]["resume"] == str(user_folder / "ckpt" / "step-00000002")
    assert cfg["eval"]["retrieval_dev"] == str(user_folder / "beir" / "mine")


def test_names_and_urls_stay_as_given(user_folder, capsys):
    code, cfg, err = print_config(["--config", "css_lm", "model.name=all-MiniLM-L6-v2",
                                   "model.tokenizer=s3://bucket/tok", "eval.sts_dev=stsb-en-dev", "eval.sts_test=",
                                   "data.url=s3://bucket/shards", "train.resume=latest",
                                   "objective.task.train=s3://bucket/train.tsv",
                                   "eval.retrieval_dev=xquad-de"], capsys)
    assert code == 0, err
    assert (cfg["model"]["name"], cfg["model"]["tokenizer"]) == ("all-MiniLM-L6-v2", "s3://bucket/tok")
    assert (cfg["eval"]["sts_dev"], cfg["eval"]["sts_test"]) == ("stsb-en-dev", "")
    assert (cfg["data"]["url"], cfg["train"]["resume"], cfg["objective"]["task"]["train"]) == (
        "s3://bucket/shards", "latest", "s3://bucket/train.tsv")
    assert cfg["eval"]["retrieval_dev"] == "xquad-de"


def test_a_path_into_the_clsys_checkout_works_from_any_folder(user_folder, capsys):
    """What the docs and the css_lm recipe write (clsys/configs/models/..., clsys/assets/...), from elsewhere."""
    code, cfg, err = print_config(["model.init=scratch", "model.name=clsys/configs/models/bert-mini.json",
                                   "model.tokenizer=all-MiniLM-L6-v2"], capsys)
    assert code == 0, err
    assert cfg["model"]["name"] == str(REPO / "clsys" / "configs" / "models" / "bert-mini.json")


@pytest.mark.parametrize("override, key", [
    ("model.name=clsys/configs/models/bert-mini.jsn", "model.name"),  # the case, one typo away
    ("model.name=models/tiny2", "model.name"),  # hub-id shaped, but no such hub id is in the cache
    ("model.tokenizer=../no/tokenizer", "model.tokenizer"),
    ("eval.sts_dev=sets/missing.csv", "eval.sts_dev"),
    ("eval.sts_test=sets/missing.csv", "eval.sts_test"),
    ("eval.tatoeba=[bitext/tatoeba.fra-eng]", "eval.tatoeba"),
    ("eval.retrieval_dev=beir/missing", "eval.retrieval_dev"),
])
def test_a_path_that_names_nothing_fails_naming_its_key(user_folder, capsys, override, key):
    code, _, err = print_config([override], capsys)
    assert code == 2
    value = override.partition("=")[2].strip("[]")
    assert f"{key}: '{value}'" in err and str(user_folder) in err, err


def test_the_objectives_own_files_resolve_against_the_checkout_or_fail_naming_their_key(user_folder, capsys):
    """The files an objective's config declares (CSS-LM's objective.task.*), whichever spelling set them: the working
    folder first, else the clsys checkout; one that names nothing fails naming its key under objective."""
    sst5 = "clsys/assets/labeled/sst5/stsa.fine.train"
    code, cfg, err = print_config(["--config", "css_lm", f"objective.task.train={sst5}", "task.dev=task/dev.tsv"],
                                  capsys)
    assert code == 0, err
    assert cfg["objective"]["task"]["train"] == str(REPO / sst5)
    assert cfg["objective"]["task"]["dev"] == str(user_folder / "task" / "dev.tsv")
    for override in ("objective.task.dev=task/missing.tsv", "task.dev=task/missing.tsv"):
        code, _, err = print_config(["--config", "css_lm", override], capsys)
        assert code == 2 and "objective.task.dev: 'task/missing.tsv'" in err and str(user_folder) in err, err


def test_a_hub_id_counts_only_when_it_is_in_the_cache(user_folder, capsys, monkeypatch):
    """Nothing is downloaded at run time: a name that is no local path is a hub id only if this machine's
    Hugging Face cache holds it (kept as given: the workers read their cache), else an error on the driver."""
    from huggingface_hub import constants

    cache = user_folder / "hf-cache"
    snapshot = cache / "models--someorg--tiny-encoder" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--someorg--tiny-encoder" / "refs").mkdir()
    (cache / "models--someorg--tiny-encoder" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    code, cfg, err = print_config(["model.name=someorg/tiny-encoder"], capsys)
    assert code == 0, err
    assert cfg["model"]["name"] == "someorg/tiny-encoder"
    code, _, err = print_config(["model.name=someorg/other-encoder"], capsys)
    assert code == 2 and "model.name: 'someorg/other-encoder'" in err and "cache" in err


def test_a_retrieval_dev_folder_without_the_split_fails_on_the_driver(user_folder, capsys):
    """Training-time retrieval reads qrels/<eval.retrieval_split>.tsv (dev by default): a folder without it fails
    before any worker starts, naming the file; a split that is there is taken."""
    code, _, err = print_config(["eval.retrieval_dev=beir/mine", "eval.retrieval_split=test"], capsys)
    assert code == 2 and f"eval.retrieval_split: {user_folder / 'beir' / 'mine' / 'qrels' / 'test.tsv'}: no such file" in err
    code, cfg, err = print_config(["eval.retrieval_dev=xquad-en", "eval.retrieval_split=test"], capsys)
    assert code == 0 and cfg["eval"]["retrieval_split"] == "test", err
