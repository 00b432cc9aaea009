"""Hostile shards and manifests: each is refused (or, with ``on_bad_sample: skip``, counted) with a reason
that names the manifest or the shard and the sample, instead of reaching a sample's text, a loader
worker's collate or a bare TypeError.

- Shard names: ``data_prep manifest`` writes only names that training's ``read_manifest`` accepts.
- A ``.tar.gz`` is decompressed as a stream, up to the configured limit (``data.max_shard_mb``).
- A sparse tar member (GNU type ``S``, or PAX ``GNU.sparse.*`` records) is not a regular file.
- Every manifest field is checked; a bad one is named with its manifest and shard entry.
- A sample's ``json`` must hold what its stream kind's objective reads (``clsys/shards/fields.py``).
- A shard is read up to the limit, whatever the manifest lists of its size (or what it names: /dev/zero).
- A manifest lists a shard once: not by two names, nor as two copies.
- A name from a shard or a manifest is clipped in messages; a URL's secrets are not printed.
"""
from __future__ import annotations

import collections
import gzip
import hashlib
import io
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tarfile
import tracemalloc

import pytest
from test_clir import record
from test_streaming_faults import tar_bytes

from clsys import storage
from clsys.recipes import load_config
from clsys.shards.reader import Shard, ShardError, load_shards, read_shard
from clsys.model.encoder import load_tokenizer
from clsys.objectives.clir import CLIR
from clsys.data.streaming import stream_loader
from clsys.storage import StorageError
from data_prep.__main__ import main as data_prep
from clsys.shards.manifest import read_manifest
from clsys.shards.writer import ShardWriter

END = bytes(1024)  # a tar's end-of-archive marker


def write_samples(url: str, tmp_path, metas: list, prefix: str = "k") -> list[str]:
    """A data_prep stream of one shard: sample i has the text ``text i`` and the json ``metas[i]``."""
    writer = ShardWriter(url, str(tmp_path), max_bytes=1 << 30)
    keys = [f"{prefix}-{i:04d}" for i in range(len(metas))]
    for key, meta in zip(keys, metas):
        writer.write(key, f"text {key}", meta)
    writer.close()
    writer.write_manifest({})
    return keys


