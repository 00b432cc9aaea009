"""Packed encoder forwards: a batch's rows without their pad tokens (``model.packed``).

A padded batch [B, L] spends the encoder's work on pad tokens: 21-29% of the tokens of the
quickstart's batches (max length 32), over half at max length 128. Packed, the rows' real tokens are
concatenated into one sequence [1, T] (T = the batch's real tokens), with the position ids each token
has in its own row, so every linear layer, LayerNorm, GELU and dropout sees real tokens only.
Attention stays within each row: the model's attention function is ``ATTENTION``, registered here
with transformers' ``AttentionInterface``, which reads the rows' boundaries (``Packing``) from the
forward's keyword arguments and falls back to SDPA when there are none (an ordinary padded call,
e.g. evaluation, runs exactly as before). ``encode`` returns the encoder's output scattered back to
the padded [B, L, d] layout (zeros at pads), so pooling, heads and losses need no change.

The attention product itself, two kernels of PyTorch's own (no flash-attn package), ``model.packed_attention``:
  padded   q, k and v laid out [B, H, L, D] for this product alone, one SDPA call with a key padding
           mask (the default). Every linear layer, LayerNorm, GELU and dropout still sees real tokens
           only; the product is O(L²·d) per row, a small part of a layer's FLOPs at these lengths.
  nested   SDPA on nested jagged tensors: no pad token anywhere. Slower on both devices where measured:
           PyTorch's CPU path loops over rows (7× one padded call, MiniLM heads, 128 rows of 8-32 tokens,
           forward + backward), and on an H200 the whole BERT-base SimCSE step ran at 0.42× the padded
           kernel's tokens/s (TaCL 0.41×; docs/benchmarks.md#gpu-mfu); torch.compile fails on it.
Both give the padded path's outputs and gradients (tests/test_packing.py, float64).

First tokens only (``encode_first``): an objective that pools the ``[CLS]`` token (SimCSE's cls and
cls_mlp, SG's BERT_T) reads one vector per row from the last layer, yet a full forward computes that
layer's query, attention output and feed-forward for every token. Each token's last-layer output
depends on the others only through the keys and values, so the last layer computes keys and values
for every token and everything else for the rows' first tokens alone: the same [CLS] vectors and
gradients, ~10/12 of one layer's per-token work saved (MiniLM's 6 layers: ~14% of the encoder's).
``enable`` gives the last layer of BERT-family encoders (``layer.attention.self`` with query/key/value,
``attention.output``, ``feed_forward_chunk``) a forward that does this when the packed call asks for it;
other models compute the whole last layer and take its first tokens.

Supported: models whose attention goes through ``AttentionInterface`` (BERT, RoBERTa, XLM-R, …) and
2-D padding masks. A 4-D mask (BertLong's local/global pattern) needs the padded path.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = "clsys_packed"
KERNELS = ("padded", "nested")


@dataclass
class Packing:
    """Where a padded batch's real tokens are: the layout ``pack`` and ``unpack`` convert between."""

    token_index: torch.Tensor  # [T]: each real token's position in the flattened [B·L] batch, row-major
    cu_seqlens: torch.Tensor  # [B + 1] int64: row r's tokens are packed[cu_seqlens[r]:cu_seqlens[r + 1]]
    rows: int
    width: int  # L, the padded batch's width: at least every row's length
    first_tokens_only: bool = False  # the last layer computes each row's first token alone (encode_first)

    @classmethod
    def of(cls, attention_mask: torch.Tensor, first_tokens_only: bool = False) -> Packing:
        """The layout of a [B, L] 0/1 padding mask; rows may be padded on either side."""
        if attention_mask.dim() != 2:
            raise ValueError(f"model.packed: needs a 2-D padding mask [batch, length], got shape "
                             f"{tuple(attention_mask.shape)} (a 4-D mask, e.g. BertLong's, needs model.packed: false)")
        rows, width = attention_mask.shape
        real = attention_mask.bool()
        # nonzero() is the one host sync of a packed forward (T decides the packed shapes).
        token_index = real.flatten().nonzero().squeeze(1)
        cu_seqlens = F.pad(real.sum(1).cumsum(0), (1, 0))
        return cls(token_index, cu_seqlens, rows, width, first_tokens_only)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, L, …] → [1, T, …]: the real tokens, row after row."""
        return padded.flatten(0, 1)[self.token_index].unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, T, …] → [B, L, …] with zeros at the pads (differentiable)."""
        values = packed.squeeze(0)
        out = values.new_zeros(self.rows * self.width, *values.shape[1:])
        return out.index_copy(0, self.token_index, values).view(self.rows, self.width, *values.shape[1:])

    def by_row(self, tokens: torch.Tensor) -> torch.Tensor:
        """[T, H, D] → [B, H, L, D], zeros at the pads: one row's heads laid out for a padded SDPA call."""
        return self.unpack(tokens.unsqueeze(0)).transpose(1, 2)

    @functools.cached_property
    def key_mask(self) -> torch.Tensor:
        """[B, 1, 1, L] bool: which keys of the padded layout are real tokens (built once, read by every layer)."""
        real = torch.zeros(self.rows * self.width, dtype=torch.bool, device=self.token_index.device)
        return real.index_fill(0, self.token_index, True).view(self.rows, 1, 1, self.width)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packing: Packing,
                     dropout: float = 0.0, scale: float | None = None, kernel: str = "padded") -> torch.Tensor:
    """Attention of packed rows, each row's tokens attending its own row only: [T, H, D] in, [T, H, D] out."""
    if kernel == "nested":
        offsets = packing.cu_seqlens.to(torch.int64)

        def jagged(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] → [B, H, j, D]
            return torch.nested.nested_tensor_from_jagged(x, offsets, max_seqlen=packing.width).transpose(1, 2)

        out = F.scaled_dot_product_attention(jagged(query), jagged(key), jagged(value), dropout_p=dropout, scale=scale)
        return out.transpose(1, 2).values()
    if kernel != "padded":
        raise ValueError(f"unknown packed attention kernel '{kernel}' (choose from {', '.join(KERNELS)})")
    heads, dim = query.shape[1:]
    out = F.scaled_dot_product_attention(packing.by_row(query), packing.by_row(key), packing.by_row(value),
                                         attn_mask=packing.key_mask, dropout_p=dropout, scale=scale)
    return out.transpose(1, 2).reshape(packing.rows * packing.width, heads, dim)[packing.token_index]


