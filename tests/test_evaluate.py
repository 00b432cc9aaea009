"""clsys.evaluate: correlations, STS file formats, the published all-MiniLM-L6-v2 figure, the CLI."""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from clsys.eval.sts import correlations, evaluate_sts
from clsys.model.encoder import load_encoder, load_tokenizer
from clsys.eval.sts_data import STS_ASSETS, load_sts, read_sts, resolve_sts

REPO = Path(__file__).resolve().parents[1]


def naive_ranks(x: list[float]) -> list[float]:
    """1-based ranks; tied values share the average of the ranks they span."""
    ranks = []
    for v in x:
        below = sum(1 for w in x if w < v)
        equal = sum(1 for w in x if w == v)
        ranks.append(below + (equal + 1) / 2)
    return ranks


def naive_pearson(x: list[float], y: list[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))


def test_correlations_match_naive_reference():
    rng = random.Random(0)
    for _ in range(5):
        gold = [rng.randint(0, 10) / 2 for _ in range(200)]  # STS-like scores, many ties
        pred = [g + rng.gauss(0, 1.5) for g in gold]
        pred[:20] = [round(p, 1) for p in pred[:20]]  # ties in the predictions as well
        spearman, pearson = correlations(pred, gold)
        assert spearman == pytest.approx(100 * naive_pearson(naive_ranks(pred), naive_ranks(gold)), abs=1e-9)
        assert pearson == pytest.approx(100 * naive_pearson(pred, gold), abs=1e-9)


def test_load_stsb_csv(tmp_path):
    f = tmp_path / "mine.csv"
    f.write_text('A cat sits.,"A cat, sitting.",4.5\n"He said ""hi"".",Nothing here.,0\n', encoding="utf-8")
    sts = load_sts(f)
    assert sts.name == "mine"
    assert sts.sent1 == ["A cat sits.", 'He said "hi".']
    assert sts.sent2 == ["A cat, sitting.", "Nothing here."]
    assert sts.scores == [4.5, 0.0]

    f.write_text("a,b,1.0\nc,d,2.0\nonly two,fields\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{f}:3: .*expected 3 fields, found 2"):
        load_sts(f)


def test_load_korsts_tsv(tmp_path):
    f = tmp_path / "kor.tsv"
    header = "genre\tfilename\tyear\tid\tscore\tsentence1\tsentence2\n"
    # An unbalanced quote is sentence text in KorSTS (QUOTE_NONE), not the start of a quoted field.
    f.write_text(header + 'main-captions\tMSRvid\t2012test\t0024\t2.500\t"한 소녀가\t한 소녀가 머리를 빗고 있다.\n',
                 encoding="utf-8")
    sts = load_sts(f)
    assert (sts.sent1, sts.sent2, sts.scores) == (['"한 소녀가'], ["한 소녀가 머리를 빗고 있다."], [2.5])

    f.write_text(header + "g\tf\ty\t1\t1.0\ta\tb\n" + "g\tf\ty\t2\tfive\ta\tb\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{f}:3: .*'five'"):
        load_sts(f)


SUITE = REPO / "tests" / "data" / "sts_suite"


def test_every_layout_reads_its_pairs():
    year = read_sts(str(SUITE / "STS12-en-test")).sets
    assert len(year) == 1 and year[0].name == "STS12-en-test"
    # The "all" setting concatenates the subsets; the OnWN pair with an empty gold line is not scored.
    assert year[0].subsets == [("MSRpar", 5), ("surprise.OnWN", 6)]
    assert len(year[0].sent1) == len(year[0].sent2) == len(year[0].scores) == 11
    onwn = load_sts(SUITE / "STS12-en-test" / "STS.gs.surprise.OnWN.txt")  # either file of the pair names it
    assert onwn.name == "surprise.OnWN" and len(onwn.scores) == 6
    assert onwn.sent1[2] == "A bird is flying over the sea."  # the third pair (unscored) was skipped
    sts16 = load_sts(SUITE / "STS16-en-test" / "STS.input.answer-answer.txt")
    assert (sts16.sent1[0], sts16.sent2[0], sts16.scores[0]) == ("A man is playing a guitar.", "A man plays the guitar.", 5.0)
    stsb = load_sts(SUITE / "STSBenchmark" / "sts-test.csv")  # lines with an extra column included
    assert (stsb.sent1[0], stsb.sent2[0], stsb.scores[0]) == ("A woman is slicing an onion.",
                                                              "A woman cuts an onion into pieces.", 4.2)
    assert len(stsb.scores) == 6
    sick = load_sts(SUITE / "SICK" / "SICK_test_annotated.txt")
    assert (sick.sent1[0], sick.scores[0], len(sick.scores)) == ("Two dogs run across a field.", 1.3, 8)
    jsonl = load_sts(SUITE / "mteb-sts.jsonl")
    assert (jsonl.name, jsonl.sent2[0], jsonl.scores[0], len(jsonl.scores)) == (
        "mteb-sts", "The train departs at twelve o'clock.", 4.6, 9)


