"""Cross-lingual QLM + RR: example construction, RR negative sampling, QLM masking, both losses
against float64 loop references, the task/pair schedule (and its resume), and the exported reranker."""
from __future__ import annotations

import math
import random

import pytest
import torch

from clsys.recipes import load_config
from clsys.data.mixing import StreamMixer, size_weights
from clsys.data.streaming import ShardLoader
from clsys.model.encoder import load_tokenizer
from clsys.objectives.clir import CLIR, clir_example, document_side, hard_negative_probability, sample_negative
from clsys.shards.writer import ShardWriter


def pair_ids(samples: list[dict]) -> dict:
    """A collate for the loader's worker processes (module level: they get it pickled)."""
    return {"ids": [x["json"]["pair_id"] for x in samples]}


def record(i: int, hard_a: int = 2, hard_b: int = 3) -> dict:
    return {"pair_id": f"en-de/{i}-{100 + i}/0-0", "langs": ["en", "de"], "method": "lead", "score": 1.0,
            "sides": [{"lang": "en", "page_id": i, "title": f"T{i}", "heading": "",
                       "sentences": [f"The river number {i} flows north.", f"It is {i} km long."],
                       "hard_negatives": [f"English negative {i}.{k}" for k in range(hard_a)]},
                      {"lang": "de", "page_id": 100 + i, "title": f"T{i}", "heading": "",
                       "sentences": [f"Der Fluss Nummer {i} fließt nach Norden.", f"Er ist {i} km lang."],
                       "hard_negatives": [f"Deutsches Negativ {i}.{k}" for k in range(hard_b)]}]}


def test_example_direction_is_drawn_at_training_time():
    rng = random.Random(0)
    examples = [clir_example(record(1), rng) for _ in range(4000)]
    en_queries = [e for e in examples if e["query_lang"] == "en"]
    assert abs(len(en_queries) / len(examples) - 0.5) < 0.03
    for e in examples:
        side = {"en": 0, "de": 1}
        q, d = record(1)["sides"][side[e["query_lang"]]], record(1)["sides"][side[e["doc_lang"]]]
        assert e["doc_lang"] != e["query_lang"] and e["query"] in q["sentences"]
        assert e["positive"] == " ".join(d["sentences"]) and e["hard_negatives"] == d["hard_negatives"]
        assert e["pair_id"] == "en-de/1-101/0-0"
    assert {e["query"] for e in en_queries} == set(record(1)["sides"][0]["sentences"])


def test_document_side_comes_from_the_tokenizers_sequences():
    """BERT's token types mark the document; an XLM-R tokenizer (multilingual-e5) gives every token type 0,
    so the split must come from the sequence ids, or QLM would mask document tokens too."""
    import sys
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from e5_model import tokenizer_path

    queries, documents = ["Where does the river flow?", "Why?"], ["Der Fluss fließt nach Norden.", "Darum."]
    bert = load_tokenizer("all-MiniLM-L6-v2")(queries, documents, padding=True, return_tensors="pt")
    assert torch.equal(document_side(bert), bert["token_type_ids"])

    xlmr = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path()), bos_token="<s>", eos_token="</s>",
                                   sep_token="</s>", cls_token="<s>", pad_token="<pad>", unk_token="<unk>")
    enc = xlmr(queries, documents, padding=True, return_tensors="pt", return_token_type_ids=True)
    assert not enc["token_type_ids"].any()
    side = document_side(enc)
    for row, query in enumerate(queries):
        ids = enc["input_ids"][row][enc["attention_mask"][row].bool()].tolist()
        document_ids = ids[side[row, :len(ids)].argmax():]
        assert xlmr.decode(document_ids, skip_special_tokens=True) == documents[row]
        assert xlmr.decode(ids[:len(ids) - len(document_ids)], skip_special_tokens=True) == query
    assert not side[~enc["attention_mask"].bool()].any()


