"""Supervised SimCSE (docs/training/objectives.md#simcse-sup): the loss of a real forward against the naive float64 reference,
gradients, config checks, and the export of the kept MLP as the HF pooler / sentence-transformers Dense."""
from __future__ import annotations

import json

import pytest
import torch

from clsys.config import Config
from clsys.model.folder import with_pooler, write_model
from clsys.model.encoder import load_tokenizer
from clsys.objectives.simcse import SimCSE, SimCSEConfig
from test_contrastive import naive_info_nce

WORDS = "a man woman dog plays runs sleeps outside inside the is not nobody park ball cat".split()
SAMPLES = [{"json": {"anchor": "a man plays outside", "positive": "a man plays", "negative": "nobody plays"}},
           {"json": {"anchor": "the dog runs in the park", "positive": "a dog runs", "negative": "the dog sleeps"}},
           {"json": {"anchor": "a woman is inside", "positive": "a woman is not outside", "negative": "a woman is outside"}}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A random 2-layer BertModel (vocab 100, hidden 32) and a word-level tokenizer, saved as an HF folder."""
    from transformers import BertConfig, BertModel, BertTokenizer

    folder = tmp_path_factory.mktemp("tiny-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    vocab += [f"[unused{i}]" for i in range(100 - len(vocab))]
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config).save_pretrained(folder)
    return str(folder)


def make_objective(model: str, **objective) -> SimCSE:
    cfg = Config(objective=SimCSEConfig(**objective))
    cfg.model.name = model
    torch.manual_seed(1)
    return SimCSE(cfg, load_tokenizer(model))


def test_supervised_stream_and_batch(tiny_model):
    objective = make_objective(tiny_model, supervised=True)
    assert SimCSE.streams(objective.cfg) == ["triplets"]
    assert SimCSE.streams(make_objective(tiny_model).cfg) == ["sentences"]
    batch = objective.collate(SAMPLES)
    assert batch["input_ids"].shape[0] == 3 * len(SAMPLES)  # anchors, positives, negatives in one forward
    rows = objective.tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
    assert rows[0] == SAMPLES[0]["json"]["anchor"] and rows[4] == SAMPLES[1]["json"]["positive"]
    assert rows[8] == SAMPLES[2]["json"]["negative"]


@pytest.mark.parametrize("alpha", [0.0, 0.8])
def test_supervised_loss_matches_naive_reference_and_trains_everything(tiny_model, alpha):
    objective = make_objective(tiny_model, supervised=True, hard_negative_weight=alpha, export_pooling="cls_mlp")
    objective.eval()  # dropout off, so the reference below sees the same embeddings as the loss
    batch = objective.collate(SAMPLES)
    out = objective(batch)
    with torch.no_grad():
        z = objective.mlp(objective.model(**batch).last_hidden_state[:, 0]).double()
    z1, z2, z3 = z.chunk(3)
    assert out.loss.item() == pytest.approx(naive_info_nce(z1, z2, 0.05, z3, alpha), rel=1e-5)
    assert set(out.metrics) == {"loss", "alignment", "uniformity"}
    out.loss.backward()
    for name in ("mlp.dense.weight", "model.embeddings.word_embeddings.weight", "model.encoder.layer.1.output.dense.weight"):
        grad = objective.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


@pytest.mark.parametrize("objective,key", [
    ({"export_pooling": "cls_mlp"}, "objective.export_pooling"),  # unsupervised keeps raw CLS
    ({"supervised": True, "pooler": "cls", "export_pooling": "cls_mlp"}, "objective.export_pooling"),  # no MLP
    ({"hard_negative_weight": 1.0}, "objective.hard_negative_weight"),  # no hard negatives without triplets
    ({"supervised": True, "export_pooling": "cls_max"}, "objective.export_pooling"),
])
def test_invalid_combinations_name_the_key(tiny_model, objective, key):
    with pytest.raises(ValueError, match=key):
        make_objective(tiny_model, **objective)


def test_export_cls_mlp_is_hf_pooler_and_sentence_transformers_dense(tiny_model, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    objective = make_objective(tiny_model, supervised=True, export_pooling="cls_mlp")
    with torch.no_grad():  # a trained-looking MLP, not the fresh init
        objective.mlp.dense.weight.normal_(0, 0.3)
        objective.mlp.dense.bias.normal_(0, 0.3)
    spec = objective.export_spec()
    folder = tmp_path / "export"
    write_model(str(folder), spec.encoder_weights(objective.state_dict()), objective.model.config,
                tiny_model, "cls_mlp", 32, "test", tiny_model)

    sentences = ["a man plays outside", "the dog sleeps inside"]
    objective.eval()
    batch = objective.tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        cls = objective.model(**batch).last_hidden_state[:, 0]
        want = torch.tanh(cls @ objective.mlp.dense.weight.T + objective.mlp.dense.bias)
        hf = AutoModel.from_pretrained(folder).eval()(**batch).pooler_output
    st = SentenceTransformer(str(folder), device="cpu").encode(sentences, convert_to_tensor=True)
    torch.testing.assert_close(hf, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st, want, atol=1e-5, rtol=1e-5)
    modules = json.loads((folder / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Dense"]
    assert json.loads((folder / "1_Pooling" / "config.json").read_text())["pooling_mode_cls_token"]


def test_export_unsupervised_keeps_raw_cls_and_the_base_pooler(tiny_model, tmp_path):
    """The training MLP stays out of the export (raw CLS at inference); the pooler the folder
    carries, for AutoModel's sake, is the base model's, untrained."""
    from safetensors.torch import load_file

    from clsys.model.encoder import pooler_weights

    objective = make_objective(tiny_model)
    spec = objective.export_spec()
    assert spec.head_map == {}
    pooler = write_model(str(tmp_path), spec.encoder_weights(objective.state_dict()), objective.model.config,
                         tiny_model, "cls", 32, "test", tiny_model)
    assert pooler == f"{tiny_model}'s, untrained"
    saved, base = load_file(tmp_path / "model.safetensors"), pooler_weights(tiny_model)
    assert set(base) == {"pooler.dense.weight", "pooler.dense.bias"}
    assert all(torch.equal(saved[k], v) for k, v in base.items())
    assert not torch.equal(saved["pooler.dense.weight"], objective.mlp.dense.weight.detach())
    assert not (tmp_path / "2_Dense").exists()
    # From scratch (no base weights to take): a fixed initialisation, the same on every export.
    fresh, pooler = with_pooler(spec.encoder_weights(objective.state_dict()), objective.model.config, "")
    again, _ = with_pooler(spec.encoder_weights(objective.state_dict()), objective.model.config, "")
    assert pooler == "initialised (seed 0), untrained" and torch.equal(fresh["pooler.dense.weight"],
                                                                       again["pooler.dense.weight"])


def test_training_mlp_is_initialised_like_simcse(tiny_model):
    """SimCSE's cl_init: weight ~ N(0, initializer_range²), zero bias; PyTorch's default would give a
    uniform weight with std 1/sqrt(3·32) ≈ 0.10 and a non-zero bias."""
    dense = make_objective(tiny_model).mlp.dense
    assert torch.count_nonzero(dense.bias) == 0
    assert 0.017 < dense.weight.std().item() < 0.023  # 1024 draws of N(0, 0.02²)
    assert abs(dense.weight.mean().item()) < 0.003
