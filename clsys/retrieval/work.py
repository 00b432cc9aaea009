"""What a mining run keeps under its output while it runs, ``OUT/.mining/``, so that the same command, run again
after a failure, continues where the first stopped; removed once the output streams are complete.

  settings.json                      what decides the output (``Settings``), written before anything else; a run
                                     with other settings is refused rather than mixed with it
  corpus/worker-RRRRR-of-WWWWW.*     a worker's slice of the corpus (``Slice``): ``.safetensors`` (ids and
                                     embeddings), ``.jsonl`` (its texts, a JSON string a line, in id order: lines
                                     end at "\n" alone, a text's U+2028 and U+0085 are its own), ``.json`` (rows,
                                     dimension and the sha256 of the other two), written last: a slice without it
                                     is not there; one with a checksum that does not match is computed again; one
                                     whose files disagree with its ``.json`` is refused, naming it
  parts/<stream>/<shard>.json.gz     one input shard's mined negatives (``Part``: a list per record, in record
                                     order, and the drop counts), written once every query of the shard is mined:
                                     a shard with its part is not mined again

Every file is written whole or not at all (``clsys.storage``'s staged files and ``write_bytes``). A slice's files
are streamed both ways: written from the tensors' and texts' own memory, read into tensors made to their size, so
that saving or taking up a slice holds it once, not again as bytes. Nothing here is ever unpickled: JSON, and
safetensors for the tensors.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import math
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import safetensors.torch
import torch

from clsys import storage
from clsys.storage import StorageError
from clsys.storage.integrity import file_sha256

FOLDER = ".mining"
SLICE_FORMAT = "clsys-mining-slice/1"
PART_FORMAT = "clsys-mining-part/1"
CHUNK = 1 << 20  # bytes of a slice's files read or written at a time
TENSORS = {"ids": ("I64", torch.int64), "embeddings": ("F32", torch.float32)}  # a slice's: safetensors dtype
SHAPES = {"ids": 1, "embeddings": 2}  # their dimensions: [n] and [n, d]
HEADER_LIMIT = 1 << 16  # bytes of a slice's safetensors header (its two tensors': ~150)


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
    """``part``'s files at ``stem``, its ``.json`` last. safetensors writes the tensors from their own memory."""
    tensors = {"ids": part.ids.contiguous(), "embeddings": part.embeddings.contiguous()}
    with tempfile.TemporaryDirectory(prefix="clsys-slice-") as tmp:  # where a remote file is staged
        sums = [_publish(f"{stem}.safetensors", tmp, lambda path: safetensors.torch.save_file(tensors, path)),
                _publish(f"{stem}.jsonl", tmp, lambda path: _write_texts(path, part.texts))]
    storage.write_json(f"{stem}.json", {"format": SLICE_FORMAT, "rows": len(part.texts),
                                        "dim": part.embeddings.shape[1], "sha256": sums})


def _publish(url: str, tmp: str, fill: Callable[[str], None]) -> str:
    """The file that ``fill(path)`` writes, put at ``url`` whole; its sha256."""
    staged = storage.staging_path(url, tmp)
    try:
        fill(staged)
        digest = file_sha256(staged)
    except OSError as err:
        storage.discard_staged(staged)
        raise StorageError(f"{url}: writing failed: {err.strerror or err}") from None
    storage.publish_staged(staged, url)
    return digest


def _write_texts(path: str, texts: list[str]) -> None:
    # json.dumps escapes "\n" in a string, never U+2028, U+2029 or U+0085: "\n" alone ends a line.
    with open(path, "wb", buffering=CHUNK) as f:
        for text in texts:
            f.write(json.dumps(text, ensure_ascii=False).encode() + b"\n")


def saved_rows(out: str, world: int) -> int:
    """The texts of the corpus: the rows of the ``world`` slices saved under ``out`` (all are, once a part is)."""
    return sum(storage.read_json(f"{slice_stem(out, rank, world)}.json")["rows"] for rank in range(world))


class Disagrees(Exception):
    """A slice's files whose checksums match its ``.json`` but whose content does not: what it says and why."""


class Hashed:
    """A stream read through in chunks, its sha256 taken as it goes."""

    def __init__(self, stream: BinaryIO):
        self.stream, self.digest = stream, hashlib.sha256()

    def read(self, size: int) -> bytes:
        data = self.stream.read(size)
        self.digest.update(data)
        return data

    def chunks(self) -> Iterator[bytes]:
        return iter(lambda: self.read(CHUNK), b"")

    def hexdigest(self) -> str:
        """The sha256 of the whole stream (what is left of it is read)."""
        for _ in self.chunks():
            pass
        return self.digest.hexdigest()


