"""data_prep: the bundled real Wikipedia dump through the real CLI, a real moto S3 server, no mocks."""
from __future__ import annotations

import bz2
import gzip
import itertools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from clsys import storage
from clsys.data.sentences import SplitStats, count_words, counted_sentences, pack_passages, split_sentences
from clsys.shards.manifest import read_manifest
from clsys.shards.reader import load_shards, read_shard
from clsys.shards.writer import ShardWriter
from data_prep.dumps import SiteInfo
from data_prep.wikitext import WikitextCleaner

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data_prep" / "samples" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
STREAMS = ("sentences", "documents")


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data_prep", "wiki", *map(str, args)], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def sample_xml() -> bytes:
    return bz2.decompress(SAMPLE.read_bytes())


def small_dump(xml: bytes, first_page: int, n_pages: int) -> bytes:
    """A valid dump with the sample's header and ``n_pages`` of its pages, starting at ``first_page``."""
    head, *pages = xml.split(b"  <page>")
    body = b"".join(b"  <page>" + p for p in pages[first_page:first_page + n_pages])
    return head + body.split(b"</mediawiki>")[0] + b"</mediawiki>\n"


def read_blocks(folder: Path, manifest: dict) -> list[dict[str, bytes]]:
    """Every tar sample of a local stream (format 2: blocks), checking tar contents against the manifest."""
    samples = []
    for shard in manifest["shards"]:
        path = folder / shard["name"]
        data = path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert len(data) == shard["bytes"]
        with tarfile.open(path) as tar:
            members = tar.getmembers()
            assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 for m in members)
            by_key: dict[str, dict[str, bytes]] = {}
            for m in members:
                key, ext = m.name.split(".", 1)
                by_key.setdefault(key, {"__key__": key})[ext] = tar.extractfile(m).read()
        assert len(by_key) == shard["blocks"]
        samples.extend(by_key.values())
    return samples


def records(block: dict[str, bytes]) -> list[dict[str, bytes]]:
    """A format 2 block's records as format 1 samples were: txt and json bytes, the key ``BLOCK/i``; read here
    with json and str alone, as a user's own code would."""
    meta = json.loads(block["json"])
    texts = block["txt"].decode().split("\n")
    assert len(texts) == meta["records"] and set(meta) == {"records", "constant", "columns"}
    assert all(len(column) == len(texts) for column in meta["columns"].values())
    return [{"__key__": f"{block['__key__']}/{i}", "txt": text.encode(),
             "json": json.dumps({**meta["constant"], **{k: v[i] for k, v in meta["columns"].items()}}).encode()}
            for i, text in enumerate(texts)]


def read_stream(folder: Path, manifest: dict) -> list[dict[str, bytes]]:
    """Every record of a local format 2 stream, checking tar contents and counts against the manifest."""
    samples = [record for block in read_blocks(folder, manifest) for record in records(block)]
    assert len(samples) == manifest["samples"] == sum(s["samples"] for s in manifest["shards"])
    return samples


def test_wikitext_cleaning():
    text = """{{Infobox person|name=X}}'''Ada Lovelace''' ({{IPA|x}}) was an English [[mathematician|mathematics person]].<ref name="a">{{cite web|url=http://x}}</ref> See [http://example.org her notes] and [http://example.org/bare].
[[File:Ada.jpg|thumb|A portrait of [[Ada]]]]
<!-- hidden comment -->
{| class="wikitable"
|-
| cell one || cell two
|}
She wrote <i>the first</i> <span class="x">algorithm</span> &amp; more.

== Early life ==
Born in [[London]].{{citation needed}}
=== Education ===
She studied <b>maths</b>.<ref>Book.</ref>
== See also ==
* [[Charles Babbage]]
== References ==
{{reflist}}
[[Category:Mathematicians]]
[[de:Ada Lovelace]]
"""
    sections = WikitextCleaner().sections(text)
    assert [s.heading for s in sections] == ["", "Early life", "Early life > Education"]
    lead = " ".join(sections[0].paragraphs)
    assert lead == ("Ada Lovelace was an English mathematics person. See her notes and. "
                    "She wrote the first algorithm & more.")
    assert sections[1].paragraphs == ["Born in London."]
    assert sections[2].paragraphs == ["She studied maths."]
    everything = " ".join(p for s in sections for p in s.paragraphs)
    for gone in ("Infobox", "cite", "portrait", "cell", "comment", "Babbage", "Mathematicians", "reflist", "de:", "http"):
        assert gone not in everything


