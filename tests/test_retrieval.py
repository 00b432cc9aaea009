"""clsys.eval.retrieval: metrics, re-ranking merge, XQuAD/Tatoeba loading, all-MiniLM-L6-v2 sanity, the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clsys.evaluate import main
from clsys.model.encoder import load_encoder, load_tokenizer
from clsys.eval.retrieval import (HELD_OUT_ARTICLES, XQUAD_ASSETS, evaluate_tatoeba, evaluate_xquad, gold_ranks,
                             hf_reranker, load_tatoeba, load_xquad, parse_articles, rerank, retrieval_metrics,
                             xquad_pair)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def minilm():
    return load_encoder("all-MiniLM-L6-v2"), load_tokenizer("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    """A randomly initialised 2-label BERT cross-encoder with the packaged MiniLM tokenizer, 128 positions."""
    from transformers import BertConfig, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("reranker")
    tokenizer = load_tokenizer("all-MiniLM-L6-v2")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=2, max_position_embeddings=128)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# -----------------------------------------------------------------------------
# metrics and re-ranking

def test_metrics_hand_computed():
    scores = torch.full((3, 12), 0.1)
    scores[0, 2] = 0.9  # gold 2 is the best: rank 1
    scores[1, 0], scores[1, 1], scores[1, 3] = 0.9, 0.5, 0.5  # gold 1: one higher, one tied -> rank 2
    scores[2, :10], scores[2, 11] = 0.8, 0.3  # gold 11: ten higher -> rank 11, outside MRR@10
    gold = torch.tensor([2, 1, 11])
    assert gold_ranks(scores, gold).tolist() == [1, 2, 11]
    metrics = retrieval_metrics(scores, gold, ks=(1, 2, 10))
    assert metrics["mrr@10"] == pytest.approx(100 * (1 + 1 / 2 + 0) / 3)
    assert metrics["recall@1"] == pytest.approx(100 / 3)
    assert metrics["recall@2"] == pytest.approx(200 / 3)
    assert metrics["recall@10"] == pytest.approx(200 / 3)
    assert metrics["n"] == 3
    assert list(retrieval_metrics(scores, gold)) == ["mrr@10", "recall@1", "recall@10", "n"]


def test_nan_gold_ranks_last():
    scores = torch.tensor([[float("nan")] * 4, [0.2, float("nan"), 0.1, 0.0]])
    assert gold_ranks(scores, torch.tensor([0, 2])).tolist() == [4, 2]


def test_rerank_merges_top_k_and_keeps_the_rest_in_bi_encoder_order():
    docs = ["d0", "d1", "d2", "d3", "d4"]
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5],   # top 3: d0 d1 d2
                           [0.1, 0.2, 0.3, 0.4, 0.5]])  # top 3: d4 d3 d2
    relevance = {("q0", "d0"): 0.0, ("q0", "d1"): 2.0, ("q0", "d2"): 1.0,
                 ("q1", "d4"): -1.0, ("q1", "d3"): -1.0, ("q1", "d2"): 3.0}
    calls = []

    def fake_reranker(queries: list[str], documents: list[str]) -> torch.Tensor:
        calls.append(sorted(zip(queries, documents)))
        return torch.tensor([relevance[pair] for pair in zip(queries, documents)])

    merged = rerank(scores, ["q0", "q1"], docs, fake_reranker, top=3)
    assert calls == [sorted(relevance)]  # one call, exactly each query's top 3
    ranks = torch.stack([gold_ranks(merged, torch.tensor([d, d])) for d in range(5)], dim=1)
    # q0: d1 d2 d0 by the reranker, then d3 d4 as before; q1: d2, then d3 and d4 tied, then d1 d0.
    assert ranks.tolist() == [[3, 1, 2, 4, 5], [5, 4, 1, 2, 2]]
    metrics = retrieval_metrics(merged, torch.tensor([0, 3]), ks=(1, 2))
    assert (metrics["recall@1"], metrics["recall@2"]) == (0.0, 50.0)
    assert metrics["mrr@10"] == pytest.approx(100 * (1 / 3 + 1 / 2) / 2)

    # top beyond the number of documents re-ranks them all.
    everything = rerank(scores[:1], ["q0"], docs, lambda q, d: torch.tensor([float(x[1]) for x in d]), top=50)
    assert gold_ranks(everything, torch.tensor([4])).tolist() == [1]


# -----------------------------------------------------------------------------
# data

def test_parse_articles():
    assert parse_articles("24:48") == HELD_OUT_ARTICLES == slice(24, 48)
    assert parse_articles("40:") == slice(40, None)
    with pytest.raises(ValueError, match="START:STOP"):
        parse_articles("24-48")


def test_load_xquad_articles_and_gold():
    full = load_xquad("en")
    assert (len(full.paragraphs), len(full.questions), sorted(set(full.article))) == (240, 1190, list(range(48)))
    held_out = load_xquad("en", parse_articles("24:48"))
    assert sorted(set(held_out.article)) == list(range(24, 48))
    assert (len(held_out.paragraphs), len(held_out.questions)) == (120, 558)
    # Every question's gold paragraph is the one the file lists it under, and holds its answer.
    raw = json.loads((XQUAD_ASSETS / "xquad.en.json").read_text(encoding="utf-8"))
    context = {qa["id"]: (p["context"], qa["answers"][0])
               for a in raw["data"] for p in a["paragraphs"] for qa in p["qas"]}
    for qid, gold in zip(held_out.question_ids, held_out.gold):
        paragraph, answer = context[qid]
        assert held_out.paragraphs[gold] == paragraph
        assert paragraph[answer["answer_start"]:].startswith(answer["text"])


def test_xquad_pair_is_parallel_and_checked(tmp_path):
    pair = xquad_pair("en", "de", HELD_OUT_ARTICLES)
    en, de = load_xquad("en", HELD_OUT_ARTICLES), load_xquad("de", HELD_OUT_ARTICLES)
    assert pair.name == "xquad-en-de"
    assert (pair.questions, pair.paragraphs, pair.gold) == (en.questions, de.paragraphs, de.gold)
    assert pair.question_ids == de.question_ids

    def squad(ids: list[str]) -> str:
        qas = [{"id": i, "question": f"question {i}?", "answers": []} for i in ids]
        return json.dumps({"data": [{"title": "t", "paragraphs": [{"context": "c1", "qas": qas[:1]},
                                                                   {"context": "c2", "qas": qas[1:]}]}]})

    (tmp_path / "xquad.aa.json").write_text(squad(["q1", "q2", "q3"]))
    (tmp_path / "xquad.bb.json").write_text(squad(["q1", "q3", "q2"]))
    assert xquad_pair("aa", "aa", directory=tmp_path).gold == [0, 1, 1]
    with pytest.raises(ValueError, match="not parallel: question 1 is q2"):
        xquad_pair("aa", "bb", directory=tmp_path)
    with pytest.raises(ValueError, match="bundled: de, en, es, ru, zh"):
        xquad_pair("en", "fr")
    (tmp_path / "xquad.cc.json").write_text("[" * 100_000 + "]" * 100_000)  # it was a RecursionError
    with pytest.raises(ValueError, match=r"xquad\.cc\.json: not valid JSON \(nested too deeply"):
        xquad_pair("cc", "cc", directory=tmp_path)


def test_tatoeba_accuracy_with_one_swapped_pair(tmp_path, minilm):
    english = ["The cat sleeps on the sofa.", "I bought three apples yesterday.", "Where is the train station?",
               "She plays the violin every evening.", "Our team lost the final match."]
    # The "abc" side repeats the English text, so every sentence finds itself, but lines 2 and 3 are
    # swapped: 3 of 5 sentences retrieve the line of their translation, in both directions.
    source = english[:2] + [english[3], english[2]] + english[4:]
    prefix = tmp_path / "tatoeba.abc-eng"
    Path(f"{prefix}.eng").write_text("\n".join(english) + "\n", encoding="utf-8")
    Path(f"{prefix}.abc").write_text("\n".join(source) + "\n", encoding="utf-8")
    bitext = load_tatoeba(str(prefix))
    assert (bitext.name, bitext.source, bitext.english) == ("tatoeba-abc-eng", source, english)
    assert evaluate_tatoeba(*minilm, str(prefix), "mean") == {"xxx->eng": 60.0, "eng->xxx": 60.0, "n": 5}

    Path(f"{prefix}.abc").write_text("one line\n", encoding="utf-8")
    with pytest.raises(ValueError, match="has 1 lines but"):
        load_tatoeba(str(prefix))
    with pytest.raises(ValueError, match="neither bundled .*deu-eng"):
        load_tatoeba("xyz-eng")
    assert len(load_tatoeba("deu-eng").source) == 1000


# -----------------------------------------------------------------------------
# real models

def test_minilm_xquad_en_en_sanity(minilm):
    result = evaluate_xquad(*minilm, "en", "en", "mean", parse_articles("40:48"), max_length=256)
    assert result["n"] == 177
    assert result["recall@10"] > 95 and result["mrr@10"] > 90  # 40 paragraphs: chance R@10 is 25


def test_hf_reranker_scores_pairs(reranker_dir):
    score = hf_reranker(str(reranker_dir), batch_size=2)
    queries = ["who won?", "when was it?", "a much longer question about the paragraph below?"]
    documents = ["The Broncos won the game.", "It was in 2016, in February.", "Short."]
    batched = score(queries, documents)
    assert batched.shape == (3,) and batched.dtype == torch.float32
    # Length-sorted batches come back in input order and padding changes nothing.
    alone = torch.cat([score([q], [d]) for q, d in zip(queries, documents)])
    assert torch.allclose(batched, alone, atol=1e-5)
    # A pair longer than the model's 128 positions is cut to them (it was cut to 512 tokens, and crashed).
    assert torch.isfinite(score(["a question?"], ["word " * 400])).all()


# -----------------------------------------------------------------------------
# CLI

def test_cli_xling_tatoeba_rerank_end_to_end(tmp_path, reranker_dir):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "clsys.evaluate", "--model", "all-MiniLM-L6-v2", "--xling", "en-de",
                           "--articles", "40:48", "--tatoeba", "deu-eng", "--pooling", "mean",
                           "--rerank", str(reranker_dir), "--rerank-top", "5", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"model all-MiniLM-L6-v2, max_length 256, xquad_articles 40:48, "
                        f"reranker {reranker_dir}, rerank_top 5")
    assert lines[1].split() == ["set", "pooling", "n", "MRR@10", "R@1", "R@10",
                                "rerank-MRR@10", "rerank-R@1", "rerank-R@10"]
    assert lines[2].split()[:3] == ["xquad-en-de", "mean", "177"]
    assert lines[3] == ""
    assert lines[4].split() == ["set", "pooling", "n", "xxx->eng", "eng->xxx"]
    assert lines[5].split()[:3] == ["tatoeba-deu-eng", "mean", "1000"]

    xquad, tatoeba = json.loads(out.read_text())["results"]
    assert lines[2].split()[5] == f"{xquad['recall@10']:.2f}"
    # all-MiniLM-L6-v2 is an English model: it still finds most German paragraphs for English
    # questions, but rarely a German sentence's English translation among 1000.
    assert xquad["recall@10"] == pytest.approx(95.48, abs=0.6)
    assert (tatoeba["xxx->eng"], tatoeba["eng->xxx"]) == (pytest.approx(8.6, abs=0.3), pytest.approx(16.7, abs=0.3))
    # Re-ranking only reorders the top 5, so recall@5 and beyond cannot change.
    assert xquad["rerank_recall@10"] == xquad["recall@10"]


@pytest.mark.parametrize("args, message", [
    (["--xling", "en-fr"], "no bundled XQuAD language 'fr' (bundled: de, en, es, ru, zh"),
    (["--xling", "ende"], "bad --xling pair 'ende'"),
    (["--xling", "en-de", "--articles", "24-48"], "bad article range '24-48'"),
    (["--tatoeba", "deu"], "neither bundled (cmn-eng, deu-eng, fra-eng, jpn-eng, kor-eng, rus-eng, spa-eng)"),
    (["--tatoeba", "deu-eng", "--rerank"], "--rerank qualifies --xling"),
    (["--xling", "en-de", "--rerank"], "model/reranker': no such folder"),  # the default: <model>/reranker
])
def test_cli_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "all-MiniLM-L6-v2", "--pooling", "mean"] + args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
