"""``python -m clsys.mine``: hard negatives mined on Ray workers, each holding a slice of the corpus.

Real parts: pairs streams written by ``data_prep pairs`` from XQuAD questions and their paragraphs (the bundled
``clsys/assets/xquad``), the packaged all-MiniLM-L6-v2 (the mined negatives must be plausible) or a tiny random
BERT (where only equality matters), a real local Ray cluster of 2 CPUs on 127.0.0.1 and the S3 server fixture.
Checked: the merged top-k of slices is one sort of the whole corpus, ties included (top-k alone, then the workers in
this process, then two Ray workers against a one-process ranking of every text embedded alone); the false-negative
filter against a naive reference; a run killed mid-way (its own local Ray cluster then gone too) and run again
writes what an uninterrupted run writes, over texts with line separators; a slice that disagrees with its .json is
refused; bad input is refused before anything is written."""
from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from clsys import storage
from clsys.eval.retrieval import load_xquad
from clsys.mine import main
from clsys.model.encoder import embed, load_encoder, load_tokenizer
from clsys.retrieval import topk, work
from clsys.retrieval.corpus import corpus_shards, owner, pair_streams, text_id
from clsys.retrieval.negatives import DROP_REASONS, choose_negatives
from clsys.retrieval.worker import Encoding, MiningWorker
from clsys.shards.reader import load_shards, read_shard
from conftest import environ_set, loopback_ray_cluster
from data_prep.__main__ import main as data_prep

REPO = Path(__file__).resolve().parents[1]
ARTICLES = slice(0, 6)  # 30 paragraphs, 177 questions


def naive_ranking(scores: list[float], ids: list[int]) -> list[tuple[float, int]]:
    """Every candidate, sorted as the module says: score descending, then id ascending."""
    return sorted(zip(scores, ids), key=lambda c: (-c[0], c[1]))


# ---------------------------------------------------------------------------------------------
# Top-k of slices


@pytest.mark.parametrize("k,chunk", [(1, 3), (5, 4), (12, 7), (40, 100)])
def test_merged_slices_equal_one_sort_of_the_whole_corpus(k, chunk):
    """Vectors of small integers: every score is exact however it is summed, and many candidates tie (the
    vectors take 3^3 values for 60 rows). Three slices by owner, each scanned in chunks, padded and merged."""
    g = torch.Generator().manual_seed(0)
    corpus = torch.randint(-1, 2, (60, 3), generator=g).float()
    queries = torch.randint(-1, 2, (5, 3), generator=g).float()
    ids = torch.tensor([text_id(f"text {i}") for i in range(60)])
    parts = []
    for rank in range(3):
        rows = [i for i in range(60) if owner(int(ids[i]), 3) == rank]
        mine_ids, mine = ids[rows], corpus[rows]
        chunks = ((queries @ mine[s:s + chunk].T, mine_ids[s:s + chunk]) for s in range(0, len(rows), chunk))
        parts.append(topk.pad(*topk.scan(chunks, k, len(queries), queries), k))
    scores, best = topk.merge(parts, k)
    full = (queries @ corpus.T).tolist()
    for q in range(len(queries)):
        want = naive_ranking(full[q], ids.tolist())[:k]
        assert list(zip(scores[q].tolist(), best[q].tolist())) == want
    # The case discriminates: the k-th score is shared by candidates left out (ties across the cut).
    if k > 1:
        cut = scores[:, -1].tolist()
        assert any(full[q].count(cut[q]) > scores[q].tolist().count(cut[q]) for q in range(len(queries)))


def test_select_counts_nan_among_the_best():
    """topk takes NaN (a diverged model's score) as the greatest: a tie at the cut behind it is still broken by id."""
    scores = torch.tensor([[float("nan"), 1.0, 2.0, 1.0, 1.0]])
    ids = torch.tensor([[7, 9, 3, 4, 2]])
    _, best = topk.select(scores, ids, 3)
    assert best.tolist() == [[7, 3, 2]]


# ---------------------------------------------------------------------------------------------
# The false-negative filter


