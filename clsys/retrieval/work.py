"""What a mining run keeps under its output while it runs, ``OUT/.mining/``, so that the same command, run again
after a failure, continues where the first stopped; removed once the output streams are complete.

  settings.json                      what decides the output (``Settings``), written before anything else; a run
                                     with other settings is refused rather than mixed with it
  corpus/worker-RRRRR-of-WWWWW.*     a worker's slice of the corpus (``Slice``): ``.safetensors`` (ids and
                                     embeddings), ``.jsonl`` (its texts, a JSON string a line, in id order),
                                     ``.json`` (rows, dimension and the sha256 of the other two), written last: a
                                     slice without it is not there; one with a checksum that does not match is
                                     computed again
  parts/<stream>/<shard>.json.gz     one input shard's mined negatives (``Part``: a list per record, in record
                                     order, and the drop counts), written once every query of the shard is mined:
                                     a shard with its part is not mined again

Every file is written whole or not at all (``clsys.storage.write_bytes``). Nothing here is ever unpickled: JSON,
and safetensors for the tensors.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch

from clsys import storage
from clsys.storage import StorageError

FOLDER = ".mining"
SLICE_FORMAT = "clsys-mining-slice/1"
PART_FORMAT = "clsys-mining-part/1"


@dataclass(frozen=True)
class Settings:
    """What decides a mining run's output: a run continues only the progress of a run with the same settings."""

    data: str  # the root of the pairs streams
    corpus: str | None  # the corpus's stream or root; None: the streams' own passages
    inputs: str  # sha256 of the shards (names and checksums) of every stream read: changed inputs are another run
    model: str  # the model's folder
    model_sha256: str  # of its files (``folder_sha256``): a model exported again to the same folder is another
    pooling: str
    max_length: int
    query_prefix: str
    passage_prefix: str
    device: str  # "cpu" or "cuda": their floats differ
    k: int
    depth: int
    max_score_ratio: float
    keep_given: bool
    workers: int  # the slices of the corpus (their files are per worker)


def folder_sha256(path: str) -> str:
    """sha256 over the relative names and bytes of every file under the folder ``path``, in name order."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{file.relative_to(root).as_posix()}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def start(out: str, settings: Settings) -> bool:
    """Take up the progress under ``out`` of a run with these settings (True), or begin one (False).
    ``ValueError`` names the settings that differ from those of the progress found there."""
    url = storage.join(out, FOLDER, "settings.json")
    if not storage.exists(url):
        storage.write_json(url, dataclasses.asdict(settings))
        return False
    found = storage.read_json(url)
    wanted = dataclasses.asdict(settings)
    differ = [f"{key} {found.get(key)!r} there, {value!r} now" for key, value in wanted.items()
              if found.get(key) != value]
    if differ:
        raise ValueError(f"{storage.join(out, FOLDER)} holds the progress of a mining run with other settings "
                         f"({'; '.join(differ)}): give the options of that run to continue it, or another --out "
                         f"(or delete that folder to start over)")
    return True


def finish(out: str) -> None:
    """Remove the progress under ``out`` (the run's output is complete): every object under the folder (an object
    store has no folders to delete), then the folder (a filesystem's)."""
    folder = storage.join(out, FOLDER)
    for url in storage.list_prefix(folder):
        storage.delete(url)
    storage.delete(folder)


# ---------------------------------------------------------------------------------------------
# A worker's slice of the corpus


@dataclass
class Slice:
    """A worker's texts: ``ids`` [n] ascending, ``embeddings`` [n, d] (unit vectors) and ``texts`` in that order."""

    ids: torch.Tensor
    embeddings: torch.Tensor
    texts: list[str]


def slice_stem(out: str, rank: int, world: int) -> str:
    return storage.join(out, FOLDER, "corpus", f"worker-{rank:05d}-of-{world:05d}")


def save_slice(stem: str, part: Slice) -> None:
    tensors = safetensors.torch.save({"ids": part.ids.contiguous(), "embeddings": part.embeddings.contiguous()})
    texts = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in part.texts).encode()
    storage.write_bytes(f"{stem}.safetensors", tensors)
    storage.write_bytes(f"{stem}.jsonl", texts)
    storage.write_json(f"{stem}.json", {"format": SLICE_FORMAT, "rows": len(part.texts),
                                        "dim": part.embeddings.shape[1],
                                        "sha256": [hashlib.sha256(tensors).hexdigest(),
                                                   hashlib.sha256(texts).hexdigest()]})


def saved_rows(out: str, world: int) -> int:
    """The texts of the corpus: the rows of the ``world`` slices saved under ``out`` (all are, once a part is)."""
    return sum(storage.read_json(f"{slice_stem(out, rank, world)}.json")["rows"] for rank in range(world))


def load_slice(stem: str) -> Slice | None:
    """The slice saved at ``stem``; None when it is not there whole (no ``.json``, a checksum that differs)."""
    if not storage.exists(f"{stem}.json"):
        return None
    meta = storage.read_json(f"{stem}.json")
    tensors, texts = storage.read_bytes(f"{stem}.safetensors"), storage.read_bytes(f"{stem}.jsonl")
    if meta.get("format") != SLICE_FORMAT or meta.get("sha256") != [hashlib.sha256(tensors).hexdigest(),
                                                                    hashlib.sha256(texts).hexdigest()]:
        return None
    loaded = safetensors.torch.load(tensors)
    return Slice(loaded["ids"], loaded["embeddings"], [json.loads(line) for line in texts.decode().splitlines()])


# ---------------------------------------------------------------------------------------------
# An input shard's mined negatives


@dataclass
class Part:
    """An input shard's result: each record's mined negatives (texts), the candidates dropped by reason
    (``clsys.retrieval.negatives``), and the records that got fewer than k."""

    negatives: list[list[str]]
    dropped: dict[str, int]
    short: int


def part_url(out: str, stream: str, shard_name: str) -> str:
    return storage.join(out, FOLDER, "parts", stream, f"{shard_name}.json.gz")


def save_part(url: str, part: Part) -> None:
    data = {"format": PART_FORMAT, **dataclasses.asdict(part)}
    storage.write_bytes(url, gzip.compress(json.dumps(data, ensure_ascii=False).encode(), 1, mtime=0))


def load_part(url: str, records: int) -> Part | None:
    """The part at ``url`` of a shard of ``records`` records; None when there is none. ``StorageError`` when
    it is not such a part."""
    if not storage.exists(url):
        return None
    try:
        data = json.loads(gzip.decompress(storage.read_bytes(url)))
        part = Part(data["negatives"], data["dropped"], data["short"])
    except (OSError, ValueError, KeyError, TypeError) as err:  # gzip, JSON and the fields
        raise StorageError(f"{url}: not a mining part ({err})") from None
    if data.get("format") != PART_FORMAT or len(part.negatives) != records:
        raise StorageError(f"{url}: not the part of a shard of {records} records (format {data.get('format')!r}, "
                           f"{len(part.negatives)} records): delete it to mine that shard again")
    return part
