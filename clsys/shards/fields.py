"""What a sample's metadata (its ``json`` member) must hold, per stream kind: the one place that says it.

``clsys.shards.reader`` checks every sample against its stream's kind as it is decoded, so a sample
that its objective's collate could not use is bad data (reason ``missing_fields``: left out and counted
with ``data.on_bad_sample: skip``, else a ShardError naming the shard and the sample) instead of a
KeyError or AttributeError in a loader worker that names neither.

A stream's kind is the first part of its name under ``data.url`` (``stream_kind``), which the objective
reading it gives (``clsys.data.streaming.stream_loader``): ``sentences`` (SimCSE, SG, a retrieval recipe's corpus), ``documents`` (TaCL),
``triplets`` (supervised SimCSE), ``clir/<pair>`` (CLIR), ``pairs/<source>`` (query-passage pairs). Every
sample's json is an object; a kind adds the fields its objective reads. Fields not listed are neither checked
nor read. A foreign stream's samples (``data_prep manifest``) have no metadata: their json is ``{}``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class ListOf:
    """A JSON list of ``min_items`` to ``max_items`` values, each as ``item`` says."""

    item: Spec
    min_items: int = 0
    max_items: int | None = None


@dataclass(frozen=True)
class IfPresent:
    """An object field that may be absent; when present, as ``spec`` says."""

    spec: Spec


# A type (str, int, …), an object's fields ({name: Spec}), a list, or an optional field.
Spec = Union[type, dict, ListOf, IfPresent]

SAMPLE_FIELDS: dict[str, dict[str, Spec]] = {
    "sentences": {},  # the text alone
    "documents": {"lang": IfPresent(str)},  # TaCL's NSP re-splits a passage by its language (default en)
    "triplets": {"anchor": str, "positive": str, "negative": str},  # data_prep triplets
    # data_prep pairs (pairs/<source>): the txt is the query; data_prep writes "" for no instruction
    "pairs": {"positive": str, "negatives": ListOf(str), "source": str, "instruction": IfPresent(str)},
    "clir": {"pair_id": str,  # data_prep align: a query is drawn from one side's sentences, the document is the other's
             "sides": ListOf({"lang": str, "sentences": ListOf(str, 1), "hard_negatives": ListOf(str)}, 2, 2)},
}
_NAMES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
          bool: "true or false", type(None): "null"}


def stream_kind(stream: str) -> str:
    """The kind of a stream under ``data.url``: ``clir/en-de`` → ``clir``, ``sentences`` → ``sentences``."""
    return stream.split("/", 1)[0]


def fields_problem(kind: str, meta: Any) -> str | None:
    """Why ``meta``, a sample's decoded json, is not what a ``kind`` stream's samples hold, or None. An
    unknown kind ("" included) asks for an object only."""
    spec = SAMPLE_FIELDS.get(kind, {})
    if not spec and type(meta) is dict:  # most samples (sentences): asked for an object, and one it is
        return None
    return _problem(meta, spec, "json")


def _problem(value: Any, spec: Spec, where: str) -> str | None:
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{where} is {_NAMES[type(value)]}, not an object"
        for name, field in spec.items():
            optional = isinstance(field, IfPresent)
            if name not in value:
                if optional:
                    continue
                return f"{where} has no '{name}'"
            if problem := _problem(value[name], field.spec if optional else field, f"{where}.{name}"):
                return problem
        return None
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            return f"{where} is {_NAMES[type(value)]}, not a list"
        if len(value) < spec.min_items or (spec.max_items is not None and len(value) > spec.max_items):
            wanted = (f"{spec.min_items}" if spec.min_items == spec.max_items else f"at least {spec.min_items}"
                      if spec.max_items is None else f"{spec.min_items} to {spec.max_items}")
            return f"{where} has {len(value)} item{'s' * (len(value) != 1)}, expected {wanted}"
        for i, item in enumerate(value):
            if problem := _problem(item, spec.item, f"{where}[{i}]"):
                return problem
        return None
    # JSON's true and false are Python ints too.
    if not isinstance(value, spec) or (isinstance(value, bool) and spec is not bool):
        return f"{where} is {_NAMES[type(value)]}, not {_NAMES[spec]}"
    return None
