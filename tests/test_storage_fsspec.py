"""Storage URLs of the schemes fsspec knows (gs://, az://, hf://, …), on two of fsspec's own filesystems:
memory:// (one process's, every storage function checked against the file and s3 backends) and
ftp:// on a real FTP server (pyftpdlib on 127.0.0.1, in its own process), which a data_prep
subprocess writes a stream to and this process reads back, checksums verified."""
from __future__ import annotations

import bz2
import hashlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from clsys import storage
from clsys.storage import compare_and_swap, fsspec_store
from clsys.shards.reader import ShardError, load_shards, read_shard
from clsys.storage.lease import Lease
from clsys.storage import StorageError
from clsys.shards.manifest import read_manifest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data_prep" / "samples" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


@pytest.fixture
def mem() -> str:
    """A fresh folder on this process's memory:// filesystem."""
    return f"memory://t-{uuid.uuid4().hex[:12]}/run"


def test_urls_parse_and_join():
    loc = storage.parse("memory://bucket/a/b/")
    assert (loc.scheme, loc.bucket, loc.path, str(loc)) == ("memory", "bucket", "a/b", "memory://bucket/a/b")
    assert storage.join("memory://bucket", "x/", "/y") == "memory://bucket/x/y"
    assert storage.join("memory://bucket/a", "x") == "memory://bucket/a/x"
    assert storage.is_local("/tmp/x") and storage.is_local("file:///tmp/x")
    assert not storage.is_local("memory://bucket/a") and not storage.is_local("s3://bucket/a")
    with pytest.raises(storage.StorageError, match="a password in a storage URL") as err:
        storage.parse("ftp://alice:s3cret@127.0.0.1:21/data")
    assert "s3cret" not in str(err.value) and "127.0.0.1:21" in str(err.value)
    assert storage.parse("ftp://alice@127.0.0.1/data").bucket == "alice@127.0.0.1"  # a user name alone is no secret


def test_round_trips(mem, tmp_path):
    url = storage.join(mem, "sub/object.bin")
    data = os.urandom(3000)
    storage.write_bytes(url, data)
    assert storage.read_bytes(url) == data and storage.exists(url)
    with storage.open_read(url) as f:
        assert f.read(10) == data[:10] and f.read() == data[10:]
    storage.write_json(storage.join(mem, "m.json"), {"ü": [1, 2]})
    assert storage.read_json(storage.join(mem, "m.json")) == {"ü": [1, 2]}

    local = tmp_path / "in.bin"
    local.write_bytes(data[::-1])
    storage.upload_file(str(local), storage.join(mem, "up.bin"))
    storage.download_file(storage.join(mem, "up.bin"), str(tmp_path / "deep" / "out.bin"))
    assert (tmp_path / "deep" / "out.bin").read_bytes() == data[::-1]

    storage.write_bytes(url, b"replaced")
    assert storage.read_bytes(url) == b"replaced"
    assert compare_and_swap.read_versioned(url) == (b"replaced", compare_and_swap.read_versioned(url)[1])
    assert compare_and_swap.read_versioned(storage.join(mem, "none")) is None
    storage.check_bucket(mem)


def test_dirs_round_trip(mem, tmp_path):
    src = tmp_path / "src"
    for rel, text in {"a.txt": "1", "x/b.txt": "22", "x/y/c.txt": "333"}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    storage.upload_dir(str(src), storage.join(mem, "model"))
    assert list(storage.list_sizes(storage.join(mem, "model"))) == [
        (storage.join(mem, "model/a.txt"), 1), (storage.join(mem, "model/x/b.txt"), 2),
        (storage.join(mem, "model/x/y/c.txt"), 3)]
    storage.download_dir(storage.join(mem, "model"), str(tmp_path / "dst"))
    assert sorted(str(p.relative_to(tmp_path / "dst")) for p in (tmp_path / "dst").rglob("*") if p.is_file()) == [
        "a.txt", "x/b.txt", "x/y/c.txt"]
    assert (tmp_path / "dst" / "x" / "y" / "c.txt").read_text() == "333"


@pytest.fixture(params=["file", "s3"])
def reference(request, tmp_path) -> str:
    """A fresh folder on one of the two backends clsys had before fsspec."""
    if request.param == "file":
        return f"file://{tmp_path}/ref"
    return f"{request.getfixturevalue('s3_bucket')}/ref"


