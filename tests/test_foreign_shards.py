"""Shards written by other tools: `python -m data_prep manifest` indexes them, clsys reads them as webdataset does.

The shards are written with webdataset's own `TarWriter` (plain and gzip-compressed) and read back
with `webdataset.WebDataset` as the reference: same keys, same texts, same order. Members other than
the text (images, class labels, other tools' json, a pickle) are skipped unread: the pickle's payload
would create a file if it were ever unpickled.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import tarfile

import pytest
import webdataset as wds

from clsys import storage
from clsys.shards.reader import ShardError, load_shards, read_shard
from clsys.data.epoch_layout import plan_epoch
from clsys.data.streaming import ShardLoader
from clsys.storage import StorageError
from data_prep.__main__ import main as data_prep
from clsys.shards.manifest import previous_shas, read_manifest


class _Opens:
    """A pickle whose loading would create ``path`` (it calls ``open(path, "w")``)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def texts_of(samples: list[dict]) -> dict:
    """A collate for the loader's worker processes (module level: they get it pickled)."""
    return {"txt": [s["txt"] for s in samples]}


def write_foreign(folder, pickle_target: str) -> list[tuple[str, str]]:
    """Four shards as another tool writes them (three .tar, one .tar.gz); returns (key, caption) in order."""
    os.makedirs(folder, exist_ok=True)
    expected = []
    for i, name in enumerate(["part-00000.tar", "part-00001.tar", "part-00002.tar", "part-00003.tar.gz"]):
        with wds.TarWriter(os.path.join(folder, name), compress=name.endswith(".gz")) as writer:
            for j in range(7 + i):
                key, caption = f"img{i}-{j:04d}", f"Une légende {i}.{j}: ünïcode ✓"
                sample = {"__key__": key, "caption": caption, "jpg": os.urandom(64), "cls": j % 3,
                          "json": [i, j]}  # other tools' json need not be an object: it is not read
                if (i, j) == (1, 2):
                    sample["pyd"] = pickle.dumps(_Opens(pickle_target))
                writer.write(sample)
                expected.append((key, caption))
    return expected


def webdataset_reference(urls: list[str]) -> list[tuple[str, str]]:
    """(key, caption) of every sample as webdataset itself reads the shards (no decoding but the caption's)."""
    dataset = wds.WebDataset(urls, shardshuffle=False)
    return [(s["__key__"], s["caption"].decode("utf-8")) for s in dataset]


def test_foreign_shards_index_in_place_and_read_like_webdataset(tmp_path, capsys):
    src, unpickled = tmp_path / "captions", tmp_path / "unpickled"
    expected = write_foreign(src, str(unpickled))
    assert data_prep(["manifest", str(src), "--text-member", "caption"]) == 0
    out = capsys.readouterr().out
    assert "34 samples in 4 shards (0 skipped), text from .caption" in out
    assert "skipped unread: .cls 34, .jpg 34, .json 34, .pyd 1" in out

    manifest = read_manifest(str(src))
    assert manifest["stream"] == "captions" and manifest["samples"] == 34
    assert [s["name"] for s in manifest["shards"]] == sorted(n for n in os.listdir(src) if n.startswith("part-"))
    assert manifest["foreign"]["text_member"] == "caption"
    shards = load_shards(str(src))
    samples = [s for shard in shards for s in read_shard(shard)]
    assert [(s["__key__"], s["txt"]) for s in samples] == expected == webdataset_reference([sh.url[7:] for sh in shards])
    assert all(set(s) == {"__key__", "txt", "json"} and s["json"] == {} for s in samples)
    assert not unpickled.exists()

    # Training's loader plans the epoch from the manifest and reads every sample once.
    plan = plan_epoch(shards, 0, 3, 1, 2, 4)
    loader = ShardLoader(str(src), 0, 1, 4, texts_of, seed=3,
                         loader_workers=2, shuffle_buffer=8)
    batches = [b for b, _ in zip(loader, range(plan.batches_per_rank))]
    read = [t for b in batches for t in b["txt"]]
    assert len(read) == len(set(read)) == plan.batches_per_rank * 4 and set(read) <= {c for _, c in expected}

    # A changed shard is caught by its sha256, as for data_prep's own streams.
    first = src / "part-00000.tar"
    first.write_bytes(first.read_bytes()[:-1] + b"\1")
    with pytest.raises(ShardError, match="part-00000.tar: checksum: sha256"):
        list(read_shard(load_shards(str(src))[0]))


