"""Pre-tokenized streams: data_prep tokenize on the bundled Wikipedia sample, ids collated exactly as the
tokenizer would, bad ids members, and the start-up refusal of a stream tokenized by another tokenizer."""
from __future__ import annotations

import collections
import itertools
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from clsys.config import Config, ModelConfig
from clsys.data.streaming import stream_loader
from clsys.recipes import load_config
from clsys.data.pretokenized import SentenceBatcher, tokenizer_fingerprint
from clsys.shards.reader import Shard, ShardError, load_shards, read_shard
from clsys.model.encoder import load_tokenizer
from clsys.objectives.self_guided import SelfGuided, SelfGuidedConfig
from clsys.objectives.simcse import SimCSE, SimCSEConfig
from clsys.pretrain import check_data, main as pretrain
from data_prep.__main__ import main as data_prep
from clsys import storage
from clsys.storage import StorageError
from clsys.shards.manifest import read_manifest
from clsys.shards.blocks import Record
from clsys.shards.writer import ShardWriter

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data_prep" / "samples" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MINILM = "all-MiniLM-L6-v2"


def samples_of(stream: str) -> list[dict]:
    return [s for shard in load_shards(stream) for s in read_shard(shard)]


@pytest.fixture(scope="module")
def streams(tmp_path_factory) -> tuple[Path, Path]:
    """(text stream, the same pre-tokenized with all-MiniLM-L6-v2): the sentences of the bundled dump."""
    tmp = tmp_path_factory.mktemp("pretok")
    subprocess.run([sys.executable, "-m", "data_prep", "wiki", "--input", str(SAMPLE), "--out", str(tmp / "txt"),
                    "--shard-size-mb", "0.5"], cwd=ROOT, check=True, capture_output=True, timeout=120)
    assert data_prep(["tokenize", "--input", f"file://{tmp / 'txt' / 'sentences'}", "--tokenizer", MINILM,
                      "--out", str(tmp / "tok" / "sentences")]) == 0
    return tmp / "txt" / "sentences", tmp / "tok" / "sentences"


@pytest.fixture(scope="module")
def minilm():
    return load_tokenizer(MINILM)


def test_tokenize_adds_the_tokenizers_ids(streams, minilm):
    txt, tok = streams
    before, after = read_manifest(str(txt)), read_manifest(str(tok))
    assert after["tokenizer"] == {"name": MINILM, "fingerprint": tokenizer_fingerprint(minilm), "max_tokens": 512}
    assert after["languages"] == before["languages"] and after["tokenized_from"].endswith("txt/sentences")
    # One output shard per input shard: the same epoch plans.
    assert [s["samples"] for s in after["shards"]] == [s["samples"] for s in before["shards"]]
    plain, tokenized = samples_of(str(txt)), samples_of(str(tok))
    assert [{k: s[k] for k in ("__key__", "txt", "json")} for s in tokenized] == plain
    expected = minilm([s["txt"] for s in plain], add_special_tokens=False)["input_ids"]
    assert [s["ids"] for s in tokenized] == expected
    assert max(map(len, expected)) > 32  # long enough to test truncation below
    # The member itself: the block's records' ids, raw little-endian int32, nothing else; the blocks are the input's.
    assert [s["blocks"] for s in after["shards"]] == [s["blocks"] for s in before["shards"]]
    with tarfile.open(tok / after["shards"][0]["name"]) as tar:
        member = next(m for m in tar if m.name.endswith(".ids"))
        raw = tar.extractfile(member).read()
        lengths = json.loads(tar.extractfile(member.name.replace(".ids", ".json")).read())["ids_lengths"]
    first_block = [s["ids"] for s in tokenized[:len(lengths)]]
    assert [len(ids) for ids in first_block] == lengths
    assert np.frombuffer(raw, dtype="<i4").tolist() == [i for ids in first_block for i in ids]