@pytest.mark.parametrize("hard", [0, 1, 2, 4, 8])
def test_rr_negative_is_hard_with_probability_one_minus_three_quarters_to_the_hard_count(hard):
    rng = random.Random(hard)
    hard_texts = [f"hard {k}" for k in range(hard)]
    pool = [f"pool {k}" for k in range(50)] + ["positive"]
    draws = [sample_negative(hard_texts, pool, "positive", rng) for _ in range(20000)]
    assert "positive" not in draws and None not in draws
    p = hard_negative_probability(hard)
    assert p == pytest.approx(1 - 0.75 ** hard)
    observed = sum(d.startswith("hard") for d in draws) / len(draws)
    assert abs(observed - p) <= 4 * math.sqrt(p * (1 - p) / len(draws)) + 1e-12
    # Within each kind the choice is uniform.
    if hard >= 2:
        counts = [draws.count(t) for t in hard_texts]
        assert max(counts) / min(counts) < 1.2
    assert sample_negative([], ["positive"], "positive", rng) is None


@pytest.fixture(scope="module")
def tiny_model(tiny_bert_with_heads):
    return tiny_bert_with_heads


def make(tiny_model, *overrides) -> CLIR:
    cfg = load_config("clir", [f"model.name={tiny_model}", "data.max_length=64", *overrides])
    return CLIR(cfg, load_tokenizer(tiny_model))


def test_qlm_masks_only_query_tokens_at_the_configured_rate(tiny_model):
    objective = make(tiny_model, "objective.mask_probability=0.3")
    torch.manual_seed(0)
    chosen_total, candidates_total = 0, 0
    for i in range(60):
        batch = objective.collate([{"json": record(i)} for i in range(i, i + 4)])
        ids, types, attention = batch["qlm_input_ids"], batch["qlm_token_type_ids"], batch["qlm_attention_mask"]
        special = torch.isin(ids, torch.tensor(objective.tokenizer.all_special_ids))
        query = (types == 0) & attention.bool() & ~special
        chosen = batch["qlm_chosen"]
        assert not (chosen & ~query).any(), "a document, special or pad token was masked"
        assert chosen.any(1).all(), "every sequence has at least one target"
        assert torch.equal(batch["qlm_masked_input_ids"][~chosen], ids[~chosen])
        chosen_total += int(chosen.sum())
        candidates_total += int(query.sum())
    # Bernoulli(0.3) per query token, plus the forced single target of rows that drew none.
    assert 0.27 < chosen_total / candidates_total < 0.36


def test_rr_batch_has_the_positive_then_its_negatives(tiny_model):
    objective = make(tiny_model, "objective.rr_negatives=2")
    batch = objective.collate([{"json": record(i)} for i in range(3)])
    assert batch["rr_labels"].tolist() == [1, 0, 0] * 3
    assert batch["rr_input_ids"].shape[0] == 9
    with_in_batch = make(tiny_model, "objective.rr_negatives=1", "objective.rr_in_batch=true")
    labels = with_in_batch.collate([{"json": record(i)} for i in range(3)])["rr_labels"].tolist()
    assert labels.count(1) == 3 and labels.count(0) >= 3


def naive_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    total = 0.0
    for row, label in zip(logits.double().tolist(), labels.tolist()):
        top = max(row)
        total += -(row[label] - top - math.log(sum(math.exp(v - top) for v in row)))
    return total / len(labels)


def test_losses_match_float64_loop_references(tiny_model):
    objective = make(tiny_model)
    objective.eval()  # no dropout: the reference recomputes the same forward
    torch.manual_seed(1)
    batch = objective.collate([{"json": record(i)} for i in range(4)])
    qlm, _ = objective.qlm_loss(batch)
    hidden = objective.model(input_ids=batch["qlm_masked_input_ids"], attention_mask=batch["qlm_attention_mask"],
                             token_type_ids=batch["qlm_token_type_ids"]).last_hidden_state
    logits, targets = [], []
    for b, i in batch["qlm_chosen"].nonzero().tolist():
        logits.append(objective.mlm_head(hidden[b, i][None])[0])
        targets.append(int(batch["qlm_input_ids"][b, i]))
    assert qlm.item() == pytest.approx(naive_cross_entropy(torch.stack(logits), torch.tensor(targets)), rel=1e-5)

    rr, accuracy = objective.rr_loss(batch)
    pooled = objective.model(input_ids=batch["rr_input_ids"], attention_mask=batch["rr_attention_mask"],
                             token_type_ids=batch["rr_token_type_ids"]).last_hidden_state[:, 0]
    dense, classifier = objective.rr_head[0].dense, objective.rr_head[2]
    rr_logits = torch.tanh(pooled.double() @ dense.weight.double().T + dense.bias.double()) @ \
        classifier.weight.double().T + classifier.bias.double()
    assert rr.item() == pytest.approx(naive_cross_entropy(rr_logits, batch["rr_labels"]), rel=1e-5)
    assert accuracy.item() == pytest.approx((rr_logits.argmax(-1) == batch["rr_labels"]).double().mean().item())


