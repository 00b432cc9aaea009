"""A model folder as clsys exports it, and its publication at a URL.

The encoder's Hugging Face weights (with a pooler for architectures that have one: ``with_pooler``) and its
tokenizer, the sentence-transformers modules after the Transformer (``write_sentence_transformers``), optionally a
reranker, and ``publish``: the finished folder put in place of an earlier export (and of nothing else), whole or
not at all. Used by ``python -m clsys.export`` (a checkpoint → a folder) and by a recipe's own export in its
training workers; it reads no checkpoint (``ExportSpec``, what an objective exports, is written into checkpoints by
the engine and read back by ``clsys.export``), but says how a field of a checkpoint's record is checked as it is
read (``record_field``, ``CheckpointError``), for ``ExportSpec`` and for the engine's readers alike.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from clsys import storage
from clsys.config import choices
from clsys.storage import integrity
from clsys.model.encoder import Pooling, encoder_from_config, pooler_weights, with_global_attention
from clsys.model.loading import POOLER_MODEL_TYPES, resolve_model_path


def source_max_seq_length(model_name: str, config) -> int:
    """Keep the source model's sentence-transformers length when it has one."""
    st_config = os.path.join(resolve_model_path(model_name), "sentence_bert_config.json")
    if os.path.exists(st_config):
        with open(st_config) as f:
            return int(json.load(f)["max_seq_length"])
    return min(512, getattr(config, "max_position_embeddings", 512))


