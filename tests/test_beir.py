"""clsys.eval.beir: BEIR / MTEB folders (layout, errors), the metrics against pytrec_eval (random runs with ties
and graded relevance, and a real all-MiniLM-L6-v2 run), the bundled XQuAD folders, prefixes, the CLI, and
the training-time evaluation (eval.retrieval_dev) with best-checkpoint selection."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import pytrec_eval
import torch
import torch.nn.functional as F

from clsys.eval.beir import (BEIR_ASSETS, BeirSet, bundled_beir, evaluate_beir, load_beir, rank_chunks, rank_corpus,
                             ranking_metrics, resolve_beir)
from clsys.eval.retrieval import XQUAD_ASSETS, embed_by_length
from clsys.evaluate import folder_prompts, main
from clsys.model.encoder import load_encoder, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
MEASURES = {"ndcg_cut.10", "recip_rank", "recall.100"}


def pytrec_metrics(qrels: dict[str, dict[str, int]], run: dict[str, dict[str, float]]) -> dict[str, float]:
    """The three figures as BEIR and MTEB take them from pytrec_eval: means x 100 over the queries it scores;
    MRR@10 is recip_rank cut at rank 10 (a reciprocal rank >= 1/10)."""
    scored = pytrec_eval.RelevanceEvaluator(qrels, MEASURES).evaluate(run)
    assert set(scored) == set(qrels), "pytrec_eval scores every query the qrels grade"
    n = len(scored)
    return {"ndcg@10": 100 * sum(s["ndcg_cut_10"] for s in scored.values()) / n,
            "mrr@10": 100 * sum(s["recip_rank"] if s["recip_rank"] >= 0.1 else 0 for s in scored.values()) / n,
            "recall@100": 100 * sum(s["recall_100"] for s in scored.values()) / n, "n": n}


def write_beir(folder: Path, corpus: list[dict], queries: list[dict], qrels: dict[str, list[tuple]]) -> Path:
    """A BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv with its header."""
    (folder / "qrels").mkdir(parents=True)
    for name, records in (("corpus.jsonl", corpus), ("queries.jsonl", queries)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    for split, rows in qrels.items():
        (folder / "qrels" / f"{split}.tsv").write_text(
            "query-id\tcorpus-id\tscore\n" + "".join("\t".join(map(str, row)) + "\n" for row in rows))
    return folder


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory) -> Path:
    """XQuAD's article 47 (Force) as a BEIR folder: the 20 English paragraphs of articles 44-47 as the corpus,
    article 47's 21 questions graded 1 on their paragraph (test), the first 3 also on the next paragraph
    graded 2 (graded relevance, several relevant documents); dev: the first 5 questions only."""
    articles = json.loads((XQUAD_ASSETS / "xquad.en.json").read_text(encoding="utf-8"))["data"]
    corpus, queries, test = [], [], []
    for a in (44, 45, 46, 47):
        for p, paragraph in enumerate(articles[a]["paragraphs"]):
            corpus.append({"_id": f"{a}-{p}", "title": articles[a]["title"].replace("_", " "),
                           "text": paragraph["context"]})
            if a == 47:
                for qa in paragraph["qas"]:
                    queries.append({"_id": qa["id"], "text": qa["question"]})
                    test.append((qa["id"], f"{a}-{p}", 1))
    test += [(row[0], f"47-{(int(row[1][-1]) + 1) % 5}", 2) for row in test[:3]]
    return write_beir(tmp_path_factory.mktemp("force"), corpus, queries, {"test": test, "dev": test[:5]})


@pytest.fixture(scope="module")
def minilm():
    return load_encoder("all-MiniLM-L6-v2"), load_tokenizer("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A random 1-layer BERT (hidden 32) with the packaged tokenizer, saved as a sentence-transformers folder
    that declares mean pooling and e5-style prompts: where quality does not matter."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-st")
    tokenizer = load_tokenizer("all-MiniLM-L6-v2")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128), add_pooling_layer=False
              ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Transformer"},
                                                     {"type": "sentence_transformers.models.Pooling"}]))
    (folder / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": None}))
    return folder


# -----------------------------------------------------------------------------
# ranking and metrics against pytrec_eval

def test_metrics_and_tie_order_match_pytrec_eval_on_random_runs():
    """Scores drawn from a few levels (many ties), grades -1..3 (several relevant, some queries with none),
    ids whose string order is not their numeric order (trec_eval breaks ties by id, the greater first,
    byte-wise), corpora on both sides of 100 (recall@100's cut), ranked in chunks and blocks of every size,
    and queries whose own id is a document's (ignore_identical_ids, as BEIR pops them from its results)."""
    rng = random.Random(0)
    for trial in range(60):
        n_queries = rng.randint(1, 8)
        ids = list(dict.fromkeys(f"{rng.randint(0, 10 ** rng.randint(1, 3))}{rng.choice(['', 'a', 'é', 'Z'])}"
                                 for _ in range(rng.randint(1, 160))))
        levels = rng.randint(1, 5)
        scores = torch.tensor([[rng.randint(-levels, levels) / levels for _ in ids] for _ in range(n_queries)])
        # pytrec_eval itself crashes (segfault) on some qrels with grades below -1: -1 is the negative grade here.
        qrels = [{d: rng.choice([-1, 0, 0, 1, 1, 2, 3])
                  for d in rng.sample(range(len(ids)), rng.randint(1, min(len(ids), 12)))} for _ in range(n_queries)]
        ignore_identical = trial % 2 == 1
        own = rng.sample(range(len(ids)), min(len(ids), n_queries))  # half the queries take a document's id
        query_ids = [ids[own[q]] if q < len(own) and rng.random() < 0.5 else f"q{q}" for q in range(n_queries)]
        excluded = [ids.index(q) if ignore_identical and q in ids else -1 for q in query_ids]

        # One-hot queries: queries @ chunk.T is the score matrix itself, chunk by chunk.
        chunk = rng.randint(1, len(ids))
        order = rng.sample(range(len(ids)), len(ids))
        chunks = [(torch.tensor(order[s:s + chunk]), scores.T[order[s:s + chunk]]) for s in range(0, len(ids), chunk)]
        ranking = rank_chunks(torch.eye(n_queries), chunks, ids, exclude=torch.tensor(excluded),
                              score_block=rng.randint(1, 500))

        run = {q: {ids[d]: float(scores[i, d]) for d in range(len(ids)) if d != excluded[i]}
               for i, q in enumerate(query_ids)}
        for i, q in enumerate(query_ids):  # our ranking is the full sort by (score, id), both descending, cut at 100
            expected = sorted(run[q], key=lambda d: (run[q][d], d), reverse=True)[:100]
            assert [ids[d] for d in ranking.docs[i].tolist() if d >= 0] == expected, trial
            assert ranking.scores[i, :len(expected)].tolist() == [run[q][d] for d in expected]
        ours = ranking_metrics(ranking.docs, qrels)
        reference = pytrec_metrics({q: {ids[d]: g for d, g in qrels[i].items()} for i, q in enumerate(query_ids)}, run)
        assert ours == pytest.approx(reference, abs=1e-9), trial


def test_hand_computed_metrics():
    """Graded relevance by hand: nDCG's gain is the grade, the ideal ranking the grades sorted; a query
    without a relevant document scores 0 on all three."""
    docs = torch.tensor([[2, 0, 1, -1], [0, 1, 2, 3]])
    metrics = ranking_metrics(docs, [{0: 1, 1: 2, 3: 1}, {0: 0}])
    # Query 0: grades 0, 1, 2 at ranks 1-3; ideal 2, 1, 1; first relevant at rank 2; 2 of 3 relevant retrieved.
    dcg, ideal = 1 / torch.log2(torch.tensor(3.0)) + 2 / 2, 2 + 1 / torch.log2(torch.tensor(3.0)) + 1 / 2
    assert metrics["ndcg@10"] == pytest.approx(100 * (dcg / ideal).item() / 2)
    assert metrics["mrr@10"] == pytest.approx(100 * 0.5 / 2)
    assert metrics["recall@100"] == pytest.approx(100 * (2 / 3) / 2)
    assert metrics["n"] == 2


def test_real_run_matches_pytrec_eval(small_folder, minilm):
    """all-MiniLM-L6-v2 on a 20-paragraph corpus, embedded 7 documents at a time: the ranking's scores are
    the cosines of the whole query x document matrix (embedded in one go), and the figures pytrec_eval's on
    them."""
    data = load_beir(small_folder)
    ranking = rank_corpus(*minilm, data, "mean", max_length=64, chunk=7)
    queries = embed_by_length(*minilm, data.queries, "mean", 64, 64)
    documents = embed_by_length(*minilm, list(data.documents), "mean", 64, 64)
    full = F.normalize(queries, dim=-1) @ F.normalize(documents, dim=-1).T
    assert ranking.docs.shape == (21, 20)
    assert torch.allclose(ranking.scores, full.gather(1, ranking.docs), atol=1e-5)
    run = {q: {data.doc_ids[d]: s for d, s in zip(ranking.docs[i].tolist(), ranking.scores[i].tolist())}
           for i, q in enumerate(data.query_ids)}
    qrels = {q: {data.doc_ids[d]: g for d, g in data.qrels[i].items()} for i, q in enumerate(data.query_ids)}
    ours = ranking_metrics(ranking.docs, data.qrels)
    assert ours == pytest.approx(pytrec_metrics(qrels, run), abs=1e-4)
    assert ours["ndcg@10"] > 60 and ours["recall@100"] == 100  # an English model on English text; 20 documents


# -----------------------------------------------------------------------------
# reading folders

def test_load_reads_the_beir_layout(tmp_path):
    """Title and text joined as BEIR and MTEB join them; numeric ids read as strings; the queries evaluated are
    the split's, in queries.jsonl order; CRLF line ends and blank lines are fine; the note counts what is
    left out and what scores 0."""
    folder = write_beir(tmp_path / "set", [{"_id": "d1", "title": "Berlin", "text": " Capital of Germany. "},
                                           {"_id": 7, "text": "No title here."},
                                           {"_id": "d3", "title": "", "text": "Empty title.", "extra": [1]}],
                        [{"_id": "q1", "text": "Where is Berlin?"}, {"_id": "q2", "text": "unused"},
                         {"_id": "q3", "text": "Seven?"}],
                        {"test": [("q3", 7, 1), ("q1", "d1", 2), ("q1", "d3", 0)], "dev": [("q2", "d3", 0)]})
    qrels_file = folder / "qrels" / "test.tsv"
    qrels_file.write_bytes(qrels_file.read_bytes().replace(b"\n", b"\r\n") + b"\r\n")
    data = load_beir(folder)
    assert data.name == "set" and data.doc_ids == ["d1", "7", "d3"]
    assert list(data.documents) == ["Berlin  Capital of Germany.", "No title here.", "Empty title."]
    assert (data.query_ids, data.queries) == (["q1", "q3"], ["Where is Berlin?", "Seven?"])
    assert data.qrels == [{0: 2, 2: 0}, {1: 1}]
    assert data.note == "2 of 3 queries graded in qrels/test.tsv"
    assert load_beir(folder, "dev").note == ("1 of 3 queries graded in qrels/dev.tsv; 1 of them with no relevant "
                                             "document (grade >= 1): they score 0, as in BEIR and MTEB")


@pytest.mark.parametrize("file, text, message", [
    ("corpus.jsonl", None, "corpus.jsonl: no such file (a BEIR folder holds corpus.jsonl, queries.jsonl and "
                           "qrels/<split>.tsv)"),
    ("corpus.jsonl", '{"_id": "d1", "text": "a"}\n{"_id": "d2", "text": "b"\n', "corpus.jsonl:2: bad JSON"),
    ("corpus.jsonl", '{"_id": "d1", "text": "a"}\n\n{"_id": "d1", "text": "b"}\n',
     "corpus.jsonl:3: _id 'd1' is given twice (first on line 1)"),
    ("corpus.jsonl", '{"_id": "d1", "text": null}\n', "corpus.jsonl:1: text: expected a string, got None"),
    ("queries.jsonl", '{"id": "q1", "text": "a"}\n', "queries.jsonl:1: _id: expected a non-empty string, got None"),
    ("queries.jsonl", '["q1", "a"]\n', "queries.jsonl:1: expected a JSON object, got list"),
    ("queries.jsonl", b'{"_id": "q1", "text": "\xff"}\n', "queries.jsonl:1: not UTF-8"),
    ("qrels/test.tsv", "q1\td1\t1\n", "test.tsv:1: expected the header 'query-id\tcorpus-id\tscore'"),
    ("qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq9\td1\t1\n",
     "test.tsv:3: query-id 'q9' is not in "),
    ("qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1\td9\t1\n", "test.tsv:2: corpus-id 'd9' is not in "),
    ("qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t0.5\n",
     "test.tsv:2: score: expected an integer grade, got '0.5'"),
    *(("qrels/test.tsv", f"query-id\tcorpus-id\tscore\nq1\td1\t{grade}\n",
       f"test.tsv:2: score: expected an integer grade, got '{grade}'") for grade in ("1_0", "\u0663")),
    ("qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t2147483648\n",
     "test.tsv:2: score: 2147483648 is outside 32 bits (-2147483648 to 2147483647)"),
    ("corpus.jsonl", '{"_id": "d1", "text": ' + "[" * 100_000 + "]" * 100_000 + "}\n",
     "corpus.jsonl:1: bad JSON (nested too deeply"),
    ("qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1 d1 1\n", "test.tsv:2: expected 3 tab-separated fields"),
    ("qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td1\t2\n",
     "test.tsv:3: query 'q1' and document 'd1' are graded twice (first on line 2)"),
    ("qrels/test.tsv", "query-id\tcorpus-id\tscore\n", "test.tsv: holds no judgements"),
])
def test_bad_input_names_file_and_line(tmp_path, file, text, message):
    folder = write_beir(tmp_path / "set", [{"_id": "d1", "text": "a"}], [{"_id": "q1", "text": "b"}],
                        {"test": [("q1", "d1", 1)]})
    if text is None:
        (folder / file).unlink()
    else:
        (folder / file).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        load_beir(folder)
    assert message in str(error.value) and str(folder) in str(error.value)


def test_a_missing_split_names_the_splits_there(small_folder):
    with pytest.raises(FileNotFoundError, match=r"qrels/train.tsv: no such file \(qrels splits in .*: dev, test\)"):
        load_beir(small_folder, "train")
    with pytest.raises(FileNotFoundError, match=r"neither a folder nor a bundled set \(xquad-de, xquad-en\)"):
        resolve_beir("xquad-fr")


def test_cli_refuses_a_grade_beyond_32_bits_before_loading_the_model(tmp_path, capsys):
    """1 followed by 400 zeros as a grade: refused naming file and line, before the model (here: none) loads;
    it used to pass and end in an OverflowError after the whole corpus was embedded. -2147483648 and +3 pass."""
    folder = write_beir(tmp_path / "set", [{"_id": "d1", "text": "a"}, {"_id": "d2", "text": "b"}],
                        [{"_id": "q1", "text": "c"}], {"test": [("q1", "d1", "+3"), ("q1", "d2", -2147483648)]})
    assert load_beir(folder).qrels == [{0: 3, 1: -2147483648}]
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1" + "0" * 400 + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path / "no-model"), "--pooling", "mean", "--retrieval", str(folder)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"{folder / 'qrels' / 'test.tsv'}:2: score: 1000" in err and "is outside 32 bits" in err, err
    assert "cannot load model" not in err and len(err.splitlines()[-1]) < 500


# -----------------------------------------------------------------------------
# bundled folders

def test_bundled_folders_are_what_build_writes_and_hold_xquad(tmp_path):
    """build.py rewrites the shipped files byte for byte; each test question's paragraph holds its answer;
    the splits are articles 24-47 (test) and 0-23 (dev), over one corpus of all 240 paragraphs."""
    subprocess.run([sys.executable, str(BEIR_ASSETS / "build.py"), "--out", str(tmp_path)], check=True, timeout=60)
    assert bundled_beir() == ["xquad-de", "xquad-en"]
    built = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert len(built) == 8
    for rel in built:
        assert (BEIR_ASSETS / rel).read_bytes() == (tmp_path / rel).read_bytes(), rel
    assert (BEIR_ASSETS / "LICENSE.md").is_file()

    for lang in ("en", "de"):
        answers = {qa["id"]: qa["answers"][0]["text"] for article in json.loads(
            (XQUAD_ASSETS / f"xquad.{lang}.json").read_text(encoding="utf-8"))["data"]
            for paragraph in article["paragraphs"] for qa in paragraph["qas"]}
        test, dev = load_beir(resolve_beir(f"xquad-{lang}")), load_beir(resolve_beir(f"xquad-{lang}"), "dev")
        assert (len(test.doc_ids), len(test.query_ids), len(dev.query_ids)) == (240, 558, 632)
        assert {int(test.doc_ids[d][:2]) for q in test.qrels for d in q} == set(range(24, 48))
        assert {int(dev.doc_ids[d][:2]) for q in dev.qrels for d in q} == set(range(24))
        for data in (test, dev):
            assert all(list(q.values()) == [1] for q in data.qrels)
        documents = list(test.documents)
        for query_id, graded in zip(test.query_ids, test.qrels):
            assert answers[query_id] in documents[next(iter(graded))]
    assert documents[0].startswith("Super Bowl 50 Die Verteidigung der Panthers")


# -----------------------------------------------------------------------------
# prefixes

def test_prefixes_come_from_the_model_folder_as_sentence_transformers_chooses_them(tmp_path):
    def prompts(config: dict | str) -> tuple[str, str]:
        (tmp_path / "config_sentence_transformers.json").write_text(config if isinstance(config, str)
                                                                     else json.dumps(config))
        return folder_prompts(str(tmp_path))

    assert folder_prompts(str(tmp_path)) == ("", "")  # no file
    assert prompts({"prompts": {"query": "query: ", "passage": "passage: "}}) == ("query: ", "passage: ")
    # documents: "document" before "passage" before "corpus", whatever the file's order
    assert prompts({"prompts": {"query": "q: ", "corpus": "c: ", "passage": "p: ", "document": "d: "}}) == ("q: ",
                                                                                                          "d: ")
    assert prompts({"prompts": {"query": "q: ", "all": "x: "}, "default_prompt_name": "all"}) == ("q: ", "x: ")
    assert prompts({"prompts": {}, "default_prompt_name": None}) == ("", "")  # what a clsys export writes
    assert prompts("not json") == ("", "")


def test_prefixes_are_put_before_queries_and_documents(tiny_folder, small_folder):
    model, tokenizer = load_encoder(str(tiny_folder)), load_tokenizer(str(tiny_folder))
    data = load_beir(small_folder)
    prefixed = rank_corpus(model, tokenizer, data, "mean", max_length=128, query_prefix="query: ",
                           passage_prefix="passage: ")
    by_hand = BeirSet(data.name, data.doc_ids, [f"passage: {d}" for d in data.documents], data.query_ids,
                      [f"query: {q}" for q in data.queries], data.qrels)
    expected = rank_corpus(model, tokenizer, by_hand, "mean", max_length=128)
    assert torch.equal(prefixed.docs, expected.docs) and torch.allclose(prefixed.scores, expected.scores)
    assert not torch.allclose(prefixed.scores, rank_corpus(model, tokenizer, data, "mean", max_length=128).scores)


# -----------------------------------------------------------------------------
# CLI

def test_cli_reads_the_folders_prompts_and_reports_the_figures(tiny_folder, small_folder, tmp_path, capsys):
    out = tmp_path / "result.json"
    again = tmp_path / "again"  # several folders: each its row
    shutil.copytree(small_folder, again)
    main(["--model", str(tiny_folder), "--retrieval", str(small_folder), str(again), "--json", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "pooling mean (the model's 1_Pooling/config.json)"
    assert lines[1] == (f"model {tiny_folder}, max_length 128, retrieval_split test, query_prefix \"query: \", "
                        "passage_prefix \"passage: \", ignore_identical_ids False")
    assert lines[2].split() == ["set", "pooling", "n", "nDCG@10", "MRR@10", "R@100"]
    assert [line.split()[:3] for line in lines[3:]] == [[small_folder.name, "mean", "21"], ["again", "mean", "21"]]
    assert lines[3].split()[3:] == lines[4].split()[3:]
    result = json.loads(out.read_text())
    assert (result["query_prefix"], result["passage_prefix"], result["retrieval_split"]) == ("query: ", "passage: ",
                                                                                          "test")
    model, tokenizer = load_encoder(str(tiny_folder)), load_tokenizer(str(tiny_folder))
    expected = evaluate_beir(model, tokenizer, load_beir(small_folder), "mean", max_length=128,
                             query_prefix="query: ", passage_prefix="passage: ")
    assert {k: result["results"][0][k] for k in expected} == expected
    assert lines[3].split()[3] == f"{expected['ndcg@10']:.2f}"

    main(["--model", str(tiny_folder), "--retrieval", str(small_folder), "--query-prefix", "", "--passage-prefix",
          "search_document: ", "--ignore-identical-ids", "--retrieval-split", "test"])
    assert 'query_prefix "", passage_prefix "search_document: ", ignore_identical_ids True' in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--sts", "stsb-en-dev", "--retrieval-split", "dev"], "--retrieval-split qualifies --retrieval"),
    (["--retrieval", "xquad-fr"], "'xquad-fr' is neither a folder nor a bundled set (xquad-de, xquad-en)"),
    (["--retrieval", "xquad-en", "--retrieval-split", "train"], "qrels/train.tsv: no such file"),
])
def test_cli_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "all-MiniLM-L6-v2", "--pooling", "mean"] + args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# -----------------------------------------------------------------------------
# during training