def test_listing_and_delete_match_file_and_s3(mem, reference):
    """The same writes, listings and deletes on memory:// and on file:// or s3:// give the same answers,
    named relative to the folder: a listing holds what is under the folder (recursively, sorted),
    never a sibling that shares its name's start, nor the object named by the URL itself."""
    def run(root: str) -> list:
        for rel, data in (("a/x", b"1"), ("a/y/z", b"22"), ("ab", b"333"), ("a2/q", b"4444")):
            storage.write_bytes(storage.join(root, rel), data)
        rel = lambda items: [(u[len(root) + 1:], n) for u, n in items]  # noqa: E731
        answers = [rel(storage.list_sizes(root)), rel(storage.list_sizes(storage.join(root, "a"))),
                   list(storage.list_prefix(storage.join(root, "a/x"))),
                   list(storage.list_prefix(storage.join(root, "missing"))),
                   storage.exists(storage.join(root, "a/y/z")), storage.exists(storage.join(root, "a/nothing"))]
        storage.delete(storage.join(root, "a/x"))
        storage.delete(storage.join(root, "a/never-written"))
        answers.append(rel(storage.list_sizes(root)))
        return answers

    answers = run(mem)
    assert answers == run(reference)
    assert answers[1] == [("a/x", 1), ("a/y/z", 2)]
    assert answers[-1] == [("a/y/z", 2), ("a2/q", 4), ("ab", 3)]


def test_delete_a_folder(mem):
    for rel in ("ckpt/a", "ckpt/b/c", "keep"):
        storage.write_bytes(storage.join(mem, rel), b"x")
    storage.delete(storage.join(mem, "ckpt"))
    assert list(storage.list_prefix(mem)) == [storage.join(mem, "keep")]


def test_checkpoints_are_found_and_pruned(mem):
    from clsys.engine import checkpoint

    for step in (100, 200, 300):
        for rel in ("ds/mp_rank_00_model_states.pt", "ranks/rank-00000", "COMPLETE"):
            storage.write_bytes(storage.join(checkpoint.step_url(mem, step), rel), b"x")
    storage.write_bytes(storage.join(checkpoint.step_url(mem, 400), "ds/partial"), b"x")  # no COMPLETE yet
    assert checkpoint.complete_checkpoints(mem) == [(s, checkpoint.step_url(mem, s)) for s in (100, 200, 300)]
    checkpoint.prune(mem, keep=1, protect=checkpoint.step_url(mem, 100))
    assert sorted({u.split("/")[5] for u in storage.list_prefix(mem)}) == ["step-00000100", "step-00000300",
                                                                        "step-00000400"]


def test_a_tokenizer_folder_loads_from_a_url(mem, tmp_path):
    from clsys.model.encoder import load_tokenizer

    packaged = load_tokenizer("all-MiniLM-L6-v2")
    packaged.save_pretrained(tmp_path / "tok")
    storage.upload_dir(str(tmp_path / "tok"), storage.join(mem, "tok"))
    loaded = load_tokenizer(storage.join(mem, "tok"))
    text = "Storage URLs of other schemes."
    assert loaded(text)["input_ids"] == packaged(text)["input_ids"] and len(loaded) == len(packaged)


def test_missing_objects_name_the_url(mem, tmp_path):
    url = storage.join(mem, "nope.bin")
    assert not storage.exists(url)
    for op in (storage.read_bytes, storage.open_read, lambda u: storage.download_file(u, str(tmp_path / "x"))):
        with pytest.raises(StorageError, match=f"^{url}: no such object"):
            op(url)


def test_download_dir_refuses_names_that_leave_the_folder(mem, tmp_path):
    fs, root = fsspec_store.filesystem(storage.parse(mem))
    fs.pipe_file(f"{root}/ok.txt", b"fine")
    fs.pipe_file(f"{root}/../../evil.txt", b"escaped")  # a name an object store holds as it is
    with pytest.raises(StorageError, match="leaves the folder it is downloaded into"):
        storage.download_dir(mem, str(tmp_path / "dst"))
    assert not list(tmp_path.rglob("evil.txt"))


def test_unknown_scheme_and_missing_package(monkeypatch):
    with pytest.raises(StorageError, match=r"^nosuch://b/x: unsupported URL scheme nosuch://"):
        storage.parse("nosuch://b/x")
    # A scheme whose package is not installed, as gs:// is without gcsfs.
    from fsspec.registry import known_implementations

    monkeypatch.setitem(known_implementations, "nopkg",
                        {"class": "clsys_absent_fs.FileSystem", "err": "Install clsys_absent_fs"})
    with pytest.raises(StorageError, match=r"^nopkg://b/x: the nopkg:// scheme needs a package that is not "
                                           r"installed \(pip install clsys_absent_fs\)"):
        storage.read_bytes("nopkg://b/x")


