"""The text encoder: a Hugging Face ``AutoModel`` plus the pooling rules every objective shares.

Pooling kinds (the names are used in configs, ``clsys.evaluate`` and the exported
sentence-transformers folder):
  cls   the last layer's first token, as is (SimCSE's ``cls_before_pooler``)
  mean  the average of the last layer over non-pad tokens
  max   the element-wise max of the last layer over non-pad tokens
"""
from __future__ import annotations

import os
import tempfile

import typing
from typing import Literal

import torch
from torch import nn

from clsys.model.loading import checked_model_path, quiet_transformers, resolve_model_path, without_pooler

Pooling = Literal["cls", "mean", "max"]  # what a sentence embedding is made of
POOLINGS: tuple[str, ...] = typing.get_args(Pooling)


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


def model_overrides(model_cfg) -> dict:
    """Hugging Face config overrides from our ``ModelConfig`` (dropout sets hidden and attention dropout)."""
    if model_cfg.dropout is None:
        return {}
    return {"hidden_dropout_prob": model_cfg.dropout, "attention_probs_dropout_prob": model_cfg.dropout}


def load_encoder(name: str, **overrides) -> nn.Module:
    """A bare pretrained ``AutoModel`` without the NSP pooler layer; ``overrides`` patch its config."""
    from transformers import AutoConfig, AutoModel

    quiet_transformers()
    path = checked_model_path(name)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False, **overrides)
    return with_global_attention(AutoModel.from_pretrained(path, config=config, trust_remote_code=False,
                                                       **without_pooler(config)), path)


def with_global_attention(model: nn.Module, path: str | None = None) -> nn.Module:
    """``model`` with BertLong's global attention projections when it is one (clsys.model.long), loaded
    from the folder ``path`` when it holds trained ones; other models unchanged."""
    from clsys.model.long import enable_global_attention  # long.py builds on this module

    return enable_global_attention(model, path)


def _training_config(model_cfg, tokenizer):
    """(folder, HF config) of the model an objective trains.

    ``model.init: pretrained``: ``model.name`` is a pretrained model. ``model.init: scratch``:
    ``model.name`` only describes the architecture (a config.json file or a folder with one) and the
    embeddings are sized to the tokenizer (e.g. one trained by ``data_prep tokenizer``).
    """
    from transformers import AutoConfig

    quiet_transformers()
    path = checked_model_path(model_cfg.name)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False, **model_overrides(model_cfg))
    if model_cfg.init == "scratch":
        config.vocab_size, config.pad_token_id = len(tokenizer), tokenizer.pad_token_id
    return path, config


def _for_training(model: nn.Module, model_cfg, path: str) -> None:
    with_global_attention(model, path if model_cfg.init == "pretrained" else None)
    if model_cfg.packed:
        from clsys.model import packing

        packing.enable(model)  # its attention then also takes packed rows (clsys.model.packing.encode)


def build_encoder(model_cfg, tokenizer) -> nn.Module:
    """The encoder (without NSP pooler) that an objective trains: pretrained or freshly initialised."""
    from transformers import AutoModel

    path, config = _training_config(model_cfg, tokenizer)
    if model_cfg.init == "scratch":
        model = AutoModel.from_config(config, **without_pooler(config))
    else:
        model = AutoModel.from_pretrained(path, config=config, trust_remote_code=False, **without_pooler(config))
    _for_training(model, model_cfg, path)
    return model


def build_masked_lm(model_cfg, tokenizer) -> tuple[nn.Module, nn.Module]:
    """(encoder, masked-LM head). The head comes from the checkpoint when it has one; otherwise (e.g. a
    sentence-transformers model, or from scratch) it is new, its decoder tied to the word embeddings."""
    from transformers import AutoModelForMaskedLM

    path, config = _training_config(model_cfg, tokenizer)
    if model_cfg.init == "scratch":
        model = AutoModelForMaskedLM.from_config(config)
    else:
        model = AutoModelForMaskedLM.from_pretrained(path, config=config, trust_remote_code=False)
    _for_training(model, model_cfg, path)
    # The head's attribute name differs per architecture (BERT: cls, RoBERTa/XLM-R: lm_head).
    for attribute in ("cls", "lm_head"):
        if hasattr(model, attribute):
            return model.base_model, getattr(model, attribute)
    raise ValueError(f"{type(model).__name__}: no masked-LM head this code knows")


