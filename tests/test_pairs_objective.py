"""The pairs objective (clsys/objectives/pairs.py): its loss against a naive float64 reference written with loops,
in one process and across a real 2-process gloo group; GradCache's gradient against the full batch's; its collate
on real shards written by ``python -m data_prep pairs`` (prefixes, instructions, k negatives drawn or left out);
its config and the bundled sample it trains on in the docs; and one short ``python -m clsys.pretrain --config
pairs`` run whose export sentence-transformers loads, prompts and Matryoshka dimensions included (slow)."""
from __future__ import annotations

import json
import math
import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data_prep" / "samples" / "xquad-en-train.parquet"

# A global batch of 6 pairs, k = 2 hard negatives each, as digests (which text is which) and presence:
# pair 4 asks pair 0's query, pair 3 has pair 1's positive, pair 4's first negative is pair 2's positive; pairs
# have 2, 1, 0, 2, 2 and 1 negatives. Split over 2 ranks (pairs 0-2, 3-5), every copy is on the other rank.
QUERY_DIGESTS = [10, 11, 12, 13, 10, 15]
POSITIVE_DIGESTS = [20, 21, 22, 21, 24, 25]
NEGATIVE_DIGESTS = [[30, 31], [32, 0], [0, 0], [33, 34], [22, 35], [36, 0]]
PRESENT = [[True, True], [True, False], [False, False], [True, True], [True, True], [True, False]]
K = 2


def labels(pairs: slice = slice(None)) -> dict[str, torch.Tensor]:
    """The batch's label tensors (as ``PairsData.collate`` makes them) of ``pairs``."""
    return {"query_digest": torch.tensor(QUERY_DIGESTS[pairs], dtype=torch.int32),
            "positive_digest": torch.tensor(POSITIVE_DIGESTS[pairs], dtype=torch.int32),
            "negative_digest": torch.tensor(NEGATIVE_DIGESTS[pairs], dtype=torch.int32).flatten(),
            "negative_present": torch.tensor(PRESENT[pairs]).flatten()}


def naive_loss(q, p, n, tau: float, symmetric: bool, dims: list[int]) -> float:
    """The loss by its definition, with loops over the whole global batch: each query over every positive and every
    present hard negative, but for copies of what is relevant to it (the same query or positive: that pair's
    positive; a negative equal to its positive); with ``symmetric``, each positive over every query (the same
    copies left out), the two directions averaged; summed over the embeddings cut to each of ``dims``."""
    def cos(u, v):
        return sum(a * b for a, b in zip(u, v)) / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))

    def same(i, j):
        return j != i and (QUERY_DIGESTS[j] == QUERY_DIGESTS[i] or POSITIVE_DIGESTS[j] == POSITIVE_DIGESTS[i])

    pairs, total = len(q), 0.0
    for dim in dims:
        qs, ps = [v[:dim] for v in q.tolist()], [v[:dim] for v in p.tolist()]
        ns = [v[:dim] for v in n.tolist()]
        forward = backward = 0.0
        for i in range(pairs):
            denominator = sum(math.exp(cos(qs[i], ps[j]) / tau) for j in range(pairs) if not same(i, j))
            for j in range(pairs):
                for m in range(K):
                    if PRESENT[j][m] and NEGATIVE_DIGESTS[j][m] != POSITIVE_DIGESTS[i]:
                        denominator += math.exp(cos(qs[i], ns[j * K + m]) / tau)
            forward -= math.log(math.exp(cos(qs[i], ps[i]) / tau) / denominator)
            denominator = sum(math.exp(cos(ps[i], qs[j]) / tau) for j in range(pairs) if not same(i, j))
            backward -= math.log(math.exp(cos(ps[i], qs[i]) / tau) / denominator)
        total += (forward + backward) / (2 * pairs) if symmetric else forward / pairs
    return total


