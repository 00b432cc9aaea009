"""Shard format 2 (``clsys/shards/blocks.py``): blocks of records written by ``ShardWriter(block_records=N)``
and read back record by record; what other tools (webdataset, Hugging Face datasets, Ray Data) make of them;
hostile blocks and manifests refused or counted; the loader's exact and elastic resume over a format 2 stream."""
from __future__ import annotations

import collections
import contextlib
import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
import tracemalloc
from typing import Iterator

import pytest

from clsys import storage
from clsys.data.streaming import ShardLoader
from clsys.shards.blocks import MAX_BLOCK_RECORDS, Record
from clsys.shards.reader import ShardError, load_shards, read_shard
from clsys.shards.writer import ShardWriter, encode_members
from clsys.storage import StorageError
from data_prep.__main__ import main as data_prep


def make_records(n: int, seed: int = 0, ids: bool = False) -> list[Record]:
    """Records with a field shared by all (lang), one per article (page_id) and text of every kind."""
    rng = random.Random(seed)
    words = ["alpha", "Straße", "北京", "", "  spaced  ", "tab\tin", "ü" * 40, "naïve", "\u2028sep", "end."]
    records = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(0, 12)))
        row = [rng.randrange(30000) for _ in range(rng.randrange(0, 20))] if ids else None
        records.append(Record(text, {"lang": "en", "page_id": i // 7, "score": rng.random()}, row))
    return records


def write(url: str, tmp_path, records: list[Record], block_records: int = 16, max_bytes: int = 1 << 30,
          shuffle_window: int = 0) -> ShardWriter:
    writer = ShardWriter(url, str(tmp_path), max_bytes, shuffle_window=shuffle_window, block_records=block_records)
    for start in range(0, len(records), 5):  # a few records a call, as data_prep wiki hands an article's
        writer.write_records(records[start:start + 5])
    writer.close()
    writer.write_manifest({})
    return writer


def read_all(url: str, **kwargs) -> list[dict]:
    return [s for shard in load_shards(url) for s in read_shard(shard, **kwargs)]


def as_records(samples: list[dict]) -> list[Record]:
    return [Record(s["txt"], s["json"], s.get("ids")) for s in samples]


@pytest.mark.parametrize("ids", [False, True])
def test_records_read_back_in_order_with_their_metadata_and_ids(tmp_path, ids):
    records = make_records(300, ids=ids)
    url = str(tmp_path / "sentences")
    writer = write(url, tmp_path, records, block_records=16, max_bytes=8 * 1024)
    manifest = json.loads((tmp_path / "sentences" / "manifest.json").read_text())
    assert manifest["format"] == "clsys-shards/2" and manifest["samples"] == 300 == writer.samples
    assert len(manifest["shards"]) > 2  # shards roll over at block boundaries
    assert sum(s["blocks"] for s in manifest["shards"]) == 19  # 18 blocks of 16 records, then 12
    samples = read_all(url)
    assert as_records(samples) == records
    assert [s["__key__"] for s in samples] == [f"{i // 16:09d}/{i % 16}" for i in range(300)]
    # A field equal across a block is stored once; the others as columns.
    first = storage.read_bytes(storage.join(url, "shard-000000.tar"))
    meta = json.loads(first[first.index(b'{"columns"'):].split(b"\0", 1)[0])
    assert meta["constant"] == {"lang": "en"} and set(meta["columns"]) == {"page_id", "score"}


def test_the_shuffle_window_shuffles_records_and_blocks_are_cut_from_it(tmp_path):
    records = make_records(200)
    url = str(tmp_path / "s")
    write(url, tmp_path, records, block_records=32, shuffle_window=10**9)
    shuffled = as_records(read_all(url))
    assert shuffled != records and sorted(shuffled, key=records.index) == records
    again = str(tmp_path / "again" / "s")  # the stream's name is part of the seed
    write(again, tmp_path, records, block_records=32, shuffle_window=10**9)
    assert as_records(read_all(again)) == shuffled  # the order depends on the seed and the stream alone


@pytest.mark.parametrize("bad, message", [
    (Record("two\nlines", {}), "line feed"),
    (Record("x", {"other": 1}), "share their fields"),
    (Record("x", {}, [1, 2]), "token ids on some records"),
])
def test_the_writer_refuses_what_a_block_cannot_hold(tmp_path, bad, message):
    writer = ShardWriter(str(tmp_path / "s"), str(tmp_path), 1 << 30, block_records=4)
    with pytest.raises(ValueError, match=message) as err:
        writer.write_records([Record("fine", {}), bad, Record("more", {}), Record("and more", {})])
    assert "block 000000000" in str(err.value) and "record 1" in str(err.value)
    with pytest.raises(TypeError, match="write_records"):
        writer.write("k", "text", {})


def stream_of_blocks(tmp_path, blocks: list[dict[str, bytes]], records: int | None = None,
                     shard_blocks: int | None = None, compress: bool = False) -> str:
    """A format 2 stream of one shard holding ``blocks`` (members by extension), its manifest saying
    ``records`` records and ``shard_blocks`` blocks (by default what the blocks' json say); ``compress``: a .tar.gz."""
    url = str(tmp_path / "hostile")
    data = b"".join(encode_members(f"{i:09d}", members) for i, members in enumerate(blocks)) + bytes(1024)
    data += bytes(-len(data) % 10240)
    name = "shard-000000.tar.gz" if compress else "shard-000000.tar"
    if compress:
        data = gzip.compress(data, 9)
    storage.write_bytes(storage.join(url, name), data)
    counted = sum(map(json_records, blocks))
    shard = {"name": name, "samples": counted if records is None else records, "bytes": len(data),
             "sha256": hashlib.sha256(data).hexdigest(), "blocks": len(blocks) if shard_blocks is None else shard_blocks}
    storage.write_json(storage.join(url, "manifest.json"), {"format": "clsys-shards/2", "stream": "hostile",
                                                            "shards": [shard], "samples": shard["samples"]})
    return url


def json_records(members: dict[str, bytes]) -> int:
    try:
        return json.loads(members["json"])["records"]
    except (KeyError, ValueError, TypeError):
        return 0


def block(texts: list[str], **meta) -> dict[str, bytes]:
    fields = {"records": len(texts), "constant": {}, "columns": {}, **meta}
    return {"txt": "\n".join(texts).encode(), "json": json.dumps(fields).encode()}


GOOD = block(["one", "two"])


@pytest.mark.parametrize("bad, detail", [
    ({"txt": b"one\ntwo\nthree", "json": GOOD["json"]}, "its txt has 3 lines, its json says 2 records"),
    (block(["a", "b"], columns={"page_id": [1]}), "column 'page_id' is not a list of 2 values"),
    (block(["a", "b"], constant=[]), "'constant' and 'columns' objects"),
    ({**block(["a", "b"], ids_lengths=[1, 1]), "ids": b"\0" * 4}, "holds 4 bytes, 'ids_lengths' says 2 int32 ids"),
    ({**block(["a", "b"]), "ids": b"\0" * 8}, "needs 'ids_lengths'"),
    (block(["a", "b"], ids_lengths=[1, -1]), "an ids member needs"),
])
def test_a_block_whose_members_disagree_is_one_bad_sample(tmp_path, bad, detail):
    url = stream_of_blocks(tmp_path, [GOOD, bad, GOOD])
    with pytest.raises(ShardError, match="undecodable: block 000000001: ") as err:
        read_all(url)
    assert detail in str(err.value) and "hostile/shard-000000.tar" in str(err.value)
    skipped = collections.Counter()
    assert [s["txt"] for s in read_all(url, skipped=skipped)] == ["one", "two", "one", "two"]
    assert skipped == {"undecodable": 1}


@pytest.mark.parametrize("blocks, records, shard_blocks, detail", [
    ([GOOD, GOOD], 5, None, "its blocks hold 4 records, the manifest says 5"),
    ([GOOD, GOOD], None, 3, "2 blocks, the manifest says 3"),
    ([GOOD, {"txt": b"x", "json": b"{\"records\": 0}"}], 2, None, "block 000000001: its json is not a block's"),
    ([GOOD, {"txt": b"x", "json": b"[1"}], 2, None, "block 000000001: "),
    ([GOOD, {"txt": b"x"}], 2, None, "block 000000001 has no .json member"),
])
def test_a_shard_whose_blocks_do_not_add_up_is_bad_whole(tmp_path, blocks, records, shard_blocks, detail):
    url = stream_of_blocks(tmp_path, blocks, records, shard_blocks)
    with pytest.raises(ShardError, match="corrupt: ") as err:
        read_all(url)
    assert detail in str(err.value)
    skipped = collections.Counter()
    assert read_all(url, skipped=skipped) == [] and skipped == {"corrupt": 1}


def test_a_record_without_its_kinds_fields_is_left_out_alone(tmp_path):
    """documents' ``lang``, when present, must be a string: record 1 of the block breaks it."""
    url = stream_of_blocks(tmp_path, [block(["a", "b", "c"], columns={"lang": ["en", 3, "de"]})])
    shards = load_shards(url, "documents")
    with pytest.raises(ShardError, match=r"missing_fields: sample 000000000/1: json.lang is a number, not a string"):
        list(read_shard(shards[0]))
    skipped = collections.Counter()
    assert [s["txt"] for s in read_shard(shards[0], skipped=skipped)] == ["a", "c"] and skipped == {"missing_fields": 1}


def test_a_format_2_manifest_names_a_shard_without_its_block_count(tmp_path):
    url = stream_of_blocks(tmp_path, [GOOD])
    manifest = storage.read_json(storage.join(url, "manifest.json"))
    del manifest["shards"][0]["blocks"]
    storage.write_json(storage.join(url, "manifest.json"), manifest)
    with pytest.raises(StorageError, match=r"manifest field 'shards\[0\].blocks' \(shard 'shard-000000.tar'\) is missing"):
        load_shards(url)
    manifest["format"] = "clsys-shards/3"
    storage.write_json(storage.join(url, "manifest.json"), manifest)
    with pytest.raises(StorageError, match="manifest format is 'clsys-shards/3', expected one of clsys-shards/1, "
                                           "clsys-shards/2"):
        load_shards(url)


# ---- a block's records: bounded in number and in decoded size, built one at a time -------------------------

@contextlib.contextmanager
def peak_memory() -> Iterator[list[int]]:
    """A list that holds, once the ``with`` block has ended (raising or not), the most bytes Python held at
    once inside it (tracemalloc)."""
    peak: list[int] = []
    tracemalloc.start()
    try:
        yield peak
    finally:
        peak.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def test_a_block_counting_more_records_than_a_block_holds_is_refused_unbuilt(tmp_path):
    """A record can take one byte of a block (an empty text is a line feed): 4,000,000 of them in an 8 KB
    .tar.gz took 1.86 GiB of a loader worker before its first record. 1,000,000 here: refused as the shard is
    checked, naming the shard, the block and the count, with none built."""
    count = 1_000_000
    meta = {"records": count, "constant": {"lang": "en"}, "columns": {}}
    url = stream_of_blocks(tmp_path, [{"txt": b"\n" * (count - 1), "json": json.dumps(meta).encode()}], compress=True)
    assert os.path.getsize(tmp_path / "hostile" / "shard-000000.tar.gz") < 8 << 10
    with peak_memory() as peak, pytest.raises(ShardError) as err:
        read_all(url)
    assert str(err.value) == (f"{storage.join(url, 'shard-000000.tar.gz')}: corrupt: block 000000000: its json counts "
                              f"1,000,000 records, more than a block holds ({MAX_BLOCK_RECORDS:,})")
    assert peak[0] < 8 << 20, peak  # the 1 MB tar and its text; the records, built, took ~400 MB


def test_a_blocks_records_are_built_as_they_are_read(tmp_path):
    """A full block (the most records a block holds, 20 constant fields each): its first record comes
    before the others are built, so a reader holds no more records than its consumer keeps (a loader's
    shuffle buffer)."""
    constant = {f"field_{i}": i for i in range(20)}
    texts = [f"record {i}" for i in range(MAX_BLOCK_RECORDS)]
    (shard,) = load_shards(stream_of_blocks(tmp_path, [block(texts, constant=constant)]))
    samples = read_shard(shard)
    with peak_memory() as peak:
        first = next(samples)
    assert first == {"__key__": "000000000/0", "txt": "record 0", "json": constant}
    assert peak[0] < 4 << 20, peak  # the block's records, built all at once: ~25 MB
    assert [s["txt"] for s in samples] == texts[1:]


def test_a_block_whose_records_decode_past_the_limit_is_too_large(tmp_path):
    """Every record gets its own copy of its block's constant fields: 1,000 records sharing 2 KiB of them
    take 2 MB decoded, from a block of 4 KiB, past a 1 MiB data.max_shard_mb that its tar is far within."""
    hostile = block(["x"] * 1000, constant={"note": "n" * 2048})
    url = stream_of_blocks(tmp_path, [GOOD, hostile])
    (shard,) = load_shards(url, max_bytes=1 << 20)
    decoded = sum(map(len, hostile.values())) + 999 * len('{"note":""}' + "n" * 2048)
    with pytest.raises(ShardError) as err:
        list(read_shard(shard))
    assert str(err.value) == (f"{shard.url}: too_large: block 000000001: its 1,000 records take {decoded:,} bytes "
                              "decoded (every one its own copy of the block's constant fields), more than 1 MiB "
                              "(data.max_shard_mb)")
    skipped = collections.Counter()
    assert list(read_shard(shard, skipped=skipped)) == [] and skipped == {"too_large": 1}
    assert len(list(read_shard(load_shards(url, max_bytes=4 << 20)[0]))) == 1002  # within a larger limit


def test_the_writer_writes_no_block_the_reader_refuses(tmp_path):
    with pytest.raises(ValueError, match=f"block_records {MAX_BLOCK_RECORDS + 1:,}: a block holds at most "
                                         f"{MAX_BLOCK_RECORDS:,} records"):
        ShardWriter(str(tmp_path / "s"), str(tmp_path), 1 << 30, block_records=MAX_BLOCK_RECORDS + 1)
    writer = ShardWriter(str(tmp_path / "s"), str(tmp_path), 1 << 30, block_records=1)
    with pytest.raises(ValueError, match=f"block 000000000: a block holds at most {MAX_BLOCK_RECORDS:,} records, "
                                         f"not {MAX_BLOCK_RECORDS + 1:,}"):
        writer.write_block([Record("x", {})] * (MAX_BLOCK_RECORDS + 1))


# ---- format 2 shards under a format 1 manifest: each block would be one sample of many texts ---------------

def test_format_2_shards_are_neither_indexed_nor_read_as_format_1(tmp_path, capsys):
    url = f"file://{tmp_path}/sentences"
    write(url, tmp_path, make_records(40), block_records=16)  # blocks of 16, 16 and 8 records
    says = ("sample 000000000 is a block of 16 records of clsys-shards/2, which a clsys-shards/1 manifest reads as one "
            "sample: read these shards with the manifest data_prep wrote with them")
    # data_prep manifest (--out: their own manifest is beside them) indexes other tools' shards, not these.
    assert data_prep(["manifest", url, "--out", f"file://{tmp_path}/indexed/sentences"]) == 2
    assert f"bad shard {url}/shard-000000.tar: {says}" in capsys.readouterr().out
    # A format 1 manifest over them, a data_prep stream's or a foreign one's: refused by the reader.
    manifest = storage.read_json(f"{url}/manifest.json")
    (shard,) = manifest["shards"]
    v1_shard = {"name": shard["name"], "samples": 3, "bytes": shard["bytes"], "sha256": shard["sha256"]}
    for foreign in ({}, {"foreign": {"text_member": "txt"}}):
        storage.write_json(f"{url}/manifest.json", {**manifest, "format": "clsys-shards/1", "samples": 3, **foreign,
                                                    "shards": [v1_shard]})
        with pytest.raises(ShardError) as err:
            read_all(url)
        assert str(err.value) == f"{url}/shard-000000.tar: corrupt: {says}"


# ---- other tools read format 2 shards as plain WebDataset tars: a sample is a block ----------------------

@pytest.fixture(scope="module")
def blocked_stream(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blocks")
    records = make_records(100, ids=True)
    write(str(tmp / "sentences"), tmp, records, block_records=32, max_bytes=4096)
    return tmp / "sentences", records


def split(key: str, txt: str, meta: dict) -> list[tuple[str, str, int]]:
    """(key, text, page_id) of a block's records, split with str and json alone, as a user's code would."""
    columns = {**{k: [v] * meta["records"] for k, v in meta["constant"].items()}, **meta["columns"]}
    return [(f"{key}/{i}", text, columns["page_id"][i]) for i, text in enumerate(txt.split("\n"))]


def expected(records: list[Record]) -> list[tuple[str, str, int]]:
    return [(f"{i // 32:09d}/{i % 32}", r.text, r.meta["page_id"]) for i, r in enumerate(records)]


def test_webdataset_reads_blocks(blocked_stream):
    import webdataset as wds

    folder, records = blocked_stream
    shards = sorted(str(p) for p in folder.glob("shard-*.tar"))
    dataset = wds.WebDataset(shards, shardshuffle=False).decode()
    got = [row for sample in dataset for row in split(sample["__key__"], sample["txt"], sample["json"])]
    assert got == expected(records)


def test_hugging_face_datasets_reads_blocks(blocked_stream):
    from datasets import load_dataset

    folder, records = blocked_stream
    shards = sorted(str(p) for p in folder.glob("shard-*.tar"))
    dataset = load_dataset("webdataset", data_files={"train": shards}, split="train", streaming=True)
    got = [row for sample in dataset for row in split(sample["__key__"], sample["txt"], sample["json"])]
    assert got == expected(records)


RAY_DATA = """
import json, sys
import ray
ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
rows = ray.data.read_webdataset(sys.argv[1:], decoder=None).take_all()
print(json.dumps([[r["__key__"], r["txt"].decode(), r["json"].decode()] for r in rows]))
"""


def test_ray_data_reads_blocks(blocked_stream):
    """In a process of its own: a driver connected to a local Ray cluster on 127.0.0.1, as a user's is."""
    folder, records = blocked_stream
    shards = sorted(str(p) for p in folder.glob("shard-*.tar"))
    result = subprocess.run([sys.executable, "-c", RAY_DATA, *shards], capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = sorted(json.loads(result.stdout.strip().splitlines()[-1]))
    assert [r for key, txt, meta in rows for r in split(key, txt, json.loads(meta))] == expected(records)


# ---- the loader: records are its samples, so exact and elastic resume hold over blocks --------------------

def keys_of(samples: list[dict]) -> dict:
    return {"keys": [s["__key__"] for s in samples]}


def loader(url: str, ranks: int, rank: int, workers: int = 2, batch: int = 8) -> ShardLoader:
    return ShardLoader(url, rank, ranks, batch, keys_of, seed=3, loader_workers=workers, shuffle_buffer=20)


def test_exact_and_elastic_resume_over_blocks(tmp_path):
    url = str(tmp_path / "sentences")
    write(url, tmp_path, make_records(700), block_records=16, max_bytes=4096)
    assert len(load_shards(url)) >= 8

    def run(ranks: int, steps: int, states: list[dict] | None = None) -> tuple[list[list[str]], list[dict]]:
        loaders = [loader(url, ranks, r) for r in range(ranks)]
        for r, state in enumerate(states or []):
            loaders[r].load_state_dict(state)
        iterators = [iter(x) for x in loaders]
        batches = [[k for it in iterators for k in next(it)["keys"]] for _ in range(steps)]
        return batches, [x.state_dict() for x in loaders]

    whole, _ = run(2, 12)
    first, states = run(2, 5)
    rest, _ = run(2, 7, states)
    assert first + rest == whole  # exact: the same batches after a restart
    # Elastic: 2 ranks for 5 steps, then 1 rank: no record of the epoch read twice.
    elastic, _ = run(1, 6, [states[0]])
    seen = [k for batch in first + elastic for k in batch]
    assert len(seen) == len(set(seen))
