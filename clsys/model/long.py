"""BertLong: a BERT-like checkpoint made to read longer inputs, with local + global attention.

``python -m clsys.model.long --model DIR_OR_ALIAS --max-positions 1024 [--attention-window 64] --out DIR``

Conversion (docs/training/objectives.md#clir-bertlong): the position-embedding table grows to ``--max-positions`` rows by
tiling the learned rows (rows k·n … (k+1)·n-1 are copies of the original n), so every new position
starts from a trained vector instead of noise. The attention window is recorded in config.json as
``attention_window``; the weights are otherwise untouched, heads included where the checkpoint has them.

Attention: Longformer's pattern. Every token sees ``window // 2`` neighbours on each side; the
query segment is global: it sees everything and everything sees it. The pattern is an ordinary
[B, 1, L, L] attention mask for the BERT layers, so compute and memory stay O(L²): the mask buys
the attention pattern, not the speed of a banded kernel. As in Longformer, global rows have their
own Q/K/V projections (``LongSelfAttention``), created from the local ones when a BertLong model is
loaded (so step 0 computes exactly what shared weights did) and trained apart from them from then on.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn
from transformers.models.bert.modeling_bert import (ALL_ATTENTION_FUNCTIONS, BertSelfAttention,
                                                    eager_attention_forward)

from clsys.model.loading import quiet_transformers, resolve_model_path, without_pooler

GLOBAL_PROJECTIONS = ("query_global", "key_global", "value_global")


def local_global_mask(attention_mask: torch.Tensor, global_tokens: torch.Tensor, window: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [B, 1, L, L] additive mask (0: attend, dtype's min: not) from a [B, L] padding mask.

    Query i may attend key j iff j is a real token and (|i - j| <= window // 2, or i is global, or j
    is global). Every position also attends itself: a pad row far from the text would otherwise have
    no key at all, and a fully masked softmax row can turn into NaN (in fp16, min + score rounds to -inf).

    Additive float, not boolean, because transformers 5.x hands a 4D mask to the attention kernel
    as is: SDPA accepts either kind, but eager attention adds the mask to the scores, so a boolean
    one would be silently wrong there. With eager attention ``dtype`` must be the model's compute dtype.
    """
    real = attention_mask.bool()
    is_global = global_tokens.bool()
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device)
    distance = (positions[:, None] - positions[None, :]).abs()
    allowed = (distance <= window // 2) | is_global[:, :, None] | is_global[:, None, :]
    allowed = (allowed & real[:, None, :]) | (distance == 0)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def long_attention_inputs(config, attention_mask: torch.Tensor, document: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The attention keyword arguments of an encoder forward over ``[CLS] query [SEP] document [SEP]``
    rows: ``attention_mask`` as is for an ordinary model; for a BertLong (``config.attention_window``
    set) the local/global 4D mask and ``global_tokens``, the query segment (every real token before the
    document), so document tokens see only their window. ``document``: [B, L], 1 on the
    document side (``clsys.objectives.clir.document_side``).

    ``dtype``: the encoder's compute dtype (eager attention in bf16 needs a bf16 mask; SDPA takes either).
    """
    window = getattr(config, "attention_window", None)
    if not window:
        return {"attention_mask": attention_mask}
    query_segment = ~document.bool() & attention_mask.bool()
    return {"attention_mask": local_global_mask(attention_mask, query_segment, window, dtype),
            "global_tokens": query_segment}


class LongSelfAttention(BertSelfAttention):
    """BERT self-attention plus Longformer's separate projections for global attention.

    Local rows attend through ``query``/``key``/``value`` (global tokens' local keys included, as in
    Longformer); global rows (``global_tokens``) attend through ``query_global``/``key_global``/
    ``value_global`` over every key their mask row allows, which for a global row is every real token.
    Without ``global_tokens`` the layer is BERT's. Both outputs are computed for every row and the
    global one kept where a row is global: the query segment is a few tokens, but gathering them per
    row would cost more code than the second [L, L] product it saves at the lengths BertLong reads.
    """

    def __init__(self, config, layer_idx=None):
        super().__init__(config, layer_idx=layer_idx)
        for name in GLOBAL_PROJECTIONS:
            setattr(self, name, nn.Linear(config.hidden_size, self.all_head_size))

    @classmethod
    def from_local(cls, local: BertSelfAttention) -> "LongSelfAttention":
        """A copy of ``local`` whose global projections start equal to its local ones."""
        weight = local.query.weight
        long = cls(local.config, layer_idx=local.layer_idx).to(device=weight.device, dtype=weight.dtype)
        long.load_state_dict(local.state_dict(), strict=False)
        for name in GLOBAL_PROJECTIONS:
            getattr(long, name).load_state_dict(getattr(local, name.removesuffix("_global")).state_dict())
        return long.train(local.training)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                global_tokens: torch.Tensor | None = None, **kwargs):
        local, weights = super().forward(hidden_states, attention_mask, **kwargs)
        if global_tokens is None:
            return local, weights
        heads = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        query, key, value = (getattr(self, name)(hidden_states).view(heads).transpose(1, 2)
                             for name in GLOBAL_PROJECTIONS)
        # The kernel BERT's own attention uses, so that equal weights give bit-equal rows.
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        attended, _ = attention(self, query, key, value, attention_mask, scaling=self.scaling,
                                dropout=self.dropout.p if self.training else 0.0, **kwargs)
        attended = attended.reshape(*hidden_states.shape[:-1], -1)
        return torch.where(global_tokens[..., None].bool(), attended, local), weights


def enable_global_attention(model: nn.Module, path: str | None = None) -> nn.Module:
    """Give each self-attention of a BertLong ``model`` (``config.attention_window`` set) its global
    projections: the trained ones saved in the folder ``path`` when it holds them, else copies of the
    local ones (a freshly converted model). Other models are returned untouched."""
    if not getattr(model.config, "attention_window", None):
        return model
    for name, module in list(model.named_modules()):
        if type(module) is BertSelfAttention:
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, LongSelfAttention.from_local(module))
    saved = _saved_global_weights(path) if path else {}
    if saved:
        state = {key: saved[_layer_key(key)] for key in model.state_dict() if _is_global(key)
                 if _layer_key(key) in saved}
        wanted = sum(_is_global(key) for key in model.state_dict())
        if len(state) != wanted:
            raise ValueError(f"{path}: holds {len(saved)} global-attention weights, the model needs {wanted}")
        model.load_state_dict(state, strict=False)
    return model


def _is_global(key: str) -> bool:
    return any(f".{name}." in key for name in GLOBAL_PROJECTIONS)


def _layer_key(key: str) -> str:
    # The same weight is "bert.encoder.layer.0..." in a pretraining model and "encoder.layer.0..." in a bare one.
    return key[key.index("encoder.layer."):]


def _saved_global_weights(path: str) -> dict[str, torch.Tensor]:
    """The global projections a saved folder holds (none for a converted, not yet trained model)."""
    from safetensors import safe_open

    found = {}
    for file in sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []:
        with safe_open(str(file), "pt") as tensors:
            found.update({_layer_key(key): tensors.get_tensor(key) for key in tensors.keys() if _is_global(key)})
    return found


def load_with_heads(path: str) -> tuple[nn.Module, list[str]]:
    """The checkpoint at ``path`` in the richest model class that it fully fills, and the checkpoint
    keys that class had no place for.

    Pretraining heads (MLM + NSP), then the MLM head alone, then the bare encoder (with, then without
    the pooler): a class is accepted only if nothing of it is missing from the checkpoint, so no head
    is ever made up of random weights. One that also uses every key wins at once; otherwise the first
    complete one is kept and the unused keys are reported.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoModelForPreTraining

    quiet_transformers()
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    attempts = [(AutoModelForPreTraining, {}), (AutoModelForMaskedLM, {}), (AutoModel, {})]
    if without_pooler(config):
        # Encoders saved without the pooler (clsys export does that) would otherwise get a random one.
        attempts.append((AutoModel, without_pooler(config)))
    complete = None
    for auto_class, kwargs in attempts:
        try:
            model, info = auto_class.from_pretrained(path, output_loading_info=True, trust_remote_code=False, **kwargs)
        except ValueError:  # the architecture has no model of this kind
            continue
        if info["missing_keys"]:
            continue
        if not info["unexpected_keys"]:
            return model, []
        complete = complete or (model, sorted(info["unexpected_keys"]))
    if complete is None:
        raise ValueError(f"{path}: no model class loads every weight it needs from this checkpoint")
    return complete


def extend_positions(model: nn.Module, max_positions: int) -> int:
    """Grow the position embeddings of ``model`` to ``max_positions`` rows by tiling; returns the old count.

    The ``position_ids`` / ``token_type_ids`` buffers are not saved with the weights and are sized at
    construction, so they are rebuilt here too: without that, a model converted in memory would
    still slice positions from the old 0..n-1 range.
    """
    embeddings = getattr(model.base_model, "embeddings", None)
    old = getattr(embeddings, "position_embeddings", None)
    # RoBERTa-style tables (padding_idx set) number positions from pad_token_id + 1: tiling them
    # would copy the reserved rows into the middle, so only tables that start at position 0 qualify.
    if not isinstance(old, nn.Embedding) or old.padding_idx is not None:
        raise ValueError(f"{model.config.model_type}: not BERT-like (needs absolute position embeddings "
                         "numbered from 0)")
    n = old.num_embeddings
    if max_positions < n:
        raise ValueError(f"--max-positions {max_positions} is smaller than the model's {n} positions")
    new = nn.Embedding(max_positions, old.embedding_dim, device=old.weight.device, dtype=old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight.repeat(-(-max_positions // n), 1)[:max_positions])
    embeddings.position_embeddings = new
    position_ids = torch.arange(max_positions, device=old.weight.device).expand(1, -1)
    if hasattr(embeddings, "position_ids"):
        embeddings.position_ids = position_ids
    if hasattr(embeddings, "token_type_ids"):
        embeddings.token_type_ids = torch.zeros_like(position_ids)
    model.config.max_position_embeddings = max_positions
    return n


def convert(name: str, max_positions: int, attention_window: int, out: str) -> dict:
    """Convert the model ``name`` (folder or packaged alias) and save model + tokenizer to ``out``."""
    from transformers import AutoTokenizer

    if attention_window < 0 or attention_window % 2:
        raise ValueError(f"--attention-window {attention_window}: needs an even number >= 0 (0: full attention)")
    path = resolve_model_path(name)
    model, unused = load_with_heads(path)
    old_positions = extend_positions(model, max_positions)
    # An extra config attribute: PretrainedConfig writes it to config.json and AutoConfig reads it back.
    model.config.attention_window = attention_window
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    tokenizer.model_max_length = max_positions
    tokenizer.save_pretrained(out)
    return {"model_class": type(model).__name__, "old_positions": old_positions, "unused_keys": unused}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clsys.model.long", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder or packaged alias (e.g. all-MiniLM-L6-v2)")
    parser.add_argument("--max-positions", type=int, required=True, help="new number of positions, e.g. 1024")
    parser.add_argument("--attention-window", type=int, default=64,
                        help="local window, window/2 tokens each side (default 64; 0: full attention)")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    try:
        done = convert(args.model, args.max_positions, args.attention_window, args.out)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    window = (f"{args.attention_window} (+ global query segment)" if args.attention_window else "none (full attention)")
    print(f"{done['model_class']}: positions {done['old_positions']} -> {args.max_positions} (tiled), "
          f"attention window {window}, saved to {args.out}")
    if done["unused_keys"]:
        print(f"not kept (no model class holds them with the rest): {', '.join(done['unused_keys'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