def build_bert_pretraining(model_cfg, tokenizer) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(encoder, masked-LM head, next-sentence head) of a BERT; heads from the checkpoint where it has
    them, else new (the MLM decoder tied to the word embeddings).

    The NSP head is BERT's pooler (dense + tanh on [CLS]) followed by the 2-way classifier. The pooler
    is taken out of the encoder, so the encoder that export saves stays pooler-free like every other.
    """
    from transformers import AutoModelForPreTraining

    path, config = _training_config(model_cfg, tokenizer)
    if config.model_type != "bert":
        raise ValueError(f"next-sentence prediction needs a BERT model, not {config.model_type}")
    if model_cfg.init == "scratch":
        model = AutoModelForPreTraining.from_config(config)
    else:
        model = AutoModelForPreTraining.from_pretrained(path, config=config, trust_remote_code=False)
    _for_training(model, model_cfg, path)
    encoder, pooler = model.base_model, model.base_model.pooler
    encoder.pooler = None
    return encoder, model.cls.predictions, nn.Sequential(pooler, model.cls.seq_relationship)


def pooler_weights(name: str) -> dict[str, torch.Tensor]:
    """The pooler (``pooler.dense.weight``/``bias``) saved in model ``name``'s ``model.safetensors``
    (keys with or without the architecture's prefix, e.g. ``bert.``); empty where there is none or the
    model cannot be read here."""
    from safetensors import safe_open

    try:
        path = os.path.join(resolve_model_path(name), "model.safetensors")
        with safe_open(path, "pt") as f:
            return {f"pooler.dense.{p}": f.get_tensor(k) for k in f.keys()
                    for p in ("weight", "bias") if k == f"pooler.dense.{p}" or k.endswith(f".pooler.dense.{p}")}
    except (OSError, FileNotFoundError):
        return {}


def encoder_from_config(config, with_pooler: bool = False) -> nn.Module:
    """An untrained encoder of the given architecture (export fills in the trained weights).

    ``with_pooler`` keeps the architecture's pooler layer, for objectives that export a head into it.
    """
    from transformers import AutoModel

    return with_global_attention(AutoModel.from_config(config, **({} if with_pooler else without_pooler(config))))


def load_tokenizer(name: str):
    """A tokenizer folder (local, or a storage URL: file://, s3://, gs://, …), a packaged alias, or a hub id."""
    from transformers import AutoTokenizer

    from clsys import storage

    if "://" in name:  # not a hub id or an alias
        if storage.is_local(name):
            name = storage.parse(name).path
        else:
            local = tempfile.mkdtemp(prefix="clsys-tokenizer-")
            storage.download_dir(name, local)
            name = local
    return AutoTokenizer.from_pretrained(resolve_model_path(name), trust_remote_code=False)


# A text is cut to this many characters a token of max_length before it is tokenized: the tokenizer reads a whole
# text before it truncates, holding ~170 bytes a character (a 32 MB document: 6 GB). Prose averages 4-6 characters
# a token, so the cut changes what max_length tokens read only for a text averaging more than this (long runs of
# spaces, which tokenizers drop).
CHARS_PER_TOKEN = 16


def cut_for_tokens(text: str, max_length: int) -> str:
    """``text`` cut to its first ``CHARS_PER_TOKEN * max_length`` characters: more than ``max_length`` tokens of
    prose span."""
    return text[:CHARS_PER_TOKEN * max_length]


@torch.no_grad()
def embed(model: nn.Module, tokenizer, sentences: list[str], pooling: str, batch_size: int = 64,
          max_length: int = 128) -> torch.Tensor:
    """Sentence embeddings in eval mode (dropout off), batches padded to their longest sentence; each sentence
    read to ``max_length`` tokens (``cut_for_tokens`` first)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer([cut_for_tokens(s, max_length) for s in sentences[start:start + batch_size]], padding=True,
                          truncation=True, max_length=max_length, return_tensors="pt").to(device)
        hidden = model(**batch).last_hidden_state
        out.append(pool(hidden, batch["attention_mask"], pooling).float().cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.empty(0)
