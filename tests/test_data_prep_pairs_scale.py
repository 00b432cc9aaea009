"""``python -m data_prep pairs`` at scale, as a hostile or just large pair file meets it: the memory of the
duplicate check per distinct pair (a real process's peak RSS), the shuffle windows counting every byte of a
record and shared by a worker's sources (read back from the shards' order), and the cap on sources
(docs/operations/untrusted-input.md#pair-files-scale)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from data_prep.pairs import read as pairs_read
from tests.test_data_prep_pairs import manifests, read_stream, run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from process_runs import peak_rss_mib  # noqa: E402 (bench/process_runs.py: a child's own peak, not its parent's)

MAX_BYTES_A_PAIR = 24  # the duplicate check's target: peak RSS growth per distinct pair (docs/data-prep.md#pairs)


def test_distinct_pairs_cost_the_main_process_at_most_24_bytes_each(tmp_path):
    """100,000 short rows, every pair distinct, against the same rows repeating 1,000 pairs: the same parts,
    parsing and writing, so the difference in peak RSS is what holding 99,000 more distinct pairs costs."""
    rows = 100_000
    for name, distinct in (("distinct", rows), ("repeated", 1000)):
        (tmp_path / f"{name}.jsonl").write_text("".join(f'{{"query": "q{i % distinct:07d}", "positive": "p"}}\n'
                                                        for i in range(rows)))
    # one worker: the main process is the worker, so the peak is the duplicate check's process
    peak = {name: peak_rss_mib([sys.executable, "-m", "data_prep", "pairs", "--input", str(tmp_path / f"{name}.jsonl"),
                                "--out", str(tmp_path / name), "--shuffle-window-mb", "0"], tmp_path / f"{name}.log")
            for name in ("distinct", "repeated")}
    per_pair = (peak["distinct"] - peak["repeated"]) * 2**20 / (rows - 1000)
    assert per_pair <= MAX_BYTES_A_PAIR, f"{per_pair:.0f} bytes a distinct pair ({peak} MiB peak RSS)"


def record_bytes(query: str, meta: dict) -> int:
    """What a window counts a pair as (docs/data-prep.md#pairs): every character of its query, positive,
    negatives, source and instruction, and 16."""
    return len(query) + len(meta["positive"]) + sum(map(len, meta["negatives"])) + len(meta["source"]) + \
        len(meta["instruction"]) + 16


def most_held(arrivals: list[tuple[str, str]], streams: dict[str, list[str]], sizes: dict[str, int]) -> int:
    """The most bytes a worker's windows held at once, at least, from what it wrote. ``arrivals``: (stream,
    query) in input order; ``streams``: each stream's queries in shard order. A window is written in an order
    of its own, never mixed with the next, so a stream's windows end where its written queries, so far, are
    exactly its first queries in input order; a window holds what arrived of it until its last query arrives."""
    window_of: dict[str, tuple[str, int]] = {}  # query → (stream, its window's number)
    ends: dict[tuple[str, int], str] = {}  # window → the query whose arrival completes it
    for stream, written in streams.items():
        order = [query for s, query in arrivals if s == stream]
        assert sorted(order) == sorted(written)
        pending, window = set(), 0
        for arrived, out in zip(order, written):
            pending ^= {arrived}
            pending ^= {out}
            window_of[arrived] = (stream, window)
            if not pending:
                ends[(stream, window)] = arrived
                window += 1
    held, most = {}, 0
    for _, query in arrivals:
        window = window_of[query]
        held[window] = held.get(window, 0) + sizes[query]
        most = max(most, sum(held.values()))
        if ends[window] == query:
            del held[window]
    return most


def test_the_shuffle_windows_count_every_byte_and_share_one_budget(tmp_path, capsys, monkeypatch):
    """12-character queries with 2,000-character positives: a window of --shuffle-window-mb 0.05 (52,429
    bytes) holds ~25 pairs, not the ~1,870 their queries alone would allow. Two sources, row by row in turn:
    both windows together hold at most that much (plus the record that fills it), not twice. (Parts of a line
    each: the worker gets the pairs in input order, not grouped by source a part at a time.)"""
    monkeypatch.setattr(pairs_read, "PART_BYTES", 1024)
    limit = int(0.05 * 2**20)
    for sources in (("one",), ("a", "b")):
        name = f"{len(sources)}-sources"
        lines, arrivals, sizes = [], [], {}
        for i in range(240):
            source = sources[i % len(sources)]
            row = {"query": f"q{i:011d}", "positive": f"{i:04d}" * 500, "negatives": ["n" * (i % 50)]}
            if len(sources) > 1:
                row["source"] = source
            else:
                source = name
            lines.append(json.dumps(row) + "\n")
            arrivals.append((source, row["query"]))
            sizes[row["query"]] = record_bytes(row["query"], {**row, "source": source, "instruction": ""})
        (tmp_path / f"{name}.jsonl").write_text("".join(lines))
        code, _, err = run(capsys, "--input", tmp_path / f"{name}.jsonl", "--out", tmp_path / name,
                           "--shuffle-window-mb", 0.05, "--block-records", 8)
        assert code == 0, err
        streams = {stream: [query for query, _ in read_stream(str(tmp_path / name / "pairs" / stream))]
                   for stream in {s for s, _ in arrivals}}
        assert all(written != sorted(written) for written in streams.values())  # shuffled
        held = most_held(arrivals, streams, sizes)
        assert limit // 2 < held < limit + max(sizes.values()), f"{name}: windows held {held:,} bytes at once"


def test_a_source_column_naming_more_sources_than_the_cap_is_refused(tmp_path, capsys):
    """300 rows, each naming a source of its own: the 257th stops the run (exit 2, naming its line, before any
    stream is written), --skip-bad or not; --max-sources sets the cap."""
    lines = [json.dumps({"query": f"q{i}", "positive": "p", "source": f"s{i}"}) + "\n" for i in range(300)]
    (tmp_path / "many.jsonl").write_text("".join(lines))
    (tmp_path / "three.jsonl").write_text("".join(lines[:3]))
    for extra in ((), ("--skip-bad",)):
        code, stdout, err = run(capsys, "--input", tmp_path / "many.jsonl", "--out", tmp_path / "out", *extra)
        assert code == 2 and stdout == ""
        assert err.strip().splitlines()[-1] == (
            f"data_prep pairs: error: {tmp_path / 'many.jsonl'}:257: column 'source': 's256' would be source 257 of "
            "this run, over --max-sources 256 (a stream, a shuffle window and shard files each): raise "
            "--max-sources if the data means it")
        assert not (tmp_path / "out" / "pairs").exists()
    code, _, err = run(capsys, "--input", tmp_path / "many.jsonl", "--out", tmp_path / "out", "--max-sources", 3,
                       "--workers", 2)
    assert code == 2 and "many.jsonl:4: column 'source': 's3' would be source 4 of this run, over --max-sources 3" in err
    code, _, err = run(capsys, "--input", tmp_path / "three.jsonl", "--out", tmp_path / "out", "--max-sources", 3)
    assert code == 0, err
    assert len(manifests(tmp_path / "out")) == 3