def packed_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             packing: Packing | None = None, packing_kernel: str = "padded", **kwargs):
    """transformers' attention-function signature: q, k, v [batch, heads, seq, dim] → ([batch, seq, heads, dim], None)."""
    if packing is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))  # [1, H, T, D] → [T, H, D]
    return varlen_attention(q, k, v, packing, dropout, scaling, packing_kernel).unsqueeze(0), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention_forward)
    # Padded calls build the same masks as SDPA; packed calls pass no mask at all.
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def enable(model: nn.Module) -> None:
    """Make a Hugging Face model's attention ``ATTENTION`` (refused for models that cannot switch)."""
    _register()
    if not model._can_set_attn_implementation():
        raise ValueError(f"model.packed: {type(model).__name__} does not route attention through transformers' "
                         "AttentionInterface, so it cannot run packed rows; set model.packed: false")
    model.set_attn_implementation(ATTENTION)
    last = _last_layer(model)
    if last is not None:
        # A bound method, not a closure: deep copies of the model (SG's frozen BERT_F) get their own.
        last.forward = types.MethodType(_first_tokens_forward, last)


def _last_layer(model: nn.Module) -> nn.Module | None:
    """The encoder's last layer when it has BERT's structure (what ``first_tokens_layer`` calls), else None."""
    layers = getattr(getattr(model.base_model, "encoder", None), "layer", None)
    if not layers:
        return None
    last = layers[-1]
    attention = getattr(last, "attention", None)
    parts = (getattr(attention, "self", None), getattr(attention, "output", None), getattr(last, "feed_forward_chunk", None))
    if any(part is None for part in parts) or getattr(last, "is_decoder", False):
        return None
    if not all(hasattr(attention.self, name) for name in ("query", "key", "value", "dropout", "scaling")):
        return None
    return last


def _first_tokens_forward(layer: nn.Module, hidden_states: torch.Tensor, *args, packing: Packing | None = None,
                          **kwargs):
    """The last layer's forward: its class's own, or ``first_tokens_layer`` when a packed call asks."""
    if packing is not None and packing.first_tokens_only:
        return first_tokens_layer(layer, hidden_states, packing)
    return type(layer).forward(layer, hidden_states, *args, packing=packing, **kwargs)