def test_mlm_head_is_loaded_from_the_checkpoint_and_tied(tiny_model):
    from transformers import BertForPreTraining

    objective = make(tiny_model)
    saved = BertForPreTraining.from_pretrained(tiny_model)
    assert torch.equal(objective.mlm_head.transform.dense.weight, saved.cls.predictions.transform.dense.weight)
    assert objective.mlm_head.decoder.weight.data_ptr() == objective.model.get_input_embeddings().weight.data_ptr()
    # The RR head starts from the checkpoint's pooler; its 2-way classifier is new.
    assert torch.equal(objective.rr_head[0].dense.weight, saved.bert.pooler.dense.weight)


def test_alternate_and_summed_schedules_train_both_heads(tiny_model):
    objective = make(tiny_model)
    optimizer = torch.optim.AdamW(objective.parameters(), lr=1e-3)
    batch = objective.collate([{"json": record(i)} for i in range(4)])
    for task in ("qlm", "rr"):
        out = objective({**batch, "task": task, "source": "en-de"})
        optimizer.zero_grad()
        out.loss.backward()
        used_rr = objective.rr_head[2].weight.grad is not None and objective.rr_head[2].weight.grad.abs().sum() > 0
        used_mlm = objective.mlm_head.transform.dense.weight.grad is not None
        assert used_rr == (task == "rr") and used_mlm == (task == "qlm")
        optimizer.step()
    assert {"qlm_loss", "rr_loss", "qlm_loss_en-de", "rr_accuracy"} <= set(out.metrics)

    summed = make(tiny_model, "objective.schedule=sum", "objective.rr_weight=0.5")
    summed.eval()
    out = summed({**batch, "task": "qlm+rr", "source": "en-de"})
    assert out.loss.item() == pytest.approx(summed.qlm_loss(batch)[0].item() + 0.5 * summed.rr_loss(batch)[0].item(),
                                            rel=1e-5)


def test_keep_weight_pulls_the_pooled_embeddings_to_the_starting_encoders(tiny_model):
    objective = make(tiny_model, "objective.keep_weight=2.0")
    assert not any(p.requires_grad for p in objective.start_encoder.parameters())
    objective.train()
    assert not objective.start_encoder.training  # e₀ without dropout
    batch = objective.collate([{"json": record(i)} for i in range(4)])
    objective.eval()
    assert objective.keep_loss(batch).item() == pytest.approx(0.0, abs=1e-6)  # nothing trained yet

    with torch.no_grad():
        for p in objective.model.encoder.parameters():
            p.add_(0.05 * torch.randn_like(p))
    keep = objective.keep_loss(batch)
    distances = []  # float64 loop reference: each text alone, mean pooling over its own tokens
    for side in ("query", "document"):
        ids, types, mask = (batch[f"keep_{side}_{k}"] for k in ("input_ids", "token_type_ids", "attention_mask"))
        for row in range(ids.shape[0]):
            n = int(mask[row].sum())
            inputs = {"input_ids": ids[row:row + 1, :n], "token_type_ids": types[row:row + 1, :n]}
            with torch.no_grad():
                e = objective.model(**inputs).last_hidden_state[0].double().mean(0)
                e0 = objective.start_encoder(**inputs).last_hidden_state[0].double().mean(0)
            distances.append(1 - float(e @ e0 / (e.norm() * e0.norm())))
    assert keep.item() == pytest.approx(sum(distances) / len(distances), rel=1e-4) and keep.item() > 1e-4

    out = objective({**batch, "task": "rr", "source": "en-de"})
    rr, _ = objective.rr_loss(batch)
    assert out.loss.item() == pytest.approx(rr.item() + 2.0 * keep.item(), rel=1e-5)
    assert out.metrics["keep_loss"].item() == pytest.approx(keep.item(), rel=1e-6)
    out.loss.backward()
    assert all(p.grad is None for p in objective.start_encoder.parameters())
    assert make(tiny_model).start_encoder is None  # off by default: no copy


