"""data_prep wiki reading a dump in parallel: a Wikimedia multistream dump by bz2 block with its index
(each block read, parsed and encoded by a worker), and the batches a dump without an index is read in
(by a Ray task of its own with --ray). Real dumps made from the bundled sample, the real CLI."""
from __future__ import annotations

import bz2
import html
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from clsys.shards.manifest import read_manifest
from test_data_prep import SAMPLE, STREAMS, read_stream, run_cli, sample_run, sample_xml  # noqa: F401 (fixtures)


def write_multistream(xml: bytes, folder: Path, pages_per_block: int = 7,
                      compress: Callable[[bytes], bytes] = bz2.compress) -> tuple[Path, Path, list[int]]:
    """The dump as Wikimedia writes a multistream one: a header stream (``<siteinfo>``), streams of
    ``pages_per_block`` pages, a closing stream; and its index (``OFFSET:PAGE_ID:TITLE`` per page, bz2).
    Each stream is ``compress``'s bz2 stream of its XML. Returns the dump, the index and the offset of each page
    stream."""
    head, *pages = xml.split(b"  <page>")
    pages = [b"  <page>" + p for p in pages]
    pages[-1], footer = pages[-1].split(b"</mediawiki>")[0], b"</mediawiki>" + pages[-1].split(b"</mediawiki>")[1]
    dump, index, offsets = bytearray(compress(head)), [], []
    for start in range(0, len(pages), pages_per_block):
        offsets.append(len(dump))
        block = pages[start:start + pages_per_block]
        for page in block:
            page_id = int(re.search(rb"<id>(\d+)</id>", page).group(1))  # the page's; revisions' ids come later
            title = html.unescape(re.search(rb"<title>(.*?)</title>", page).group(1).decode())
            index.append(f"{len(dump)}:{page_id}:{title}\n")
        dump += compress(b"".join(block))
    dump += compress(footer)
    dump_path, index_path = folder / "multi-pages-articles-multistream.xml.bz2", folder / "multi-index.txt.bz2"
    dump_path.write_bytes(bytes(dump))
    index_path.write_bytes(bz2.compress("".join(index).encode()))
    return dump_path, index_path, offsets


@pytest.fixture(scope="module")
def multistream(sample_xml, tmp_path_factory):
    return write_multistream(sample_xml, tmp_path_factory.mktemp("multistream"))


def manifests(out: Path) -> dict[str, bytes]:
    return {stream: (out / stream / "manifest.json").read_bytes() for stream in STREAMS}