def test_rerun_is_byte_identical(streams, tmp_path, capsys):
    txt, tok = streams
    again = tmp_path / "sentences"
    assert data_prep(["tokenize", "--input", str(txt), "--tokenizer", MINILM, "--out", str(again)]) == 0
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in tok.iterdir())
    shards = [p.name for p in tok.iterdir() if p.suffix == ".tar"]
    assert all((again / name).read_bytes() == (tok / name).read_bytes() for name in shards)
    # The same manifest but for tokenized_from, which names the input as given.
    assert {**read_manifest(str(again)), "tokenized_from": ""} == {**read_manifest(str(tok)), "tokenized_from": ""}
    capsys.readouterr()
    assert data_prep(["tokenize", "--input", str(txt), "--tokenizer", MINILM, "--out", str(again)]) == 0
    assert "0 uploaded" in capsys.readouterr().out


def test_max_tokens_cuts_the_ids(streams, minilm, tmp_path):
    txt, _ = streams
    assert data_prep(["tokenize", "--input", str(txt), "--tokenizer", MINILM, "--out", str(tmp_path / "s"),
                      "--max-tokens", "8"]) == 0
    tokenized = samples_of(str(tmp_path / "s"))
    full = minilm([s["txt"] for s in tokenized], add_special_tokens=False)["input_ids"]
    assert [s["ids"] for s in tokenized] == [ids[:8] for ids in full]
    assert read_manifest(str(tmp_path / "s"))["tokenizer"]["max_tokens"] == 8


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _batches(streams, size: int = 16) -> list[tuple[list[dict], list[dict]]]:
    """(pre-tokenized samples, the same without ids) in batches, some with sentences beyond 32 tokens."""
    tokenized = samples_of(str(streams[1]))[:8 * size]
    return [(b, [{k: v for k, v in s.items() if k != "ids"} for s in b])
            for b in (tokenized[i:i + size] for i in range(0, len(tokenized), size))]


@pytest.mark.parametrize("objective", ["simcse", "self_guided"])
def test_collate_from_ids_equals_tokenizing(objective, streams, minilm):
    cfg = Config(model=ModelConfig(name=MINILM))
    cfg.data.max_length = 32
    if objective == "simcse":
        cfg.objective = SimCSEConfig(name="simcse")
        model = SimCSE(cfg, minilm)
    else:
        cfg.objective = SelfGuidedConfig(name="self_guided", projection_dim=16)
        model = SelfGuided(cfg, minilm)
    truncated = 0
    for with_ids, without in _batches(streams):
        batch = model.collate(with_ids)
        _assert_same(batch, model.collate(without))
        assert batch["input_ids"].shape[0] == len(with_ids) * (2 if objective == "simcse" else 1)
        truncated += sum(len(s["ids"]) > 30 for s in with_ids)
        assert model.sample_lengths(with_ids) == model.sample_lengths(without)  # length grouping's sort key
    assert truncated > 0
    assert model.sample_lengths([{"txt": "one", "ids": [5, 6, 7]}]) == [3]  # counted from ids, not tokenized


@pytest.fixture(scope="module")
def spm_tokenizer(streams, tmp_path_factory) -> str:
    """A SentencePiece tokenizer trained by data_prep tokenizer on the sample (its own [CLS]/[SEP] template)."""
    out = tmp_path_factory.mktemp("spm") / "tokenizer"
    assert data_prep(["tokenizer", "--input", str(streams[0]), "--vocab-size", "600", "--out", str(out)]) == 0
    return str(out)


@pytest.mark.parametrize("kind", ["minilm_left_padded", "sentencepiece"])
def test_sentence_batcher_mirrors_other_tokenizers(kind, streams, spm_tokenizer):
    tokenizer = load_tokenizer(MINILM if kind == "minilm_left_padded" else spm_tokenizer)
    if kind == "minilm_left_padded":
        tokenizer.padding_side = "left"
    batcher = SentenceBatcher(tokenizer, max_length=20)
    for _, plain in _batches(streams):
        ids = tokenizer([s["txt"] for s in plain], add_special_tokens=False)["input_ids"]
        _assert_same(batcher([{**s, "ids": i} for s, i in zip(plain, ids)], copies=2), batcher(plain, copies=2))


