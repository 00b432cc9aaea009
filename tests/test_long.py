"""BertLong: position tiling, the saved folder, the local/global attention mask and its global projections."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
from transformers import (AutoConfig, AutoModel, AutoTokenizer, BertConfig, BertForPreTraining,
                          BertModel)

from clsys.model.encoder import encoder_from_config, load_encoder
from clsys.model.loading import resolve_model_path
from clsys.model.long import (GLOBAL_PROJECTIONS, LongSelfAttention, enable_global_attention, extend_positions,
                              local_global_mask, long_attention_inputs, main)


def tiny_config(**kwargs) -> BertConfig:
    sizes = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=16)
    return BertConfig(**{**sizes, **kwargs})


def tiny_bert(**kwargs) -> BertModel:
    torch.manual_seed(0)
    return BertModel(tiny_config(**kwargs), add_pooling_layer=False).eval()


def test_tiling_repeats_the_learned_rows_and_the_model_runs_longer():
    model = tiny_bert()
    old = model.embeddings.position_embeddings.weight.detach().clone()
    assert extend_positions(model, 40) == 16  # not a multiple of 16: the last copy is cut short
    new = model.embeddings.position_embeddings.weight
    assert new.shape == (40, 32)
    for row in range(40):
        assert torch.equal(new[row], old[row % 16])
    assert model.config.max_position_embeddings == 40
    assert model.embeddings.position_ids.shape == model.embeddings.token_type_ids.shape == (1, 40)
    ids = torch.randint(1, 100, (2, 40))
    assert model(input_ids=ids).last_hidden_state.shape == (2, 40, 32)


def test_not_bert_like_and_shrinking_are_refused():
    from transformers import RobertaConfig, RobertaModel

    roberta = RobertaModel(RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=18))
    with pytest.raises(ValueError, match="not BERT-like"):
        extend_positions(roberta, 64)
    with pytest.raises(ValueError, match="smaller"):
        extend_positions(tiny_bert(), 8)


def test_cli_refuses_fewer_positions(tmp_path, capsys):
    tiny_bert().save_pretrained(tmp_path / "src")
    assert main(["--model", str(tmp_path / "src"), "--max-positions", "8", "--out", str(tmp_path / "out")]) != 0
    assert "--max-positions 8 is smaller than the model's 16 positions" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_pretraining_heads_are_kept(tmp_path):
    torch.manual_seed(0)
    source = BertForPreTraining(tiny_config())
    source.save_pretrained(tmp_path / "src")
    AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2")).save_pretrained(tmp_path / "src")
    assert main(["--model", str(tmp_path / "src"), "--max-positions", "40", "--out", str(tmp_path / "out")]) == 0

    converted = BertForPreTraining.from_pretrained(tmp_path / "out")
    for name, weight in source.cls.state_dict().items():
        assert torch.equal(converted.cls.state_dict()[name], weight), name
    assert converted.config.attention_window == 64


@pytest.fixture(scope="module")
def minilm_long(tmp_path_factory):
    """all-MiniLM-L6-v2 converted to 1024 positions by the command line's entry point (in process:
    a subprocess would pay the torch + transformers import again)."""
    out = tmp_path_factory.mktemp("minilm") / "long"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["--model", "all-MiniLM-L6-v2", "--max-positions", "1024", "--attention-window", "32",
                     "--out", str(out)]) == 0
    return out, printed.getvalue()


def test_minilm_conversion_saves_a_loadable_long_model(minilm_long):
    out, stdout = minilm_long
    assert "BertModel: positions 512 -> 1024" in stdout and "window 32" in stdout
    assert AutoConfig.from_pretrained(out).attention_window == 32
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.model_max_length == 1024
    model = AutoModel.from_pretrained(out).eval()
    assert model.config.max_position_embeddings == 1024

    original = AutoModel.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    table = model.embeddings.position_embeddings.weight
    learned = original.embeddings.position_embeddings.weight
    assert torch.equal(table[:512], learned) and torch.equal(table[512:], learned)

    batch = tokenizer(["where is the river?"], [" ".join(["the river runs to the sea"] * 100)],
                      truncation=True, return_tensors="pt")
    assert batch["input_ids"].shape[1] > 512
    attention = long_attention_inputs(model.config, batch["attention_mask"], batch["token_type_ids"])
    with torch.no_grad():
        hidden = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                       **attention).last_hidden_state
    assert torch.isfinite(hidden).all()


def reference_mask(attention_mask, global_tokens, window):
    """The rule written out position by position."""
    batch, length = attention_mask.shape
    allowed = torch.zeros(batch, length, length, dtype=torch.bool)
    for b in range(batch):
        for i in range(length):
            for j in range(length):
                near = abs(i - j) <= window // 2
                allowed[b, i, j] = i == j or (bool(attention_mask[b, j]) and
                                              (near or bool(global_tokens[b, i]) or bool(global_tokens[b, j])))
    return allowed


def test_mask_matches_the_rule():
    torch.manual_seed(1)
    lengths = torch.tensor([12, 7, 1, 12])
    attention_mask = (torch.arange(12)[None] < lengths[:, None]).long()
    global_tokens = torch.rand(4, 12) < 0.2
    for window in (0, 2, 4, 6, 30):
        mask = local_global_mask(attention_mask, global_tokens, window)
        assert mask.shape == (4, 1, 12, 12)
        assert torch.equal(mask[:, 0] == 0, reference_mask(attention_mask, global_tokens, window))


def test_long_attention_inputs_are_a_no_op_without_a_window():
    config = tiny_config()
    attention_mask = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    document = torch.tensor([[0] * 3 + [1] * 5, [0] * 4 + [1] * 2 + [0] * 2])
    plain = long_attention_inputs(config, attention_mask, document)
    assert plain.keys() == {"attention_mask"} and plain["attention_mask"] is attention_mask
    config.attention_window = 4
    long = long_attention_inputs(config, attention_mask, document)
    assert long["attention_mask"].shape == (2, 1, 8, 8)
    assert long["global_tokens"].tolist() == [[True] * 3 + [False] * 5, [True] * 4 + [False] * 4]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_window_covering_the_input_equals_full_attention(attn):
    model = tiny_bert(attn_implementation=attn)
    ids = torch.randint(1, 100, (3, 14))
    lengths = torch.tensor([14, 9, 5])
    attention_mask = (torch.arange(14)[None] < lengths[:, None]).long()
    token_type_ids = (torch.arange(14)[None] >= 4).long() * attention_mask
    model.config.attention_window = 28
    enable_global_attention(model)
    attention = long_attention_inputs(model.config, attention_mask, token_type_ids)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=attention_mask, token_type_ids=token_type_ids).last_hidden_state
        windowed = model(input_ids=ids, token_type_ids=token_type_ids, **attention).last_hidden_state
    assert torch.isfinite(windowed).all()
    real = attention_mask.bool()
    assert torch.allclose(windowed[real], full[real], atol=1e-5)


def test_locality_and_global_attention():
    model = tiny_bert(num_hidden_layers=1)  # one layer: an output sees exactly the keys its row allows
    model.config.attention_window = 4  # 2 neighbours each side
    enable_global_attention(model)
    ids = torch.randint(5, 100, (1, 16))
    token_type_ids = (torch.arange(16)[None] >= 4).long()  # [CLS] q q [SEP] | document
    attention_mask = torch.ones_like(ids)

    def outputs(changed_at: int) -> torch.Tensor:
        changed = ids.clone()
        changed[0, changed_at] = 1 + changed[0, changed_at] % 99
        with torch.no_grad():
            return model(input_ids=changed, token_type_ids=token_type_ids, **attention).last_hidden_state[0]

    attention = long_attention_inputs(model.config, attention_mask, token_type_ids)
    with torch.no_grad():
        base = model(input_ids=ids, token_type_ids=token_type_ids, **attention).last_hidden_state[0]
    far_document_token, query_token, local, global_ = 14, 2, 6, 0
    assert torch.allclose(outputs(far_document_token)[local], base[local])  # 8 positions away: outside the window
    assert not torch.allclose(outputs(query_token)[local], base[local])  # the query is seen from everywhere
    assert not torch.allclose(outputs(far_document_token)[global_], base[global_])  # and sees everything


def padded_pairs(batch: int = 3, length: int = 14):
    """Rows of [query | document | padding] with different lengths and query sizes."""
    lengths, query_sizes = torch.tensor([14, 9, 6])[:batch], torch.tensor([4, 3, 6])[:batch]
    positions = torch.arange(length)[None]
    attention_mask = (positions < lengths[:, None]).long()
    document = ((positions >= query_sizes[:, None]) & attention_mask.bool()).long()
    return attention_mask, document


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_global_projections_start_as_the_shared_weights(attn):
    """Step 0 of a converted model: separate global Q/K/V copied from the local ones give bit-for-bit
    the output of the same layers with shared weights (what BertLong computed before they existed)."""
    model = tiny_bert(attn_implementation=attn)
    model.config.attention_window = 4
    ids = torch.randint(1, 100, (3, 14))
    attention_mask, document = padded_pairs()
    attention = long_attention_inputs(model.config, attention_mask, document)
    with torch.no_grad():
        shared = model(input_ids=ids, attention_mask=attention["attention_mask"]).last_hidden_state
        enable_global_attention(model)
        assert all(isinstance(layer.attention.self, LongSelfAttention) for layer in model.encoder.layer)
        separate = model(input_ids=ids, **attention).last_hidden_state
    assert torch.equal(separate, shared)


def reference_long_attention(layer: LongSelfAttention, hidden, attention_mask, global_tokens, window):
    """Longformer's self-attention written out row by row, in float64: a local row attends through the
    local Q/K/V to its window and to the global tokens; a global row through the global Q/K/V to all."""
    heads, size = layer.num_attention_heads, layer.attention_head_size

    def project(name, b):
        linear = getattr(layer, name)
        return (hidden[b] @ linear.weight.T + linear.bias).view(-1, heads, size)

    out = torch.zeros_like(hidden)
    length = hidden.shape[1]
    for b in range(hidden.shape[0]):
        local = [project(name, b) for name in ("query", "key", "value")]
        global_ = [project(name, b) for name in GLOBAL_PROJECTIONS]
        for i in range(length):
            is_global = bool(global_tokens[b, i])
            q, k, v = global_ if is_global else local
            keys = [j for j in range(length) if j == i or (attention_mask[b, j] and (
                is_global or abs(i - j) <= window // 2 or global_tokens[b, j]))]
            for h in range(heads):
                scores = torch.stack([q[i, h] @ k[j, h] for j in keys]) / size ** 0.5
                weights = torch.softmax(scores, 0)
                out[b, i, h * size:(h + 1) * size] = sum(w * v[j, h] for w, j in zip(weights, keys))
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_long_self_attention_matches_the_longformer_rule(attn):
    torch.manual_seed(2)
    config = tiny_config(attn_implementation=attn, attention_window=4)
    layer = LongSelfAttention(config).double().eval()  # independent random local and global weights
    hidden = torch.randn(3, 14, 32, dtype=torch.float64)
    attention_mask, document = padded_pairs()
    attention = long_attention_inputs(config, attention_mask, document, torch.float64)
    with torch.no_grad():
        out, _ = layer(hidden, **attention)
    expected = reference_long_attention(layer, hidden, attention_mask, attention["global_tokens"], 4)
    real = attention_mask.bool()
    assert torch.allclose(out[real], expected[real], atol=1e-10)


def test_global_projections_train_apart_and_are_saved_and_loaded(tmp_path):
    model = tiny_bert(num_hidden_layers=1)
    model.config.attention_window = 4
    enable_global_attention(model).train()
    ids = torch.randint(1, 100, (3, 14))
    attention_mask, document = padded_pairs()
    model(input_ids=ids, **long_attention_inputs(model.config, attention_mask, document)).last_hidden_state.sum().backward()
    attention = model.encoder.layer[0].attention.self
    for name in ("query", "key", "value", *GLOBAL_PROJECTIONS):
        assert getattr(attention, name).weight.grad.abs().sum() > 0, name  # both sets are trained
    assert not torch.equal(attention.query.weight.grad, attention.query_global.weight.grad)

    with torch.no_grad():  # as if training had moved the global weights away from the local ones
        for name in GLOBAL_PROJECTIONS:
            getattr(attention, name).weight.add_(torch.randn_like(attention.query.weight))
    model.save_pretrained(tmp_path / "trained")
    loaded = load_encoder(str(tmp_path / "trained"))
    assert torch.equal(loaded.encoder.layer[0].attention.self.key_global.weight, attention.key_global.weight)
    # What export fills (strictly) from a trained state dict: the same keys, global projections included.
    assert encoder_from_config(model.config).state_dict().keys() == model.state_dict().keys()


def test_a_converted_folder_starts_from_the_local_weights(minilm_long):
    out, _ = minilm_long
    attention = load_encoder(str(out)).encoder.layer[2].attention.self
    for name in GLOBAL_PROJECTIONS:
        assert torch.equal(getattr(attention, name).weight, getattr(attention, name.removesuffix("_global")).weight)