def embeddings(width: int = 5, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pairs = len(QUERY_DIGESTS)
    return [torch.randn(rows, width, generator=g, dtype=torch.float64) for rows in (pairs, pairs, pairs * K)]


@pytest.mark.parametrize("symmetric,dims,tau", [(False, [5], 0.05), (True, [5], 0.02), (True, [5, 3], 0.1),
                                                (False, [5, 2, 1], 0.02)])
def test_loss_matches_the_naive_reference(symmetric, dims, tau):
    from clsys.objectives.pairs import pairs_loss
    from clsys.objectives.ranks import ONE_PROCESS

    q, p, n = embeddings()
    out = pairs_loss(q, p, n, labels(), tau, symmetric, dims, ONE_PROCESS)
    assert out.loss.item() == pytest.approx(naive_loss(q, p, n, tau, symmetric, dims), rel=1e-10)
    # Pair 0 has pair 4's positive left out (same query) and pair 1 pair 3's (same positive), and vice versa.
    assert out.metrics["copies_left_out"].item() == pytest.approx(4 / 6)
    # The copies matter: counted as negatives, they give another loss.
    distinct = {**labels(), "query_digest": torch.arange(6, dtype=torch.int32),
                "positive_digest": torch.arange(100, 106, dtype=torch.int32)}
    assert pairs_loss(q, p, n, distinct, tau, symmetric, dims, ONE_PROCESS).loss.item() != \
        pytest.approx(out.loss.item(), rel=1e-6)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5)).double()


def _inputs() -> list[torch.Tensor]:
    """Model inputs of the global batch's queries, positives and negatives."""
    g = torch.Generator().manual_seed(2)
    pairs = len(QUERY_DIGESTS)
    return [torch.randn(rows, 6, generator=g, dtype=torch.float64) for rows in (pairs, pairs, pairs * K)]


SETTINGS = [(False, [5], 0.05), (True, [5, 2], 0.02)]  # (symmetric, dims, τ) of the two-rank runs


def _gradients(model, pairs: slice, symmetric: bool, dims: list[int], tau: float, ranks) -> tuple[float, list]:
    from clsys.objectives.pairs import pairs_loss

    q, p, n = _inputs()
    first, last = pairs.start or 0, pairs.stop or len(QUERY_DIGESTS)
    out = pairs_loss(model(q[pairs]), model(p[pairs]), model(n[first * K:last * K]), labels(pairs), tau, symmetric,
                     dims, ranks)
    model.zero_grad()
    out.loss.backward()
    return out.loss.item(), [param.grad.clone() for param in model.parameters()]


def _rank(rank: int, world: int, port: int, out: str) -> None:
    from clsys.engine.ranks import ProcessGroupRanks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = len(QUERY_DIGESTS) // world
    results = []
    for symmetric, dims, tau in SETTINGS:
        model = _model()
        loss, grads = _gradients(model, slice(rank * rows, (rank + 1) * rows), symmetric, dims, tau,
                                 ProcessGroupRanks())
        for grad in grads:  # what DeepSpeed (and DDP) do with the per-rank gradients: average them over ranks
            dist.all_reduce(grad)
            grad /= world
        results.append((loss, grads))
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_give_the_gradient_of_one_process_with_the_global_batch(tmp_path):
    """2 gloo ranks × 3 pairs, the copies and the negative equal to a positive each on the other rank: the averaged
    gradient is one process's with all 6 pairs, and the ranks' mean loss is its loss (the naive reference's)."""
    from clsys.objectives.ranks import ONE_PROCESS

    out = str(tmp_path / "grads")
    mp.spawn(_rank, args=(2, free_port(), out), nprocs=2, join=True)
    got = [torch.load(f"{out}.{rank}", weights_only=True) for rank in range(2)]
    for index, (symmetric, dims, tau) in enumerate(SETTINGS):
        model = _model()
        loss, reference = _gradients(model, slice(None), symmetric, dims, tau, ONE_PROCESS)
        with torch.no_grad():
            q, p, n = (model(x) for x in _inputs())
        assert loss == pytest.approx(naive_loss(q, p, n, tau, symmetric, dims), rel=1e-10)
        assert (got[0][index][0] + got[1][index][0]) / 2 == pytest.approx(loss, rel=1e-10)
        for rank in range(2):
            for g, r in zip(got[rank][index][1], reference):
                torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
        # The test can fail: each rank's pairs alone give another gradient.
        _, alone = _gradients(_model(), slice(0, 3), symmetric, dims, tau, ONE_PROCESS)
        assert not torch.allclose(alone[0], reference[0])