# SICK.txt's pairs of each split, in file order (tests/data/sts_suite/SICK/SICK.txt).
SICK_TEST = (["The kettle is boiling water.", "The children are building a sandcastle.", "A chef is chopping carrots.",
              "The cat is climbing a tree."], [1.1, 4.5, 3.9, 4.9])
SICK_TRIAL = (["A man is riding a bicycle downhill.", "A girl is singing on a stage."], [4.7, 3.2])


def test_full_sick_is_scored_on_the_split_its_semeval_set_column_marks_and_says_so():
    """SICK.txt holds all of SICK: its SemEval_set column marks each pair TRAIN, TRIAL or TEST."""
    test = load_sts(SUITE / "SICK" / "SICK.txt")
    assert (test.name, test.sent1, test.scores) == ("SICK", *SICK_TEST)
    assert test.note == "the test split only, SemEval_set TEST: 4 of 10 pairs (TRAIN 4, TRIAL 2 left out)"
    dev = load_sts(SUITE / "SICK" / "SICK.txt", split="dev")
    assert (dev.sent1, dev.scores) == SICK_TRIAL
    assert dev.note == "the dev split only, SemEval_set TRIAL: 2 of 10 pairs (TEST 4, TRAIN 4 left out)"


def test_the_trainer_evaluates_on_the_trial_split_of_sick_txt():
    from clsys.recipes import load_config
    from clsys.engine.evaluator import dev_set as _dev_set

    dev = _dev_set(load_config(None, [f"eval.sts_dev={SUITE / 'SICK' / 'SICK.txt'}"]))
    assert (dev.sent1, dev.scores) == SICK_TRIAL


def test_semeval_sick_file_without_its_header_row():
    trial = load_sts(SUITE / "SICK" / "SICK_trial.txt")
    assert (trial.sent1[0], trial.sent2[2], trial.scores) == ("A horse is jumping over a fence.",
                                                              "A woman is baking bread.", [4.4, 3.3, 1.0])
    assert trial.note == ""


