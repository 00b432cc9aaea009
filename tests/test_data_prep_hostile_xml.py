"""data_prep wiki given a hostile dump: a DOCTYPE whose entities would expand without bound ("billion laughs"),
read a local file into the shards (an external entity), or inject text. MediaWiki dumps never carry a DOCTYPE,
so any is refused before anything is parsed after it or written: the real CLI on crafted bz2 dumps (plain and
multistream), in a child process held to 1 GiB of address space and a time limit."""
from __future__ import annotations

import bz2
import resource
import subprocess
import sys

import pytest

from test_data_prep import ROOT
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


def run_bounded(*args: object) -> subprocess.CompletedProcess:
    """The real CLI, in a child limited to MEMORY_BYTES of address space and 60 seconds."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    return subprocess.run([sys.executable, "-m", "data_prep", "wiki", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, preexec_fn=limit)


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
