"""Packed encoder forwards (model.packed, clsys/model/packing.py) against the padded path.

Every check is in float64 with dropout off, so packed and padded must agree to rounding: outputs at the
real tokens, zeros at the pads, every layer's hidden states, and every parameter's gradient; for the
encoder alone (BERT and RoBERTa position ids, right and left padding, both attention kernels) and for
each objective's whole loss (SimCSE unsup/sup with the MLM auxiliary, SG, SG-OPT, TaCL with NSP, QLM + RR, CSS-LM stage A).
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from clsys.recipes import OBJECTIVES, load_config
from clsys.model import packing
from clsys.model.encoder import load_tokenizer

TEXTS = ["A river.", "The river rises in the hills and flows east for forty miles to the sea.",
         "It reaches the sea at the port of Lynn, where ships once loaded wool.", "Hills.",
         "In 1850 the first bridge was built; it stood for ninety years.", "Wool was the main export.",
         "Tolls paid for the bridge.", "The port silted up, and trade moved south to other harbours along the coast."]


def tiny_encoder(kind: str) -> torch.nn.Module:
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    config_class, model_class = {"bert": (BertConfig, BertModel), "roberta": (RobertaConfig, RobertaModel)}[kind]
    torch.manual_seed(0)
    config = config_class(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, pad_token_id=1, type_vocab_size=2)
    return model_class(config, add_pooling_layer=False).double()


def ragged_batch(padding_side: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([5, 11, 3, 11, 1, 8])
    width = int(lengths.max())
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    if padding_side == "left":
        mask = mask.flip(1)
    ids = torch.randint(2, 100, mask.shape, generator=generator).masked_fill(mask == 0, 1)
    types = torch.randint(0, 2, mask.shape, generator=generator) * mask
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("kernel", ["padded", "nested"])
def test_packed_encoder_equals_padded_outputs_and_gradients(kind, padding_side, kernel):
    model = tiny_encoder(kind)
    generator = torch.Generator().manual_seed(1)
    batch = ragged_batch(padding_side, generator)
    real = batch["attention_mask"][..., None].double()
    weights = torch.randn(*batch["input_ids"].shape, 32, generator=generator, dtype=torch.float64)

    reference = model(**batch, output_hidden_states=True)
    (reference.last_hidden_state * real * weights).sum().backward()
    expected = grads(model)
    model.zero_grad()

    packing.enable(model)
    out = packing.encode(model, batch, packed=True, output_hidden_states=True, kernel=kernel)
    (out.last_hidden_state * weights).sum().backward()
    assert torch.allclose(out.last_hidden_state, reference.last_hidden_state * real, atol=1e-12)
    assert (out.last_hidden_state[batch["attention_mask"] == 0] == 0).all(), "pads are not zeros"
    assert len(out.hidden_states) == len(reference.hidden_states)
    for packed_layer, padded_layer in zip(out.hidden_states, reference.hidden_states):
        assert torch.allclose(packed_layer, padded_layer * real, atol=1e-12)
    got = grads(model)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.allclose(got[name], grad, atol=1e-11), name


@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("kernel", ["padded", "nested"])
def test_first_tokens_only_equal_the_padded_cls_outputs_and_gradients(kind, kernel):
    """encode_first: the last layer computes the rows' first tokens alone, with the [CLS] vectors and every
    gradient of a full padded forward (last-layer parameters included: keys and values see every token)."""
    model = tiny_encoder(kind)
    generator = torch.Generator().manual_seed(5)
    batch = ragged_batch("right", generator)
    weights = torch.randn(batch["input_ids"].shape[0], 32, generator=generator, dtype=torch.float64)

    reference = model(**batch).last_hidden_state[:, 0]
    (reference * weights).sum().backward()
    expected = grads(model)
    model.zero_grad()

    packing.enable(model)
    calls = []
    last = model.encoder.layer[-1]
    last.feed_forward_chunk = lambda x, layer=last: calls.append(x.shape) or type(layer).feed_forward_chunk(layer, x)
    first = packing.encode_first(model, batch, packed=True, kernel=kernel)
    assert calls == [torch.Size([6, 32])], "the last layer's feed-forward ran on more than the first tokens"
    (first * weights).sum().backward()
    assert torch.allclose(first, reference, atol=1e-12)
    got = grads(model)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.allclose(got[name], grad, atol=1e-11), name


def test_first_tokens_forward_survives_a_deep_copy():
    """SG deep-copies its encoder for BERT_F: the copy's last layer must run its own weights."""
    import copy

    model = tiny_encoder("bert")
    packing.enable(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.encoder.layer[-1].output.dense.weight.mul_(2)
    batch = ragged_batch("right", torch.Generator().manual_seed(6))
    for encoder in (model, twin):
        assert torch.allclose(packing.encode_first(encoder, batch, packed=True),
                              encoder(**batch).last_hidden_state[:, 0], atol=1e-12)


def test_padded_calls_of_a_packing_model_are_unchanged():
    """Evaluation and any padded call of an enabled model run SDPA exactly as before."""
    model = tiny_encoder("bert")
    batch = ragged_batch("right", torch.Generator().manual_seed(2))
    before = model(**batch).last_hidden_state
    packing.enable(model)
    assert torch.equal(model(**batch).last_hidden_state, before)
    assert torch.equal(packing.encode(model, batch, packed=False).last_hidden_state, before)


def test_rows_do_not_see_each_other():
    """Changing one row's tokens leaves every other row's packed output bitwise unchanged."""
    model = tiny_encoder("bert")
    packing.enable(model)
    batch = ragged_batch("right", torch.Generator().manual_seed(3))
    before = packing.encode(model, batch, packed=True).last_hidden_state
    changed = {**batch, "input_ids": batch["input_ids"].clone()}
    changed["input_ids"][1, :4] = torch.tensor([7, 8, 9, 10])
    after = packing.encode(model, changed, packed=True).last_hidden_state
    assert not torch.allclose(after[1], before[1])
    assert torch.allclose(after[[0, 2, 3, 4, 5]], before[[0, 2, 3, 4, 5]], atol=1e-13)


def test_refusals_name_the_key():
    model = tiny_encoder("bert")
    batch = ragged_batch("right", torch.Generator().manual_seed(4))
    with pytest.raises(RuntimeError, match="enable"):
        packing.encode(model, batch, packed=True)  # attention not switched: rows would attend each other
    packing.enable(model)
    four_d = {**batch, "attention_mask": batch["attention_mask"][:, None, None, :].expand(-1, 1, 11, -1)}
    with pytest.raises(ValueError, match="model.packed"):
        packing.encode(model, four_d, packed=True)
    with pytest.raises(ValueError, match="model.packed"):
        packing.encode(model, {**batch, "inputs_embeds": batch["input_ids"]}, packed=True)


def test_exported_config_does_not_name_the_packed_attention(tmp_path):
    """The attention function exists only inside clsys: a saved config must not ask a user's
    transformers for it."""
    model = tiny_encoder("bert")
    packing.enable(model)
    model.config.save_pretrained(tmp_path)
    assert packing.ATTENTION not in (tmp_path / "config.json").read_text()


# ---- every objective: the whole loss and its gradients ---------------------------------------------


def clir_record(i: int) -> dict:
    sides = [(lang, 100 * k + i, [TEXTS[(i + j + k) % len(TEXTS)] for j in range(1 + (i + k) % 3)])
             for k, lang in enumerate(("en", "de"))]
    return {"pair_id": f"en-de/{i}-{100 + i}/0-0", "langs": ["en", "de"], "method": "lead", "score": 1.0,
            "sides": [{"lang": lang, "page_id": page, "title": f"T{i}", "heading": "", "sentences": sentences,
                       "hard_negatives": [TEXTS[(i + 5) % len(TEXTS)]]} for lang, page, sentences in sides]}


CASES = {
    "simcse_unsup+mlm": ("simcse_unsup", ["objective.mlm_weight=0.1"], "sentences"),
    "simcse_sup": ("simcse_sup", ["objective.hard_negative_weight=0.5"], "triplets"),
    "sg": ("sg_opt", ["objective.loss=sg"], "sentences"),
    "sg_opt": ("sg_opt", [], "sentences"),
    "tacl+nsp": ("tacl", ["objective.nsp_weight=1.0"], "documents"),
    "clir": ("clir", ["objective.rr_dropout=0.0", "objective.rr_in_batch=true"], "clir"),
    "css_lm": ("css_lm", ["objective.num_labels=2", "objective.domain_negatives=2", "objective.classifier_dropout=0.0"],
               "labeled"),
}


def samples(kind: str) -> list[dict]:
    if kind == "sentences":
        return [{"txt": t} for t in TEXTS]
    if kind == "documents":
        return [{"txt": " ".join(TEXTS[i:i + 3]), "json": {"lang": "en"}} for i in range(6)]
    if kind == "labeled":  # CSS-LM stage A: 4 labelled texts, 2 corpus sentences each
        return [{"txt": t} for t in TEXTS]
    if kind == "triplets":
        return [{"json": {"anchor": TEXTS[i], "positive": TEXTS[i + 1], "negative": TEXTS[i + 2]}} for i in range(6)]
    return [{"json": json.loads(json.dumps(clir_record(i)))} for i in range(4)]


def objective_loss_and_grads(model_dir: str, recipe: str, overrides: list[str], batch: dict | None, packed: bool,
                             sample_kind: str):
    cfg = load_config(recipe, [f"model.name={model_dir}", "model.dropout=0.0", "data.max_length=48",
                               f"model.packed={str(packed).lower()}", *overrides])
    torch.manual_seed(0)
    objective = OBJECTIVES[cfg.objective.name](cfg, load_tokenizer(model_dir)).double().train()
    if batch is None:  # collate draws masks and negatives: once, shared by both runs
        random.seed(0)
        torch.manual_seed(0)
        batch = objective.collate(samples(sample_kind))
        if cfg.objective.name == "css_lm":
            batch = objective.collate_labeled(TEXTS[4:], [0, 1, 1, 0], corpus=batch)
        if cfg.objective.name == "clir":
            batch.update(task="qlm+rr", source="en-de")
    torch.manual_seed(1)  # SG draws one layer view per sentence
    out = objective(batch)
    out.loss.backward()
    return batch, out.loss.detach(), grads(objective)


@pytest.mark.parametrize("case", list(CASES))
def test_objective_loss_and_gradients_packed_equal_padded(tiny_bert_with_heads, case):
    recipe, overrides, sample_kind = CASES[case]
    batch, padded_loss, padded_grads = objective_loss_and_grads(tiny_bert_with_heads, recipe, overrides, None,
                                                                False, sample_kind)
    mask = batch["qlm_attention_mask"] if recipe == "clir" else batch["attention_mask"]
    assert (mask == 0).any(), "no padding to remove"
    _, packed_loss, packed_grads = objective_loss_and_grads(tiny_bert_with_heads, recipe, overrides, batch, True,
                                                            sample_kind)
    assert torch.allclose(packed_loss, padded_loss, rtol=0, atol=1e-12), (packed_loss, padded_loss)
    assert packed_grads.keys() == padded_grads.keys() and padded_grads
    for name, grad in padded_grads.items():
        assert torch.allclose(packed_grads[name], grad, rtol=1e-9, atol=1e-12), name


def test_tacl_pad_negatives_needs_the_padded_path(tiny_bert_with_heads):
    cfg = load_config("tacl", [f"model.name={tiny_bert_with_heads}", "objective.pad_negatives=true"])
    with pytest.raises(ValueError, match="model.packed: false"):
        OBJECTIVES["tacl"](cfg, load_tokenizer(tiny_bert_with_heads))
