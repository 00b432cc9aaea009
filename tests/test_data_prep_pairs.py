"""``python -m data_prep pairs``: real files of every input format (JSONL, CSV, TSV, Parquet, an Arrow IPC file,
a ``datasets`` save_to_disk folder) → one format 2 stream per source, read back through the project's shard reader
(``clsys.shards.reader``, which checks the ``pairs`` kind's fields); bad rows refused (exit 2, naming file,
line or row, and column) or counted with ``--skip-bad``; exact duplicates dropped; a failed run leaves no
manifest; workers write the pairs one process writes, and S3 output changes nothing (Ray actors:
tests/test_data_prep_ray.py)."""
from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clsys.shards.manifest import read_manifest
from clsys.shards.reader import load_shards, read_shard
from data_prep.pairs import read as pairs_read, rows as pairs_rows
from data_prep.__main__ import main

@dataclass
class Row:
    query: str
    positives: list[str]
    negatives: list[str]
    instruction: str = ""

    def simple(self) -> bool:
        """What a TSV (no quoting) can hold: no tab or line break anywhere, one positive."""
        texts = [self.query, *self.positives, *self.negatives, self.instruction]
        return len(self.positives) == 1 and not any(c in t for t in texts for c in "\t\r\n")


ROWS = [
    Row("what is a cat?", ["A cat is a small feline."], ["A dog barks.", "Fish swim."]),
    Row("spans\ntwo lines", ['It has a "quote", a comma\nand a line break.'], ["neg, with a comma"],
        "Represent this question: "),
    Row("crlf\r\nquery", ["positive of the crlf query"], []),
    Row("猫は何ですか", ["ねこ 🐈 is a cat"], ["犬"]),
    Row("several positives", ["first positive", "second positive"], ["shared negative"]),
    Row("plain and simple", ["simple positive"], ["n1", "n2"]),
]


def one_line(query: str) -> str:
    return query.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")


def expected(rows: list[Row], source: str) -> list[tuple[str, dict]]:
    """The records a stream must hold for ``rows``, in input order: one per positive."""
    return [(one_line(r.query), {"positive": p, "negatives": r.negatives, "source": source,
                                 "instruction": r.instruction}) for r in rows for p in r.positives]


def write_jsonl(path: Path, rows: list[Row]) -> None:
    """FlagEmbedding's layout: pos and neg lists, the instruction as prompt."""
    path.write_text("".join(json.dumps({"query": r.query, "pos": r.positives, "neg": r.negatives,
                                        "prompt": r.instruction}, ensure_ascii=False) + "\n" for r in rows))


def write_csv(path: Path, rows: list[Row], tsv: bool = False) -> None:
    """sentence-transformers' layout: anchor, positive, negative_1 … (an empty cell: no negative)."""
    width = max(len(r.negatives) for r in rows)
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f, delimiter="\t" if tsv else ",", **({"quoting": csv.QUOTE_NONE} if tsv else {}))
        out.writerow(["Anchor", "positive", *(f"negative_{i + 1}" for i in range(width)), "instruction"])
        for r in rows:
            out.writerow([r.query, r.positives[0], *(r.negatives + [""] * (width - len(r.negatives))), r.instruction])


def write_parquet(path: Path, rows: list[Row]) -> None:
    """query, passage, a negatives list column; two rows a row group."""
    table = pa.table({"query": [r.query for r in rows], "passage": [r.positives[0] for r in rows],
                      "negatives": [r.negatives for r in rows], "instruction": [r.instruction for r in rows]})
    pq.write_table(table, path, row_group_size=2)


def write_arrow_file(path: Path, rows: list[Row]) -> None:
    """Arrow's IPC file format (``ARROW1``, what ``pyarrow.feather`` and others write), batches of two rows."""
    table = pa.table({"question": [r.query for r in rows], "pos": [r.positives for r in rows],
                      "neg": [r.negatives for r in rows]})
    with pa.ipc.new_file(str(path), table.schema) as out:
        for batch in table.to_batches(max_chunksize=2):
            out.write_batch(batch)


def write_saved(path: Path, rows: list[Row]) -> None:
    """A Hugging Face datasets folder (``save_to_disk``, two Arrow files): anchor, pos and negatives lists."""
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"anchor": [r.query for r in rows], "pos": [r.positives for r in rows],
                                "negatives": [r.negatives for r in rows], "prompt": [r.instruction for r in rows]}
                               ).save_to_disk(str(path), num_shards=2)


