"""data_prep wiki given a hostile dump: a DOCTYPE whose entities would expand without bound ("billion laughs"),
read a local file into the shards (an external entity), or inject text. MediaWiki dumps never carry a DOCTYPE,
so any is refused before anything is parsed after it or written: the real CLI on crafted bz2 dumps (plain and
multistream), in a child process held to 1 GiB of address space and a time limit. And a bz2 "bomb": a few hundred
bytes that decompress to an article of 100 MiB, read in bounded memory and skipped as too long."""
from __future__ import annotations

import bz2
import re
import resource
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from clsys.shards.manifest import read_manifest
from data_prep import bz2_streams, dumps
from data_prep.bz2_streams import index_blocks
from data_prep.dumps import BlockReader, DumpReader, skip_reason
from test_data_prep import ROOT, SAMPLE, sample_xml  # noqa: F401 (a fixture)
from test_data_prep_languages import dump_xml
from test_data_prep_multistream import write_multistream

MARKER = "MARKER-3b9e-SECRET-DO-NOT-LEAK"
MEMORY_BYTES = 1 << 30  # a normal run of the bundled sample fits in this; the laughs below would take ~3 GB
LAUGHS = ("<!ENTITY lol0 \"lollollollollollollollollollol\">"
          + "".join(f"<!ENTITY lol{i} \"{f'&lol{i - 1};' * 10}\">" for i in range(1, 10)))
# name → (the internal subset of <!DOCTYPE mediawiki [...]>, the entity reference put into an article's text)
DOCTYPES = {
    "external_file": ('<!ENTITY xxe SYSTEM "file://{secret}">', "&xxe;"),
    "external_parameter_entity": ('<!ENTITY % xxe SYSTEM "file://{secret}"> %xxe;', ""),
    "billion_laughs": (LAUGHS, "&lol9;"),
    "injected_text": (f'<!ENTITY spam "{MARKER} buy now at example dot com, the best offer.">', "&spam;"),
}
ARTICLES = {"Harmless": "A harmless article comes first, with two sentences of prose. It is kept nowhere.",
            "Target": "The text of this article reads {ref} and then goes on as usual for a while.",
            "After": "Another harmless article follows the one with the entity reference in it."}


def hostile_dump(name: str, secret: str) -> bytes:
    subset, ref = DOCTYPES[name]
    xml = dump_xml({title: text.format(ref=ref) for title, text in ARTICLES.items()}, dbname="enwiki")
    # dump_xml escapes the text ("&" → "&amp;"): put the reference back as a reference
    xml = xml.replace(b"&amp;", b"&")
    doctype = f"<!DOCTYPE mediawiki [{subset.format(secret=secret)}]>\n".encode()
    return b'<?xml version="1.0" encoding="utf-8"?>\n' + doctype + xml


def limit_memory() -> None:
    """In the child (subprocess's preexec_fn): at most MEMORY_BYTES of address space."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def run_bounded(*args: object) -> subprocess.CompletedProcess:
    """The real CLI, in a child limited to MEMORY_BYTES of address space and 60 seconds."""
    return subprocess.run([sys.executable, "-m", "data_prep", "wiki", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, preexec_fn=limit_memory)


@pytest.mark.parametrize("multistream", [False, True], ids=["plain", "multistream"])
@pytest.mark.parametrize("name", list(DOCTYPES))
def test_doctype_refused(tmp_path, name, multistream):
    secret = tmp_path / "secret.txt"
    secret.write_text(f"{MARKER}: a local file the dump must never read\n")
    xml = hostile_dump(name, str(secret))
    if multistream:
        dump, index, _ = write_multistream(xml, tmp_path, pages_per_block=1)
        args = ["--input", dump, "--index", index]
    else:
        dump = tmp_path / "enwiki-20261101-pages-articles.xml.bz2"
        dump.write_bytes(bz2.compress(xml))
        args = ["--input", dump]
    out = tmp_path / "out"
    # --allow-truncated: a dump read "up to a fault" must not pass for a usable one either
    result = run_bounded(*args, "--out", out, "--allow-truncated")
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert f"data_prep wiki: error: {dump}: " in result.stderr and "DOCTYPE" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr, result.stderr
    assert MARKER not in result.stdout + result.stderr
    written = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert written == []  # refused before anything is written


# MediaWiki's own limit on an article's wikitext ($wgMaxArticleSize, 2048 KiB by default), in bytes of UTF-8.
MAX_ARTICLE_BYTES = 2048 * 1024
BOMB = b"@@BOMB@@"  # where the bomb's text goes in its article
BOMB_BYTES = 100 << 20  # of one letter
# The most a run of data_prep wiki over the bomb's dump may grow its peak memory (resident): the bomb's
# text alone is 100 MiB.
GROWTH_LIMIT_KIB = 64 << 10
MEASURED = """import resource, sys
from data_prep.__main__ import main
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = main(sys.argv[1:])
print("peak memory growth:", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, "KiB")
sys.exit(code)
"""


def bomb_stream(xml: bytes) -> bytes:
    """``xml``'s bz2 stream, with BOMB_BYTES of one letter in place of BOMB (compressed a MiB at a time)."""
    if BOMB not in xml:
        return bz2.compress(xml)
    before, after = xml.split(BOMB)
    compressor = bz2.BZ2Compressor()
    parts = [compressor.compress(before)]
    parts += [compressor.compress(b"a" * (1 << 20)) for _ in range(BOMB_BYTES >> 20)]
    return b"".join([*parts, compressor.compress(after), compressor.flush()])


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> tuple[Path, Path]:
    """A multistream dump, a page a bz2 stream, whose article "Bomb" holds BOMB_BYTES of text, and its index. Its
    streams back to back are also a plain .xml.bz2 (read without the index)."""
    articles = {"Harmless": ARTICLES["Harmless"], "Bomb": BOMB.decode(), "After": ARTICLES["After"]}
    dump, index, _ = write_multistream(dump_xml(articles, dbname="enwiki"), tmp_path_factory.mktemp("bomb"), 1,
                                       bomb_stream)
    return dump, index