ROWS = [  # two sources; one row with an instruction; 3, 1, 0 and 2 negatives
    {"query": "what do cats eat", "positive": "Cats eat mice and fish.",
     "negatives": ["Dogs bark at night.", "Fish swim in rivers.", "Birds fly south."], "source": "nq"},
    {"query": "who wrote hamlet", "positive": "Shakespeare wrote Hamlet around 1600.",
     "negatives": ["Milton wrote Paradise Lost."], "source": "nq",
     "instruction": "Given a question, find the passage that answers it"},
    {"query": "capital of france", "positive": "Paris is the capital of France.", "negatives": [],
     "source": "msmarco"},
    {"query": "boiling point of water", "positive": "Water boils at 100 degrees Celsius at sea level.",
     "negatives": ["Ice melts at 0 degrees.", "Iron melts at 1538 degrees."], "source": "msmarco"},
    {"query": "how tall is everest", "positive": "Everest is 8849 metres high.",
     "negatives": ["K2 is 8611 metres high.", "Mont Blanc is 4805 metres high."], "source": "nq"},
    {"query": "what is a cat", "positive": "Cats eat mice and fish.",  # the first row's positive again
     "negatives": ["Cows eat grass."], "source": "msmarco"},
]
# Quoted: an override's value is stripped, and the prefixes end in a space.
SETTINGS_OF_COLLATE = ["objective.negatives=2", "objective.query_prefix='query: '",
                       "objective.passage_prefix='passage: '", "objective.source_prefixes={nq: 'question: '}"]


@pytest.fixture(scope="module")
def pairs_root(tmp_path_factory) -> str:
    """``data_prep pairs`` output of ROWS: the streams pairs/msmarco and pairs/nq."""
    from data_prep.__main__ import main

    folder = tmp_path_factory.mktemp("pairs")
    source = folder / "rows.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    assert main(["pairs", "--input", str(source), "--out", str(folder / "shards")]) == 0
    return str(folder / "shards")


def objective_on(root: str, tiny: str, *overrides: str):
    from clsys.model.encoder import load_tokenizer
    from clsys.recipes import OBJECTIVES, load_config

    cfg = load_config(None, ["objective.name=pairs", f"data.url={root}", f"model.name={tiny}", "model.init=scratch",
                             "model.tokenizer=all-MiniLM-L6-v2", "model.dropout=0.0", "data.max_length=32",
                             "cluster.num_workers=1", *overrides])
    return OBJECTIVES["pairs"](cfg, load_tokenizer(cfg.model.tokenizer))


def records(root: str) -> list[dict]:
    """Every record of every stream under ``root``, as the loader decodes them."""
    from clsys.objectives.pairs import pairs_streams
    from clsys.shards.reader import load_shards, read_shard

    return [s for stream in pairs_streams(root) for shard in load_shards(f"{root}/{stream}", "pairs")
            for s in read_shard(shard)]