FORMATS = {  # name → (file name, writer, the rows it can hold)
    "jsonl": ("flag.jsonl", write_jsonl, ROWS),
    "csv": ("st.csv", write_csv, [r for r in ROWS if len(r.positives) == 1]),
    "tsv": ("st.tsv", lambda p, rows: write_csv(p, rows, tsv=True), [r for r in ROWS if r.simple()]),
    "parquet": ("table.parquet", write_parquet, [r for r in ROWS if len(r.positives) == 1]),
    "arrow": ("table.arrow", write_arrow_file, [r for r in ROWS if not r.instruction]),
    "saved": ("saved", write_saved, ROWS),
}


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["pairs", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def read_stream(url: str) -> list[tuple[str, dict]]:
    """Every record of a pairs stream, in shard order, through the reader (which checks the kind's fields)."""
    return [(s["txt"], s["json"]) for shard in load_shards(url, "pairs") for s in read_shard(shard)]


def manifests(out: Path) -> list[Path]:
    return sorted(out.rglob("manifest.json"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_back_as_its_rows(fmt, tmp_path, capsys):
    """Columns found by their spellings (FlagEmbedding, sentence-transformers, tables); a query's line breaks
    become spaces (counted); a multi-positive row gives a pair per positive; read back in input order."""
    name, write, rows = FORMATS[fmt]
    write(tmp_path / name, rows)
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "--input", tmp_path / name, "--out", out, "--shuffle-window-mb", 0)
    assert code == 0, err
    source = Path(name).stem
    stream = out / "pairs" / source
    assert read_stream(str(stream)) == expected(rows, source)
    manifest = read_manifest(str(stream))
    assert manifest["format"] == "clsys-shards/2" and manifest["source"] == source
    assert manifest["counts"] == {
        "rows": len(rows), "pairs": sum(len(r.positives) for r in rows), "duplicates": 0,
        "query_line_breaks": sum(one_line(r.query) != r.query for r in rows),
        "skipped": dict.fromkeys(pairs_rows.SKIP_REASONS, 0)}
    assert manifest["inputs"][0]["format"] == ("arrow" if fmt == "saved" else fmt)
    assert f"pairs/{source}: {manifest['samples']} pairs" in stdout


def test_source_column_and_option_split_streams_and_duplicates_are_dropped_per_source(tmp_path, capsys):
    """--source names the default stream, a row's source column overrides it; an exact duplicate (after the
    column mapping: a CSV's row equal to a JSONL's) is dropped within a source, kept in another; a pair that
    differs only in its negatives' order or its instruction is no duplicate."""
    a = {"query": "q", "positive": "p", "negatives": ["n1", "n2"]}
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in [
        a, a, {**a, "negatives": ["n2", "n1"]}, {**a, "instruction": "i"}, {**a, "source": "other"},
        {"query": "q", "pos": ["p", "p", "p2"], "neg": ["n1", "n2"]},  # p again in the row: dropped too
    ]) + "\n")
    (tmp_path / "b.csv").write_text("query,positive,negative,negative_1\nq,p,n1,n2\n")
    code, stdout, err = run(capsys, "--input", tmp_path / "a.jsonl", tmp_path / "b.csv", "--source", "mine",
                            "--out", tmp_path / "out", "--shuffle-window-mb", 0)
    assert code == 0, err
    mine = read_stream(str(tmp_path / "out" / "pairs" / "mine"))
    meta = {"positive": "p", "negatives": ["n1", "n2"], "source": "mine", "instruction": ""}
    assert mine == [("q", meta), ("q", {**meta, "negatives": ["n2", "n1"]}), ("q", {**meta, "instruction": "i"}),
                    ("q", {**meta, "positive": "p2"})]
    assert read_stream(str(tmp_path / "out" / "pairs" / "other")) == [("q", {**meta, "source": "other"})]
    counts = read_manifest(str(tmp_path / "out" / "pairs" / "mine"))["counts"]
    assert (counts["rows"], counts["pairs"], counts["duplicates"]) == (6, 4, 4)
    assert [line.split()[:4] for line in stdout.splitlines()[-3:]] == [
        ["mine", "6", "4", "4"], ["other", "1", "1", "0"], ["total", "7", "5", "4"]]