def test_training_evaluates_the_dev_split_logs_it_and_selects_by_it(tiny, small_folder, tmp_path):
    """eval.retrieval_dev: the dev split (eval.retrieval_split's default), scored by the model being trained
    as far as its export will read, logged under eval/<name>_ndcg@10 ...; eval.select: retrieval_dev picks
    its nDCG@10."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from clsys.engine.evaluator import Evaluator
    from clsys.metrics.health import TensorBoard
    from clsys.recipes import OBJECTIVES, load_config

    cfg = load_config(None, ["objective.name=simcse", f"model.name={tiny}", "model.init=scratch",
                             "model.tokenizer=all-MiniLM-L6-v2", "eval.sts_dev=", f"eval.retrieval_dev={small_folder}",
                             "eval.select=retrieval_dev", "eval.pooling=mean"])
    objective = OBJECTIVES["simcse"](cfg, load_tokenizer(cfg.model.tokenizer))
    tb = TensorBoard(str(tmp_path / "tb"))
    evaluator = Evaluator(objective, cfg, 0, tb)
    name = small_folder.name
    assert evaluator.metric == f"{name}_ndcg@10" and evaluator.due(0)
    assert len(evaluator.retrieval_set.query_ids) == 5  # dev
    scores = evaluator(5)
    tb.close()
    expected = evaluate_beir(objective.encoder(), objective.tokenizer, load_beir(small_folder, "dev"), "mean",
                             max_length=64)  # the tiny architecture's 64 positions: what its export declares
    assert scores == {f"{name}_{k}": v for k, v in expected.items() if k != "n"}
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = events.Scalars(f"eval/{name}_ndcg@10")
    assert [(e.step, e.value) for e in logged] == [(5, pytest.approx(scores[f"{name}_ndcg@10"], abs=1e-4))]