def foreign_shard(path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# ---- shard names: one rule, for what data_prep manifest writes and what training reads ------------------

def test_manifest_command_lists_only_names_training_accepts(tmp_path, capsys):
    src = tmp_path / "sentences"
    foreign_shard(src / "part-0.tar", tar_bytes([("a.txt", b"first")]))
    foreign_shard(src / ".part-1.tar", tar_bytes([("b.txt", b"second")]))  # hidden: refused by read_manifest
    assert data_prep(["manifest", str(src)]) == 2
    captured = capsys.readouterr()
    assert f"bad shard file://{src}/.part-1.tar: name '.part-1.tar': a file name in the stream folder cannot " \
           "begin with '.'" in captured.out
    assert not (src / "manifest.json").exists()

    assert data_prep(["manifest", str(src), "--skip-bad"]) == 0
    manifest = read_manifest(str(src))  # what `manifest` reported as ready, training reads
    assert [s["name"] for s in manifest["shards"]] == ["part-0.tar"]
    assert manifest["foreign"]["shards_skipped"] == 1
    assert [s["txt"] for shard in load_shards(str(src)) for s in read_shard(shard)] == ["first"]


# ---- compressed shards: decompressed as a stream, up to a limit --------------------------------------------

def gzip_bomb(path, tar_mib: int) -> None:
    """A .tar.gz of one sample whose text is ``tar_mib`` MiB of 'a': ~1000 times smaller than its tar."""
    foreign_shard(path, gzip.compress(tar_bytes([("bomb.txt", b"a" * (tar_mib << 20))]), 9))


def test_a_gzip_shard_is_decompressed_only_up_to_the_limit(tmp_path, capsys):
    src = tmp_path / "sentences"
    gzip_bomb(src / "bomb.tar.gz", 16)
    foreign_shard(src / "fine.tar", tar_bytes([("ok.txt", b"fine")]))
    assert (src / "bomb.tar.gz").stat().st_size < 64 << 10

    # data_prep manifest reads shards as training will: with the same limit (--max-shard-mb).
    assert data_prep(["manifest", str(src), "--max-shard-mb", "1"]) == 2
    assert (f"bad shard file://{src}/bomb.tar.gz: too_large: the tar inside is larger than 1 MiB "
            "(data.max_shard_mb)") in capsys.readouterr().out
    assert data_prep(["manifest", str(src), "--max-shard-mb", "32"]) == 0

    # Training, limited to 1 MiB: refused after decompressing little more than the limit, not the 16 MiB.
    bomb = next(s for s in load_shards(str(src), max_bytes=1 << 20) if s.url.endswith(".tar.gz"))
    tracemalloc.start()
    with pytest.raises(ShardError, match=re.escape(f"{bomb.url}: too_large: the tar inside is larger than 1 MiB")):
        list(read_shard(bomb))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, peak
    skipped = collections.Counter()
    assert [s["txt"] for shard in load_shards(str(src), max_bytes=1 << 20) for s in read_shard(shard, True, skipped)
            ] == ["fine"]
    assert skipped == {"too_large": 1}
    # Within the limit it is read whole, as before.
    assert len(next(read_shard(load_shards(str(src), max_bytes=32 << 20)[0]))["txt"]) == 16 << 20


def test_an_uncompressed_shard_over_the_limit_is_refused_before_it_is_read(tmp_path):
    url = f"file://{tmp_path}/sentences"
    write_samples(url, tmp_path, [{"lang": "en"}] * 3)
    (shard,) = load_shards(url, max_bytes=1024)
    storage.delete(shard.url)  # never read: its listed size decides
    with pytest.raises(ShardError, match=re.escape(f"{shard.url}: too_large: {shard.size} bytes, more than 1024 bytes "
                                                   "(data.max_shard_mb)")):
        list(read_shard(shard))


def run_in_capped_memory(code: str, cap: int = 1 << 30) -> subprocess.CompletedProcess:
    """``python -c code`` in a process of its own whose address space is capped: a read that took a whole
    /dev/zero or sparse file fails there with MemoryError, instead of taking the test machine's memory."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))


def test_a_shard_without_its_size_listed_is_read_only_up_to_the_limit(tmp_path):
    """A manifest need not list a shard's ``bytes``; what it names may be no file at all (a device), whose
    size says nothing. Reading stops one chunk past the limit, for training and for data_prep manifest."""
    stream = tmp_path / "sentences"
    stream.mkdir()
    (stream / "manifest.json").write_text(json.dumps({"format": "clsys-shards/1", "stream": "sentences", "samples": 1,
                                                      "shards": [{"name": "file:///dev/zero", "samples": 1,
                                                                  "sha256": "0" * 64}]}))
    read = run_in_capped_memory(f"""
from clsys.shards.reader import load_shards, read_shard
(shard,) = load_shards({str(stream)!r}, max_bytes=1 << 20)
try:
    list(read_shard(shard))
except Exception as err:
    print(type(err).__name__, err)
""")
    assert read.stdout.strip() == "ShardError file:///dev/zero: too_large: more than 1 MiB (data.max_shard_mb) stored"

    # data_prep manifest reads a listed shard the same way: a 64 GiB sparse file is refused, not read whole.
    src = tmp_path / "foreign"
    foreign_shard(src / "big.tar", b"")
    os.truncate(src / "big.tar", 64 << 30)
    indexed = run_in_capped_memory(f"from data_prep.__main__ import main; main(['manifest', {str(src)!r}, "
                                   "'--max-shard-mb', '1'])")
    assert (f"bad shard file://{src}/big.tar: too_large: more than 1 MiB (data.max_shard_mb) stored"
            in indexed.stdout), indexed.stderr[-2000:]


# ---- sparse members: not regular files ---------------------------------------------------------------------

def gnu_sparse(name: str, stored: bytes, claimed: int) -> bytes:
    """A GNU sparse member (type 'S', written byte by byte) storing ``stored`` but claiming a file of
    ``claimed`` bytes: tarfile reports a regular file of ``claimed`` bytes starting at the stored data."""
    info = tarfile.TarInfo(name)
    info.type, info.size = tarfile.GNUTYPE_SPARSE, len(stored)
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[386:410] = b"%011o\0%011o\0" % (0, len(stored))  # one region: the stored bytes at offset 0
    header[483:495] = b"%011o\0" % claimed  # the "real" size
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + stored + bytes(-len(stored) % 512)


def pax_sparse(name: str, stored: bytes, claimed: int) -> bytes:
    """The same through PAX records (GNU sparse format 0.1): a type '0' member that tarfile marks sparse."""
    info = tarfile.TarInfo(name)
    info.size = len(stored)
    info.pax_headers = {"GNU.sparse.map": f"0,{len(stored)}", "GNU.sparse.realsize": str(claimed)}
    return info.tobuf(tarfile.PAX_FORMAT) + stored + bytes(-len(stored) % 512)


@pytest.mark.parametrize("sparse", [gnu_sparse, pax_sparse])
def test_a_sparse_member_cannot_pull_the_next_members_into_a_text(tmp_path, capsys, sparse):
    src = tmp_path / "sentences"
    # A foreign shard: its .pickle member is skipped unread, unless a sparse text claims its bytes.
    after = tar_bytes([("a.pickle", b"cos\nsystem\n(S'touch pwned'\ntR."), ("b.txt", b"second")])[:-len(END)]
    claimed = 5 + 512 + 512  # its own data's block, the pickle's header and data
    foreign_shard(src / "part-0.tar", sparse("a.txt", b"first", claimed) + after + END)
    assert data_prep(["manifest", str(src)]) == 2
    assert f"bad shard file://{src}/part-0.tar: corrupt: member a.txt is a sparse file, not a regular file" \
        in capsys.readouterr().out

    data = (src / "part-0.tar").read_bytes()
    shard = Shard(f"file://{src}/part-0.tar", 2, hashlib.sha256(data).hexdigest(), len(data), text_member="txt")
    with pytest.raises(ShardError, match="corrupt: member a.txt is a sparse file, not a regular file"):
        print([s["txt"] for s in read_shard(shard)])


# ---- manifest fields ---------------------------------------------------------------------------------------

def manifest_with(tmp_path, shard: dict, **top) -> str:
    """A stream folder whose manifest lists one shard, ``shard``'s fields replacing a valid entry's."""
    url = tmp_path / "sentences"
    url.mkdir(exist_ok=True)
    entry = {"name": "x.tar", "samples": 1, "bytes": 1536, "sha256": "0" * 64, **shard}
    (url / "manifest.json").write_text(json.dumps({
        "format": "clsys-shards/1", "stream": "sentences", "samples": 1, "shards": [entry], **top}))
    return f"file://{url}"


BAD_ENTRIES = [  # (the entry's changed fields, what the error says after the manifest's URL)
    ({"bytes": None}, "'shards[0].bytes' (shard 'x.tar') is null; expected a whole number >= 0"),
    ({"bytes": "abc"}, "'shards[0].bytes' (shard 'x.tar') is \"abc\"; expected a whole number >= 0"),
    ({"bytes": -1}, "'shards[0].bytes' (shard 'x.tar') is -1; expected a whole number >= 0"),
    ({"bytes": 1.5}, "'shards[0].bytes' (shard 'x.tar') is 1.5; expected a whole number >= 0"),
    ({"samples": True}, "'shards[0].samples' (shard 'x.tar') is true; expected a whole number >= 0"),
    ({"sha256": "abc"}, "'shards[0].sha256' (shard 'x.tar') is \"abc\"; expected 64 lowercase hex digits"),
    ({"sha256": None}, "'shards[0].sha256' (shard 'x.tar') is null; expected 64 lowercase hex digits"),
    ({"name": None}, "'shards[0].name' is null; expected a string"),
    ({"name": "x\0.tar"}, "'shards[0].name' is 'x\\x00.tar': a shard name cannot be empty or hold control characters"),
    ({"name": "file:///tmp/x\0.tar"},
     "'shards[0].name' is 'file:///tmp/x\\x00.tar': a shard name cannot be empty or hold control characters"),
    ({"name": ""}, "'shards[0].name' is '': a shard name cannot be empty or hold control characters"),
    ({"name": ".."}, "'shards[0].name' is '..': a file name in the stream folder cannot begin with '.'"),
]


@pytest.mark.parametrize("entry, says", BAD_ENTRIES)
def test_every_shard_field_is_checked_naming_manifest_shard_and_field(tmp_path, entry, says):
    url = manifest_with(tmp_path, entry)
    with pytest.raises(StorageError) as raised:
        load_shards(url)  # what training calls first, in the driver and in every loader
    assert str(raised.value) == f"{url}/manifest.json: manifest field {says}"


@pytest.mark.parametrize("top, says", [
    ({"foreign": {"text_member": "json"}}, "manifest field 'foreign.text_member' is 'json': name the extension"),
    ({"foreign": {"text_member": ""}}, "manifest field 'foreign.text_member' is '': name the extension"),
    ({"tokenizer": {"name": "t", "fingerprint": "f", "max_tokens": True}},
     "manifest field 'tokenizer.max_tokens' is true; expected a whole number >= 0"),
])
def test_other_manifest_fields_are_checked(tmp_path, top, says):
    url = manifest_with(tmp_path, {}, **top)
    with pytest.raises(StorageError, match=re.escape(f"{url}/manifest.json: {says}")):
        load_shards(url)


# ---- one shard, listed once ---------------------------------------------------------------------------------

def test_a_manifest_cannot_list_one_shard_twice(tmp_path):
    """Each duplicate would come twice in every epoch: in contrastive training, a false negative. A shard's
    other names: its URL (the stream's names are file names in its folder), that URL spelled otherwise, a
    symbolic link; and a copy of it: the same sha256."""
    url = f"file://{tmp_path}/sentences"
    write_samples(url, tmp_path, [{"lang": "en"}] * 3)
    entry = read_manifest(url)["shards"][0]
    folder, name, sha = tmp_path / "sentences", entry["name"], entry["sha256"]
    os.symlink(folder / name, folder / "link.tar")
    shutil.copy(folder / name, folder / "copy.tar")
    for other, how in [(name, f"both are {url}/{name}"), (f"{url}/{name}", f"both are {url}/{name}"),
                       (f"file://{folder}//./{name}", f"both are {url}/{name}"), ("link.tar", f"both are {url}/{name}"),
                       ("copy.tar", f"both hold sha256 {sha}")]:
        (folder / "manifest.json").write_text(json.dumps({"format": "clsys-shards/1", "stream": "sentences",
                                                          "samples": 6, "shards": [entry, {**entry, "name": other}]}))
        with pytest.raises(StorageError) as err:
            load_shards(url)
        assert str(err.value) == (f"{url}/manifest.json: shards[1] ({other!r}) is shards[0] ({name!r}) again ({how}): "
                                  "every epoch would hold its samples twice")


def test_the_manifest_command_lists_a_copied_shard_once(tmp_path, capsys):
    src = tmp_path / "sentences"
    foreign_shard(src / "a.tar", tar_bytes([("k.txt", b"text")]))
    shutil.copy(src / "a.tar", src / "b.tar")
    sha = hashlib.sha256((src / "a.tar").read_bytes()).hexdigest()
    assert data_prep(["manifest", str(src)]) == 2
    assert (f"bad shard file://{src}/b.tar: shards[1] ('b.tar') is shards[0] ('a.tar') again (both hold sha256 {sha}): "
            "every epoch would hold its samples twice") in capsys.readouterr().out
    assert data_prep(["manifest", str(src), "--skip-bad"]) == 0
    assert [s["name"] for s in read_manifest(str(src))["shards"]] == ["a.tar"]
    assert read_manifest(str(src))["foreign"]["shards_skipped"] == 1


# ---- names from data in messages: clipped; a URL's secrets: never printed --------------------------------

@pytest.mark.timeout(60)  # each message quoting 1 MiB names took minutes (storage.redact scanned it)
@pytest.mark.parametrize("long_part", ["key", "extension"])
def test_a_long_member_name_is_clipped_in_messages(tmp_path, capsys, long_part):
    """A PAX header can give a member a name of any length: 1 MiB of it in a 2 KB .tar.gz. Each message
    quoting it stays one short line that still names the shard."""
    long = "k" * (1 << 20)
    member = tarfile.TarInfo(f"{long}.bin" if long_part == "key" else f"k.{long}")
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(member, io.BytesIO())
    src = tmp_path / "sentences"
    foreign_shard(src / "long.tar.gz", gzip.compress(data.getvalue(), 9))
    assert (src / "long.tar.gz").stat().st_size < 2 << 10

    assert data_prep(["manifest", str(src)]) == 2  # as a foreign shard: its sample has no .txt
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "bad shard" in line]
    assert line.startswith(f"data_prep manifest: bad shard file://{src}/long.tar.gz: sample k") and len(line) < 1000
    assert "(1,048,576 characters)" in line, line[:1000]

    stored = (src / "long.tar.gz").read_bytes()  # as a data_prep stream's: a member that is not txt/json/ids
    shard = Shard(f"file://{src}/long.tar.gz", 1, hashlib.sha256(stored).hexdigest(), len(stored))
    with pytest.raises(ShardError) as err:
        list(read_shard(shard))
    assert str(err.value).startswith(f"{shard.url}: unsafe: sample k") and len(str(err.value)) < 1000


@pytest.mark.timeout(60)
def test_a_long_shard_name_is_clipped_in_manifest_errors(tmp_path):
    url = manifest_with(tmp_path, {"name": "sub/" + "x" * (1 << 20)})
    with pytest.raises(StorageError) as err:
        load_shards(url)
    assert str(err.value).startswith(f"{url}/manifest.json: manifest field 'shards[0].name' is 'sub/xxx")
    assert "(1,048,580 characters)" in str(err.value) and len(str(err.value)) < 1000


@pytest.mark.parametrize("secret_url", ["http://T0KEN-as-user@127.0.0.1:9/x.tar",
                                        "http://127.0.0.1:9/x.tar?token=BEARER-1234",
                                        "http://" + "T0KEN-" * 50 + "@127.0.0.1:9/x.tar"])  # long enough to be clipped
def test_a_shard_error_never_prints_a_secret_of_its_url(tmp_path, secret_url):
    """A manifest may name a shard by a URL that carries a token: errors about the shard name it redacted
    (``clsys.storage.redact``), as StorageError does. Too large to be read, it is refused unread."""
    url = manifest_with(tmp_path, {"name": secret_url, "bytes": 2 << 20})
    (shard,) = load_shards(url, max_bytes=1 << 20)
    with pytest.raises(ShardError) as err:
        list(read_shard(shard))
    message = str(err.value)
    assert message.startswith("http://") and "127.0.0.1:9/x.tar" in message
    assert message.endswith(": too_large: 2097152 bytes, more than 1 MiB (data.max_shard_mb)")
    assert "T0KEN" not in message and "BEARER" not in message, message


# ---- sample metadata, per stream kind ----------------------------------------------------------------------

def clir_record(**changes) -> dict:
    sample = record(1)
    sample["sides"][0].update(changes)
    return sample


GOOD = {"sentences": {"lang": "en"}, "documents": {"lang": "en", "page_id": 7},
        "triplets": {"anchor": "a", "positive": "p", "negative": "n"}, "clir": record(2)}
BAD_METAS = [  # (stream kind, the middle sample's json, the reason given)
    ("sentences", [], "json is a list, not an object"),
    ("documents", [], "json is a list, not an object"),
    ("documents", {"lang": 5}, "json.lang is a number, not a string"),
    ("triplets", {"anchor": "a", "positive": "p"}, "json has no 'negative'"),
    ("triplets", {"anchor": "a", "positive": "p", "negative": None}, "json.negative is null, not a string"),
    ("clir", {"not_sides": 1}, "json has no 'pair_id'"),
    ("clir", {**record(1), "sides": record(1)["sides"][:1]}, "json.sides has 1 item, expected 2"),
    ("clir", clir_record(sentences=[]), "json.sides[0].sentences has 0 items, expected at least 1"),
    ("clir", clir_record(hard_negatives=[1]), "json.sides[0].hard_negatives[0] is a number, not a string"),
]


@pytest.mark.parametrize("kind, meta, says", BAD_METAS)
def test_a_sample_without_its_streams_fields_is_bad_data(tmp_path, kind, meta, says):
    url = f"file://{tmp_path}/{kind}"
    keys = write_samples(url, tmp_path, [GOOD[kind], meta, GOOD[kind]])
    (shard,) = load_shards(url, kind=kind)
    with pytest.raises(ShardError, match=re.escape(f"{shard.url}: missing_fields: sample {keys[1]}: {says}")):
        list(read_shard(shard))
    skipped = collections.Counter()
    assert [s["__key__"] for s in read_shard(shard, True, skipped)] == [keys[0], keys[2]]
    assert skipped == {"missing_fields": 1}


def test_a_foreign_stream_has_no_fields_for_triplets(tmp_path):
    src = tmp_path / "triplets"
    foreign_shard(src / "part-0.tar", tar_bytes([("a.txt", b"anchor only")]))
    assert data_prep(["manifest", str(src)]) == 0
    (shard,) = load_shards(str(src), kind="triplets")
    with pytest.raises(ShardError, match=r"missing_fields: sample a: json has no 'anchor' \(a foreign stream's "
                                         r"samples have no metadata"):
        list(read_shard(shard))


@pytest.mark.parametrize("on_bad_sample", ["error", "skip"])
def test_the_objectives_loader_checks_its_streams_fields_before_collate(tiny_bert_with_heads, tmp_path,
                                                                        on_bad_sample):
    """CLIR's real collate in a loader worker: a record without ``sides`` is bad data named by shard and
    sample (error), or counted (skip); it never reaches ``clir_example`` (a KeyError naming neither)."""
    root = f"file://{tmp_path}/shards"
    keys = write_samples(storage.join(root, "clir", "en-de"), tmp_path, [record(i) for i in range(4)] + [
        {"not_sides": 1}] + [record(i) for i in range(5, 8)], prefix="en-de")
    cfg = load_config("clir", [f"model.name={tiny_bert_with_heads}", "data.max_length=64", f"data.url={root}",
                               "train.batch_size=2", "cluster.num_workers=1", f"data.on_bad_sample={on_bad_sample}"])
    objective = CLIR(cfg, load_tokenizer(tiny_bert_with_heads))
    loader = stream_loader(cfg, objective.streams(cfg)[0], 0, 1, objective.data)
    if on_bad_sample == "error":
        with pytest.raises(ShardError, match=re.escape(f"shard-000000.tar: missing_fields: sample {keys[4]}: "
                                                       "json has no 'pair_id'")):
            list(zip(range(4), loader))  # the epoch's 4 planned batches
        return
    epoch = []
    for batch in loader:
        if loader.state_dict()["epoch"]:
            break
        epoch.append(batch)
    assert len(epoch) == 3  # 7 good samples
    assert sum(batch["data_skipped"].get("missing_fields", 0) for batch in epoch) == 1
    assert all(batch["qlm_input_ids"].shape[0] == 2 for batch in epoch)