def test_a_pair_in_parts_of_two_workers_is_written_once(tmp_path, capsys, monkeypatch):
    """Parts of one line each (``PART_BYTES`` below a line's length), dealt to two workers in turn: a pair whose
    copies lie in parts of different workers, in one input (parts 0 and 1) and across two (parts 2 and 5), is
    written once and counted as a duplicate, as one process does."""
    monkeypatch.setattr(pairs_read, "PART_BYTES", 16)

    def line(i: int) -> str:
        return json.dumps({"query": f"q{i}", "positive": f"p{i}"}) + "\n"

    (tmp_path / "a.jsonl").write_text(line(0) + line(0) + line(1) + line(2))
    (tmp_path / "b.jsonl").write_text(line(3) + line(1))
    meta = {"negatives": [], "source": "s", "instruction": ""}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        code, _, err = run(capsys, "--input", tmp_path / "a.jsonl", tmp_path / "b.jsonl", "--source", "s",
                           "--out", out, "--workers", workers, "--shuffle-window-mb", 0)
        assert code == 0, err
        assert sorted(read_stream(str(out / "pairs" / "s")), key=lambda r: r[0]) == [
            (f"q{i}", {"positive": f"p{i}", **meta}) for i in range(4)]
        counts = read_manifest(str(out / "pairs" / "s"))["counts"]
        assert (counts["rows"], counts["pairs"], counts["duplicates"]) == (6, 4, 2)


# (file name, content, the error after "FILE", the skip reason). Each file also holds a good row first.
GOOD = '{"query": "good", "positive": "p"}\n'


def jsonl_case(row: str, error: str, reason: str) -> tuple[str, str, str, str]:
    """A JSON lines file of the good row, then ``row``, refused at line 2 with ``error``."""
    return "a.jsonl", GOOD + row + "\n", f":2: {error}", reason