def write_sentence_transformers(folder: str, pooling: str, model, max_seq_length: int, normalize: bool = False,
                                model_args: dict | None = None, prompts: dict[str, str] | None = None) -> None:
    """modules.json and the modules after the Transformer: Pooling, plus Dense(tanh) for ``cls_mlp``,
    plus Normalize (unit-length embeddings) with ``normalize``; ``prompts`` (name → the text put before an input,
    ``encode(..., prompt_name=name)``) in config_sentence_transformers.json, with no default prompt.

    ``cls_mlp`` is the model's pooler (dense + tanh on [CLS]) written as sentence-transformers'
    ``Dense`` module (its ``config.json`` + ``model.safetensors`` with ``linear.weight``/``linear.bias``),
    so ``SentenceTransformer(folder)`` gives the HF ``pooler_output``. ``model_args``: keyword arguments
    sentence-transformers passes when it builds the Transformer's model (e.g. ``add_pooling_layer``).
    """
    from safetensors.torch import save_file

    dim = model.config.hidden_size
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    pooling_config = {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": pooling in ("cls", "cls_mlp"),
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    files = {"1_Pooling/config.json": pooling_config,
             "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False,
                                           **({"model_args": model_args} if model_args else {})},
             "config_sentence_transformers.json": {"__version__": _versions(), "model_type": "SentenceTransformer",
                                                   "prompts": dict(prompts or {}), "default_prompt_name": None,
                                                   "similarity_fn_name": "cosine"}}
    if pooling == "cls_mlp":
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        dense = model.pooler.dense
        files["2_Dense/config.json"] = {
            "in_features": dense.in_features, "out_features": dense.out_features, "bias": True,
            "activation_function": "torch.nn.modules.activation.Tanh",
            "module_input_name": "sentence_embedding", "module_output_name": "sentence_embedding"}
        os.makedirs(os.path.join(folder, "2_Dense"), exist_ok=True)
        save_file({"linear.weight": dense.weight.detach().contiguous(), "linear.bias": dense.bias.detach().contiguous()},
                  os.path.join(folder, "2_Dense", "model.safetensors"))
    if normalize:  # Normalize has no parameters: its folder is all it needs
        index = len(modules)
        modules.append({"idx": index, "name": str(index), "path": f"{index}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(folder, f"{index}_Normalize"), exist_ok=True)
    files["modules.json"] = modules
    os.makedirs(os.path.join(folder, "1_Pooling"), exist_ok=True)
    for name, obj in files.items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(obj, f, indent=2)


def _versions() -> dict[str, str]:
    """The library versions sentence-transformers records in config_sentence_transformers.json."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"pytorch": torch.__version__}
    for package in ("transformers", "sentence-transformers"):
        try:
            out[package.replace("-", "_")] = version(package)
        except PackageNotFoundError:  # sentence-transformers is not a dependency of clsys
            pass
    return out


class CheckpointError(ValueError):
    """A checkpoint's record (its clsys_state.json) or one of its files is not what clsys writes; the message
    names the field or the file. Whoever can write a checkpoint's storage can write its checksums too."""


@dataclass(frozen=True)
class Kind:
    """What a field of a checkpoint's record holds: as an error says it, and the test of a value."""

    says: str
    holds: Callable[[object], bool]
    optional: bool = False  # absent (or null) is no error: a checkpoint of an older clsys may not record it


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no count


INTEGER = Kind("an integer", _integer)
POSITIVE = Kind("a positive integer", lambda value: _integer(value) and value >= 1)
COUNT = Kind("an integer >= 0", lambda value: _integer(value) and value >= 0)
NUMBER = Kind("a number", lambda value: isinstance(value, (int, float)) and not isinstance(value, bool))
# Names, paths and URLs, which are written into lines and tables (the model card's): no line breaks or other
# control characters.
TEXT = Kind("a string of printable characters", lambda value: isinstance(value, str) and value.isprintable())
NAME_MAP = Kind("a mapping of names to names", lambda value: isinstance(value, dict) and all(
    TEXT.holds(name) and TEXT.holds(key) for name, key in value.items()), optional=True)
# A prompt is the text put before an input: any string, line breaks included ("Instruct: ...\nQuery: ").
PROMPTS = Kind("a mapping of prompt names to strings", lambda value: isinstance(value, dict) and all(
    TEXT.holds(name) and isinstance(prompt, str) for name, prompt in value.items()), optional=True)
DIMENSIONS = Kind("a list of positive integers", lambda value: isinstance(value, list) and all(
    POSITIVE.holds(dim) for dim in value), optional=True)
EXPORT_POOLINGS = (*typing.get_args(Pooling), "cls_mlp")  # what ExportSpec.pooling may be
POOLING = Kind(choices(EXPORT_POOLINGS), lambda value: isinstance(value, str) and value in EXPORT_POOLINGS)


def record_field(record: object, name: str, kind: Kind, source: str):
    """The value of the field ``name`` (dotted: inside its sections) of a checkpoint's ``record`` (``source``
    names it) once it is of ``kind`` (None where it is optional and absent); else CheckpointError naming the
    field, on one short line whatever the value."""
    value, path = record, []
    for part in name.split("."):
        if not isinstance(value, dict):
            raise CheckpointError(f"{': '.join([source, '.'.join(path)] if path else [source])}: expected a "
                                  f"mapping, got {_shown(value)}")
        path.append(part)
        value = value.get(part)
        if value is None:
            if kind.optional:
                return None
            raise CheckpointError(f"{source}: {name}: missing")
    if not kind.holds(value):
        raise CheckpointError(f"{source}: {name}: expected {kind.says}, got {_shown(value)}")
    return value


def checked_record(record: object, fields: dict[str, Kind], source: str) -> dict:
    """``record`` (a checkpoint's clsys_state.json, ``source`` naming it) once each of ``fields`` is of its kind
    (``record_field``): what a reader of it reads, so that a hostile or damaged one fails there, by name."""
    for name, kind in fields.items():
        record_field(record, name, kind, source)
    return typing.cast(dict, record)


def _shown(value: object) -> str:
    """``value`` as an error shows it: its repr (one line), cut short."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:80]}…"


@dataclass(frozen=True)
class ExportSpec:
    """What an objective's trained weights export as (``Objective.export_spec``), recorded in every checkpoint.

    ``pooling``: how sentence embeddings are pooled from the encoder at inference: ``cls``/``mean``/``max``, or
    ``cls_mlp``, ``[CLS]`` through the encoder's pooler (dense + tanh), whose weights ``head_map`` supplies.
    ``encoder_prefix``: where the encoder's own weights sit in the objective's state dict. ``head_map``: heads the
    objective trains outside the encoder that ship inside it (its parameter names as exported → the objective's
    state-dict keys: an MLP that becomes the pooler). ``reranker_map``: a (query, document) relevance head, as the
    parameter names of a 2-label Hugging Face ``*ForSequenceClassification`` model that are not the encoder's own →
    the objective's keys; export writes that model to ``<export>/reranker``. Empty maps: nothing of the kind.
    ``prompts``: sentence-transformers' named prompts (name → the text the objective trained to put before such
    inputs: ``{"query": "query: ", "passage": "passage: "}``). ``matryoshka_dims``: the leading dimensions the
    embeddings were also trained to be used at, truncated (Kusupati et al., 2022); () for the full dimension only.
    """

    pooling: str
    encoder_prefix: str
    head_map: dict[str, str] = field(default_factory=dict)
    reranker_map: dict[str, str] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)
    matryoshka_dims: tuple[int, ...] = ()

    def to_meta(self) -> dict:
        """The checkpoint meta's keys (``clsys_state.json``), named as every clsys checkpoint has named them."""
        return {"export_pooling": self.pooling, "encoder_prefix": self.encoder_prefix,
                "export_head_map": self.head_map, "export_reranker_map": self.reranker_map,
                "export_prompts": self.prompts, "export_matryoshka_dims": list(self.matryoshka_dims)}

    @classmethod
    def from_meta(cls, meta: dict, source: str = "clsys_state.json") -> ExportSpec:
        """The spec a checkpoint recorded (one written before the maps, prompts or Matryoshka dimensions were
        recorded has none), its fields checked (``record_field``; ``source`` names the record): the pooling is one
        export writes, which a path with a model card's table row in it was not."""
        return cls(record_field(meta, "export_pooling", POOLING, source),
                   record_field(meta, "encoder_prefix", TEXT, source),
                   record_field(meta, "export_head_map", NAME_MAP, source) or {},
                   record_field(meta, "export_reranker_map", NAME_MAP, source) or {},
                   record_field(meta, "export_prompts", PROMPTS, source) or {},
                   tuple(record_field(meta, "export_matryoshka_dims", DIMENSIONS, source) or ()))

    def encoder_weights(self, state: dict) -> dict:
        """The exported encoder's state dict, from the objective's ``state``: the encoder's own weights, plus the
        heads ``head_map`` maps into it."""
        prefix = self.encoder_prefix + "."
        weights = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        weights.update(mapped(state, self.head_map, "export_head_map"))
        return weights


def mapped(state: dict, names: dict[str, str], field_name: str) -> dict:
    """Exported parameter name → the objective's weight, for ``names`` (``ExportSpec``'s map ``field_name``: a
    name → its key in ``state``); CheckpointError naming the map and the key it lacks."""
    missing = [(name, key) for name, key in names.items() if key not in state]
    if missing:
        name, key = missing[0]
        raise CheckpointError(f"{field_name}: {name}: no weight {_shown(key)} in the checkpoint"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return {name: state[key] for name, key in names.items()}


def with_pooler(weights: dict, config, base_model: str) -> tuple[dict, str]:
    """``weights`` with a pooler for architectures that have one, and where it comes from. Objectives
    pool without it (it is not trained) unless they export a head into it; but ``AutoModel`` builds it
    and would report it missing and initialise it at random on every load. So the base model's pooler
    goes with the export, or, where the base has none (from scratch, or a model saved without it), a
    fixed initialisation (seed 0): either way unused by the export's own pooling."""
    if config.model_type not in POOLER_MODEL_TYPES:
        return weights, "none (the architecture has no pooler)"
    if "pooler.dense.weight" in weights:
        return weights, "trained (the objective's head)"
    base = pooler_weights(base_model)
    if base:
        return {**weights, **base}, f"{base_model}'s, untrained"
    # BERT's initialisation of its pooler's dense layer, from a generator of its own: the caller's random
    # state (a training worker's, for a recipe's own export) stays as it was, and no whole model is built.
    dim = config.hidden_size
    weight = torch.empty(dim, dim).normal_(0.0, getattr(config, "initializer_range", 0.02),
                                           generator=torch.Generator().manual_seed(0))
    return {**weights, "pooler.dense.weight": weight, "pooler.dense.bias": torch.zeros(dim)}, \
        "initialised (seed 0), untrained"


def write_model(folder: str, weights: dict, config, tokenizer_dir: str, pooling: str, max_seq_length: int,
                source: str, base_model: str, prompts: dict[str, str] | None = None) -> str:
    """Save the encoder (with its pooler: see ``with_pooler``; ``base_model`` "" for one trained from
    scratch), tokenizer and sentence-transformers files (with ``prompts``: ``ExportSpec.prompts``); returns where
    the pooler came from."""
    weights, pooler = with_pooler(weights, config, base_model)
    model = encoder_from_config(config, with_pooler=config.model_type in POOLER_MODEL_TYPES)
    _save_filled(model, weights, folder, tokenizer_dir, source)
    write_sentence_transformers(folder, pooling, model, max_seq_length, prompts=prompts)
    return pooler


def _save_filled(model, weights: dict, folder: str, tokenizer_dir: str, source: str) -> None:
    """Load ``weights`` into ``model`` (every parameter must be covered) and save it with the tokenizer."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Writing model shards" bar for the one file of a small model

    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{source}: checkpoint does not match {type(model).__name__} (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=False)
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) != rows:
        # transformers makes a tokenizer of its special tokens alone from a folder without a vocabulary: an
        # export with it would load and embed every text as unknown tokens.
        raise CheckpointError(f"{source}: its tokenizer (hf/: {', '.join(sorted(os.listdir(tokenizer_dir)))}) has "
                              f"{len(tokenizer):,} tokens but the embedding {rows:,} rows: hf/ lacks the vocabulary "
                              f"the model was trained with")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_reranker(folder: str, weights: dict, state: dict, reranker_map: dict[str, str], config,
                   tokenizer_dir: str) -> None:
    """The objective's relevance head (``ExportSpec.reranker_map`` into its ``state``) with the encoder's
    ``weights`` as a 2-label ``AutoModelForSequenceClassification`` in ``folder`` (scores are its logit 1, see
    ``clsys.eval.retrieval.hf_reranker``)."""
    from transformers import AutoModelForSequenceClassification

    model = with_global_attention(AutoModelForSequenceClassification.from_config(
        config.__class__.from_dict({**config.to_dict(), "num_labels": 2})))
    full = {f"{model.base_model_prefix}.{k}": v for k, v in weights.items()}
    full.update(mapped(state, reranker_map, "export_reranker_map"))
    _save_filled(model, full, folder, tokenizer_dir, "reranker")


RECORD = "clsys_export.json"  # what clsys.export records of the checkpoint it exported
SHOWN = 5  # how many of many files an error names (the others counted): it stays one short line


def check_replaceable(out: str) -> None:
    """Refuse (FileExistsError naming it and the files it would lose) an ``out`` that ``publish`` must not
    replace: anything but nothing, an empty folder, or a folder as ``publish`` left it, that is one whose
    SHA256SUMS, sealed in its COMPLETE, lists every file it holds with its sha256 (but those an exported
    folder's own check lets through, ``integrity.model_file_apart``: the model card and hidden files).
    ``--out ~/models`` or ``--out .`` used to be deleted whole; then any folder holding a
    ``classifier.json`` or ``clsys_export.json`` at its top: a thesis beside one, files a user added to an
    export. A file of the export's that is missing is no reason to refuse: nothing of it would be lost.
    Every file is read (on object storage, downloaded) to compare its sha256."""
    target = storage.parse(out)
    if storage.is_local(out) and os.path.lexists(target.path) and not os.path.isdir(target.path):
        raise FileExistsError(f"{out}: not a folder: refusing to replace it with an export; choose another --out")
    names = [rel for _, rel in storage.list_relative(out)]
    if not names:
        return
    seal = storage.read_bytes(storage.join(out, integrity.SEAL)) if integrity.SEAL in names else b""
    if integrity.SUMS not in names or not seal:
        # A list no COMPLETE seals could be anyone's (``sha256sum * > SHA256SUMS``); clsys leaves one where an
        # upload to object storage was cut short (see publish), or wrote one before it sealed its lists.
        why = (f"its {integrity.SUMS} sealed by no {integrity.SEAL}: an upload cut short, or an export of a clsys "
               f"of before the seal? then delete it first" if integrity.SUMS in names
               else f"no {integrity.SUMS} sealed by a {integrity.SEAL}")
        raise FileExistsError(f"{out}: not a clsys export ({why}): refusing to replace it, which would lose "
                              f"{_some(names)}; choose another --out")
    try:
        sums = integrity.sealed_sums(storage.read_bytes(storage.join(out, integrity.SUMS)), seal, out)
    except integrity.IntegrityError as err:
        raise FileExistsError(f"{err}: not a clsys export as it was written: refusing to replace it, which would "
                              f"lose {_some(names)}; choose another --out") from None
    unlisted = [rel for rel in names if rel not in sums and rel not in (integrity.SUMS, integrity.SEAL)
                and not integrity.model_file_apart(rel)]
    changed = [rel for rel in names if rel in sums and _stored_sha256(storage.join(out, rel)) != sums[rel]]
    lost = [f"{what}: {_some(rels)}" for what, rels in ((f"files not listed in its {integrity.SUMS}", unlisted),
                                                          ("files changed since it was written", changed)) if rels]
    if lost:
        raise FileExistsError(f"{out}: a clsys export with files that are not its own: refusing to replace it, which "
                              f"would lose {'; '.join(lost)}; choose another --out, or move them out of it")


def _some(names: list[str]) -> str:
    """The first ``SHOWN`` of ``names``, and how many more: a refusal stays one line."""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def _stored_sha256(url: str) -> str:
    """The sha256 of the file or object ``url``, read as a stream (an export's weights may be large)."""
    digest = hashlib.sha256()
    with storage.open_read(url) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def publish(folder: str, out: str) -> None:
    """Seal the finished local ``folder`` (its SHA256SUMS, of every file but the model card, in its COMPLETE:
    the check every reader of an exported folder makes, and what lets a later ``publish`` replace it) and put
    it at ``out`` in place of what ``check_replaceable`` lets it replace.

    On a filesystem the folder is copied to a temporary folder beside ``out`` and renamed to it (the
    previous export renamed aside just before, deleted just after): a copy that fails leaves the
    previous export as it was and nothing beside it. Object storage (s3://) has no rename: the previous
    export's COMPLETE is deleted first, then its objects the new export lacks, and the new files are
    uploaded with COMPLETE last, so that an upload cut short leaves a folder without COMPLETE (which no
    reader takes for an export, and a later ``publish`` refuses to replace: it could be anyone's).
    """
    check_replaceable(out)
    integrity.write_folder_sums(folder, skip=lambda rel: rel == integrity.MODEL_CARD)
    target = storage.parse(out)
    if not storage.is_local(out):
        storage.delete(storage.join(out, integrity.SEAL))
        new = {path.relative_to(folder).as_posix() for path in Path(folder).rglob("*") if path.is_file()}
        for obj, rel in list(storage.list_relative(out)):
            if rel not in new:
                storage.delete(obj)
        integrity.upload_sealed(folder, out)
        return
    parent, name = os.path.split(target.path)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.clsys-export-", dir=parent)
    aside = f"{staging}-previous"
    try:
        _copy_files(folder, staging, out, previous=os.path.lexists(target.path))
        if os.path.lexists(target.path):
            os.rename(target.path, aside)
        try:
            os.rename(staging, target.path)
        except BaseException:
            if os.path.lexists(aside):
                os.rename(aside, target.path)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(aside, ignore_errors=True)


def _copy_files(folder: str, staging: str, out: str, previous: bool) -> None:
    """Copy ``folder``'s files into ``staging``; stop at the first that fails with an OSError naming ``out``,
    the file, and that the ``previous`` export (if any) is as it was. (shutil.copytree goes on past a failed
    file and then reports every one as a Python list of tuples.)"""
    for path in sorted(Path(folder).rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(folder).as_posix()
        try:
            os.makedirs(os.path.dirname(os.path.join(staging, rel)), exist_ok=True)
            shutil.copy2(path, os.path.join(staging, rel))
        except OSError as err:
            kept = "the previous export is unchanged" if previous else "nothing is left there"
            raise OSError(f"{out}: {(err.strerror or str(err)).lower()} (writing {rel}); {kept}") from None
