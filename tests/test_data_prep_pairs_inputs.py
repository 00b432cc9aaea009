"""``python -m data_prep pairs`` on inputs that used to stop it or be refused: JSON nested deeper than the parser
recurses (a JSONL line, a CSV cell of negatives) is a bad row like any other, in real worker processes; gzip
and zstd compressed JSONL, CSV and TSV read as the plain files do, in parts, their line numbers counted as a
plain file's; a truncated one is named in one line, or counted as unreadable with ``--skip-bad``."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from clsys.shards.manifest import read_manifest
from data_prep.pairs import read as pairs_read
from test_data_prep_pairs import FORMATS, GOOD, expected, read_stream, run

REPO = Path(__file__).resolve().parents[1]
DEEP = "[" * 100_000 + "]" * 100_000  # 200 KB: far deeper than Python's recursion limit


def data_prep(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data_prep", "pairs", *map(str, argv)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)


def test_json_nested_too_deep_is_a_bad_row(tmp_path):
    """A JSONL line holding a 100,000-deep list as a value, one that is nothing else, and a CSV cell of negatives
    holding one: each an error naming its line without --skip-bad (one line, no traceback), counted with it;
    an old manifest as deep in the output is replaced as any unreadable one is."""
    jsonl, table = tmp_path / "a.jsonl", tmp_path / "b.csv"
    jsonl.write_text(GOOD + '{"query": "q", "positive": "p", "neg": ' + DEEP + "}\n" + DEEP + "\n")
    table.write_text(f"query,positive,negatives\ngood,p,[]\nq,p,{DEEP}\n")
    for path, message in ((jsonl, ":2: not JSON: nested too deeply"),
                          (table, ":3: column 'negatives': is not a JSON list of strings: nested too deeply")):
        result = data_prep("--input", path, "--out", tmp_path / "out")
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if "error" in line]  # the rest: the progress bar
        assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert errors[0].startswith(f"data_prep pairs: error: {path}{message}") and len(errors[0]) < 500, errors
    # An old manifest where a stream goes, nested as deep: unreadable, so replaced (the run reads it first).
    (tmp_path / "out" / "pairs" / "a").mkdir(parents=True)
    (tmp_path / "out" / "pairs" / "a" / "manifest.json").write_text(DEEP)
    result = data_prep("--input", jsonl, table, "--out", tmp_path / "out", "--skip-bad", "--workers", 2)
    assert result.returncode == 0, result.stderr[-2000:]
    for source, reason, skipped in (("a", "bad_line", 2), ("b", "wrong_type", 1)):
        counts = read_manifest(str(tmp_path / "out" / "pairs" / source))["counts"]
        assert (counts["pairs"], counts["skipped"][reason]) == (1, skipped)


COMPRESSIONS = {".gz": gzip.compress, ".zst": zstandard.ZstdCompressor().compress}
TEXT_FORMATS = ("jsonl", "csv", "tsv")
BAD_ROW = {"jsonl": '{"query": 7, "positive": "p"}\n', "csv": "x,y\n", "tsv": "x\ty\n"}
BAD_ROW_ERROR = {"jsonl": "column 'query': is a number, not a string", "csv": "2 fields, the header has",
                 "tsv": "2 fields, the header has"}


def compressed_input(folder: Path, fmt: str, suffix: str, bad_row: bool = False) -> tuple[Path, list, int]:
    """``FORMATS[fmt]``'s rows as ``<fmt><suffix>.<ext><suffix>`` (its source: ``<fmt><suffix>`` less the dot);
    with ``bad_row``, a bad row after them. Returns the file, its rows, and the bad row's line."""
    name, write, rows = FORMATS[fmt]
    plain = folder / name
    write(plain, rows)
    text = plain.read_bytes()
    plain.unlink()
    if bad_row:
        text += BAD_ROW[fmt].encode()
    path = folder / f"{fmt}-{suffix[1:]}{Path(name).suffix}{suffix}"
    path.write_bytes(COMPRESSIONS[suffix](text))
    return path, rows, text.count(b"\n")


