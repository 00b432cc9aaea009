"""One place for storage URLs: ``s3://bucket/key``, ``file:///abs/path``, plain local paths, and
every other scheme fsspec knows (``gs://``, ``az://``, ``hf://``, …).

Everything that reads or writes shards, manifests, checkpoints or logs goes through here. Each function parses
the URL and calls its scheme's backend (``urls.backend``, the one place that tests a scheme), each backend
implementing ``base.Backend``: ``local.py`` (atomic writes by rename, compare-and-swap by hard links, no lock),
``s3/`` (``store.py``, with ``client.py``: the client, retries, errors; ``reader.py``: resumed reads),
``fsspec_store.py`` (every other scheme fsspec knows); ``compare_and_swap.py`` for the run lease. Credentials and the endpoint
come only from the standard AWS chain (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, profiles, …);
nothing here logs them. A URL may carry a secret of another scheme's (a token as its user name, a
signed query): what clsys prints of a URL goes through ``redact`` (``clsys/storage/redaction.py``), and a
StorageError's message always does.

Other schemes go through fsspec (``fsspec_store.py`` says how they differ).

Faults: botocore retries every request (connection reset, 500, 503 SlowDown, a response body cut
short) up to ``base.ATTEMPTS`` times with backoff, uploads and multipart parts included. What it cannot
retry is a GetObject body that breaks while the caller streams it; ``open_read`` resumes those
with ranged GETs (``S3Reader``). Permanent errors (missing object or bucket, access denied, bad
credentials) are not retried and raise StorageError naming the URL.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import BinaryIO, Iterator

from clsys.storage.redaction import redact, redact_values
from clsys.storage import local
from clsys.storage.base import Location, StorageError, discard_staged
from clsys.storage.s3.client import forget_clients as forget_s3_clients, s3_client
from clsys.storage.urls import backend, is_local, join, overlaps, parse

# The retry limits live in ``storage.base`` alone (read there at each use, so that tests can lower them).
# redact, redact_values: how callers print a URL, and write what holds some; s3_client and forget_s3_clients:
# S3's own calls (buckets, tests)
__all__ = [
    "Location", "StorageError", "check_bucket", "delete", "discard_staged", "download_dir", "download_file",
    "exists", "forget_s3_clients", "is_local", "join", "json_bytes", "list_prefix", "list_relative", "list_sizes",
    "loads_json", "open_read", "overlaps", "parallel_writes", "parse", "parse_json", "publish_staged", "read_bytes",
    "read_json", "redact", "redact_values", "s3_client", "size", "staging_path", "upload_dir", "upload_file",
    "write_bytes", "write_file", "write_json",
]


def open_read(url: str, start: int = 0, end: int | None = None) -> BinaryIO:
    """A binary stream over the object from byte ``start``; S3 objects are streamed, not downloaded
    first, and a connection that breaks mid-object is resumed from where it stopped. ``end`` (exclusive)
    bounds what an S3 ranged GET asks for, so that reading one part of a large object does not make
    the server send more (the stream may still be closed before ``end``); other schemes may read past
    it and ignore it. Other schemes: the filesystem's own file object (opening is retried, reading only
    as the filesystem does)."""
    loc = parse(url)
    return backend(loc).open_read(url, loc, start, end)


def size(url: str) -> int:
    """The object's size in bytes; StorageError when it is missing."""
    loc = parse(url)
    return backend(loc).size(url, loc)


def read_bytes(url: str) -> bytes:
    loc = parse(url)
    return backend(loc).read_bytes(url, loc)


def read_json(url: str):
    return parse_json(read_bytes(url), url)


def parse_json(data: bytes, url: str):
    try:
        return loads_json(data)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise StorageError(f"{url}: not valid JSON ({err})") from None


def loads_json(data: str | bytes):
    """``json.loads`` for JSON from elsewhere: a value nested deeper than the decoder can recurse (a 200 KB line
    of ``[`` 100,000 deep) is a ValueError, as other malformed JSON is, not a RecursionError that no reader of
    bad input catches."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply (arrays and objects within each other beyond Python's recursion "
                         "limit)") from None


def json_bytes(obj) -> bytes:
    """How clsys writes JSON: indented, keys sorted, UTF-8."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False).encode()


def exists(url: str) -> bool:
    loc = parse(url)
    return backend(loc).exists(url, loc)


