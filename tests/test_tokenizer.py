"""data_prep tokenizer: real English (bundled dump) + German (stsb-multi-mt) shards, real spm training."""
from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
from transformers import AutoTokenizer

from data_prep.__main__ import main as data_prep
from clsys.shards.writer import ShardWriter
from data_prep.tokenizer import language_shares, language_targets, sample_sentences, training_lines

ROOT = Path(__file__).resolve().parents[1]
GERMAN = ROOT / "clsys" / "assets" / "sts" / "stsb-de-test.csv"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    """(English wiki --out root, German sentences stream)."""
    tmp = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, "-m", "data_prep", "wiki", "--input", *map(str, (ROOT / "data_prep" / "samples").glob("*.bz2")),
                    "--out", str(tmp / "en")], cwd=ROOT, check=True, capture_output=True, timeout=120)
    writer = ShardWriter(str(tmp / "de"), str(tmp), 1 << 16)
    with open(GERMAN, newline="", encoding="utf-8") as f:
        for i, row in enumerate(csv.reader(f)):
            writer.write(f"de-{i:06d}", row[0], {"lang": "de"})
    writer.close()
    writer.write_manifest({"languages": ["de"]})
    return str(tmp / "en"), str(tmp / "de")


def train(corpus, out: Path, *extra: str) -> int:
    return data_prep(["tokenizer", "--input", *corpus, "--vocab-size", "800", "--max-sentences", "6000",
                      "--seed", "7", "--out", str(out), *extra])


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    assert train(corpus, out) == 0
    return out


def test_language_shares_follow_xlm_formula():
    counts = {"en": 9000, "de": 1000, "sw": 0}
    q = language_shares(counts, alpha=0.3)
    expected_en = 0.9 ** 0.3 / (0.9 ** 0.3 + 0.1 ** 0.3)
    assert q == pytest.approx({"de": 1 - expected_en, "en": expected_en}, abs=1e-12)  # empty languages dropped
    assert language_shares(counts, alpha=1.0) == pytest.approx({"de": 0.1, "en": 0.9})
    assert language_shares(counts, alpha=0.0) == pytest.approx({"de": 0.5, "en": 0.5})
    targets = language_targets(q, 1001)
    assert sum(targets.values()) == 1001 and abs(targets["en"] - expected_en * 1001) < 1


def test_sampler_counts_and_bounded_memory():
    counts = {"en": 4000, "de": 400, "fi": 40}
    targets = language_targets(language_shares(counts, 0.3), 2000)
    items = [(f"{lang}-{i}", lang, f"{lang} sentence {i}") for lang, n in counts.items() for i in range(n)]
    random.Random(0).shuffle(items)
    reservoirs, held = sample_sentences(items, targets, seed=1)
    assert (reservoirs, held) == sample_sentences(items, targets, seed=1)
    for lang, n in counts.items():
        # Never more than the target in memory; all the (non-held-out) sentences of a small language.
        assert len(reservoirs[lang]) == min(targets[lang], n - len(held[lang]))
        assert not set(reservoirs[lang]) & set(held[lang])
        lines = training_lines(reservoirs[lang], targets[lang], random.Random(0))
        assert len(lines) == targets[lang] and set(lines) == set(reservoirs[lang])
        assert len(lines) / 2000 == pytest.approx(language_shares(counts, 0.3)[lang], abs=1e-3)
    assert targets["fi"] > counts["fi"]  # up-sampled: the 40 Finnish sentences are repeated


def test_report(trained):
    report = json.loads((trained / "tokenizer_report.json").read_text())
    assert report["vocab_size"] == 800 and report["model_type"] == "unigram" and report["alpha"] == 0.3
    langs = report["languages"]
    assert langs["de"]["available"] == 1379 and langs["en"]["available"] > 10000
    assert sum(lang["sampled"] for lang in langs.values()) == report["training_sentences"] == 6000
    q = language_shares({k: v["available"] for k, v in langs.items()}, 0.3)
    for lang, r in langs.items():
        assert r["share"] == pytest.approx(q[lang]) and r["sampled"] == pytest.approx(q[lang] * 6000, abs=1)
        assert r["held_out"] > 0 and 0 <= r["unk_rate"] < 0.01


def test_hf_tokenizer(trained, tmp_path):
    tok = AutoTokenizer.from_pretrained(trained)
    assert tok.is_fast and len(tok) == 800
    ids = [tok.convert_tokens_to_ids(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")]
    assert ids == [0, 1, 2, 3, 4]
    assert [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id] == ids

    single = tok("Ein Mann spielt eine Harfe.")
    assert single["input_ids"][0] == 2 and single["input_ids"][-1] == 3
    pair = tok("Ein Mann spielt eine Harfe.", "A man plays the harp.")
    n_a = len(single["input_ids"])
    assert pair["input_ids"][:n_a] == single["input_ids"] and pair["input_ids"][-1] == 3
    assert pair["token_type_ids"] == [0] * n_a + [1] * (len(pair["input_ids"]) - n_a)
    assert 4 in tok("The [MASK] is red.")["input_ids"]

    assert_same_as_spm(tok, trained)
    sp = spm.SentencePieceProcessor(model_file=str(trained / "spm.model"))
    assert not {2, 3, 4} & set(sp.encode("[CLS] [SEP] [MASK]"))  # specials never come from text in spm

    texts = ["Anarchism is a political philosophy.", "Eine Gruppe von Männern spielt am Strand Fußball."]
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(texts, texts[::-1]) == tok(texts, texts[::-1])


def assert_same_as_spm(tok, folder: Path) -> None:
    """The fast tokenizer is the spm model: same ids on unseen sentences (the sentence2 column)."""
    sp = spm.SentencePieceProcessor(model_file=str(folder / "spm.model"))
    with open(GERMAN, newline="", encoding="utf-8") as f:
        texts = [row[1] for row in csv.reader(f)][:300] + ["Ünïcödé  and 日本 ,  spaces "]
    assert tok(texts, add_special_tokens=False)["input_ids"] == [sp.encode(t) for t in texts]


def test_bpe(corpus, tmp_path):
    assert train(corpus, tmp_path, "--model-type", "bpe", "--max-sentences", "3000") == 0
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok("Ein Mann")["input_ids"]
    assert [ids[0], ids[-1]] == [2, 3] and len(tok) == 800
    assert_same_as_spm(tok, tmp_path)


def test_same_seed_same_model(corpus, trained, tmp_path):
    assert train(corpus, tmp_path / "again") == 0
    for name in ("spm.model", "spm.vocab", "tokenizer.json", "tokenizer_report.json"):
        assert (tmp_path / "again" / name).read_bytes() == (trained / name).read_bytes(), name


def test_errors_exit_2(corpus, tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert train((missing,), tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("data_prep tokenizer: error: ") and missing in err and "\n" not in err
    assert train(corpus[1:], tmp_path / "out", "--vocab-size", "50000") == 2  # 1379 sentences cannot fill it
    err = capsys.readouterr().err.strip()
    assert corpus[1] in err and "vocab" in err.lower()
    assert not (tmp_path / "out").exists()