def test_sick_files_joined_together_are_refused(tmp_path):
    """SemEval's train, trial and test files joined into one: no column says which pair is in which split."""
    train = (SUITE / "SICK" / "SICK_train.txt").read_text(encoding="utf-8")
    test = (SUITE / "SICK" / "SICK_test_annotated.txt").read_text(encoding="utf-8")
    joined = tmp_path / "SICK_all.txt"
    joined.write_text(train + test, encoding="utf-8")  # `cat`: the second file's header row inside
    with pytest.raises(ValueError, match=rf"{joined}:5: a second header row: .*joins several SICK files"):
        load_sts(joined)
    joined.write_text(train + test.split("\n", 1)[1], encoding="utf-8")  # one header: pair ids 0, 1, 2 twice
    with pytest.raises(ValueError, match=rf"{joined}:5: pair_ID 0 again \(first on line 2\)"):
        load_sts(joined)
    # Distinct ids, as SICK's are across its splits, but more pairs than its largest split (the test set).
    rows = [f"{i}\tA man walks to shop number {i}.\tA person walks, {i}.\t{i % 5}.0\tNEUTRAL\n" for i in range(4928)]
    joined.write_text("".join(rows), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{joined}: 4928 pairs, more than any SICK split holds"):
        load_sts(joined)
    joined.write_text("".join(rows[:4927]), encoding="utf-8")
    assert len(load_sts(joined).scores) == 4927


def test_a_folder_is_a_suite_of_its_test_sets(tmp_path):
    suite = read_sts(str(SUITE))
    assert [s.name for s in suite.sets] == ["SICK", "SICK_test_annotated", "STS12-en-test", "STS16-en-test",
                                            "sts-test", "mteb-sts"]
    assert sorted(Path(x.split(" (")[0]).name + " (" + x.split(" (")[1] for x in suite.left_out) == [
        "SICK_train.txt (a train/dev/trial split)", "SICK_trial.txt (a train/dev/trial split)",
        "readme.txt (not an STS layout)", "sts-dev.csv (a train/dev/trial split)"]
    assert suite.sets[0].scores == SICK_TEST[1]  # SICK.txt: its test split
    (tmp_path / "sts-train.csv").write_text("a,b,1.0\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"no STS set found in this folder \(passed over: .*sts-train.csv \(a train"):
        read_sts(str(tmp_path))


@pytest.mark.parametrize("name, text, message", [
    ("bad.jsonl", '{"sentence1": "a", "sentence2": "b", "score": 1}\n{"sentence1": "a", "score": 2}\n',
     r":2: missing field 'sentence2'"),
    ("bad.jsonl", '{"sentence1": "a", "sentence2": "b", "score": 1}\n\n{"sentence1": "a",\n', r":3: bad JSON"),
    ("bad.jsonl", '{"sentence1": "a", "sentence2": "b", "score": "high"}\n', r":1: score 'high' is not a number"),
    ("SICK.txt", "pair_ID\tsentence_A\tsentence_B\trelatedness_score\n1\ta\tb\t4.5\n2\ta\tb\n",
     r":3: expected 4 fields, found 3"),
    ("sts-test.csv", "g\tf\ty\t1\t2.0\ta\tb\ng\tf\ty\t2\t2.0\ta\n", r":2: expected at least 7"),
    ("notes.txt", "Some notes about the data.\n", r":1: not a known STS layout"),
])
def test_malformed_files_name_file_and_line(tmp_path, name, text, message):
    f = tmp_path / name
    f.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{f}{message}"):
        load_sts(f)


def test_senteval_pair_errors(tmp_path):
    (tmp_path / "STS.input.x.txt").write_text("a\tb\nc\td\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=r"STS.gs.x.txt: missing"):
        load_sts(tmp_path / "STS.input.x.txt")
    (tmp_path / "STS.gs.x.txt").write_text("4.0\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"STS.gs.x.txt: 1 lines, but .*STS.input.x.txt has 2"):
        load_sts(tmp_path / "STS.input.x.txt")
    (tmp_path / "STS.gs.x.txt").write_text("4.0\nfour\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"STS.gs.x.txt:2: score 'four'"):
        load_sts(tmp_path / "STS.input.x.txt")
    (tmp_path / "STS.input.x.txt").write_text("a\tb\nonly one sentence\n", encoding="utf-8")
    (tmp_path / "STS.gs.x.txt").write_text("4.0\n2\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"STS.input.x.txt:2: expected two tab-separated sentences"):
        load_sts(tmp_path / "STS.input.x.txt")


def test_year_aggregations_against_its_subsets(minilm):
    """"all" is one Spearman over the concatenation; "mean"/"wmean" average the subsets' own Spearman."""
    model, tokenizer = minilm
    year = read_sts(str(SUITE / "STS12-en-test")).sets[0]
    result = evaluate_sts(model, tokenizer, year, "mean")
    folder = SUITE / "STS12-en-test"
    parts = [evaluate_sts(model, tokenizer, load_sts(folder / f"STS.input.{n}.txt"), "mean") for n in ("MSRpar", "surprise.OnWN")]
    assert result["spearman_mean"] == pytest.approx((parts[0]["spearman"] + parts[1]["spearman"]) / 2, abs=1e-9)
    assert result["spearman_wmean"] == pytest.approx((5 * parts[0]["spearman"] + 6 * parts[1]["spearman"]) / 11, abs=1e-9)
    # "all" differs from both: it ranks the two subsets' pairs together.
    concatenated = load_sts(folder / "STS.input.MSRpar.txt")
    assert result["n"] == 11 and result["spearman"] not in (result["spearman_mean"], result["spearman_wmean"])
    assert concatenated.scores + load_sts(folder / "STS.input.surprise.OnWN.txt").scores == year.scores


def test_bundled_sets():
    sizes = {"stsb-en-dev": 1500, "stsb-en-test": 1379, "stsb-de-dev": 1500, "stsb-de-test": 1379,
             "korsts-dev": 1500, "korsts-test": 1379}
    for name, n in sizes.items():
        sts = load_sts(resolve_sts(name))
        assert (sts.name, len(sts.sent1), len(sts.sent2), len(sts.scores)) == (name, n, n, n)
        assert all(0 <= s <= 5 for s in sts.scores)
    assert (STS_ASSETS / "LICENSE.md").is_file()
    with pytest.raises(FileNotFoundError, match="stsb-en-test"):
        resolve_sts("stsb-xx-test")


@pytest.fixture(scope="module")
def minilm():
    return load_encoder("all-MiniLM-L6-v2"), load_tokenizer("all-MiniLM-L6-v2")


def test_all_minilm_mean_reproduces_published_spearman(minilm):
    model, tokenizer = minilm
    result = evaluate_sts(model, tokenizer, load_sts(resolve_sts("stsb-en-test")), "mean", max_length=256)
    assert result["n"] == 1379
    assert result["spearman"] == pytest.approx(82.03, abs=0.05)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clsys.evaluate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_cli_table_and_json(tmp_path):
    # A 40-pair slice keeps the subprocess quick; the full-set figure is checked above.
    small = tmp_path / "small.csv"
    small.write_text("".join((STS_ASSETS / "stsb-en-test.csv").read_text(encoding="utf-8").splitlines(True)[:40]),
                     encoding="utf-8")
    out = tmp_path / "result.json"
    proc = run_cli("--model", "all-MiniLM-L6-v2", "--sts", str(small), "--pooling", "cls,mean", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "model all-MiniLM-L6-v2, max_length 256"
    assert lines[1].split() == ["set", "pooling", "n", "Spearman", "Pearson"]
    assert [line.split()[:3] for line in lines[2:]] == [["small", "cls", "40"], ["small", "mean", "40"]]
    result = json.loads(out.read_text())
    assert [(r["set"], r["pooling"], r["n"]) for r in result["results"]] == [("small", "cls", 40), ("small", "mean", 40)]
    # The table shows the JSON figures, rounded.
    assert lines[3].split()[3] == f"{result['results'][1]['spearman']:.2f}"


def test_cli_folder_reports_every_set_and_their_average(tmp_path):
    out = tmp_path / "result.json"
    proc = run_cli("--model", "all-MiniLM-L6-v2", "--sts", str(SUITE), "--pooling", "mean", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["set"] for r in rows] == ["SICK", "SICK_test_annotated", "STS12-en-test", "STS16-en-test", "sts-test",
                                        "mteb-sts", "sts_suite avg"]
    assert rows[-1]["spearman"] == pytest.approx(sum(r["spearman"] for r in rows[:-1]) / 6, abs=1e-9)
    assert rows[-1]["n"] == 4 + 8 + 11 + 6 + 6 + 9 and "spearman_mean" in rows[2] and "spearman_mean" not in rows[-1]
    header = proc.stdout.splitlines()[1].split()
    assert header == ["set", "pooling", "n", "Spearman", "Pearson", "Spearman-mean", "Spearman-wmean"]
    assert proc.stdout.splitlines()[-1].split()[:2] == ["sts_suite", "avg"]
    for left_out in ("SICK_train.txt (a train/dev/trial split)", "readme.txt (not an STS layout)"):
        assert left_out in proc.stderr
    assert f"{SUITE}: SICK: the test split only, SemEval_set TEST: 4 of 10 pairs" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "/definitely/missing/model"], "no such folder"),
    (["--model", "all-MiniLM-L6-v2", "--sts", "no-such-set"], "neither a file, a folder nor a bundled set"),
    (["--model", "all-MiniLM-L6-v2", "--pooling", "cls,avg"], "bad --pooling"),
])
def test_cli_errors_exit_2_without_traceback(args, message):
    proc = run_cli(*(["--pooling", "mean"] + args))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