BAD_ROWS = {
    "missing_query": jsonl_case('{"positive": "p"}', "no query (query / anchor / question)", "missing_query"),
    "blank_query": jsonl_case('{"query": "  ", "positive": "p"}', "column 'query': is empty or missing",
                              "missing_query"),
    "missing_positive": jsonl_case('{"query": "q", "pos": []}', "column 'pos': is empty or missing",
                                   "missing_positive"),
    "number_query": jsonl_case('{"query": 7, "positive": "p"}', "column 'query': is a number, not a string",
                               "wrong_type"),
    "negatives_item": jsonl_case('{"query": "q", "positive": "p", "negatives": ["n", 3]}',
                                 "column 'negatives': item 1 is a number, not a string", "wrong_type"),
    "negatives_string": jsonl_case('{"query": "q", "positive": "p", "negatives": "n"}',
                                   "column 'negatives': is a string, not a list of strings", "wrong_type"),
    "not_json": jsonl_case('{"query": "q", "positive": ', "not JSON", "bad_line"),
    "not_object": jsonl_case('["q", "p"]', "not a JSON object but a list", "bad_line"),
    "not_utf8": ("a.jsonl", GOOD.encode() + b'{"query": "\xff", "positive": "p"}\n', ":2: not JSON", "bad_line"),
    "surrogate": jsonl_case('{"query": "q", "positive": "\\ud800"}', "column 'positive': holds a lone surrogate",
                            "bad_text"),
    "ambiguous_keys": jsonl_case('{"query": "q", "question": "q2", "positive": "p"}',
                                 "columns 'query' and 'question' both mean the query", "ambiguous_columns"),
    "bad_source": jsonl_case('{"query": "q", "positive": "p", "source": "../up"}',
                             "column 'source': '../up' is not a source name", "bad_source"),
    "csv_fields": ("a.csv", "query,positive\ngood,p\nq,p,extra\n", ":3: 3 fields, the header has 2", "bad_line"),
    "csv_negatives": ("a.csv", 'query,positive,negatives\ngood,p,"[""n""]"\nq,p,[oops\n',
                      ":3: column 'negatives': is not a JSON list of strings", "wrong_type"),
    "csv_not_utf8": ("a.csv", b"query,positive\ngood,p\nq\xff,p\n", ":3: not UTF-8", "bad_line"),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_bad_row_is_an_error_naming_it_or_counted_with_skip_bad(case, tmp_path, capsys):
    name, content, message, reason = BAD_ROWS[case]
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, _, err = run(capsys, "--input", path, "--out", tmp_path / "out")
    assert code == 2
    assert f"data_prep pairs: error: {path}{message}" in err
    assert manifests(tmp_path / "out") == []
    code, stdout, err = run(capsys, "--input", path, "--out", tmp_path / "out", "--skip-bad")
    assert code == 0, err
    assert f"warning: {path}{message}" in err
    manifest = read_manifest(str(tmp_path / "out" / "pairs" / "a"))
    assert manifest["counts"]["pairs"] == 1
    assert {k: v for k, v in manifest["counts"]["skipped"].items() if v} == {reason: 1}
    assert manifest["inputs"][0]["skipped"][reason] == 1


def test_table_rows_are_named_by_row_and_row_group(tmp_path, capsys):
    """A null query in a Parquet file's second row group, a null positive in a save_to_disk folder's Arrow file."""
    pq.write_table(pa.table({"query": ["a", "b", None], "positive": ["p", "p", "p"]}), tmp_path / "t.parquet",
                   row_group_size=2)
    code, _, err = run(capsys, "--input", tmp_path / "t.parquet", "--out", tmp_path / "out")
    assert code == 2
    assert f"error: {tmp_path / 't.parquet'}: row 3 (row group 1): column 'query': is empty or missing" in err
    write_saved(tmp_path / "saved", [Row("a", ["p"], []), Row("b", [""], [])])
    code, _, err = run(capsys, "--input", tmp_path / "saved", "--out", tmp_path / "out")
    assert code == 2
    assert f"error: {tmp_path / 'saved' / 'data-00001-of-00002.arrow'}: row 1: column 'pos': is empty or missing" in err
    code, _, err = run(capsys, "--input", tmp_path / "t.parquet", tmp_path / "saved", "--out", tmp_path / "out",
                       "--skip-bad")
    assert code == 0, err
    for source in ("t", "saved"):
        assert read_manifest(str(tmp_path / "out" / "pairs" / source))["counts"]["pairs"] == 2 - (source == "saved")


HEADERS = {  # (file name, content or a maker, the error after "FILE")
    "ambiguous_header": ("a.csv", "query,Question,positive\nq,q,p\n",
                         ":1: columns 'query' and 'Question' both mean the query"),
    "no_positive": ("a.csv", "query,answer\nq,a\n", ":1: no positive column (positive / pos / document / passage); found: query, answer"),
    "two_negative_forms": ("a.tsv", "query\tpositive\tnegatives\tnegative_1\nq\tp\t[]\tn\n",
                           ":1: column 'negatives' (a list of negatives) and 'negative_1' (one negative each) both"),
    "json_array": ("a.json", '[{"query": "q", "positive": "p"}]\n', ":1: a JSON array, not JSON lines"),
    "unsafe_name": ("my pairs.jsonl", GOOD, ": the source 'my pairs' (the file name) is not a source name"),
    "unknown_format": ("a.txt", GOOD, ": cannot tell the format from the name"),
    "dataset_dict": ("dd", "dataset_dict", ": a DatasetDict folder (splits: train): give a split's folder"),
}


@pytest.mark.parametrize("case", HEADERS)
def test_an_unusable_header_name_or_format_stops_the_run_even_with_skip_bad(case, tmp_path, capsys):
    name, content, message = HEADERS[case]
    path = tmp_path / name
    if content == "dataset_dict":
        path.mkdir()
        (path / "dataset_dict.json").write_text('{"splits": ["train"]}')
        write_saved(path / "train", ROWS[:2])
    else:
        path.write_text(content)
    (tmp_path / "good.jsonl").write_text(GOOD)
    code, _, err = run(capsys, "--input", tmp_path / "good.jsonl", path, "--out", tmp_path / "out", "--skip-bad")
    assert code == 2
    assert f"data_prep pairs: error: {path}{message}" in err
    assert not (tmp_path / "out").exists()  # every input is checked before anything is written


def test_unsafe_source_option_is_refused(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text(GOOD)
    code, _, err = run(capsys, "--input", tmp_path / "a.jsonl", "--out", tmp_path / "out", "--source", "a/b")
    assert code == 2 and "error: --source: the source 'a/b' (--source) is not a source name" in err


def test_unreadable_inputs_are_errors_or_counted_with_skip_bad(tmp_path, capsys):
    (tmp_path / "good.jsonl").write_text(GOOD)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    missing = tmp_path / "missing.jsonl"
    for bad, message in ((missing, "cannot read: No such file or directory"),
                         (tmp_path / "junk.parquet", "cannot read as parquet")):
        code, _, err = run(capsys, "--input", tmp_path / "good.jsonl", bad, "--out", tmp_path / "out")
        assert code == 2 and f"error: {bad}: {message}" in err
        assert not (tmp_path / "out").exists()
    code, stdout, err = run(capsys, "--input", tmp_path / "good.jsonl", missing, tmp_path / "junk.parquet",
                            "--out", tmp_path / "out", "--skip-bad")
    assert code == 0, err
    inputs = read_manifest(str(tmp_path / "out" / "pairs" / "good"))["inputs"]
    assert [(i["format"], i["skipped"]["unreadable"]) for i in inputs] == [
        ("jsonl", 0), ("unreadable", 1), ("unreadable", 1)]
    assert "missing " in stdout and "junk " in stdout  # their sources' rows of the summary, without pairs


def test_a_damaged_parquet_row_group_is_an_error_naming_it_or_counted(tmp_path, capsys):
    """The second row group's first data page header overwritten: the first row group's rows are kept."""
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"query": [f"q{i}" for i in range(200)], "positive": [f"p{i}" for i in range(200)]}),
                   path, row_group_size=100)
    offset = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    code, _, err = run(capsys, "--input", path, "--out", tmp_path / "out")
    assert code == 2 and f"error: {path}: row group 1 (from row 101): cannot read: " in err
    assert manifests(tmp_path / "out") == []
    code, _, err = run(capsys, "--input", path, "--out", tmp_path / "out", "--skip-bad")
    assert code == 0, err
    counts = read_manifest(str(tmp_path / "out" / "pairs" / "c"))["counts"]
    assert (counts["pairs"], counts["skipped"]["unreadable"]) == (100, 1)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_run_leaves_no_manifest(workers, tmp_path, capsys, monkeypatch):
    """Shards of the parts before the bad row are published (small parts, small shards), but no manifest:
    a stream folder without one is incomplete, and no shard it was building (``shard-….tar.tmp-PID``) stays, nor
    one that an earlier, killed run left. Two workers: the error raised in a worker process reaches the main
    process as it was raised."""
    monkeypatch.setattr(pairs_read, "PART_BYTES", 4096)
    good = "".join(json.dumps({"query": f"query {i}", "positive": f"positive {i} " * 5}) + "\n" for i in range(2000))
    (tmp_path / "a.jsonl").write_text(good + '{"query": "q", "positive": ["p", {"x": 1}]}\n')
    stream = tmp_path / "out" / "pairs" / "a"
    stream.mkdir(parents=True)
    (stream / "shard-001-000007.tar.tmp-99999").write_bytes(b"a killed run's")
    code, _, err = run(capsys, "--input", tmp_path / "a.jsonl", "--out", tmp_path / "out", "--shard-size-mb", 0.02,
                       "--shuffle-window-mb", 0, "--block-records", 16, "--workers", workers)
    assert code == 2
    assert f"error: {tmp_path / 'a.jsonl'}:2001: column 'positive': item 1 is an object, not a string" in err
    assert len(list(stream.glob("shard-*.tar"))) > 3
    assert sorted(stream.glob("*.tmp-*")) == []
    assert manifests(tmp_path / "out") == []


