"""``python -m data_prep triplets``: per-premise NLI triplets (docs/training/objectives.md#simcse-triplets), the CLI and its manifest."""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

from clsys import storage
from data_prep.__main__ import main
from clsys.shards.manifest import read_manifest

DATA = Path(__file__).parent / "data" / "nli"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["triplets", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def read_triplets(stream: Path) -> list[dict]:
    """Every sample's json, in shard order, checking that its txt is the anchor."""
    manifest = read_manifest(str(stream))
    samples = []
    for shard in manifest["shards"]:
        with tarfile.open(storage.parse(storage.join(str(stream), shard["name"])).path) as tar:
            members = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}
        for name in sorted(n for n in members if n.endswith(".json")):
            sample = json.loads(members[name])
            assert members[name[:-5] + ".txt"] == sample["anchor"]
            samples.append(sample)
    return samples


CSV = '''gold_label,sentence1,sentence2
entailment,A man plays.,A person plays.
contradiction,A man plays.,Nobody plays.
neutral,A man plays.,A man plays chess.
entailment,A man plays.,"A man, who is tall,
plays."
entailment,Only entailed.,Entailed.
contradiction,Only contradicted.,Contradicted.
neutral,Only contradicted.,Maybe.
neutral,Only neutral.,Maybe.
-,A man plays.,No consensus.
entailment,too,many,fields
contradiction,A man plays.,Nobody at all plays.
'''


def test_csv_last_wins_drops_and_malformed(tmp_path, capsys):
    src = tmp_path / "nli.csv"
    src.write_text(CSV)
    code, out, err = run(capsys, "--input", src, "--out", tmp_path / "out")
    assert code == 0, err
    assert read_triplets(tmp_path / "out" / "triplets") == [
        # last entailment (a quoted field spanning two lines) and last contradiction read win
        {"anchor": "A man plays.", "positive": "A man, who is tall,\nplays.", "negative": "Nobody at all plays."}]
    manifest = read_manifest(str(tmp_path / "out" / "triplets"))
    # Each dropped premise counted once: no entailment (only contradicted, only neutral), or no contradiction.
    assert manifest["skipped"] == {"no_entailment": 2, "no_contradiction": 1, "malformed": 2}
    assert manifest["premises"] == 4 and manifest["samples"] == 1
    assert manifest["sources"] == [{"file": "nli.csv", "format": "csv", "rows": 9, "malformed": 2}]
    # Malformed lines are reported as file:line (the record's last line for a multi-line record).
    assert f"{src}:12: 4 fields, header has 3" in err
    assert f"{src}:11: empty sentence or label '-'" in err
    assert "skipped: no_entailment=2, no_contradiction=1, malformed=2" in out


def test_tsv_without_quote_processing_and_numeric_labels(tmp_path, capsys):
    # KorNLI-style TSV: quotes inside sentences are text; labels in the HF integer convention.
    src = tmp_path / "ko.tsv"
    src.write_text('sentence1\tsentence2\tgold_label\n'
                   '그가 말했다, "엄마.\t그는 말했다.\t0\n'
                   '그가 말했다, "엄마.\t그는 말하지 않았다."\t2\n'
                   '그가 말했다, "엄마.\t모른다.\t1\n', encoding="utf-8")
    code, _, err = run(capsys, "--input", src, "--out", tmp_path / "out")
    assert code == 0, err
    assert read_triplets(tmp_path / "out" / "triplets") == [
        {"anchor": '그가 말했다, "엄마.', "positive": "그는 말했다.", "negative": '그는 말하지 않았다."'}]


def test_jsonl_and_premises_merged_across_inputs(tmp_path, capsys):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join([
        json.dumps({"premise": "P1", "hypothesis": "E1", "label": 0}),
        json.dumps({"premise": "P2", "hypothesis": "C2", "label": "contradiction"}),
        "{not json",
        json.dumps({"premise": "P2", "hypothesis": "x", "label": -1}),  # HF's "no gold label"
        json.dumps({"premise": "P3"}),
    ]) + "\n")
    csv = tmp_path / "b.csv"  # completes P1 and P2 from another file, in another format
    csv.write_text("label,premise,hypothesis\ncontradiction,P1,C1\nentailment,P2,E2\n")
    code, _, err = run(capsys, "--input", jsonl, csv, "--out", tmp_path / "out")
    assert code == 0, err
    assert read_triplets(tmp_path / "out" / "triplets") == [
        {"anchor": "P1", "positive": "E1", "negative": "C1"}, {"anchor": "P2", "positive": "E2", "negative": "C2"}]
    assert f"{jsonl}:3: not a JSON object" in err and f"{jsonl}:5: missing hypothesis, label" in err
    manifest = read_manifest(str(tmp_path / "out" / "triplets"))
    assert manifest["skipped"] == {"no_entailment": 0, "no_contradiction": 0, "malformed": 3}


def test_real_excerpts_counts_add_up(tmp_path, capsys):
    inputs = [DATA / "snli_dev.head150.csv", DATA / "xnli.dev.ko.head100.tsv"]
    code, _, err = run(capsys, "--input", *inputs, "--out", tmp_path / "out", "--shard-size-mb", "0.01")
    assert code == 0, err
    stream = tmp_path / "out" / "triplets"
    manifest = read_manifest(str(stream))
    skipped = manifest["skipped"]
    assert skipped["malformed"] == 0 and len(manifest["shards"]) > 1
    assert manifest["premises"] == manifest["samples"] + skipped["no_entailment"] + skipped["no_contradiction"]
    samples = read_triplets(stream)
    assert len(samples) == manifest["samples"]
    assert samples[0] == {"anchor": "Two women are embracing while holding to go packages.",
                          "positive": "Two woman are holding packages.",
                          "negative": "The men are fighting outside a deli."}
    assert any(s["anchor"].startswith("그리고 그가 말했다") for s in samples)
    # Same input, same output: a re-run uploads nothing.
    code, out, _ = run(capsys, "--input", *inputs, "--out", tmp_path / "out", "--shard-size-mb", "0.01")
    assert code == 0 and "0 uploaded" in out


def test_bad_inputs_exit_2_and_write_nothing(tmp_path, capsys):
    bad_header = tmp_path / "bad.csv"
    bad_header.write_text("text,label\nA,entailment\n")
    good = tmp_path / "good.csv"
    good.write_text(CSV)
    code, _, err = run(capsys, "--input", good, bad_header, "--out", tmp_path / "out")
    assert code == 2
    assert err.strip() == (f"data_prep triplets: error: {bad_header}:1: header has no premise or sentence1 / "
                           "hypothesis or sentence2 column (found: text, label)")
    assert not (tmp_path / "out").exists()  # every header is checked before anything is written

    code, _, err = run(capsys, "--input", tmp_path / "missing.tsv", "--out", tmp_path / "out")
    assert code == 2 and "missing.tsv: cannot read: No such file or directory" in err

    neutral_only = tmp_path / "n.csv"
    neutral_only.write_text("gold_label,sentence1,sentence2\nneutral,A,B\n")
    code, _, err = run(capsys, "--input", neutral_only, "--out", tmp_path / "out")
    assert code == 2 and "no premise has both" in err and not (tmp_path / "out" / "triplets" / "manifest.json").exists()


def test_cli_help_lists_triplets(capsys):
    try:
        main(["--help"])
    except SystemExit:
        pass
    assert "triplets" in capsys.readouterr().out