def write_stream(folder, records: list[dict], per_shard: int) -> str:
    writer = ShardWriter(str(folder), str(folder.parent), max_bytes=1 << 30)
    for i, r in enumerate(records):
        writer.write(f"{i:06d}", r["pair_id"], r)
        if (i + 1) % per_shard == 0:
            writer.close()
    writer.close()
    writer.write_manifest({})
    return str(folder)


def test_schedule_rounds_temperature_and_resume(tmp_path):
    streams = {"en-de": write_stream(tmp_path / "en-de", [record(i) for i in range(40)], 10),
               "en-es": write_stream(tmp_path / "en-es", [record(i) for i in range(40, 50)], 5)}

    def mixer(temperature=0.0, tasks=("qlm", "rr"), alternate=True):
        loaders = {name: ShardLoader(url, 0, 1, 2, pair_ids, 7,
                                     shuffle_buffer=4)
                   for name, url in streams.items()}
        weights = size_weights(loaders, 1.0 / temperature) if temperature else None  # as CLIRData.combine does
        return StreamMixer(loaders, micro_steps=2, seed=7, weights=weights, tasks=list(tasks), alternate=alternate)

    round0 = mixer().schedule(0)
    assert [t for t, _ in round0] == ["qlm"] * 4 + ["rr"] * 4
    pairs = [s for _, s in round0]
    assert sorted(pairs[:4]) == ["en-de"] * 2 + ["en-es"] * 2 and pairs[:4] == pairs[4:]
    assert pairs[0] == pairs[1] and pairs[2] == pairs[3], "an optimizer step's micro-batches share a pair"
    assert {t for t, _ in mixer(alternate=False).schedule(0)} == {"qlm+rr"}

    # Temperature 1: pairs in proportion to their sizes (40 vs 10).
    sampled = mixer(temperature=1.0)
    assert sampled.weights == pytest.approx({"en-de": 0.8, "en-es": 0.2})
    drawn = [s for r in range(400) for t, s in sampled.schedule(r)]
    assert abs(drawn.count("en-de") / len(drawn) - 0.8) < 0.03
    assert mixer(temperature=1e9).weights == pytest.approx({"en-de": 0.5, "en-es": 0.5})

    # Resume: a mixer restored from a state taken mid-round continues with exactly the same batches.
    first = mixer()
    it = iter(first)
    for _ in range(11):
        next(it)
    state = first.state_dict()
    expected = [(b["task"], b["source"], b["ids"]) for b in (next(it) for _ in range(9))]
    second = mixer()
    second.load_state_dict(state)
    it2 = iter(second)
    assert [(b["task"], b["source"], b["ids"]) for b in (next(it2) for _ in range(9))] == expected


def test_exported_reranker_scores_like_the_rr_head(tiny_model, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from clsys.model.folder import write_reranker

    objective = make(tiny_model)
    with torch.no_grad():
        objective.rr_head[2].weight.normal_()
    state = objective.state_dict()
    prefix = "model."
    weights = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    write_reranker(str(tmp_path / "reranker"), weights, state, objective.export_spec().reranker_map,
                   AutoConfig.from_pretrained(tiny_model), tiny_model)
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "reranker").eval()
    queries, docs = ["Where does the river flow?", "How long is it?"], ["Der Fluss fließt nach Norden.", "Er ist lang."]
    ours = objective.reranker()(queries, docs)
    enc = objective.tokenizer(queries, docs, padding=True, truncation="longest_first", return_tensors="pt")
    with torch.no_grad():
        theirs = exported(**enc).logits[:, 1]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_head_lr_groups_the_heads_but_not_the_tied_decoder(tiny_model):
    from clsys.engine.deepspeed import parameter_groups

    objective = make(tiny_model, "optim.weight_decay=0.01")
    plain = parameter_groups(objective, objective.cfg)
    assert [(g["lr"], g["weight_decay"]) for g in plain] == [(1e-5, 0.01), (1e-5, 0.0)]  # as before head_lr

    objective = make(tiny_model, "optim.weight_decay=0.01", "optim.head_lr=1e-3")
    groups = parameter_groups(objective, objective.cfg)
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(1e-5, 0.01), (1e-5, 0.0), (1e-3, 0.01), (1e-3, 0.0)]
    heads = {id(p) for g in groups[2:] for p in g["params"]}
    expected = [*objective.rr_head.parameters(), objective.mlm_head.transform.dense.weight, objective.mlm_head.bias]
    assert all(id(p) in heads for p in expected)
    decoder = objective.mlm_head.decoder.weight
    assert decoder is objective.model.embeddings.word_embeddings.weight and id(decoder) not in heads
    assert sum(len(g["params"]) for g in groups) == sum(p.requires_grad for p in objective.parameters())