def naive_filter(candidates, positive, positive_score, others, given, k, ratio):
    """The rules read literally: which candidates are false negatives, then the first k others; what was passed
    over before the k-th kept one, by the first reason that holds."""
    def reasons(score, c):
        return [name for name, holds in (("positive", c == positive), ("other_positive", c in others),
                                         ("above_ratio", score > ratio * positive_score), ("given", c in given)) if holds]
    kept = [c for s, c in candidates if not reasons(s, c)][:k]
    end = [c for _, c in candidates].index(kept[-1]) + 1 if len(kept) == k else len(candidates)
    dropped = collections.Counter(reasons(s, c)[0] for s, c in candidates[:end] if reasons(s, c))
    return kept, dropped


def test_filter_matches_a_naive_reference():
    rng = random.Random(1)
    for case in range(300):
        ids = rng.sample(range(1000), 30)
        candidates = sorted(((rng.choice([0.2, 0.5, 0.8, 0.9, 0.95, 1.0]), c) for c in ids), key=lambda x: (-x[0], x[1]))
        positive = rng.choice(ids + [1001])  # a positive not among the candidates too
        others = set(rng.sample(ids, rng.randint(0, 3)))
        given = set(rng.sample(ids, rng.randint(0, 4)))
        k, ratio, positive_score = rng.randint(1, 12), rng.choice([0.9, 0.95, 1.0]), rng.choice([0.8, 0.9, 1.0])
        dropped = collections.Counter()
        got = choose_negatives(candidates, positive, positive_score, others, given, k, ratio, dropped)
        assert (got, dropped) == naive_filter(candidates, positive, positive_score, others, given, k, ratio), case
    assert set(dropped) <= set(DROP_REASONS)


# ---------------------------------------------------------------------------------------------
# Data


SEPARATORS = "\u2028\u2029\x85"  # what str.splitlines() also ends a line at; web and Wikipedia text holds them


def paragraphs_of(xs) -> list[str]:
    """XQuAD's paragraphs, each one's first sentence ending in one of ``SEPARATORS`` instead of a space."""
    return [p.replace(". ", f".{SEPARATORS[i % 3]}", 1) for i, p in enumerate(xs.paragraphs)]


def pair_rows() -> list[dict]:
    """XQuAD questions → their paragraph, two other paragraphs as given negatives. Ties: the first paragraph's
    upper-cased copy is a given negative of every tenth pair (the uncased tokenizer reads it as the paragraph itself:
    equal vectors, other ids), and a question asked twice with two positives (its other positive)."""
    xs = load_xquad("en", ARTICLES)
    paragraphs = paragraphs_of(xs)
    rng = random.Random(0)
    rows = []
    for i, (question, gold) in enumerate(zip(xs.questions, xs.gold)):
        negatives = rng.sample([p for j, p in enumerate(paragraphs) if j != gold], 2)
        if i % 10 == 0:
            negatives.append(paragraphs[0].upper())
        rows.append({"query": question, "pos": [paragraphs[gold]], "neg": negatives})
    rows.append({"query": xs.questions[0], "pos": [paragraphs[1]], "neg": []})
    return rows


def write_pairs(root: str, tmp: Path, block_records: int = 256) -> str:
    """``data_prep pairs`` on ``pair_rows`` (source ``xq``) → ``root``."""
    path = tmp / "xq.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in pair_rows()))
    assert data_prep(["pairs", "--input", str(path), "--out", root, "--shard-size-mb", "0.02",
                      "--block-records", str(block_records)]) == 0
    return root