def load_slice(stem: str) -> Slice | None:
    """The slice saved at ``stem``; None when it is not there whole (no ``.json``, a checksum that differs).
    ``StorageError`` naming it when its files are whole but disagree with its ``.json`` (texts and rows, the
    tensors' names, types and shapes): what it would hold is not known, so it is not taken for a slice."""
    if not storage.exists(f"{stem}.json"):
        return None
    meta = storage.read_json(f"{stem}.json")
    if not isinstance(meta, dict) or meta.get("format") != SLICE_FORMAT:
        return None
    size = storage.size(f"{stem}.safetensors")
    with storage.open_read(f"{stem}.safetensors") as a, storage.open_read(f"{stem}.jsonl") as b:
        files = Hashed(a), Hashed(b)
        try:
            loaded, problem = Slice(*_read_tensors(files[0], size), _read_texts(files[1])), None
        except Disagrees as err:
            loaded, problem = None, err
        if meta.get("sha256") != [f.hexdigest() for f in files]:
            return None
    rows, dim = meta.get("rows"), meta.get("dim")
    if problem is None and not (len(loaded.texts) == len(loaded.ids) == rows
                                and tuple(loaded.embeddings.shape) == (rows, dim)):
        problem = (f"{len(loaded.texts)} texts in its .jsonl, {len(loaded.ids)} ids and embeddings of shape "
                   f"{list(loaded.embeddings.shape)} in its .safetensors, {rows!r} rows of {dim!r} in its .json")
    if problem is not None:
        raise StorageError(f"{stem}.*: not the slice its .json describes ({problem}): delete {stem}.json to embed "
                           f"that slice again")
    return loaded


def _read_tensors(f: Hashed, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids and embeddings of a slice's safetensors file of ``size`` bytes (8 bytes of header size, the JSON
    header, the data), read into tensors of their size: the library's loaders would hold the file's bytes (or its
    mapped pages) beside them. Nothing is made larger than the file says it holds."""
    try:
        (header_size,) = struct.unpack("<Q", f.read(8))
        if header_size > HEADER_LIMIT:
            raise Disagrees(f"a safetensors header of {header_size} bytes")
        header = json.loads(f.read(header_size))
        header.pop("__metadata__", None)
        if set(header) != set(TENSORS):
            raise Disagrees(f"tensors {sorted(header)}, not {list(TENSORS)}")
        specs = sorted(_spec(name, header[name]) for name in TENSORS)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as err:
        raise Disagrees(f"not a safetensors file of {' and '.join(TENSORS)} ({err})") from None
    tensors, offset = {}, 0
    for begin, end, name, dtype, shape in specs:
        tag, torch_dtype = TENSORS[name]
        if dtype != tag or len(shape) != SHAPES[name] or min(shape) < 0:
            raise Disagrees(f"{name}: {dtype} of shape {shape}")
        nbytes = math.prod(shape) * torch_dtype.itemsize
        if begin != offset or end - begin != nbytes or 8 + header_size + end > size:
            raise Disagrees(f"{name}: bytes {begin}-{end} of a file of {size} for {nbytes} bytes at {offset}")
        tensor = tensors[name] = torch.empty(shape, dtype=torch_dtype)
        view = tensor.view(-1).view(torch.uint8).numpy()
        for at in range(0, nbytes, CHUNK):
            data = f.read(min(CHUNK, nbytes - at))
            if not data:
                raise Disagrees(f"{name}: its data ends at byte {offset + at}")
            view[at:at + len(data)] = memoryview(data)
        offset = end
    return tensors["ids"], tensors["embeddings"]


def _spec(name: str, entry: dict) -> tuple[int, int, str, str, list[int]]:
    """A tensor's entry in a safetensors header: (first byte, end, name, dtype, shape)."""
    begin, end = map(int, entry["data_offsets"])
    return begin, end, name, entry["dtype"], [int(n) for n in entry["shape"]]


def _read_texts(f: Hashed) -> list[str]:
    """A slice's texts: a JSON string a line, lines ending at "\\n" alone (not ``splitlines``' U+2028, U+2029,
    U+0085, which are a text's own)."""
    texts, rest = [], b""
    for chunk in f.chunks():
        *lines, rest = (rest + chunk).split(b"\n")
        texts += [_text(line, number) for number, line in enumerate(lines, len(texts) + 1)]
    if rest:
        raise Disagrees(f"its .jsonl's line {len(texts) + 1} does not end")
    return texts


def _text(line: bytes, number: int) -> str:
    try:
        text = json.loads(line)
    except ValueError as err:
        raise Disagrees(f"its .jsonl's line {number} is not JSON ({err})") from None
    if not isinstance(text, str):
        raise Disagrees(f"its .jsonl's line {number} is not a JSON string (a {type(text).__name__})")
    return text


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