def test_fingerprint_is_stable_and_tells_tokenizers_apart(minilm, tmp_path):
    fingerprint = tokenizer_fingerprint(minilm)
    minilm(["a sentence " * 40], truncation=True, max_length=7, padding="max_length")  # changes backend state
    assert tokenizer_fingerprint(minilm) == fingerprint == tokenizer_fingerprint(load_tokenizer(MINILM))
    other = load_tokenizer(MINILM)
    other.add_tokens(["clsysword"])
    assert tokenizer_fingerprint(other) != fingerprint


def _odd_ids_shard(tmp_path: Path) -> Shard:
    writer = ShardWriter(str(tmp_path / "s"), str(tmp_path), 1 << 20)
    writer.write("en-1-00000", "fine", {"lang": "en"}, {"ids": b"\x01\x00\x00\x00"})
    writer.write("en-1-00001", "cut", {"lang": "en"}, {"ids": b"\x01\x00\x00\x00\x02\x00"})
    writer.close()
    writer.write_manifest({})
    (shard,) = load_shards(str(tmp_path / "s"))
    return shard


def test_odd_length_ids_are_undecodable(tmp_path):
    shard = _odd_ids_shard(tmp_path)
    with pytest.raises(ShardError) as err:
        list(read_shard(shard))
    assert str(err.value).startswith(shard.url) and "undecodable: sample en-1-00001" in str(err.value)
    assert ".ids member" in str(err.value) and "6 bytes" in str(err.value)
    skipped = collections.Counter()
    assert [s["ids"] for s in read_shard(shard, skipped=skipped)] == [[1]]
    assert skipped == {"undecodable": 1}


def test_manifest_tokenizer_field_is_checked(tmp_path):
    writer = ShardWriter(str(tmp_path / "s"), str(tmp_path), 1 << 20)
    writer.write("en-1-00000", "text", {"lang": "en"}, {"ids": b"\x01\x00\x00\x00"})
    writer.close()
    writer.write_manifest({"tokenizer": {"name": MINILM, "max_tokens": 512}})
    with pytest.raises(StorageError, match=r"manifest.json: manifest field 'tokenizer.fingerprint' is missing"):
        read_manifest(str(tmp_path / "s"))


def _pretrain(tmp_path: Path, data: Path) -> int:
    return pretrain([f"data.url={data}", f"train.run_root={tmp_path / 'runs'}", "train.name=pretok"])


def test_training_refuses_another_tokenizers_stream(streams, minilm, tmp_path, capsys):
    other = load_tokenizer(MINILM)
    other.add_tokens(["clsysword"])
    other.save_pretrained(tmp_path / "other")
    data = tmp_path / "data"
    assert data_prep(["tokenize", "--input", str(streams[0]), "--tokenizer", str(tmp_path / "other"),
                      "--out", str(data / "sentences")]) == 0
    capsys.readouterr()
    assert _pretrain(tmp_path, data) == 2
    err = capsys.readouterr().err
    assert f"{data}/sentences: pre-tokenized with tokenizer {tmp_path / 'other'}" in err
    assert tokenizer_fingerprint(other) in err and f"training uses {MINILM}" in err
    assert tokenizer_fingerprint(minilm) in err
    # TaCL tokenizes txt and ignores ids: the same tokenizer's documents stream is not refused.
    assert data_prep(["tokenize", "--input", str(streams[0].parent / "documents"), "--tokenizer",
                      str(tmp_path / "other"), "--out", str(data / "documents")]) == 0
    assert check_data(load_config("tacl", [f"data.url={data}"])).endswith(f"{data}/documents")