def test_localized_dump_names():
    de = WikitextCleaner(media_prefixes=("file", "datei"), category_prefixes=("category", "kategorie"))
    sections = de.sections("Berlin ist eine Stadt.[[Datei:B.jpg|Bild]]\n== Geschichte ==\nAlt.\n"
                           "== Einzelnachweise ==\n<references />\n== Weblinks ==\n* x\n[[Kategorie:Stadt]]")
    assert [(s.heading, s.paragraphs) for s in sections] == [("", ["Berlin ist eine Stadt."]), ("Geschichte", ["Alt."])]
    assert SiteInfo(dbname="dewiki").lang == "de"
    assert SiteInfo(dbname="zh_yuewiki").lang == "zh-yue"
    assert SiteInfo(base="https://fr.wikipedia.org/wiki/Accueil").lang == "fr"


def test_sentences_filter_and_passages():
    stats = SplitStats()
    sentences = split_sentences("en", "Dr. Smith went to Washington on Monday. Yes. " + "word " * 300 + ".", stats)
    assert sentences == ["Dr. Smith went to Washington on Monday."]
    assert (stats.too_short, stats.too_long) == (1, 1)
    sentences = ["one two three.", "four five.", "six seven eight nine."]
    passages = pack_passages([(s, count_words(s)) for s in sentences], max_words=5)
    assert [p.text for p in passages] == ["one two three. four five.", "six seven eight nine."]
    assert [p.n_words for p in passages] == [5, 4]
    assert pack_passages([("a b c d e f g.", 7)], max_words=3)[0].n_words == 7  # never cut a sentence
    text = "Dr. Smith went to Washington on Monday. Tiny. 北京是中华人民共和国的首都。"
    counted = counted_sentences("zh", text, SplitStats())
    assert counted == [(s, count_words(s)) for s in split_sentences("zh", text, SplitStats())] and len(counted) == 2


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("wiki") / "out"
    result = run_cli("--input", SAMPLE, "--out", f"file://{out}", "--shard-size-mb", "0.5", "--workers", "2")
    assert result.returncode == 0, result.stderr
    return out, result


def test_bundled_dump_to_local(sample_run):
    out, result = sample_run
    for stream in STREAMS:
        manifest = read_manifest(f"file://{out / stream}")
        assert manifest["format"] == "clsys-shards/2" and manifest["stream"] == stream
        assert manifest["languages"] == ["en"]
        (source,) = manifest["sources"]
        assert source["file"] == SAMPLE.name and source["status"] == "complete" and source["byte_offset"] is None
        assert (source["pages_read"], source["articles"], source["lang"]) == (206, 106, "en")
        assert manifest["skipped"]["redirect"] == 100
        assert len(manifest["shards"]) > 1  # 0.5 MiB shards roll over
        assert all(s["bytes"] <= 0.5 * 2**20 for s in manifest["shards"])
        samples = read_stream(out / stream, manifest)
        assert len(samples) == manifest["samples"]
        assert sorted(os.listdir(out / stream)) == sorted([s["name"] for s in manifest["shards"]] + ["manifest.json"])
        keys = [s["__key__"] for s in samples]
        assert len(set(keys)) == len(keys)
        for sample in samples:
            assert set(sample) == {"__key__", "txt", "json"}
            meta = json.loads(sample["json"])
            assert meta["lang"] == "en" and isinstance(meta["page_id"], int)
            assert sample["txt"].decode().strip()
            if stream == "documents":
                assert meta["n_chars"] == len(sample["txt"].decode()) and {"title", "section"} <= set(meta)
            else:  # a sentence names its article; titles and headings are the documents stream's
                assert set(meta) == {"lang", "page_id"}
    sentences = read_stream(out / "sentences", read_manifest(f"file://{out / 'sentences'}"))
    texts = {s["txt"].decode() for s in sentences}
    assert any("Anarchism is a political philosophy" in t for t in texts)
    assert not any("{{" in t or "[[" in t or "<ref" in t for t in texts)
    assert {json.loads(s["json"])["page_id"] for s in sentences} >= {12, 25}  # Anarchism, Autism
    assert "pages read: 206, articles: 106" in result.stdout