def big_input(path: Path, rows: int = 600) -> list[tuple[str, dict]]:
    """Rows of several sources (a source column on every third), multi-line queries, two positives each, the
    last quarter repeating the first; returns the records of the file's own stream in input order."""
    lines, records = [], []
    for i in range(rows):
        n = i % (rows * 3 // 4)
        row = {"query": f"query {n}\nline two" if n % 7 == 0 else f"query {n}",
               "pos": [f"positive {n}", f"other positive {n}"], "neg": [f"negative {j}" for j in range(n % 4)]}
        if n % 3 == 0:
            row["source"] = f"s{n % 2}"
        elif i < rows * 3 // 4:
            records += [(one_line(row["query"]), {"positive": p, "negatives": row["neg"], "source": path.stem,
                                                  "instruction": ""}) for p in row["pos"]]
        lines.append(json.dumps(row) + "\n")
    path.write_text("".join(lines))
    return records


def stream_files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


SHUFFLED = ("--shuffle-window-mb", 0.001, "--block-records", 7, "--shard-size-mb", 0.01)


def test_workers_write_the_pairs_of_one_process_and_rerun_byte_for_byte(tmp_path, capsys, monkeypatch):
    """Many parts (a few KiB each) dealt to 3 worker processes, each writing shards of its own (shard-<worker>-…;
    one process: shard-NNNNNN): every stream holds the pairs of the one-process run and its manifest the same
    counts and inputs; a second run with 3 workers gives the same files byte for byte; the shuffled stream holds
    the pairs of the input, not in input order."""
    monkeypatch.setattr(pairs_read, "PART_BYTES", 2048)
    in_order = big_input(tmp_path / "big.jsonl")
    outs = {}
    for name, workers in (("1", 1), ("3", 3), ("3 again", 3)):
        outs[name] = tmp_path / f"out {name}"
        code, _, err = run(capsys, "--input", tmp_path / "big.jsonl", "--out", outs[name], "--workers", workers,
                           *SHUFFLED)
        assert code == 0, err
    assert stream_files(outs["3"]) == stream_files(outs["3 again"])
    assert sorted(p.name for p in (outs["1"] / "pairs").iterdir()) == ["big", "s0", "s1"]
    def key(record: tuple[str, dict]) -> str:  # a block's record lists its fields in the order the block has them
        return json.dumps(record, sort_keys=True)

    for source in ("big", "s0", "s1"):
        streams = {name: str(outs[name] / "pairs" / source) for name in ("1", "3")}
        assert sorted(read_stream(streams["1"]), key=key) == sorted(read_stream(streams["3"]), key=key)
        one, three = (read_manifest(stream) for stream in streams.values())
        assert (one["counts"], one["inputs"], one["samples"]) == (three["counts"], three["inputs"], three["samples"])
    names = {name: sorted(p.name for p in (outs[name] / "pairs" / "big").glob("shard-*")) for name in ("1", "3")}
    assert all(re.fullmatch(r"shard-\d{6}\.tar", n) for n in names["1"])
    assert {n[:10] for n in names["3"]} == {"shard-000-", "shard-001-", "shard-002-"}
    records = read_stream(str(outs["1"] / "pairs" / "big"))
    assert sorted(records, key=key) == sorted(in_order, key=key) and records != in_order
    counts = read_manifest(str(outs["1"] / "pairs" / "big"))["counts"]
    assert (counts["pairs"], counts["duplicates"]) == (len(in_order), len(in_order) // 3)
    # rows (duplicates included) of its own source whose query had a line break: n % 7 == 0, n % 3 != 0
    assert counts["query_line_breaks"] == sum(i % 450 % 7 == 0 and i % 450 % 3 != 0 for i in range(600))


def test_s3_output_reads_back(tmp_path, capsys, s3_bucket):
    write_jsonl(tmp_path / "flag.jsonl", ROWS)
    out = f"{s3_bucket}/corpora"
    code, stdout, err = run(capsys, "--input", tmp_path / "flag.jsonl", "--out", out, "--shuffle-window-mb", 0)
    assert code == 0, err
    assert read_stream(f"{out}/pairs/flag") == expected(ROWS, "flag")
    assert f"-> {out}/pairs/flag/manifest.json" in stdout


def test_an_output_on_an_input_is_refused(tmp_path, capsys):
    """OUT/pairs, where the streams go, must lie apart from every input (a save_to_disk folder included)."""
    write_saved(tmp_path / "saved", ROWS[:2])
    (tmp_path / "pairs").mkdir()
    (tmp_path / "pairs" / "a.jsonl").write_text(GOOD)
    for inputs, out in (([tmp_path / "saved"], tmp_path / "saved" / "out"),
                        ([tmp_path / "pairs" / "a.jsonl"], tmp_path)):
        code, _, err = run(capsys, "--input", *inputs, "--out", out)
        assert code == 2 and f"error: --out {out}: it writes file://{out}/pairs, which is, holds or lies inside the " \
                             f"input {inputs[0]}" in err
    assert manifests(tmp_path) == []