def test_batches_without_index_are_bounded_and_say_how_reading_ended(sample_xml, tmp_path, monkeypatch):
    """``read_batches`` (what reads a dump without an index, in a Ray task or the main process): every page
    once, in file order, with its skip reason or its task; batches held to BATCH_PAGES pages and
    BATCH_CHARS of articles' text (one longer page alone); a truncated dump's last batch carries the fault."""
    from data_prep import wiki_tasks
    from data_prep.dumps import DumpReader

    monkeypatch.setattr(wiki_tasks, "BATCH_PAGES", 7)
    monkeypatch.setattr(wiki_tasks, "BATCH_CHARS", 60_000)
    whole = [(page.page_id, page.text) for page in DumpReader(str(SAMPLE)).pages()]
    batches = list(wiki_tasks.read_batches(str(SAMPLE), "en", frozenset(), frozenset(), 200))
    pages = [page for batch in batches for page in batch.pages]
    assert [page_id for page_id, _ in pages] == [page_id for page_id, _ in whole]
    assert sum(isinstance(task, str) for _, task in pages) == 100  # the sample's redirects
    for batch in batches:
        texts = [len(task.text) for _, task in batch.pages if not isinstance(task, str)]
        assert len(batch.pages) <= 7 and (sum(texts) <= 60_000 or len(texts) == 1) and batch.fault is None
    assert batches[-1].bytes_read == SAMPLE.stat().st_size and len(batches) > 206 / 7

    cut = tmp_path / "cut.xml.bz2"
    cut.write_bytes(bz2.compress(sample_xml[:len(sample_xml) // 2]))
    batches = list(wiki_tasks.read_batches(str(cut), "en", frozenset(), frozenset(), 200))
    assert all(batch.fault is None for batch in batches[:-1])
    message, offset = batches[-1].fault
    assert "XML ends or breaks early" in message and offset == cut.stat().st_size
    assert 0 < sum(len(batch.pages) for batch in batches) < 206


def test_multistream_index_matches_serial(multistream, sample_run, tmp_path):
    """Reading by bz2 block in 2 processes gives the shards and manifests of reading the dump serially."""
    dump, index, offsets = multistream
    assert len(offsets) == 30 and "Wikipedia:Adding Wikipedia" in bz2.decompress(index.read_bytes()).decode()
    runs = {}
    for name, extra in {"serial": (), "index": ("--index", index, "--workers", "2")}.items():
        result = run_cli("--input", dump, "--out", tmp_path / name, "--shard-size-mb", "0.5", *extra)
        assert result.returncode == 0, result.stderr
        runs[name] = manifests(tmp_path / name)
    assert runs["index"] == runs["serial"]
    sample_out, _ = sample_run  # the same pages from the one-stream sample: the same shards
    for stream in STREAMS:
        by_block, whole = json.loads(runs["index"][stream]), read_manifest(str(sample_out / stream))
        assert by_block["shards"] == whole["shards"] and by_block["skipped"] == whole["skipped"]
        assert by_block["sources"][0]["pages_read"] == 206 and by_block["sources"][0]["status"] == "complete"


def test_multistream_corrupt_block(multistream, tmp_path):
    dump, index, offsets = multistream
    data = bytearray(dump.read_bytes())
    middle = (offsets[14] + offsets[15]) // 2  # inside the 15th page stream (pages 98-104)
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    bad = tmp_path / dump.name
    bad.write_bytes(bytes(data))
    result = run_cli("--input", bad, "--out", tmp_path / "out", "--index", index, "--workers", "2")
    assert result.returncode == 3, result.stderr
    assert f"{bad}: corrupt bz2 data" in result.stderr and f"block at byte {offsets[14]}" in result.stderr
    assert "lost 7 pages" in result.stderr and "Traceback" not in result.stderr
    manifest = read_manifest(str(tmp_path / "out" / "sentences"))
    (source,) = manifest["sources"]
    assert (source["status"], source["byte_offset"], source["pages_lost"], source["pages_read"]) == \
           ("corrupt", offsets[14], 7, 199)
    page_ids = {json.loads(s["json"])["page_id"] for s in read_stream(tmp_path / "out" / "sentences", manifest)}
    lost = {int(line.split(":")[1]) for line in bz2.decompress(index.read_bytes()).decode().splitlines()[98:105]}
    assert page_ids >= {12, 25} and not page_ids & lost and max(page_ids) > max(lost)  # blocks after it are kept
    ok = run_cli("--input", bad, "--out", tmp_path / "out2", "--index", index, "--allow-truncated")
    assert ok.returncode == 0 and "warning" in ok.stderr, ok.stderr
    assert manifests(tmp_path / "out2") == manifests(tmp_path / "out")


@pytest.mark.parametrize("kind", ["offset_off", "malformed", "beyond_end", "page_id", "missing_block"])
def test_multistream_wrong_index(kind, multistream, tmp_path):
    dump, index, offsets = multistream
    lines = bz2.decompress(index.read_bytes()).decode().splitlines(keepends=True)
    n = 30  # 1-based number of the line changed: the 2nd line of the 5th block (lines 29-35)
    offset, page_id, title = lines[n - 1].split(":", 2)
    if kind == "offset_off":  # a whole block shifted by 3 bytes
        lines[28:35] = [line.replace(f"{offset}:", f"{int(offset) + 3}:", 1) for line in lines[28:35]]
        n, expect = 29, "is not the start of a bz2 stream"
    elif kind == "malformed":
        lines[n - 1] = f"{offset} {page_id} {title}"
        expect = "expected OFFSET:PAGE_ID:TITLE"
    elif kind == "beyond_end":
        lines[-7:] = [f"{dump.stat().st_size + 10}:{line.split(':', 1)[1]}" for line in lines[-7:]]
        n, expect = len(lines) - 6, "is beyond the end"
    elif kind == "page_id":
        lines[n - 1] = f"{offset}:{int(page_id) + 1}:{title}"
        expect = f"holds page id {page_id} as its page 2, the index lists {int(page_id) + 1}"
    else:  # the 5th block not listed: its pages would be missing from the output
        del lines[28:35]
        n, expect = 29, "the dump holds a stream the index does not list"
    wrong = tmp_path / "wrong-index.txt"  # a plain-text index works too
    wrong.write_text("".join(lines))
    result = run_cli("--input", dump, "--out", tmp_path / "out", "--index", wrong)
    assert result.returncode == 2, result.stderr
    assert f"error: {wrong}:{n}: " in result.stderr and expect in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not list((tmp_path / "out").rglob("manifest.json"))