def test_webdataset_reads_shards(sample_run):
    import webdataset as wds

    out, _ = sample_run
    manifest = read_manifest(f"file://{out / 'documents'}")
    first = next(iter(wds.WebDataset(str(out / "documents" / manifest["shards"][0]["name"]), shardshuffle=False)))
    ours = read_blocks(out / "documents", manifest)[0]
    assert set(first) >= {"__key__", "txt", "json"}
    assert (first["__key__"], first["txt"], first["json"]) == (ours["__key__"], ours["txt"], ours["json"])


def test_tar_writer_headers_read_back(tmp_path):
    """ShardWriter builds ustar headers itself (tarfile.addfile was most of its time): tarfile parses them
    (checksum included) to the fields written, for edge sizes and non-ASCII names, and reads a shard back."""
    from clsys.shards.writer import ShardWriter, ustar_header

    for name, size in [("a.txt", 0), ("en-1-00000.json", 1), ("ü-é-名前.txt", 511), ("x" * 100, 512), ("k.txt", 8**11 - 1)]:
        info = tarfile.TarInfo.frombuf(ustar_header(name, size), "utf-8", "surrogateescape")
        assert (info.name, info.size, info.mode, info.uid, info.gid, info.mtime, info.type, info.uname) == \
               (name, size, 0o644, 0, 0, 0, tarfile.REGTYPE, "")
    with pytest.raises(ValueError, match="longer than 100 bytes"):
        ustar_header("é" * 51, 1)
    samples = [(f"en-{i}-00000", "text " * i + "é", {"title": "Ü" * i}) for i in range(40)]
    writer = ShardWriter(str(tmp_path / "out"), str(tmp_path), 1 << 30)
    for sample in samples:
        writer.write(*sample)
    writer.close()
    with tarfile.open(tmp_path / "out" / "shard-000000.tar") as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar]
    assert members == [member for key, text, meta in samples
                       for member in ((f"{key}.json", json.dumps(meta, ensure_ascii=False, sort_keys=True).encode()),
                                      (f"{key}.txt", text.encode()))]
    assert writer.shards[0].bytes % tarfile.RECORDSIZE == 0


def test_shard_writer_shuffle_window(tmp_path):
    """Samples are written in a seeded order within each window of --shuffle-window-mb, never across windows."""
    from clsys.shards.writer import ShardWriter

    def written(window_samples: int, seed: int) -> list[str]:
        out = tmp_path / f"w{window_samples}-s{seed}"
        # Each sample is 2 KiB in tar: a header and a padded block for each of its .json and .txt.
        writer = ShardWriter(str(out), str(tmp_path), 1 << 30, shuffle_window=2048 * window_samples, seed=seed)
        for i in range(100):
            writer.write(f"k{i:03d}", "x" * 10, {})
        assert writer.samples == 100  # held-back samples count too
        writer.close()
        with tarfile.open(out / "shard-000000.tar") as tar:
            return [m.name.removesuffix(".txt") for m in tar if m.name.endswith(".txt")]

    inputs = [f"k{i:03d}" for i in range(100)]
    keys = written(30, 0)
    assert keys != inputs and sorted(keys) == inputs
    for start in (0, 30, 60, 90):  # windows of 30, 30, 30 and the last 10
        assert sorted(keys[start:start + 30]) == inputs[start:start + 30]
    assert written(30, 0) == keys and written(30, 1) != keys
    assert written(0, 0) == inputs  # no window: input order


def test_default_shuffle_mixes_articles(sample_run, tmp_path):
    """The default window holds the whole sample: the first 64 sentences come from many articles, where
    --shuffle-window-mb 0 (article order) gives two or three; the samples themselves are the same."""
    out, _ = sample_run
    ordered = tmp_path / "ordered"
    result = run_cli("--input", SAMPLE, "--out", ordered, "--shard-size-mb", "0.5", "--shuffle-window-mb", "0")
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(f"file://{out / 'sentences'}")
    assert manifest["shuffle"] == {"window_mb": 64.0, "seed": 0}
    assert read_manifest(f"file://{ordered / 'sentences'}")["shuffle"] == {"window_mb": 0.0, "seed": 0}
    for stream in STREAMS:
        shuffled, in_order = ([(s["txt"], json.loads(s["json"])["page_id"]) for s in read_stream(folder / stream,
                               read_manifest(f"file://{folder / stream}"))] for folder in (out, ordered))
        assert sorted(shuffled) == sorted(in_order)
        articles = [len({page for _, page in records[:64]}) for records in (shuffled, in_order)]
        assert articles[0] >= 30 and articles[1] <= 3, (stream, articles)