def test_training_refuses_ids_cut_below_max_length(streams, tmp_path, capsys):
    data = tmp_path / "data"
    assert data_prep(["tokenize", "--input", str(streams[0]), "--tokenizer", MINILM, "--out", str(data / "sentences"),
                      "--max-tokens", "16"]) == 0
    capsys.readouterr()
    assert _pretrain(tmp_path, data) == 2  # quickstart: data.max_length 32 keeps up to 30 text tokens
    assert "ids are cut at 16 tokens, but data.max_length 32 keeps up to 30" in capsys.readouterr().err


FORGED = [7592, 2088]  # "hello world" to all-MiniLM-L6-v2, whatever a record's text says


def _ids_stream(stream: Path, shards: list[list[list[int] | None]], tokenizer: dict | None) -> None:
    """A sentences stream as data_prep tokenize writes it (format 2), one shard of one block per entry of ``shards``:
    record n says "sentence number n about cats", its ids are the entry's (None: it has none); the manifest names
    ``tokenizer`` (data_prep tokenize's section), or no tokenizer."""
    stream.mkdir(parents=True)
    writer = ShardWriter(str(stream), str(stream.parent), 1 << 20, block_records=1 << 10)
    n = 0
    for rows in shards:
        writer.write_block([Record(f"sentence number {n + i} about cats", {"lang": "en"}, ids)
                            for i, ids in enumerate(rows)])
        writer.close()  # the block's shard ends here
        n += len(rows)
    writer.write_manifest({} if tokenizer is None else {"tokenizer": tokenizer})


def _one_worker(data: Path) -> Config:
    return load_config("quickstart", [f"data.url={data}", "cluster.num_workers=1", "data.loader_workers=1"])


def _read_epoch(cfg: Config, tokenizer) -> list[dict]:
    """The first epoch's batches, through the loader SimCSE trains with (one loader worker process)."""
    loader = iter(stream_loader(cfg, "sentences", 0, 1, SimCSE(cfg, tokenizer).data))
    try:
        return list(itertools.islice(loader, 4))  # 128 records, 32 a batch
    finally:
        loader.close()


def test_training_refuses_ids_no_fingerprint_vouches_for(tmp_path):
    """A stream with ids but no tokenizer in its manifest skipped the fingerprint check, and its ids were trained
    on: "sentence number 0 about cats" as [CLS] hello world [SEP]. Refused at start-up, before any worker starts."""
    data = tmp_path / "data"
    _ids_stream(data / "sentences", [[FORGED] * 64] * 2, None)
    with pytest.raises(ValueError, match=rf"^file://{data}/sentences: .*token ids.* names no tokenizer"):
        check_data(load_config("quickstart", [f"data.url={data}"]))


def test_loader_refuses_ids_no_fingerprint_vouches_for(minilm, tmp_path):
    """Start-up reads the first shard alone: the loader refuses such ids in any shard, naming it and the sample."""
    data = tmp_path / "data"
    _ids_stream(data / "sentences", [[None] * 64, [FORGED] * 64], None)
    cfg = _one_worker(data)
    check_data(cfg)  # its first shard has no ids
    with pytest.raises(ShardError, match=r"shard-000001\.tar: unsafe: sample 000000001/0 has token ids"):
        _read_epoch(cfg, minilm)


@pytest.mark.parametrize("bad", [30522, -1])  # all-MiniLM-L6-v2 has 30,522 tokens: one past its last; a negative one
def test_ids_outside_the_vocabulary_are_refused(bad, minilm, tmp_path):
    """They went to the embedding: a bare IndexError naming no shard on a CPU, on a GPU a device-side assert that
    kills the process."""
    data = tmp_path / "data"
    rows = [FORGED] * 64
    _ids_stream(data / "sentences", [rows, rows[:10] + [[7592, bad]] + rows[11:]],
                {"name": MINILM, "fingerprint": tokenizer_fingerprint(minilm), "max_tokens": 512})
    cfg = _one_worker(data)
    check_data(cfg)  # the fingerprint is the training tokenizer's
    with pytest.raises(ShardError, match=rf"shard-000001\.tar: ids_out_of_range: sample 000000001/10: token id {bad} "):
        _read_epoch(cfg, minilm)
    # data.on_bad_sample: skip leaves out the record's block, counted.
    first, second = load_shards(str(data / "sentences"), "sentences", vocab_size=len(minilm))
    skipped = collections.Counter()
    assert len(list(read_shard(first, skipped=skipped))) == 64 and not skipped
    assert list(read_shard(second, skipped=skipped)) == [] and skipped == {"ids_out_of_range": 1}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --out spelled so that a string comparison with --input misses it: the same folder, one inside it, one holding it.