def _one_step_with_head_lr(rank: int, port: int, tiny: str, out: dict) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1", DS_ACCELERATOR="cpu")
    from clsys.engine.deepspeed import build_engine, init_distributed

    init_distributed()
    objective = make(tiny, "cluster.num_workers=1", "train.zero_stage=2", "optim.head_lr=1e-2",
                     "model.packed=false")
    engine = build_engine(objective, objective.cfg)
    before = {name: p.detach().clone() for name, p in objective.named_parameters()}
    torch.manual_seed(0)
    batch = {**objective.collate([{"json": record(i)} for i in range(4)]), "task": "rr", "source": "en-de"}
    engine.backward(engine(batch).loss)
    engine.step()
    moved = {name: (p.detach() - before[name]).abs().max().item() for name, p in objective.named_parameters()}
    out["classifier"] = moved["rr_head.2.weight"]
    out["encoder"] = max(v for name, v in moved.items() if name.startswith("model."))


def test_head_lr_reaches_the_deepspeed_optimizer(tiny_model):
    """AdamW's first step moves every parameter with a gradient by about its group's lr: ZeRO-2 must keep
    the groups' rates."""
    import torch.multiprocessing as mp

    from tests.conftest import free_port

    out = mp.Manager().dict()
    mp.spawn(_one_step_with_head_lr, args=(free_port(), tiny_model, out), nprocs=1, join=True)
    assert out["classifier"] == pytest.approx(1e-2, rel=0.05)
    assert out["encoder"] == pytest.approx(1e-5, rel=0.05)


def _stage0_checkpoint(rank: int, port: int, tiny: str, run: str, out: dict) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1", DS_ACCELERATOR="cpu")
    from clsys.engine.checkpoint_writer import CheckpointWriter
    from clsys.engine.deepspeed import build_engine, init_distributed

    init_distributed()
    objective = make(tiny, "cluster.num_workers=1", "train.zero_stage=0", "model.packed=false", "optim.lr=1e-3")
    engine = build_engine(objective, objective.cfg)
    batch = {**objective.collate([{"json": record(i)} for i in range(4)]), "task": "rr", "source": "en-de"}
    engine.backward(engine(batch).loss)
    engine.step()
    meta = {"world_size": 1, "objective": "clir", **objective.export_spec().to_meta(),
            "config": objective.cfg.to_dict()}

    def hf_files(folder: str) -> None:
        objective.tokenizer.save_pretrained(folder)
        objective.model.config.save_pretrained(folder)

    CheckpointWriter(engine, run, keep=1, background=False).save(1, {}, meta, hf_files)
    out["classifier"] = objective.rr_head[2].weight.detach().clone()
    out["query"] = objective.model.encoder.layer[1].attention.self.query.weight.detach().clone()


def test_a_zero_stage_0_checkpoint_exports(tiny_model, tmp_path):
    """Stage 0 writes no ZeRO partitions: export reads the module's state instead (it used to fail)."""
    import torch.multiprocessing as mp
    from transformers import AutoModel, AutoModelForSequenceClassification

    from clsys.export import export
    from tests.conftest import free_port

    out, run = mp.Manager().dict(), f"file://{tmp_path}/run"
    mp.spawn(_stage0_checkpoint, args=(free_port(), tiny_model, run, out), nprocs=1, join=True)
    export("latest", str(tmp_path / "export"), run)
    encoder = AutoModel.from_pretrained(tmp_path / "export")
    assert torch.equal(encoder.encoder.layer[1].attention.self.query.weight, out["query"])
    reranker = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export" / "reranker")
    assert torch.equal(reranker.classifier.weight, out["classifier"])