def write_bytes(url: str, data: bytes) -> None:
    """Write atomically: a reader sees the old object or the whole new one, never a part."""
    loc = parse(url)
    backend(loc).write_bytes(url, loc, data)


def write_json(url: str, obj) -> None:
    write_bytes(url, json_bytes(obj))


def write_file(url: str, fill) -> None:
    """Write the local file of ``url`` (file:// or a path) atomically: ``fill(f)`` writes a temporary file
    beside it, which is flushed to disk and renamed over it. A failure (a full disk, a read-only mount)
    removes the temporary file, leaves the old file as it was and raises StorageError naming ``url``."""
    if not is_local(url):
        raise StorageError(f"{url}: write_file writes local files only (write_bytes or upload_file write any URL)")
    local.write_file(url, parse(url).path, fill)


def staging_path(url: str, tmp_dir: str) -> str:
    """Where to build a file bound for ``url`` before ``publish_staged`` puts it there: beside the
    destination when it is local (publishing is then a rename: the bytes are written once), else in
    ``tmp_dir`` (publishing uploads it), under a name made of the whole URL: files bound for different
    folders share ``tmp_dir`` (data_prep's streams are each other's ``shard-000000.tar``)."""
    loc = parse(url)
    return backend(loc).staging_path(url, loc, tmp_dir)


def parallel_writes(url: str) -> bool:
    """Whether files may be written to ``url`` from several threads at once: a local folder, or S3 (boto3's
    clients are thread-safe); not the other fsspec schemes, some of which (ftp) share one connection."""
    return backend(parse(url)).parallel_writes


def publish_staged(staged: str, url: str) -> None:
    """Put the closed file ``staged`` (from ``staging_path(url, ...)``) at ``url`` atomically: a local file
    is flushed to disk and renamed over the destination, a remote one uploaded; the staged file is gone
    afterwards, also on failure (StorageError naming ``url``; the old object is left as it was)."""
    loc = parse(url)
    try:
        backend(loc).publish_staged(staged, url, loc)
    except OSError as err:
        raise StorageError(f"{url}: writing failed: {err.strerror or err}") from None
    finally:
        discard_staged(staged)


def upload_file(local_path: str, url: str) -> None:
    """Copy a local file to ``url``; boto3 switches to multipart uploads for large files."""
    loc = parse(url)
    backend(loc).upload_file(local_path, url, loc)


def download_file(url: str, local_path: str) -> None:
    loc = parse(url)
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    backend(loc).download_file(url, loc, local_path)


def list_prefix(url: str) -> Iterator[str]:
    """Every object URL under ``url`` (recursively), sorted."""
    return (obj for obj, _ in list_sizes(url))


def list_sizes(url: str) -> Iterator[tuple[str, int]]:
    """(object URL, size in bytes) of every object under ``url`` (recursively), sorted."""
    loc = parse(url)
    return backend(loc).list_sizes(url, loc)


def delete(url: str) -> None:
    """The object, or on a filesystem the folder and all under it; nothing there is no error."""
    loc = parse(url)
    backend(loc).delete(url, loc)


def upload_dir(local_dir: str, url: str) -> None:
    for p in sorted(Path(local_dir).rglob("*")):
        if p.is_file():
            upload_file(str(p), join(url, str(p.relative_to(local_dir))))


def list_relative(url: str) -> Iterator[tuple[str, str]]:
    """(object URL, its name relative to the folder ``url``) of every object under ``url``, sorted. The name is the
    one listed (a symbolic link's own, not its target's: the local backend refuses a link that leaves the folder)."""
    prefix = str(parse(url)).rstrip("/") + "/"
    for obj in list_prefix(url):
        yield obj, obj[len(prefix):].lstrip("/")


def download_dir(url: str, local_dir: str) -> None:
    root = os.path.realpath(local_dir)
    for obj, rel in list(list_relative(url)):  # listed whole first: a refused link stops it before any copy
        target = os.path.realpath(os.path.join(root, rel))
        # An object's name may hold "../" (or start with "/"): it must not write outside the folder.
        if os.path.commonpath([root, target]) != root or target == root:
            raise StorageError(f"{obj}: the object's name leaves the folder it is downloaded into")
        download_file(obj, target)


def check_bucket(url: str) -> None:
    """Fail early, with a clear message, when an s3:// bucket is missing or the credentials are wrong;
    on other remote schemes, when ``url`` cannot be reached (its absence is no error)."""
    loc = parse(url)
    backend(loc).check_reachable(url, loc)