def test_collate_on_data_prep_shards_prefixes_instructions_and_k_negatives(pairs_root, tiny):
    from clsys.objectives.pairs import pairs_streams, text_digest

    assert pairs_streams(pairs_root) == ["pairs/msmarco", "pairs/nq"]
    objective = objective_on(pairs_root, tiny, *SETTINGS_OF_COLLATE)
    samples = records(pairs_root)
    random.seed(3)  # as the loader seeds Python's random before each batch
    batch = objective.collate(samples)
    by_query = {row["query"]: row for row in ROWS}
    rows = [by_query[s["txt"]] for s in samples]
    # The record's instruction first, else its source's prefix, else the query prefix.
    queries = [(f"Instruct: {row['instruction']}\nQuery: " if row.get("instruction")
                else "question: " if row["source"] == "nq" else "query: ") + row["query"] for row in rows]
    positives = ["passage: " + row["positive"] for row in rows]
    # k = 2 negatives a pair: 2 of 3 drawn, all of 2 or fewer, the missing ones empty rows marked absent.
    negatives, present = [], []
    for index, row in enumerate(rows):
        offered = {text_digest("passage: " + text): "passage: " + text for text in row["negatives"]}
        drawn = batch["negative_digest"][2 * index:2 * index + 2].tolist()
        shown = batch["negative_present"][2 * index:2 * index + 2].tolist()
        assert shown == [m < len(row["negatives"]) for m in range(2)]
        assert len({d for d, s in zip(drawn, shown) if s}) == min(2, len(row["negatives"]))
        negatives += [offered[d] if s else "" for d, s in zip(drawn, shown)]
        present += shown
    expected = objective.data.texts(queries + positives + negatives)
    assert set(expected) <= set(batch) and all(torch.equal(batch[k], v) for k, v in expected.items())
    assert batch["query_digest"].tolist() == [text_digest(t) for t in queries]
    assert batch["positive_digest"].tolist() == [text_digest(t) for t in positives]
    # The same seed draws the same negatives (a resumed run); others draw others (the next epoch).
    random.seed(3)
    assert torch.equal(objective.collate(samples)["negative_digest"], batch["negative_digest"])
    three = next(i for i, row in enumerate(rows) if len(row["negatives"]) == 3)
    draws = set()
    for seed in range(10):
        random.seed(seed)
        draws.add(tuple(objective.collate(samples)["negative_digest"][2 * three:2 * three + 2].tolist()))
    assert len(draws) > 1
    # What the loader workers get: the data spec alone, which collates alike.
    light = pickle.loads(pickle.dumps(objective.data))
    random.seed(3)
    assert all(torch.equal(v, batch[k]) for k, v in light.collate(samples).items())
    # The lengths that length-grouped batches sort by: each pair's longest text.
    longest = [max(len(objective.tokenizer(t, add_special_tokens=False)["input_ids"])
                   for t in [s["txt"], s["json"]["positive"], *s["json"]["negatives"]]) for s in samples]
    assert objective.sample_lengths(samples) == longest


def test_grad_cache_gives_the_full_batch_gradient(pairs_root, tiny):
    """float64, dropout off, every option of the loss on: GradCache's three passes over chunks of 5 rows (of 24)
    give the plain step's loss and gradient."""
    from clsys.engine.grad_cache import grad_cache

    runs = {}
    for way in ("plain", "grad_cache"):
        torch.manual_seed(0)
        objective = objective_on(pairs_root, tiny, *SETTINGS_OF_COLLATE, "objective.symmetric=true",
                                 "objective.matryoshka_dims=[32,8]", "objective.grad_cache.chunk_size=5").double()
        random.seed(0)
        batch = objective.collate(records(pairs_root))
        if way == "plain":
            out = objective(batch)
            out.loss.backward()
        else:
            out = grad_cache(objective, batch, 5, lambda chunk, part: objective.grad_cache_part(chunk, part, batch),
                             lambda surrogate, last: surrogate.backward())
        runs[way] = (out.loss.item(), {name: p.grad.clone() for name, p in objective.named_parameters()
                                       if p.grad is not None})
    (loss, grads), (ref_loss, ref_grads) = runs["grad_cache"], runs["plain"]
    assert batch["input_ids"].shape[0] == 6 * (2 + 2) and loss == pytest.approx(ref_loss, rel=1e-10)
    assert grads.keys() == ref_grads.keys() and len(ref_grads) > 10
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-9, atol=1e-12 * (1 + g.abs().max().item()), msg=name)