OUT_ONTO_INPUT = {"file_url": "file://{input}", "dot": "{input}/.", "double_slash": "{parent}//sentences",
                  "dot_dot": "{input}/../sentences", "inside": "{input}/tokenized", "holding": "file://{parent}/"}


@pytest.mark.parametrize("spelling", list(OUT_ONTO_INPUT))
def test_tokenize_refuses_an_out_on_its_input(spelling, streams, tmp_path, capsys):
    """Writing the output stream where the input is read from replaced its shards one by one and deleted its
    manifest: a failure half-way (at shard 40) left neither stream. Refused before anything is written."""
    stream = tmp_path / "in" / "sentences"
    shutil.copytree(streams[0], stream)
    before = _files(tmp_path)
    out = OUT_ONTO_INPUT[spelling].format(input=stream, parent=stream.parent)
    capsys.readouterr()
    assert data_prep(["tokenize", "--input", str(stream), "--tokenizer", MINILM, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"data_prep tokenize: error: --out {out}: ") and f"the input {stream}" in err, err
    assert _files(tmp_path) == before  # nothing written, nothing replaced or deleted


@pytest.mark.parametrize("out", ["{input}/", "{input}/tokenized", "{bucket}/in"])
def test_tokenize_refuses_an_out_on_its_input_in_s3(out, streams, s3_bucket, capsys):
    stream = f"{s3_bucket}/in/sentences"
    storage.upload_dir(str(streams[0]), stream)
    before = {url: storage.read_bytes(url) for url in storage.list_prefix(s3_bucket)}
    out = out.format(input=stream, bucket=s3_bucket)
    capsys.readouterr()
    assert data_prep(["tokenize", "--input", stream, "--tokenizer", MINILM, "--out", out]) == 2
    assert f"error: --out {out}: " in capsys.readouterr().err
    assert {url: storage.read_bytes(url) for url in storage.list_prefix(s3_bucket)} == before


@pytest.mark.parametrize("case", ["missing_stream", "no_manifest", "bad_tokenizer", "out_is_input"])
def test_bad_input_exits_2(case, streams, tmp_path):
    args = {"--input": str(tmp_path / "nothing-here"), "--tokenizer": MINILM, "--out": str(tmp_path / "out")}
    if case == "no_manifest":
        (tmp_path / "partial").mkdir()
        (tmp_path / "partial" / "shard-000000.tar").write_bytes((streams[0] / "shard-000000.tar").read_bytes())
        args["--input"] = str(tmp_path / "partial")
    elif case == "bad_tokenizer":
        args.update({"--input": str(streams[0]), "--tokenizer": str(tmp_path / "no-tokenizer")})
        (tmp_path / "no-tokenizer").mkdir()
    elif case == "out_is_input":
        args.update({"--input": str(streams[0]), "--out": str(streams[0]) + "/"})
    proc = subprocess.run([sys.executable, "-m", "data_prep", "tokenize", *[x for kv in args.items() for x in kv]],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("data_prep tokenize: error: ") and "Traceback" not in proc.stderr
    named = {"missing_stream": args["--input"], "no_manifest": args["--input"], "bad_tokenizer": args["--tokenizer"],
             "out_is_input": args["--out"]}[case]
    assert named in proc.stderr
    assert not (tmp_path / "out").exists()
    if case in ("missing_stream", "no_manifest"):
        assert "no manifest.json" in proc.stderr
    if case == "out_is_input":
        assert json.loads((streams[0] / "manifest.json").read_text())["format"] == "clsys-shards/2"