@pytest.fixture(scope="module")
def local_pairs(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("pairs")
    return write_pairs(str(tmp / "root"), tmp)


# ---------------------------------------------------------------------------------------------
# Workers in this process


def test_a_text_vector_depends_on_the_text_alone(tiny_bert_with_heads):
    """What makes the slices' vectors independent of the number of workers: a batch of texts of one token count
    (no padding) gives each the vector it gets alone, in this build's CPU kernels (the Ray test checks it for
    all-MiniLM-L6-v2 too)."""
    model, tokenizer = load_encoder(tiny_bert_with_heads), load_tokenizer(tiny_bert_with_heads)
    questions = load_xquad("en", ARTICLES).questions
    lengths = [len(ids) for ids in tokenizer(questions)["input_ids"]]
    common = collections.Counter(lengths).most_common(1)[0][0]
    same = [q for q, n in zip(questions, lengths) if n == common][:12]
    together = embed(model, tokenizer, same, "mean", 12, 128)
    assert torch.equal(together, torch.cat([embed(model, tokenizer, [q], "mean", 1, 128) for q in same]))
    # Padded among longer texts, the same texts' vectors differ in their last bits: why batches are by length.
    mixed = embed(model, tokenizer, same + questions[:20], "mean", 32, 128)[:len(same)]
    assert not torch.equal(mixed, together)


def one_process_ranking(encoding: Encoding, texts: list[str], queries: list[str]) -> torch.Tensor:
    """Every query's scores against every corpus text, each text embedded alone: [queries, texts]. On one thread,
    as the workers (a sum's order may depend on the threads; on a loaded machine two threads also took 16x longer)."""
    model, tokenizer = load_encoder(encoding.model), load_tokenizer(encoding.model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def alone(prefix: str, items: list[str]) -> torch.Tensor:
        return F.normalize(torch.cat([embed(model, tokenizer, [prefix + t], encoding.pooling, 1, encoding.max_length)
                                      for t in items]), dim=-1)
    try:
        return alone(encoding.query_prefix, queries) @ alone(encoding.passage_prefix, texts).T
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """A worker sets its process's torch threads (its CPUs): here, this process's, restored after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_two_slices_rank_as_one_worker_and_as_one_sort(local_pairs, tiny_bert_with_heads, tmp_path, one_thread):
    """Two workers (here, without Ray: Ray is for the slow tests) each build their slice from the buckets both
    read, embed their share of the queries and rank the whole batch; merged, their lists equal one worker's and
    a one-process ranking of every text embedded alone, ties (the upper-cased paragraph) by id."""
    encoding = Encoding(tiny_bert_with_heads, "mean", 64, "query: ", "passage: ", 8, 1, "cpu")
    data = {name: load_shards(url, "pairs") for name, url in pair_streams(local_pairs).items()}
    items = corpus_shards(data, None)
    one = MiningWorker(encoding, 0, 1, work.slice_stem(str(tmp_path / "one"), 0, 1))
    one.build(one.bucket(items))
    two = [MiningWorker(encoding, r, 2, work.slice_stem(str(tmp_path / "two"), r, 2)) for r in range(2)]
    readers = [w.bucket(items[r::2]) for r, w in enumerate(two)]
    for b, w in enumerate(two):
        w.build(*[reader[b] for reader in readers])
    assert 0 < two[0].report()["rows"] < one.report()["rows"] == sum(w.report()["rows"] for w in two)
    records = [r for shard in data["pairs/xq"] for r in read_shard(shard)][:40]
    queries, positives, depth = [r["txt"] for r in records], [text_id(r["json"]["positive"]) for r in records], 12
    alone = one.search(depth, positives, one.embed_queries(queries))
    vectors = [two[0].embed_queries(queries[:15]), two[1].embed_queries(queries[15:])]
    found = [w.search(depth, positives, *vectors) for w in two]
    scores, ids = topk.merge([(f.scores, f.ids) for f in found], depth)
    assert torch.equal(ids, alone.ids) and torch.equal(scores, alone.scores)
    assert torch.equal(torch.stack([f.positive_scores for f in found]).nan_to_num(-2).amax(0), alone.positive_scores)
    texts = one.slice.texts
    reference = one_process_ranking(encoding, texts, queries)
    tied = 0
    for q in range(len(queries)):
        want = naive_ranking(reference[q].tolist(), one.slice.ids.tolist())[:depth]
        assert list(zip(scores[q].tolist(), ids[q].tolist())) == want
        tied += len({s for s, _ in want}) < len(want)
    assert tied  # the case discriminates: some lists hold equal scores
    # A second worker taking the first's place finds its slice where the first saved it.
    again = MiningWorker(encoding, 1, 2, work.slice_stem(str(tmp_path / "two"), 1, 2))
    assert again.load_slice() and again.slice.texts == two[1].slice.texts
    assert torch.equal(again.slice.embeddings, two[1].slice.embeddings)


def test_a_slice_round_trips_its_texts_and_refuses_files_that_disagree_with_its_json(tmp_path):
    """Texts with line and paragraph separators come back as they were saved; a slice whose files are whole
    (checksums match) but say other than its .json (texts against rows, a text that is not a JSON string, the
    tensors' shapes) is refused, naming it, rather than taken up with its ids and texts misaligned."""
    texts = [f"line{c}next {i}" for i, c in enumerate(SEPARATORS)] + ["plain", "a\nb"]
    part = work.Slice(torch.arange(len(texts)), F.normalize(torch.randn(len(texts), 4), dim=-1), texts)
    stem = str(tmp_path / "worker-00000-of-00001")
    work.save_slice(stem, part)
    loaded = work.load_slice(stem)
    assert loaded.texts == texts and torch.equal(loaded.ids, part.ids) and torch.equal(loaded.embeddings, part.embeddings)
    jsonl = Path(f"{stem}.jsonl").read_bytes()
    tensors = Path(f"{stem}.safetensors").read_bytes()

    def tampered(jsonl: bytes, tensors: bytes) -> str:
        """The slice's files replaced, their checksums in its .json made to match: what loading it says."""
        Path(f"{stem}.jsonl").write_bytes(jsonl)
        Path(f"{stem}.safetensors").write_bytes(tensors)
        meta = json.loads(Path(f"{stem}.json").read_text())
        meta["sha256"] = [hashlib.sha256(tensors).hexdigest(), hashlib.sha256(jsonl).hexdigest()]
        Path(f"{stem}.json").write_text(json.dumps(meta))
        with pytest.raises(storage.StorageError) as refusal:
            work.load_slice(stem)
        assert str(refusal.value).startswith(f"{stem}.*: not the slice its .json describes (")
        return str(refusal.value)
    assert "4 texts in its .jsonl, 5 ids" in tampered(jsonl.split(b"\n", 1)[1], tensors)
    assert "line 2 is not JSON" in tampered(jsonl.replace(b"\n", b"\n{", 1), tensors)
    assert "line 4 is not a JSON string (a int)" in tampered(jsonl.replace(b'"plain"', b"7"), tensors)
    other = safetensors.torch.save({"ids": part.ids, "embeddings": part.embeddings.reshape(10, 2)})
    assert "shape [10, 2]" in tampered(jsonl, other)
    assert f"a safetensors header of {2**64 - 1} bytes" in tampered(jsonl, b"\xff" * 8 + tensors)
    assert "not a safetensors file of ids and embeddings" in tampered(jsonl, tensors[:8] + b"[" + tensors[9:])
    Path(f"{stem}.jsonl").write_bytes(jsonl[:-1])  # a checksum that differs: not there, embedded again
    assert work.load_slice(stem) is None


def test_progress_of_other_settings_is_refused(tmp_path):
    settings = work.Settings("d", None, "i", "m", "s", "mean", 64, "", "", "cpu", 7, 28, 0.95, False, 2)
    assert work.start(str(tmp_path), settings) is False
    assert work.start(str(tmp_path), settings) is True
    other = work.Settings(**{**settings.__dict__, "k": 5, "workers": 3})
    with pytest.raises(ValueError, match=r"other settings \(k 7 there, 5 now; workers 2 there, 3 now\)"):
        work.start(str(tmp_path), other)


# ---------------------------------------------------------------------------------------------
# Bad input: refused before Ray starts and before anything is written


def refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


def test_bad_input_is_refused(local_pairs, tiny_bert_with_heads, tmp_path, capsys):
    model = ("--model", "all-MiniLM-L6-v2")
    inside = storage.join(local_pairs, "mined")
    for out in (inside, str(Path(local_pairs).parent), local_pairs + "/pairs/../"):
        assert "is, holds or lies inside --data" in refused(capsys, *model, "--data", local_pairs, "--out", out)
    err = refused(capsys, *model, "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "o"))
    assert "no pairs streams (pairs/<source>/manifest.json) under it" in err
    err = refused(capsys, "--model", str(tmp_path / "nowhere"), "--data", local_pairs, "--out", str(tmp_path / "o"))
    assert "--model" in err and "not a folder" in err
    err = refused(capsys, "--model", tiny_bert_with_heads, "--data", local_pairs, "--out", str(tmp_path / "o"))
    assert "declares no pooling to take" in err and "give --pooling" in err
    err = refused(capsys, *model, "--data", local_pairs, "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "o"))
    assert "neither a stream (no manifest.json) nor a root of pairs streams" in err
    damaged = tmp_path / "damaged"
    shutil.copytree(local_pairs, damaged)
    shard = damaged / "pairs" / "xq" / "shard-000000.tar"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0xFF
    shard.write_bytes(bytes(data))
    err = refused(capsys, *model, "--data", str(damaged), "--out", str(tmp_path / "o"))
    assert f"{shard.as_uri()}: checksum: sha256" in err
    for option, value in (("--k", "0"), ("--max-score-ratio", "-1"), ("--max-score-ratio", "nan")):
        with pytest.raises(SystemExit) as exit_info:
            main([*model, "--data", local_pairs, "--out", str(tmp_path / "o"), option, value])
        assert exit_info.value.code == 2 and "above 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not storage.exists(storage.join(inside, ".mining", "settings.json"))


# ---------------------------------------------------------------------------------------------
# On Ray: a local cluster of 2 CPUs, the data on the S3 server


@pytest.fixture(scope="module")
def ray_env(s3_server):
    """The cluster, started after the S3 server (its workers take the server's credentials from the environment
    they start with); this process and the runs it starts join it through RAY_ADDRESS."""
    with loopback_ray_cluster(head_cpus=2) as (_, env), environ_set(env):
        yield env


@pytest.fixture(scope="module")
def s3_pairs(s3_server, tmp_path_factory) -> str:
    """The pairs on S3, in shards of 16 pairs (12 shards): a run can be stopped between them."""
    bucket = f"s3://t-{uuid.uuid4().hex[:12]}"
    storage.s3_client().create_bucket(Bucket=bucket[5:])
    return write_pairs(f"{bucket}/data", tmp_path_factory.mktemp("s3pairs"), block_records=16)


MINE = ("--model", "all-MiniLM-L6-v2", "--workers", "2", "--max-length", "128", "--query-batch", "64")


@pytest.fixture(scope="module")
def uninterrupted(ray_env, s3_pairs, tmp_path_factory) -> str:
    """One run from start to end, its output in a local folder."""
    out = str(tmp_path_factory.mktemp("mined") / "out")
    assert main([*MINE, "--data", s3_pairs, "--out", out]) == 0
    return out


def records_of(root: str) -> list[dict]:
    return [r for shard in load_shards(storage.join(root, "pairs", "xq"), "pairs") for r in read_shard(shard)]


@pytest.mark.slow
def test_two_ray_workers_mine_what_one_process_ranks(uninterrupted, s3_pairs):
    """Every pair's negatives are those of a one-process ranking of the whole corpus (each text embedded alone,
    ties by id) after the naive filter; plausible (mostly paragraphs of the positive's article, ~8% by chance);
    counted in the manifest."""
    given, mined = records_of(s3_pairs), records_of(uninterrupted)
    assert [(r["txt"], r["json"]["positive"]) for r in mined] == [(r["txt"], r["json"]["positive"]) for r in given]
    corpus = sorted({t for r in given for t in (r["json"]["positive"], *r["json"]["negatives"])}, key=text_id)
    ids = [text_id(t) for t in corpus]
    encoding = Encoding("all-MiniLM-L6-v2", "mean", 128, "", "", 1, 1, "cpu")
    scores = one_process_ranking(encoding, corpus, [r["txt"] for r in given])
    positives = collections.defaultdict(set)
    for r in given:
        positives[r["txt"]].add(text_id(r["json"]["positive"]))
    dropped, tied = collections.Counter(), 0
    for q, (before, after) in enumerate(zip(given, mined)):
        ranking = naive_ranking(scores[q].tolist(), ids)
        own = text_id(before["json"]["positive"])
        score = dict((c, s) for s, c in ranking)[own]
        kept, why = naive_filter(ranking, own, score, positives[before["txt"]] - {own}, set(), 7, 0.95)
        assert after["json"]["negatives"] == [corpus[ids.index(c)] for c in kept], q
        dropped += why
        tied += any(a[0] == b[0] for a, b in zip(ranking[:20], ranking[1:21]))
    assert tied and dropped["other_positive"] and dropped["above_ratio"]  # ties, a second positive, a near copy
    xs = load_xquad("en", ARTICLES)
    paragraphs = paragraphs_of(xs)
    article = {**dict(zip(paragraphs, xs.article)), paragraphs[0].upper(): xs.article[0]}
    same = np.mean([article[r["json"]["negatives"][0]] == article[r["json"]["positive"]] for r in mined])
    assert same > 0.5, same
    counts = json.loads(storage.read_bytes(storage.join(uninterrupted, "pairs/xq/manifest.json")))["mining"]["counts"]
    assert counts == {"pairs": len(given), "negatives": 7 * len(given), "short": 0,
                      "dropped": {reason: dropped[reason] for reason in DROP_REASONS}}
    assert not storage.exists(storage.join(uninterrupted, work.FOLDER, "settings.json"))


@pytest.mark.slow
def test_a_killed_run_continues_to_the_uninterrupted_output(uninterrupted, s3_pairs, ray_env, capsys):
    """The driver, on a local Ray cluster of its own (no RAY_ADDRESS), is killed (SIGKILL) once its first shard is
    saved: no process of its cluster is left a few seconds later (Ray's agents used to wait about a minute on
    the dead GCS, with ppid 1). The same command again takes up the workers' saved slices, whose passages hold
    U+2028, U+2029 and U+0085 (it used to stop at once: ``error: Unterminated string starting at: line 1 column 1
    (char 0)``, exit 2), and the shards done, and writes, on S3, byte for byte what the uninterrupted run wrote."""
    out = storage.join(s3_pairs.rsplit("/", 1)[0], "mined")
    command = [sys.executable, "-m", "clsys.mine", *MINE, "--data", s3_pairs, "--out", out]
    shards = len(load_shards(storage.join(s3_pairs, "pairs", "xq")))
    own_cluster = {k: v for k, v in os.environ.items() if k not in ray_env}
    run = subprocess.Popen(command, cwd=REPO, env=own_cluster, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                           text=True)
    lines = []
    for line in run.stderr:
        lines.append(line)
        if f"pairs mined (1/{shards} shards)" in line:
            cluster = psutil.Process(run.pid).children(recursive=True)
            run.send_signal(signal.SIGKILL)
            break
    assert run.wait(timeout=60) == -signal.SIGKILL, "".join(lines)
    assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= {p.name() for p in cluster}  # what is to end
    _, left = psutil.wait_procs(cluster, timeout=10)
    assert not left, [(p.pid, p.name()) for p in left]
    parts = list(storage.list_prefix(storage.join(out, work.FOLDER, "parts")))
    assert 1 <= len(parts) < shards and not storage.exists(storage.join(out, "pairs/xq/manifest.json"))
    # Other settings are not mixed in.
    assert main([*MINE, "--data", s3_pairs, "--out", out, "--k", "5"]) == 2
    assert "other settings (k 7 there, 5 now; depth 28 there, 20 now)" in capsys.readouterr().err
    assert main([*MINE, "--data", s3_pairs, "--out", out]) == 0
    err = capsys.readouterr().err
    assert f"{shards - len(parts)} of {shards} shards to mine (continuing the run under --out)" in err
    assert "taken up from the run under --out" in err

    def objects(root: str) -> dict[str, bytes]:
        return {name: storage.read_bytes(url) for url, name in storage.list_relative(root)}
    assert objects(out) == objects(uninterrupted)  # and OUT/.mining is gone
    assert all(any(c in n for r in records_of(out) for n in r["json"]["negatives"]) for c in SEPARATORS)

