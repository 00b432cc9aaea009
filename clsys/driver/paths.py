"""The local paths of a config, made absolute by the driver before any worker starts.

Ray Train workers do not run in the driver's working folder (Ray gives each its own), so a relative
path in the config would name nothing there, or another file: ``model.name=models/mine`` became a
"hub id" that every rank failed to download. The driver (``clsys.pretrain``) resolves each key below
against the folder it runs in, and, for the files and folders a run reads, fails naming the key
when one names nothing. No hub is asked: nothing is downloaded at run time.

A value is read as, in this order:
- a URL (``s3://``, ``file://``, ...) where the key takes one: kept;
- a bundled name (a packaged model, an STS set, a Tatoeba pair, a BEIR folder): kept;
- a file or folder relative to the working folder, else to the folder holding the clsys package
  (recipes name bundled files as ``clsys/assets/...``, ``clsys/configs/models/...``): made absolute;
- for ``model.name`` and ``model.tokenizer``, a Hugging Face hub id in this machine's cache: kept
  (each worker reads its own cache);
- else an error naming the key.

Besides the shared sections' keys, the objective's config names its own (``ObjectiveConfig.local_files``: files
read as above; ``locations``: made absolute, as ``data.url`` is), so no objective is named here.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable

from clsys.config import Config, ConfigError

# The folder holding the clsys package: a checkout's root, or site-packages.
CHECKOUT = Path(__file__).resolve().parents[2]


def resolve_local_paths(cfg: Config) -> None:
    """Make every local path in ``cfg`` absolute, in place; ConfigError names a key whose path names nothing."""
    # Where data is read or written: made absolute only. The run root need not exist yet, and the
    # others are checked where they are read (check_data, resolve_resume, the objective's recipe).
    cfg.data.url = _location(cfg.data.url)
    cfg.train.run_root = _location(cfg.train.run_root)
    for key in type(cfg.objective).locations:
        group, name = _group(cfg.objective, key)
        if value := getattr(group, name):
            setattr(group, name, _location(value))
    if cfg.train.resume not in ("", "latest"):
        cfg.train.resume = _location(cfg.train.resume)

    cfg.model.name = _model("model.name", cfg.model.name)
    if cfg.model.tokenizer:
        cfg.model.tokenizer = _model("model.tokenizer", cfg.model.tokenizer)
    for key in ("sts_dev", "sts_test"):
        if getattr(cfg.eval, key):
            setattr(cfg.eval, key, _sts_set(f"eval.{key}", getattr(cfg.eval, key)))
    cfg.eval.tatoeba = [_tatoeba_pair(pair) for pair in cfg.eval.tatoeba]
    if cfg.eval.retrieval_dev:
        cfg.eval.retrieval_dev = _beir_folder(cfg.eval.retrieval_dev, cfg.eval.retrieval_split)
    for key in type(cfg.objective).local_files:
        group, name = _group(cfg.objective, key)
        value = getattr(group, name)
        if value and "://" not in value:
            found = _existing(value)
            if found is None:
                raise _names_nothing(f"objective.{key}", value, "a URL")
            setattr(group, name, found)


def _group(objective, key: str) -> tuple[object, str]:
    """The config group holding ``key`` (dotted, below the objective section: ``task.train``) and its name there."""
    *path, name = key.split(".")
    return functools.reduce(getattr, path, objective), name


def _location(value: str) -> str:
    return value if "://" in value else os.path.abspath(os.path.expanduser(value))


def _existing(value: str, exists: Callable[[Path], bool] = Path.exists) -> str | None:
    """The absolute path of ``value`` relative to the working folder, else to CHECKOUT (an absolute
    ``value`` is both), where ``exists``; None if neither."""
    path = Path(value).expanduser()
    for candidate in (Path.cwd() / path, CHECKOUT / path):
        if exists(candidate):
            return os.path.abspath(candidate)
    return None


def _names_nothing(key: str, value: str, otherwise: str) -> ConfigError:
    return ConfigError(f"{key}: '{value}' is no file or folder relative to {Path.cwd()} (where the driver runs) "
                      f"or to {CHECKOUT}, nor {otherwise}")


def _model(key: str, value: str) -> str:
    from huggingface_hub import constants

    from clsys.model.loading import PACKAGED_MODELS

    if "://" in value or value in PACKAGED_MODELS:
        return value
    found = _existing(value)
    if found is not None:
        return found
    if _in_hub_cache(value):
        return value
    raise _names_nothing(key, value, f"a packaged model ({', '.join(PACKAGED_MODELS)}) or a Hugging Face hub id "
                                      f"in this machine's cache ({constants.HF_HUB_CACHE}): nothing is downloaded "
                                      "at run time")


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, local_files_only=True)  # reads the cache only, never the network
    except (HFValidationError, LocalEntryNotFoundError):  # not a repo id at all, or not cached
        return False
    return True


def _sts_set(key: str, value: str) -> str:
    from clsys.eval.sts_data import bundled_sts

    # A path first, as clsys.eval.sts_data.resolve_sts reads one.
    found = _existing(value)
    if found is not None:
        return found
    if value in bundled_sts():
        return value
    raise _names_nothing(key, value, f"a bundled set ({', '.join(bundled_sts())})")


def _tatoeba_pair(value: str) -> str:
    from clsys.eval.retrieval import TATOEBA_PREFIX, bundled_tatoeba, tatoeba_files

    # A bundled pair first, as clsys.eval.retrieval.load_tatoeba reads one.
    if value in bundled_tatoeba():
        return value
    found = _existing(value, lambda prefix: tatoeba_files(prefix) is not None)
    if found is None:
        raise _names_nothing("eval.tatoeba", value, f"a bundled pair ({', '.join(bundled_tatoeba())}) (a path is "
                                                    f"{TATOEBA_PREFIX})")
    return found


def _beir_folder(value: str, split: str) -> str:
    from clsys.eval.beir import BEIR_ASSETS, bundled_beir

    # A folder first, as clsys.eval.beir.resolve_beir reads one.
    found = _existing(value, Path.is_dir)
    if found is None and value not in bundled_beir():
        raise _names_nothing("eval.retrieval_dev", value, f"a bundled set ({', '.join(bundled_beir())})")
    qrels = Path(found or BEIR_ASSETS / value) / "qrels" / f"{split}.tsv"
    if not qrels.is_file():  # checked here, before any worker starts, as the folder is
        raise ConfigError(f"eval.retrieval_split: {qrels}: no such file (eval.retrieval_dev {value})")
    return found or value