@pytest.mark.parametrize("multistream", [False, True], ids=["plain", "multistream"])
def test_bz2_bomb_is_read_in_bounded_memory(bomb, multistream, tmp_path):
    """A 611-byte .xml.bz2 was decompressed whole in one call: 600 MiB, a peak of 1.8 GiB. Each call now returns
    a MiB at most, and an article is cut where MediaWiki's limit is certainly passed: skipped, counted as
    page_too_long, the pages after it read as usual. The real CLI, in a child held to 1 GiB of address space."""
    dump, index = bomb
    assert dump.stat().st_size < 4096
    args = ["wiki", "--input", dump, *(["--index", index] if multistream else []), "--out", tmp_path / "out"]
    result = subprocess.run([sys.executable, "-c", MEASURED, *map(str, args)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, preexec_fn=limit_memory)
    assert result.returncode == 0, result.stderr
    growth = int(re.search(r"peak memory growth: (\d+) KiB", result.stdout).group(1))
    assert growth < GROWTH_LIMIT_KIB, growth
    manifest = read_manifest(str(tmp_path / "out" / "sentences"))
    assert manifest["skipped"]["page_too_long"] == 1
    (source,) = manifest["sources"]
    assert (source["status"], source["pages_read"], source["articles"]) == ("complete", 5, 2)  # + redirect, talk


def test_a_page_is_cut_at_mediawikis_limit(tmp_path):
    """2048 KiB of wikitext is the most MediaWiki keeps in an article, counted in bytes: one more is too long."""
    at_limit = "é" * (MAX_ARTICLE_BYTES // 2)  # two bytes each
    articles = {"At the limit": at_limit, "Over it": at_limit + "a", "After": ARTICLES["After"]}
    dump = tmp_path / "enwiki-latest-pages-articles.xml"
    dump.write_bytes(dump_xml(articles, dbname="enwiki"))
    pages = {page.title: page for page in DumpReader(str(dump)).pages()}
    assert pages["At the limit"].text == at_limit and skip_reason(pages["At the limit"]) is None
    assert pages["Over it"].text == "" and skip_reason(pages["Over it"]) == "page_too_long"
    assert pages["After"].text == ARTICLES["After"] and skip_reason(pages["After"]) is None


def test_a_bomb_outside_any_page_ends_the_reading(tmp_path):
    """Between pages there is no page to skip: the dump is read up to it, as a truncated one is."""
    xml = dump_xml({"Harmless": ARTICLES["Harmless"], "After": ARTICLES["After"]}, dbname="enwiki")
    first, rest = xml.split(b"  </page>\n", 1)
    dump = tmp_path / "enwiki-latest-pages-articles.xml"
    dump.write_bytes(first + b"  </page>\n" + b" " * (dumps.MAX_UNMARKED_BYTES + (2 << 20)) + rest)
    pages = DumpReader(str(dump)).pages()
    assert next(pages).title == "Harmless"
    with pytest.raises(bz2_streams.TruncatedDump, match="without an element starting or ending, outside any page"):
        next(pages)


def test_normal_dumps_read_the_same_a_few_kib_at_a_time(sample_xml, tmp_path, monkeypatch):
    """What bounds a bomb changes nothing else: the bundled sample, decompressed 4 KiB at a time (plain, and by
    multistream block), gives the pages ElementTree finds parsing it whole."""
    monkeypatch.setattr(bz2_streams, "OUT_BYTES", 4096)
    expected = []
    for page in ET.fromstring(sample_xml).findall("{*}page"):
        text = [t.text or "" for t in page.findall("{*}revision/{*}text")]
        expected.append((int(page.findtext("{*}id")), page.findtext("{*}title"), text[-1] if text else ""))
    assert len(expected) > 100
    plain = [(p.page_id, p.title, p.text) for p in DumpReader(str(SAMPLE)).pages()]
    assert plain == expected
    dump, index, _ = write_multistream(sample_xml, tmp_path)
    by_block = [(p.page_id, p.title, p.text) for block in index_blocks(str(index), str(dump))
                for p in BlockReader(str(dump), block).pages()]
    assert by_block == expected