def test_gzip_shards_hold_the_same_records(sample_run, tmp_path):
    """--compress gzip: .tar.gz shards whose tars are the plain run's, byte for byte, in fewer bytes; training
    reads the same records; a re-run reproduces every shard."""
    out, _ = sample_run
    for attempt in ("first", "again"):
        result = run_cli("--input", SAMPLE, "--out", tmp_path / "gz", "--shard-size-mb", "0.5", "--compress", "gzip")
        assert result.returncode == 0, result.stderr
    assert result.stdout.count("(0 uploaded") == 2  # both streams' shards: identical, upload skipped
    for stream in STREAMS:
        plain, packed = (read_manifest(f"file://{folder / stream}") for folder in (out, tmp_path / "gz"))
        assert [s["name"] for s in packed["shards"]] == [s["name"] + ".gz" for s in plain["shards"]]
        for p, z in zip(plain["shards"], packed["shards"]):
            data = (tmp_path / "gz" / stream / z["name"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == z["sha256"] and len(data) == z["bytes"] < p["bytes"] / 2
            assert gzip.decompress(data) == (out / stream / p["name"]).read_bytes()
        records = [(s["__key__"], s["txt"], s["json"]) for folder in (out, tmp_path / "gz")
                   for shard in load_shards(f"file://{folder / stream}") for s in read_shard(shard)]
        assert records[:len(records) // 2] == records[len(records) // 2:]


def test_idempotent_rerun(sample_run, tmp_path):
    out, _ = sample_run
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    mtimes = {p: p.stat().st_mtime_ns for p in before if p.suffix == ".tar"}
    result = run_cli("--input", SAMPLE, "--out", out, "--shard-size-mb", "0.5")  # plain path, 1 worker
    assert result.returncode == 0, result.stderr
    after = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert after == before
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # shards were not even rewritten
    assert "upload skipped" in result.stderr and "0 uploaded" in result.stdout


def test_s3_output(s3_bucket, sample_xml, tmp_path):
    dump = tmp_path / "small.xml.bz2"
    dump.write_bytes(bz2.compress(small_dump(sample_xml, 0, 20)))
    out = f"{s3_bucket}/wiki/v1"
    small = run_cli("--input", dump, "--out", out, "--shard-size-mb", "0.05")
    assert small.returncode == 0, small.stderr
    assert len(read_manifest(f"{out}/sentences")["shards"]) > 2
    result = run_cli("--input", dump, "--out", out)  # bigger shards: the old ones must go
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(f"{out}/sentences")
    assert len(manifest["shards"]) == 1
    assert [u.rsplit("/", 2)[-2:] for u in storage.list_prefix(out)] == [
        ["documents", "manifest.json"], ["documents", "shard-000000.tar"],
        ["sentences", "manifest.json"], ["sentences", "shard-000000.tar"]]
    shard = storage.read_bytes(storage.join(f"{out}/sentences", manifest["shards"][0]["name"]))
    assert hashlib.sha256(shard).hexdigest() == manifest["shards"][0]["sha256"]
    local = tmp_path / "shard.tar"
    local.write_bytes(shard)
    with tarfile.open(local) as tar:
        names = tar.getnames()
    first = names[0].removesuffix(".json")
    assert names[:2] == [f"{first}.json", f"{first}.txt"] and len(names) == 2 * manifest["shards"][0]["blocks"]
    assert read_manifest(f"{out}/documents")["samples"] > 0


def test_utf16_and_multistream_match_utf8(sample_xml, tmp_path):
    xml = small_dump(sample_xml, 0, 12)
    inputs = {
        "utf8.xml": xml,
        "utf16.xml": xml.decode("utf-8").encode("utf-16"),  # with BOM
        # Multistream: two bz2 streams back to back, split in the middle of the text.
        "multi.xml.bz2": bz2.compress(xml[: len(xml) // 2]) + bz2.compress(xml[len(xml) // 2:]),
    }
    texts = {}
    for name, data in inputs.items():
        (tmp_path / name).write_bytes(data)
        out = tmp_path / f"out-{name}"
        result = run_cli("--input", tmp_path / name, "--out", out)
        assert result.returncode == 0, (name, result.stderr)
        texts[name] = [s["txt"] for s in read_stream(out / "sentences", read_manifest(str(out / "sentences")))]
    assert len(texts["utf8.xml"]) > 100
    assert texts["utf16.xml"] == texts["utf8.xml"] == texts["multi.xml.bz2"]


def test_truncated_bz2(tmp_path):
    data = SAMPLE.read_bytes()
    half = tmp_path / "half.xml.bz2"
    half.write_bytes(data[: len(data) // 2])
    result = run_cli("--input", half, "--out", tmp_path / "out")
    assert result.returncode == 3
    assert str(half) in result.stderr and f"byte {len(data) // 2}" in result.stderr
    assert "Traceback" not in result.stderr
    manifest = read_manifest(str(tmp_path / "out" / "sentences"))
    (source,) = manifest["sources"]
    assert source["status"] == "truncated" and source["error"] and source["byte_offset"] == len(data) // 2
    assert 0 < source["pages_read"] < 206 and manifest["samples"] > 0
    ok = run_cli("--input", half, "--out", tmp_path / "out2", "--allow-truncated")
    assert ok.returncode == 0 and "warning" in ok.stderr
    assert read_manifest(str(tmp_path / "out2" / "sentences"))["samples"] == manifest["samples"]


def test_corrupt_bz2(tmp_path, sample_xml):
    data = bytearray(bz2.compress(small_dump(sample_xml, 0, 40)))
    middle = len(data) // 2
    data[middle:middle + 32] = bytes(b ^ 0xFF for b in data[middle:middle + 32])
    bad = tmp_path / "corrupt.xml.bz2"
    bad.write_bytes(bytes(data))
    result = run_cli("--input", bad, "--out", tmp_path / "out")
    assert result.returncode == 3, result.stderr
    assert f"{bad}: corrupt bz2 data" in result.stderr and "reading stopped at byte" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("kind", ["not_a_dump", "not_xml", "empty", "missing", "no_articles"])
def test_unusable_input_exits_2(kind, tmp_path, sample_xml):
    path = tmp_path / f"{kind}.xml"
    if kind == "not_a_dump":
        path.write_text('<?xml version="1.0"?><rss><channel><title>x</title></channel></rss>')
    elif kind == "not_xml":
        path.write_bytes(b"\x00\x01 binary junk, certainly not XML \xff\xfe")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "no_articles":  # only redirects
        path.write_bytes(small_dump(sample_xml, 0, 1))
    out = tmp_path / "out"
    result = run_cli("--input", path, "--out", out)
    assert result.returncode == 2, result.stderr
    assert str(path) in result.stderr and "error" in result.stderr and "Traceback" not in result.stderr
    assert not list(out.rglob("manifest.json"))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _inputs_inside_their_output(command: str, tmp: Path, sample_xml: bytes) -> tuple[list[str], str, str]:
    """(the command's arguments, its --out, one input) where an input lies in a folder the command writes to,
    --out spelled otherwise than that input (file://, "/.", "//")."""
    out = tmp / "out"
    if command == "wiki":  # writes OUT/sentences and OUT/documents
        dump = out / "sentences" / "enwiki-latest-pages-articles.xml"
        dump.parent.mkdir(parents=True)
        dump.write_bytes(small_dump(sample_xml, 0, 20))
        return ["--input", str(dump)], f"{out}/.", str(dump)
    if command == "align":  # writes OUT/clir/<A>-<B>
        pair = out / "clir" / "en-de"
        shutil.copytree(ROOT / "tests" / "data" / "clir", pair)
        dumps = [f"{lang}={pair / f'{lang}wiki-20261101-pages-articles.xml.bz2'}" for lang in ("en", "de")]
        links = pair / "enwiki-20261101-langlinks.sql.gz"
        return ["--dumps", *dumps, "--langlinks", f"en={links}"], f"file://{out}", dumps[0][3:]
    if command == "triplets":  # writes OUT/triplets
        nli = out / "triplets" / "snli_dev.head150.csv"
        nli.parent.mkdir(parents=True)
        shutil.copy(ROOT / "tests" / "data" / "nli" / nli.name, nli)
        return ["--input", str(nli)], f"{tmp}//out", str(nli)
    # tokenizer: writes its files to OUT itself, here the folder holding the stream it reads
    stream = out / "sentences"
    writer = ShardWriter(str(stream), str(tmp), 1 << 20)
    for i in range(120):  # sentencepiece trains on no fewer than 100
        writer.write(f"en-1-{i:05d}", f"Sentence number {i} of the stream, in words.", {"lang": "en", "page_id": 1})
    writer.close()
    writer.write_manifest({"languages": ["en"]})
    return ["--input", str(stream), "--vocab-size", "40"], f"file://{out}/", str(stream)


@pytest.mark.parametrize("command", ["wiki", "align", "triplets", "tokenizer"])
def test_no_command_writes_where_it_reads(command, tmp_path, sample_xml, capsys):
    """An --out whose streams hold an input (or that is one), however spelled, is refused before anything is
    written: a writer replaces the shards and deletes the manifest of the folder it writes to."""
    from data_prep.__main__ import main as data_prep

    args, out, an_input = _inputs_inside_their_output(command, tmp_path, sample_xml)
    before = _files(tmp_path)
    assert data_prep([command, *args, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"data_prep {command}: error: --out {out}: ") and an_input in err, err
    assert _files(tmp_path) == before


def test_s3_missing_bucket(s3_server, tmp_path):
    result = run_cli("--input", SAMPLE, "--out", "s3://no-such-bucket-here/x")
    assert result.returncode == 2
    assert "s3://no-such-bucket-here/x" in result.stderr and "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_s3_wrong_credentials(s3_auth_server, sample_xml, tmp_path):
    dump = tmp_path / "small.xml"
    dump.write_bytes(small_dump(sample_xml, 0, 3))
    env = {"AWS_ENDPOINT_URL": s3_auth_server["endpoint"], "AWS_ACCESS_KEY_ID": s3_auth_server["access_key_id"],
           "AWS_SECRET_ACCESS_KEY": s3_auth_server["secret_access_key"], "AWS_DEFAULT_REGION": "us-east-1"}
    out = f"{s3_auth_server['bucket_url']}/wiki"
    assert run_cli("--input", dump, "--out", out, env=env).returncode == 0  # right key: works
    result = run_cli("--input", dump, "--out", out, env={**env, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert result.returncode == 2
    assert out in result.stderr and "credentials" in result.stderr and "Traceback" not in result.stderr


def test_encoded_samples_write_the_same_shards(tmp_path):
    """Samples encoded elsewhere (encode_sample, as data_prep wiki's workers do) and handed to write_encoded in
    runs (an article's, here 1 to 17 samples, some across a window's end) give the bytes, shuffle order and
    shard roll-over of ShardWriter.write with each sample's fields."""
    from clsys.shards.writer import encode_sample, ShardWriter

    samples = [(f"en-{i}-{i % 7:05d}", "Satz é " * (i % 50), {"title": "Ü" * (i % 5), "page_id": i},
                {"ids": bytes(range(i % 256))} if i % 3 == 0 else None) for i in range(300)]
    shards = {}
    for how in ("write", "write_encoded"):
        writer = ShardWriter(str(tmp_path / how / "s"), str(tmp_path), 60_000, shuffle_window=100_000, seed=5)
        if how == "write":
            for key, text, meta, extra in samples:
                writer.write(key, text, meta, extra)
        else:
            encoded = [encode_sample(*sample) for sample in samples]
            starts = list(itertools.accumulate(i % 17 + 1 for i in range(300)))
            for start, end in zip([0] + starts, starts):
                writer.write_encoded(encoded[start:end])
        writer.close()
        assert len(writer.shards) > 3 and writer.samples == 300
        shards[how] = [(p.name, p.read_bytes()) for p in sorted((tmp_path / how / "s").iterdir())]
    assert shards["write_encoded"] == shards["write"]