def test_config_mappings_and_settings_are_checked_by_name(pairs_root, tiny, tmp_path):
    from clsys.config import ConfigError
    from clsys.objectives.pairs import pairs_streams
    from clsys.recipes import load_config

    cfg = load_config("pairs", ["objective.source_prefixes={nq: 'question: ', msmarco: ''}"])
    assert cfg.objective.source_prefixes == {"nq": "question: ", "msmarco": ""}
    assert load_config(None, ["objective.name=pairs"]).objective.source_prefixes == {}
    with pytest.raises(ConfigError, match=r"objective.source_prefixes: expected a mapping such as \{name: value\}, "
                                          r"got \['nq'\]"):
        load_config("pairs", ["objective.source_prefixes=[nq]"])
    for override, message in [
        ("objective.matryoshka_dims=[32,64]", "objective.matryoshka_dims: expected distinct dimensions from 1 to "
                                              "the encoder's 32, got [32, 64]"),
        ("objective.source_prefixes={query: 'q: '}", "objective.source_prefixes: expected sources other than query"),
        ("objective.instruction_format=Task: ", "objective.instruction_format: expected a text holding "
                                                "{instruction}"),
        ("objective.temperature=0", "objective.temperature: expected > 0"),
    ]:
        with pytest.raises(ValueError) as refused:
            objective_on(pairs_root, tiny, override)
        assert message in str(refused.value), override
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"{empty}/pairs: no pairs/<source> stream .*python -m data_prep pairs"):
        pairs_streams(str(empty))
    # The sources: those data.sources names, else every one found; their loaders in data.sources' schedule.
    from clsys.data.mixing import StreamMixer
    from clsys.data.streaming import stream_loader
    from clsys.objectives.pairs import Pairs

    assert Pairs.streams(objective_on(pairs_root, tiny).cfg) == ["pairs/msmarco", "pairs/nq"]
    objective = objective_on(pairs_root, tiny, "data.sources=[pairs/nq]", "train.batch_size=2")  # nq has 3 pairs
    assert objective.data.streams == ["pairs/nq"]
    loaders = {stream: stream_loader(objective.cfg, stream, 0, 1, objective.data) for stream in objective.data.streams}
    mixer = objective.data.combine(loaders)
    assert isinstance(mixer, StreamMixer) and mixer.loaders is loaders


def test_retrieval_dev_during_training_puts_the_prefixes_the_export_will_declare(pairs_root, tiny, tmp_path):
    """eval.retrieval_dev scores the model in training as clsys.evaluate scores its export, which declares the
    query and passage prefixes as its prompts: with them before the queries and the documents."""
    from clsys.engine.evaluator import Evaluator
    from clsys.eval.beir import evaluate_beir, load_beir
    from clsys.metrics.health import TensorBoard

    folder = tmp_path / "beir"
    (folder / "qrels").mkdir(parents=True)
    texts = [row["positive"] for row in ROWS[:5]] + [n for row in ROWS for n in row["negatives"]]
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "text": t}) + "\n"
                                                 for i, t in enumerate(texts)))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": row["query"]}) + "\n"
                                                  for i, row in enumerate(ROWS[:5])))
    (folder / "qrels" / "dev.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\td{i}\t1\n"
                                                                                    for i in range(5)))
    objective = objective_on(pairs_root, tiny, "objective.query_prefix='query: '",
                             "objective.passage_prefix='passage: '", f"eval.retrieval_dev={folder}", "eval.sts_dev=",
                             "eval.select=", "eval.pooling=mean")
    tb = TensorBoard(str(tmp_path / "tb"))
    scores = Evaluator(objective, objective.cfg, 0, tb).retrieval()
    tb.close()
    data = load_beir(folder, "dev")

    def scored(*prefixes: str) -> dict[str, float]:
        result = evaluate_beir(objective.encoder(), objective.tokenizer, data, "mean", 64, 64, *prefixes)
        return {f"beir_{k}": v for k, v in result.items() if k != "n"}

    assert scores == scored("query: ", "passage: ")
    assert scores != scored("", "")  # the prefixes change the figures: the comparison can fail


