"""A stream's manifest: ``manifest.json`` beside its shards, written last (a folder without one is
incomplete by definition), and the rules for what it may say: shard names, counts, checksums and the
sections that ``data_prep tokenize`` and ``data_prep manifest`` add. ``read_manifest`` is what training
and every data_prep command that reads a stream go through.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from clsys import storage
from clsys.shards.blocks import FORMAT_V2
from clsys.shards.names import clip
from clsys.storage import StorageError

FORMAT = "clsys-shards/1"  # a tar sample per record; what foreign streams' manifests say too
FORMATS = (FORMAT, FORMAT_V2)
MANIFEST = "manifest.json"


@dataclass
class ShardInfo:
    name: str
    samples: int  # records (format 1: tar samples)
    bytes: int
    sha256: str
    blocks: int | None = None  # format 2: tar samples (blocks); None in format 1


def shard_url(stream_url: str, name: str) -> str:
    """A manifest's shard name as a URL: a file name in the stream folder, or (data_prep manifest --out
    elsewhere) an absolute storage URL (s3://, file://, gs://, …)."""
    return name if "://" in name else storage.join(stream_url, name)


def previous_shas(stream_url: str) -> dict[str, str]:
    """Shard name → sha256 from an existing, valid manifest; empty when there is none. Shards the
    manifest names by absolute URL are left out: they are not this folder's to replace or delete."""
    if not storage.exists(storage.join(stream_url, MANIFEST)):
        return {}
    try:
        return {s["name"]: s["sha256"] for s in read_manifest(stream_url)["shards"] if "://" not in s["name"]}
    except StorageError:
        return {}  # an unreadable old manifest is simply replaced


def shard_name_problem(name: str) -> str | None:
    """Why a manifest cannot list a shard as ``name``, or None: the one rule for what ``data_prep manifest``
    writes and what ``read_manifest`` (training) accepts. A name is a file name in the stream folder, or
    the storage URL of a shard elsewhere (s3://, file://, gs://, …)."""
    if not name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "a shard name cannot be empty or hold control characters"
    if "://" in name:
        try:
            storage.parse(name)
        except StorageError as err:
            return str(err)
        return None
    if "/" in name:
        return "a shard name is a file name in the stream folder or a storage URL (s3://, file://, gs://, …)"
    if name.startswith("."):  # "." and ".." would name the folder or its parent; hidden files are not shards
        return "a file name in the stream folder cannot begin with '.'"
    return None


def repeated_shards(stream_url: str, shards: list[dict]) -> Iterator[tuple[int, int, str]]:
    """(i, j, how) for each entry ``j`` of a manifest's ``shards`` that lists the shard an earlier entry ``i``
    lists: the same URL once resolved (a file name and its stream folder's URL for it, that URL spelled
    otherwise, a symbolic link to it) or a copy of it (the same sha256; empty shards aside, which hold no sample
    to repeat). Every epoch would hold its samples twice: in contrastive training, negatives of themselves."""
    urls: dict[str, int] = {}
    shas: dict[str, int] = {}
    for j, shard in enumerate(shards):
        url = str(storage.parse(shard_url(stream_url, shard["name"])))
        if url in urls:
            yield urls[url], j, f"both are {clip(url)}"
        elif shard["samples"] and shard["sha256"] in shas:
            yield shas[shard["sha256"]], j, f"both hold sha256 {shard['sha256']}"
        urls.setdefault(url, j)
        if shard["samples"]:
            shas.setdefault(shard["sha256"], j)


def repeated_shard_problem(shards: list[dict], i: int, j: int, how: str) -> str:
    """What ``repeated_shards`` found, as errors say it."""
    return (f"shards[{j}] ({clip(shards[j]['name'])!r}) is shards[{i}] ({clip(shards[i]['name'])!r}) again ({how}): "
            "every epoch would hold its samples twice")


def text_member_problem(ext: str) -> str | None:
    """Why ``ext`` cannot name a foreign stream's text member (``data_prep manifest --text-member``,
    ``foreign.text_member``), or None: an extension, and not one clsys decodes as something else."""
    if ext in ("json", "ids", "") or "." in ext or "/" in ext:
        return "name the extension of a text member (txt, text, caption, ...)"
    return None


def _shown(value: Any) -> str:
    """A JSON value as errors show it: as written when short, else by kind."""
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else f"{text[:37]}..."


# What each manifest field must be: a function of its value that says what is wrong with it, or None.
def _text(value: Any) -> str | None:
    return None if isinstance(value, str) else f"is {_shown(value)}; expected a string"


def _count(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0  # JSON's true is an int to Python
    return None if ok else f"is {_shown(value)}; expected a whole number >= 0"


def _sha256(value: Any) -> str | None:
    ok = isinstance(value, str) and re.fullmatch("[0-9a-f]{64}", value)
    return None if ok else f"is {_shown(value)}; expected 64 lowercase hex digits"


def _list(value: Any) -> str | None:
    return None if isinstance(value, list) else f"is {_shown(value)}; expected a list"


def _rule(rule: Callable[[str], str | None]) -> Callable[[Any], str | None]:
    """A field check from a rule for strings (``shard_name_problem``, ``text_member_problem``)."""
    def check(value: Any) -> str | None:
        if not isinstance(value, str):
            return _text(value)
        problem = rule(value)
        return problem and f"is {clip(value)!r}: {problem}"
    return check


_MANIFEST = {"format": _text, "stream": _text, "shards": _list, "samples": _count}
_SHARD_NAME = {"name": _rule(shard_name_problem)}
_SHARD = {"samples": _count, "sha256": _sha256}
_SHARD_OPTIONAL = {"bytes": _count}  # absent: the shard's size is not compared when it is read
_SHARD_V2 = {"blocks": _count}  # format 2
_SECTIONS = {"tokenizer": {"name": _text, "fingerprint": _text, "max_tokens": _count},  # data_prep tokenize
             "foreign": {"text_member": _rule(text_member_problem)}}  # data_prep manifest


def _check_fields(url: str, where: str, value: Any, required: dict, optional: dict | None = None,
                  label: str = "") -> None:
    """Raise ``StorageError`` naming the manifest, the field (``where`` + its key, then ``label``) and
    what is wrong with it, for the first field of ``value`` that its check refuses."""
    prefix = f"{where}." if where else ""
    if not isinstance(value, dict):
        raise StorageError(f"{url}: manifest field '{where}' is {_shown(value)}; expected an object")
    for key, check in {**required, **(optional or {})}.items():
        if key in value:
            problem = check(value[key])
        else:
            problem = "is missing" if key in required else None
        if problem:
            raise StorageError(f"{url}: manifest field '{prefix}{key}'{label} {problem}")


def read_manifest(stream_url: str) -> dict:
    """Load and validate ``stream_url/manifest.json``; ``StorageError`` names the URL, the field and (for a
    shard's) the shard entry.

    The training loader relies on ``format`` (``clsys-shards/1``, or ``/2``: blocks of records,
    ``clsys.shards.blocks``), ``stream``, ``samples`` and ``shards[].name/samples/sha256/bytes`` (and, format 2,
    ``blocks``; counts are whole numbers >= 0, sha256 64 lowercase hex digits); shard names follow ``shard_name_problem``
    (file names in the stream folder, or absolute URLs: ``shard_url``). A pre-tokenized stream's ``tokenizer``
    (name, fingerprint, max_tokens) is checked against the training tokenizer; a foreign stream's
    ``foreign.text_member`` names the member holding each sample's text. No shard is listed twice
    (``repeated_shards``).
    """
    url = storage.join(stream_url, MANIFEST)
    manifest = storage.read_json(url)
    if not isinstance(manifest, dict):
        raise StorageError(f"{url}: manifest must be a JSON object")
    _check_fields(url, "", manifest, _MANIFEST)
    if manifest["format"] not in FORMATS:
        raise StorageError(f"{url}: manifest format is {manifest['format']!r}, expected one of {', '.join(FORMATS)}")
    if manifest["format"] == FORMAT_V2 and "foreign" in manifest:
        raise StorageError(f"{url}: manifest field 'foreign': a foreign stream's manifest is {FORMAT!r}")
    required = {**_SHARD, **_SHARD_V2} if manifest["format"] == FORMAT_V2 else _SHARD
    for i, shard in enumerate(manifest["shards"]):
        _check_fields(url, f"shards[{i}]", shard, _SHARD_NAME)
        _check_fields(url, f"shards[{i}]", shard, required, _SHARD_OPTIONAL, f" (shard {clip(shard['name'])!r})")
    for section, fields in _SECTIONS.items():
        if section in manifest:
            _check_fields(url, section, manifest[section], fields)
    if (repeated := next(repeated_shards(stream_url, manifest["shards"]), None)) is not None:
        raise StorageError(f"{url}: {repeated_shard_problem(manifest['shards'], *repeated)}")
    total = sum(s["samples"] for s in manifest["shards"])
    if total != manifest["samples"]:
        raise StorageError(f"{url}: manifest field 'samples' is {manifest['samples']} but the shards hold {total}")
    return manifest

