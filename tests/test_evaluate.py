"""clsys.evaluate: correlations, STS file formats, the published all-MiniLM-L6-v2 figure, the CLI."""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from clsys.evaluate import STS_ASSETS, correlations, evaluate_sts, load_sts, resolve_sts
from clsys.model.encoder import load_encoder, load_tokenizer

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


def test_all_minilm_mean_reproduces_published_spearman():
    model, tokenizer = load_encoder("all-MiniLM-L6-v2"), load_tokenizer("all-MiniLM-L6-v2")
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


@pytest.mark.parametrize("args, message", [
    (["--model", "/definitely/missing/model"], "no such folder"),
    (["--model", "all-MiniLM-L6-v2", "--sts", "no-such-set"], "neither a file nor a bundled set"),
    (["--model", "all-MiniLM-L6-v2", "--pooling", "cls,avg"], "bad --pooling"),
])
def test_cli_errors_exit_2_without_traceback(args, message):
    proc = run_cli(*(["--pooling", "mean"] + args))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