def test_transient_errors_are_retried_and_permanent_ones_are_not(mem, monkeypatch):
    url = storage.join(mem, "flaky")
    storage.write_bytes(url, b"data")
    fs, _ = fsspec_store.filesystem(storage.parse(url))
    monkeypatch.setattr(storage.base, "BACKOFF_S", 0.001)
    calls = []

    def failing(errors):
        def cat_file(path, **kwargs):
            calls.append(path)
            if len(calls) <= len(errors):
                raise errors[len(calls) - 1]
            return b"data"
        return cat_file

    monkeypatch.setattr(fs, "cat_file", failing([ConnectionResetError("reset"), TimeoutError("slow")]))
    assert storage.read_bytes(url) == b"data" and len(calls) == 3

    calls.clear()
    monkeypatch.setattr(fs, "cat_file", failing([PermissionError("denied")] * storage.base.ATTEMPTS))
    with pytest.raises(StorageError, match=f"^{url}: PermissionError: denied"):
        storage.read_bytes(url)
    assert len(calls) == 1

    calls.clear()
    monkeypatch.setattr(fs, "cat_file", failing([ConnectionResetError("reset")] * storage.base.ATTEMPTS))
    with pytest.raises(StorageError, match=f"^{url}: ConnectionResetError: reset"):
        storage.read_bytes(url)
    assert len(calls) == storage.base.ATTEMPTS


def test_no_run_lease_without_compare_and_swap(mem):
    url = storage.join(mem, "LEASE")
    for op in (lambda: compare_and_swap.write_if(url, b"x", None), lambda: compare_and_swap.delete_if(url, "v")):
        with pytest.raises(StorageError, match=f"^{url}: memory:// has no compare-and-swap write"):
            op()
    with pytest.raises(StorageError, match="set cluster.lease_ttl_s=0 to run without a lease"):
        Lease(mem, 30.0).acquire()
    assert not storage.exists(url)


def test_data_prep_writes_a_stream_over_ftp_that_training_reads(ftp_root, tmp_path):
    """data_prep, in its own process, writes its streams to ftp://; this process finds the same shards
    there (byte for byte those of a local run: the output is deterministic) and reads every sample,
    checksums verified."""
    url, folder = ftp_root
    dump = tmp_path / "small.xml.bz2"
    xml = bz2.decompress(SAMPLE.read_bytes())
    head, *pages = xml.split(b"  <page>")
    dump.write_bytes(bz2.compress(head + b"".join(b"  <page>" + p for p in pages[:20]).split(b"</mediawiki>")[0]
                                  + b"</mediawiki>\n"))
    # Looked at before data_prep writes: what this process saw must not hide what another wrote since.
    assert not storage.exists(f"{url}/wiki") and list(storage.list_prefix(url)) == []
    local = tmp_path / "local"
    started = time.monotonic()
    for out in (f"{url}/wiki", f"file://{local}"):
        result = subprocess.run([sys.executable, "-m", "data_prep", "wiki", "--input", str(dump), "--out", out,
                                 "--shard-size-mb", "0.05"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60

    stream = f"{url}/wiki/sentences"
    assert storage.exists(f"{url}/wiki") and storage.exists(f"{stream}/manifest.json")
    manifest = read_manifest(stream)
    assert manifest == read_manifest(f"file://{local}/sentences") and len(manifest["shards"]) > 2
    listed = dict(storage.list_sizes(stream))
    assert listed == {f"{stream}/{s['name']}": s["bytes"] for s in manifest["shards"]} | {
        f"{stream}/manifest.json": (local / "sentences" / "manifest.json").stat().st_size}
    for shard in manifest["shards"]:  # on the server's disk: the bytes the local run wrote
        assert (folder / "wiki" / "sentences" / shard["name"]).read_bytes() == \
            (local / "sentences" / shard["name"]).read_bytes()

    shards = load_shards(stream)
    assert [s.url for s in shards] == [f"{stream}/{s['name']}" for s in manifest["shards"]]
    samples = [sample for shard in shards for sample in read_shard(shard, verify=True)]
    assert len(samples) == manifest["samples"] > 0
    assert any("Anarchism" in s["txt"] for s in samples)
    reference = [s for shard in load_shards(f"file://{local}/sentences") for s in read_shard(shard)]
    assert [(s["__key__"], s["txt"]) for s in samples] == [(s["__key__"], s["txt"]) for s in reference]

    # A shard changed on the server is caught by its checksum.
    damaged = folder / "wiki" / "sentences" / manifest["shards"][0]["name"]
    data = bytearray(damaged.read_bytes())
    data[600] ^= 1
    damaged.write_bytes(bytes(data))
    assert hashlib.sha256(storage.read_bytes(shards[0].url)).digest() == hashlib.sha256(data).digest()
    with pytest.raises(ShardError, match=f"^{shards[0].url}: checksum: sha256 .* does not match the manifest"):
        list(read_shard(shards[0], verify=True))