def test_compressed_text_inputs_read_as_plain_ones(tmp_path, capsys, monkeypatch):
    """.jsonl, .csv and .tsv compressed with gzip or zstd, cut into parts of a few lines (``PART_BYTES`` 64, a
    quoted CSV record spanning lines included) dealt to two worker processes: each stream holds its file's rows
    in order, and a bad row after them is named by its line as in the plain file."""
    monkeypatch.setattr(pairs_read, "PART_BYTES", 64)
    inputs = {(fmt, suffix): compressed_input(tmp_path, fmt, suffix) for fmt in TEXT_FORMATS for suffix in COMPRESSIONS}
    out = tmp_path / "out"
    code, _, err = run(capsys, "--input", *(path for path, _, _ in inputs.values()), "--out", out,
                       "--shuffle-window-mb", 0, "--workers", 2)
    assert code == 0, err
    for (fmt, suffix), (path, rows, _) in inputs.items():
        source = f"{fmt}-{suffix[1:]}"
        # Each worker's shards hold its parts' rows in order: sorted, as worker 1's shards follow worker 0's.
        assert sorted(read_stream(str(out / "pairs" / source)), key=json.dumps) == sorted(expected(rows, source),
                                                                                       key=json.dumps), path
    assert [i["bytes"] for i in read_manifest(str(out / "pairs" / "jsonl-gz"))["inputs"]] == [
        path.stat().st_size for path, _, _ in inputs.values()]
    for fmt in ("jsonl", "csv"):
        for suffix in COMPRESSIONS:
            bad = tmp_path / "bad"
            bad.mkdir(exist_ok=True)
            path, _, line = compressed_input(bad, fmt, suffix, bad_row=True)
            code, _, err = run(capsys, "--input", path, "--out", tmp_path / "out-bad")
            assert code == 2
            assert f"data_prep pairs: error: {path}:{line}: {BAD_ROW_ERROR[fmt]}" in err


@pytest.mark.parametrize("suffix", COMPRESSIONS)
def test_a_truncated_compressed_input_is_named_or_counted(suffix, tmp_path, capsys, monkeypatch):
    """A compressed JSONL file (270 KB: zstd blocks hold 128 KiB) cut short (its last 20 bytes gone): an error
    naming the file and the line its readable text ends at; with --skip-bad the rows of the parts before are
    written and the rest counted as one unreadable piece. A compressed Parquet file is refused by name."""
    monkeypatch.setattr(pairs_read, "PART_BYTES", 16384)
    rows = "".join(json.dumps({"query": f"query {i}", "positive": f"positive {i}"}) + "\n" for i in range(6000))
    path = tmp_path / f"cut.jsonl{suffix}"
    path.write_bytes(COMPRESSIONS[suffix](rows.encode())[:-20])
    code, _, err = run(capsys, "--input", path, "--out", tmp_path / "out")
    assert code == 2
    errors = [line for line in err.splitlines() if "error" in line]  # the rest: the progress bar
    assert len(errors) == 1 and errors[0].startswith(f"data_prep pairs: error: {path}:"), err
    assert errors[0].endswith(": cannot read: the file ends before its compressed data does (truncated?)")
    code, _, err = run(capsys, "--input", path, "--out", tmp_path / "out", "--skip-bad")
    assert code == 0, err
    counts = read_manifest(str(tmp_path / "out" / "pairs" / "cut"))["counts"]
    assert 0 < counts["pairs"] < 6000 and counts["skipped"]["unreadable"] == 1
    (tmp_path / "t.parquet.gz").write_bytes(gzip.compress(b"PAR1"))
    code, _, err = run(capsys, "--input", tmp_path / "t.parquet.gz", "--out", tmp_path / "out")
    assert code == 2 and f"{tmp_path / 't.parquet.gz'}: cannot tell the format from the name" in err