def first_tokens_layer(layer: nn.Module, hidden_states: torch.Tensor, packing: Packing) -> torch.Tensor:
    """A BERT layer's output at each row's first token: [1, T, d] packed in, [1, B, d] out.

    Keys and values for every token (the first tokens attend their whole row); the query, attention
    output, residual + LayerNorm and feed-forward for the B first tokens only. The attention product is
    [B, H, 1, L] against the row's keys in the padded layout, dropout included.
    """
    attention = layer.attention.self
    tokens = hidden_states.squeeze(0)  # [T, d]
    first = tokens[packing.cu_seqlens[:-1]]  # [B, d]
    heads = attention.num_attention_heads
    query = attention.query(first).view(packing.rows, heads, 1, -1)  # [B, H, 1, D]
    key, value = (packing.by_row(projection(tokens).view(len(tokens), heads, -1))
                  for projection in (attention.key, attention.value))
    context = F.scaled_dot_product_attention(query, key, value, attn_mask=packing.key_mask,
                                             dropout_p=attention.dropout.p if attention.training else 0.0,
                                             scale=attention.scaling)
    attended = layer.attention.output(context.transpose(1, 2).reshape(packing.rows, -1), first)
    return layer.feed_forward_chunk(attended).unsqueeze(0)


def _position_ids(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The position ids the model gives each token of the padded batch: RoBERTa-style models count real
    tokens from padding_idx + 1, BERT-style ones use the column."""
    module = getattr(model, "embeddings", None)
    if module is not None and hasattr(module, "create_position_ids_from_input_ids"):
        return module.create_position_ids_from_input_ids(input_ids, module.padding_idx)
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


def _pack_inputs(model: nn.Module, inputs: dict[str, torch.Tensor],
                 first_tokens_only: bool = False) -> tuple[Packing, dict[str, torch.Tensor]]:
    """The layout of a padded batch and the model's packed keyword inputs for it."""
    if model.config._attn_implementation != ATTENTION:
        raise RuntimeError(f"{type(model).__name__}: packed forward on a model whose attention is "
                           f"'{model.config._attn_implementation}'; call clsys.model.packing.enable(model) first")
    unknown = set(inputs) - {"input_ids", "attention_mask", "token_type_ids"}
    if unknown:
        raise ValueError(f"model.packed: cannot pack the inputs {sorted(unknown)}")
    packing = Packing.of(inputs["attention_mask"], first_tokens_only)
    packed_inputs = {"input_ids": packing.pack(inputs["input_ids"]),
                     "position_ids": packing.pack(_position_ids(model, inputs["input_ids"]))}
    if inputs.get("token_type_ids") is not None:
        packed_inputs["token_type_ids"] = packing.pack(inputs["token_type_ids"])
    return packing, packed_inputs


def encode(model: nn.Module, inputs: dict[str, torch.Tensor], packed: bool = False,
           output_hidden_states: bool = False, kernel: str = "padded"):
    """The encoder's output for a padded batch (``input_ids``, ``attention_mask``, optionally
    ``token_type_ids``), run packed when ``packed``: ``last_hidden_state`` (and ``hidden_states`` when
    asked), always in the padded [B, L, d] layout."""
    if not packed:
        return model(**inputs, output_hidden_states=output_hidden_states)
    from transformers.modeling_outputs import BaseModelOutput

    packing, packed_inputs = _pack_inputs(model, inputs)
    out = model(**packed_inputs, packing=packing, packing_kernel=kernel, output_hidden_states=output_hidden_states)
    hidden_states = tuple(map(packing.unpack, out.hidden_states)) if output_hidden_states else None
    return BaseModelOutput(last_hidden_state=packing.unpack(out.last_hidden_state), hidden_states=hidden_states)


def encode_first(model: nn.Module, inputs: dict[str, torch.Tensor], packed: bool = False,
                 kernel: str = "padded") -> torch.Tensor:
    """[B, d]: the last layer's first token of each (right-padded) row, the ``[CLS]`` vector. Packed, on an
    encoder whose last layer ``enable`` prepared, that layer computes those tokens alone; otherwise the
    whole last layer runs and its first column is taken."""
    last = _last_layer(model)
    prepared = last is not None and getattr(last.forward, "__func__", None) is _first_tokens_forward
    if not (packed and prepared):
        return encode(model, inputs, packed, kernel=kernel).last_hidden_state[:, 0]
    packing, packed_inputs = _pack_inputs(model, inputs, first_tokens_only=True)
    return model(**packed_inputs, packing=packing, packing_kernel=kernel).last_hidden_state.squeeze(0)