def test_manifest_elsewhere_on_s3_names_the_shards_by_url(s3_bucket, tmp_path, capsys):
    local = tmp_path / "local"
    expected = write_foreign(local, str(tmp_path / "unpickled"))
    source, stream = f"{s3_bucket}/third-party/captions", f"{s3_bucket}/mine/corpus/sentences"
    for name in sorted(os.listdir(local)):
        storage.upload_file(str(local / name), storage.join(source, name))
    assert data_prep(["manifest", source, "--out", stream, "--text-member", "caption", "--jobs", "2"]) == 0
    assert f"train with data.url={s3_bucket}/mine/corpus (stream 'sentences')" in capsys.readouterr().out
    manifest = read_manifest(stream)
    assert [s["name"] for s in manifest["shards"]] == [storage.join(source, n) for n in sorted(os.listdir(local))]
    assert [(s["__key__"], s["txt"]) for sh in load_shards(stream) for s in read_shard(sh)] == expected
    assert sorted(os.path.basename(u) for u in storage.list_prefix(source)) == sorted(os.listdir(local))  # left as they were
    # A data_prep stream written into that folder later would not replace or delete the foreign shards.
    assert previous_shas(stream) == {}


def test_bad_foreign_shards_are_named_and_skipped_only_on_request(tmp_path, capsys):
    src = tmp_path / "src"
    write_foreign(src, str(tmp_path / "unpickled"))
    # Without --text-member: no .txt member; the error names the shard, the sample and what is there.
    assert data_prep(["manifest", str(src)]) == 2
    captured = capsys.readouterr()
    assert (f"bad shard file://{src}/part-00000.tar: sample img0-0000 has no .txt member (the shard's members: "
            "caption, cls, jpg, json; choose another with --text-member)") in captured.out
    assert "4 of 4 shards cannot be trained on" in captured.err
    assert not (src / "manifest.json").exists()

    # A cut shard, a cut gzip stream and a bad UTF-8 caption: named; --skip-bad leaves them out, counted.
    cut = src / "part-00001.tar"
    cut.write_bytes(cut.read_bytes()[:3000])
    cut_gz = src / "part-00003.tar.gz"
    cut_gz.write_bytes(cut_gz.read_bytes()[:200])
    with tarfile.open(src / "part-00004.tar", "w") as tar:
        info = tarfile.TarInfo("latin1.caption")
        info.size = 4
        tar.addfile(info, io.BytesIO("café".encode("latin-1")))
    assert data_prep(["manifest", str(src), "--text-member", "caption"]) == 2
    out = capsys.readouterr().out
    assert f"bad shard file://{src}/part-00001.tar: corrupt: unreadable tar" in out
    assert f"bad shard file://{src}/part-00003.tar.gz: truncated: the gzip stream ends early" in out
    assert f"bad shard file://{src}/part-00004.tar: sample latin1: its .caption member is not UTF-8" in out
    assert data_prep(["manifest", str(src), "--text-member", "caption", "--skip-bad"]) == 0
    assert "16 samples in 2 shards (3 skipped)" in capsys.readouterr().out
    manifest = json.loads((src / "manifest.json").read_text())
    assert manifest["foreign"]["shards_skipped"] == 3
    assert [s["name"] for s in manifest["shards"]] == ["part-00000.tar", "part-00002.tar"]

    # Not a text member; an empty folder; a data_prep stream's own manifest is never replaced.
    assert data_prep(["manifest", str(src), "--text-member", "json"]) == 2
    assert "--text-member 'json': name the extension of a text member" in capsys.readouterr().err
    assert data_prep(["manifest", str(tmp_path / "empty")]) == 2
    assert "no .tar, .tar.gz, .tgz shards directly in this folder" in capsys.readouterr().err
    own = tmp_path / "own"
    own.mkdir()
    (own / "manifest.json").write_text(json.dumps({"format": "clsys-shards/1", "stream": "own", "shards": [],
                                                   "samples": 0}))
    assert data_prep(["manifest", str(own)]) == 2
    assert "a manifest written by data_prep is there already" in capsys.readouterr().err


def test_manifest_shard_names_are_file_names_or_urls(tmp_path):
    def manifest_with(name: str) -> str:
        url = tmp_path / "m"
        url.mkdir(exist_ok=True)
        (url / "manifest.json").write_text(json.dumps({
            "format": "clsys-shards/1", "stream": "m", "samples": 1,
            "shards": [{"name": name, "samples": 1, "sha256": "0" * 64}], "foreign": {"text_member": "txt"}}))
        return str(url)

    assert load_shards(manifest_with("s3://bucket/p/x.tar"))[0].url == "s3://bucket/p/x.tar"
    assert load_shards(manifest_with("x.tar"))[0].url == f"file://{tmp_path}/m/x.tar"
    for bad in ("../x.tar", "sub/x.tar", "nosuch://bucket/x.tar"):
        with pytest.raises(StorageError, match=r"manifest field 'shards\[0\]\.name'"):
            read_manifest(manifest_with(bad))