def test_the_bundled_sample_is_what_its_script_builds():
    """data_prep/samples/xquad-en-train.parquet: the rows xquad_pairs.py builds from the bundled XQuAD (none of
    articles 24-47, which xquad-en's test split asks about)."""
    import importlib.util

    import pyarrow.parquet as pq

    spec = importlib.util.spec_from_file_location("xquad_pairs", SAMPLE.parent / "xquad_pairs.py")
    xquad_pairs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(xquad_pairs)
    built, bundled = xquad_pairs.build().to_pylist(), pq.read_table(SAMPLE).to_pylist()
    assert built == bundled and len(bundled) == 632
    assert all(len(row["negatives"]) == 3 and row["positive"] not in row["negatives"] for row in bundled)
    test_documents = {json.loads(line)["text"] for line in
                      (REPO / "clsys" / "assets" / "beir" / "xquad-en" / "corpus.jsonl").read_text().splitlines()
                      if json.loads(line)["_id"] >= "24"}
    assert not test_documents & {text for row in bundled for text in [row["positive"], *row["negatives"]]}


@pytest.mark.slow
def test_pretrain_with_the_pairs_recipe_exports_prompts_and_matryoshka_dims(tiny_bert_with_heads, tmp_path):
    """data_prep pairs on the bundled sample, then 2 steps of the recipe on the small random BERT (one worker,
    GradCache chunks of 7 rows under DeepSpeed), then its export as sentence-transformers loads it."""
    def run(*args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        return proc

    assert run("-m", "data_prep", "pairs", "--input", str(SAMPLE), "--out", "shards").returncode == 0
    proc = run("-m", "clsys.pretrain", "--config", "pairs", "data.url=shards", "train.run_root=runs",
               f"model.name={tiny_bert_with_heads}", "data.max_length=48", "train.batch_size=6", "train.steps=2",
               "train.ckpt_every=2", "train.log_every=1", "objective.negatives=2", "objective.grad_cache.chunk_size=7",
               "objective.query_prefix='query: '", "objective.passage_prefix='passage: '",
               "objective.source_prefixes={xquad-en-train: 'question: '}", "objective.matryoshka_dims=[32,16]",
               "eval.sts_dev=", "cluster.cpus_per_worker=1")
    assert proc.returncode == 0
    assert "[clsys] step 2/2 loss" in proc.stdout + proc.stderr
    export = tmp_path / "runs" / "pairs" / "export"
    st_config = json.loads((export / "config_sentence_transformers.json").read_text())
    assert st_config["prompts"] == {"query": "query: ", "passage": "passage: ", "xquad-en-train": "question: "}
    assert st_config["default_prompt_name"] is None
    card = (export / "README.md").read_text()
    assert "| Matryoshka dimensions | 32, 16 (trained to be used truncated to each) |" in card
    assert 'model.encode(["how long do cats sleep?"], prompt_name="query")' in card

    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(export), device="cpu")
    prompted = model.encode(["what is the capital of france"], prompt_name="query", convert_to_tensor=True)
    written = model.encode(["query: what is the capital of france"], convert_to_tensor=True)
    torch.testing.assert_close(prompted, written)
    assert not torch.allclose(prompted, model.encode(["what is the capital of france"], convert_to_tensor=True))
    small = SentenceTransformer(str(export), device="cpu", truncate_dim=16)
    assert small.encode(["a passage"], prompt_name="passage").shape == (1, 16)
