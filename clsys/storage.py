"""One place for storage URLs: ``s3://bucket/key``, ``file:///abs/path``, plain local paths, and
every other scheme fsspec knows (``gs://``, ``az://``, ``hf://``, …).

Everything that reads or writes shards, manifests, checkpoints or logs goes through here, so
that S3 specifics (endpoint, retries, multipart) live in one file. Credentials and the endpoint
come only from the standard AWS chain (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, profiles, …);
nothing here logs them. A URL may carry a secret of another scheme's (a token as its user name, a
signed query): what clsys prints of a URL goes through ``redact`` (``clsys/redaction.py``), and a
StorageError's message always does.

Other schemes go through fsspec (``clsys/fsspec_store.py``, which says how they differ).

Faults: botocore retries every request (connection reset, 500, 503 SlowDown, a response body cut
short) up to ``ATTEMPTS`` times with backoff, uploads and multipart parts included. What it cannot
retry is a GetObject body that breaks while the caller streams it; ``open_read`` resumes those
with ranged GETs (``S3Reader``). Permanent errors (missing object or bucket, access denied, bad
credentials) are not retried and raise StorageError naming the URL.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from clsys import fsspec_store
from clsys.redaction import redact, userinfo_end
from clsys.s3_reader import S3Reader


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URL and the cause, never a secret the URL
    holds (the cause may be a library's message, which quotes the URL whole)."""

    def __init__(self, message: str):
        super().__init__(redact(message))


ATTEMPTS = 8  # tries per request (botocore), per download part (s3transfer), per stalled read (S3Reader)
BACKOFF_S = 0.05  # longest wait before the first resume of a broken read; it doubles per failure in a row
MULTIPART_BYTES = 64 * 2**20  # uploads this big go in parts of this size


@dataclass(frozen=True)
class Location:
    scheme: str  # "file", "s3", or another fsspec protocol ("gs", "az", "hf", "memory", …)
    bucket: str  # what follows "://" up to the first "/" (bucket, container, host); empty for file
    path: str  # key for object stores (no leading slash), absolute path for file

    def __str__(self) -> str:
        return f"file://{self.path}" if self.scheme == "file" else f"{self.scheme}://{self.bucket}/{self.path}"


def parse(url: str | os.PathLike) -> Location:
    url = str(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme == "file":
        return Location("file", "", str(Path(rest if sep else url).expanduser().resolve()))
    userinfo = rest[:max(userinfo_end(rest), 0)]
    if ":" in userinfo:
        # Printed URLs are redacted, but a URL is also written down as given (the run's config, manifests).
        raise StorageError(f"{url}: a password in a storage URL would be stored with it (the run's config, "
                           f"manifests); give it through the filesystem's configuration instead "
                           f"(FSSPEC_{scheme.upper()}_PASSWORD, docs/operations/storage.md)")
    if scheme == "s3" and userinfo:
        raise StorageError(f"{url}: s3:// URLs carry no credentials (they come from the AWS chain: "
                           f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, an instance role)")
    bucket, _, key = rest.partition("/")
    if scheme == "s3" and not bucket:
        raise StorageError(f"{url}: an s3:// URL needs a bucket name")
    if scheme != "s3":
        fsspec_store.check_scheme(url, scheme)  # an unknown scheme, or one whose package is missing, fails here
    return Location(scheme, bucket, key.strip("/"))


def join(url: str, *parts: str) -> str:
    loc = parse(url)
    tail = "/".join(p.strip("/") for p in parts if p)
    if loc.scheme == "file":
        return f"file://{os.path.join(loc.path, tail)}"
    return f"{loc.scheme}://{loc.bucket}/{loc.path + '/' if loc.path else ''}{tail}"


def is_local(url: str) -> bool:
    """Whether ``url`` is a folder on this machine (a local path or file://), which tools can use in place."""
    return parse(url).scheme == "file"


_CLIENT_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _s3_client(pid: int):
    # One client per process (boto3 clients are not fork-safe, hence the pid in the cache key).
    import boto3
    from botocore.config import Config

    del pid
    # botocore says at INFO where it found the endpoint and the credentials, once per client: in every
    # Ray worker, whose INFO lines reach the driver's console. Warnings and errors still show.
    logging.getLogger("botocore").setLevel(logging.WARNING)
    return boto3.client(
        "s3",
        config=Config(retries={"max_attempts": ATTEMPTS, "mode": "adaptive"}, connect_timeout=10, read_timeout=120),
    )


def s3_client():
    # Threads (data_prep's shard uploads) may ask at once: boto3's default session must not build two clients
    # at the same time.
    with _CLIENT_LOCK:
        return _s3_client(os.getpid())


def _s3_error(url: str, err: Exception) -> StorageError:
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(err, NoCredentialsError):
        return StorageError(f"{url}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)")
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "?")
        hints = {
            "NoSuchBucket": "the bucket does not exist",
            "NoSuchKey": "no such object",
            "404": "no such object",
            "InvalidAccessKeyId": "the access key is not valid (check your AWS credentials)",
            "SignatureDoesNotMatch": "the secret key is wrong (check your AWS credentials)",
            "AccessDenied": "access denied",
            "403": "access denied (check your AWS credentials)",
            "PreconditionFailed": "the object was replaced while it was being read",
            "412": "the object was replaced while it was being read",
        }
        return StorageError(f"{url}: {hints.get(code, 'S3 error')} [{code}]")
    return StorageError(f"{url}: {type(err).__name__}: {err}")


def _s3_call(url: str, fn, *args, **kwargs):
    from boto3.exceptions import RetriesExceededError, S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(*args, **kwargs)
    except (BotoCoreError, ClientError) as err:
        raise _s3_error(url, err) from None
    except S3UploadFailedError as err:
        # boto3 replaces an upload's ClientError with this one; the ClientError has the error code.
        raise _s3_error(url, err.__context__ if isinstance(err.__context__, ClientError) else err) from None
    except RetriesExceededError as err:  # s3transfer gave up on a download part
        raise _s3_error(url, err.last_exception) from None


def backoff_s(failures: int) -> float:
    """Exponential backoff with full jitter, so that readers that failed together spread out."""
    return random.uniform(0, BACKOFF_S * 2 ** (failures - 1))


def open_read(url: str, start: int = 0, end: int | None = None) -> BinaryIO:
    """A binary stream over the object from byte ``start``; S3 objects are streamed, not downloaded
    first, and a connection that breaks mid-object is resumed from where it stopped. ``end`` (exclusive)
    bounds what an S3 ranged GET asks for, so that reading one part of a large object does not make
    the server send more (the stream may still be closed before ``end``); other schemes may read past
    it and ignore it. Other schemes: the filesystem's own file object (opening is retried, reading only
    as the filesystem does)."""
    loc = parse(url)
    if loc.scheme == "s3":
        return S3Reader(url, loc, start, end)
    if loc.scheme != "file":
        fs, path = fsspec_store.filesystem(loc)
        f = fsspec_store.call(url, fs.open, path, "rb")
    else:
        try:
            f = open(loc.path, "rb")
        except OSError as err:
            raise StorageError(f"{url}: {err.strerror}") from None
    if start:
        f.seek(start)
    return f


def size(url: str) -> int:
    """The object's size in bytes; StorageError when it is missing."""
    loc = parse(url)
    if loc.scheme == "s3":
        return _s3_call(url, s3_client().head_object, Bucket=loc.bucket, Key=loc.path)["ContentLength"]
    if loc.scheme != "file":
        fs, path = fsspec_store.filesystem(loc)
        return fsspec_store.call(url, fs.size, path)
    try:
        return os.path.getsize(loc.path)
    except OSError as err:
        raise StorageError(f"{url}: {err.strerror}") from None


def read_bytes(url: str) -> bytes:
    loc = parse(url)
    if loc.scheme not in ("s3", "file"):  # one call, so that a retry reads the object again
        fs, path = fsspec_store.filesystem(loc)
        return fsspec_store.call(url, fs.cat_file, path)
    with open_read(url) as f:
        return f.read()


def read_json(url: str):
    return parse_json(read_bytes(url), url)


def parse_json(data: bytes, url: str):
    try:
        return json.loads(data)
    except json.JSONDecodeError as err:
        raise StorageError(f"{url}: not valid JSON ({err})") from None


def json_bytes(obj) -> bytes:
    """How clsys writes JSON: indented, keys sorted, UTF-8."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False).encode()


MISSING = ("NoSuchKey", "404", "NotFound")


def s3_or_none(url: str, fn, none_codes: tuple[str, ...], **kwargs):
    """An S3 request's response, or None when it fails with one of ``none_codes``; other failures raise
    StorageError naming ``url``."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(**kwargs)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in none_codes:
            return None
        raise _s3_error(url, err) from None
    except BotoCoreError as err:  # botocore's retries are spent
        raise _s3_error(url, err) from None


def exists(url: str) -> bool:
    loc = parse(url)
    if loc.scheme == "file":
        return os.path.exists(loc.path)
    if loc.scheme != "s3":
        fs, path = fsspec_store.filesystem(loc)
        return fsspec_store.call(url, fs.info, path, missing=None) is not None
    return s3_or_none(url, s3_client().head_object, MISSING, Bucket=loc.bucket, Key=loc.path) is not None


def write_bytes(url: str, data: bytes) -> None:
    """Write atomically: a reader sees the old object or the whole new one, never a part."""
    loc = parse(url)
    if loc.scheme == "s3":
        _s3_call(url, s3_client().put_object, Bucket=loc.bucket, Key=loc.path, Body=data)
    elif loc.scheme != "file":
        fsspec_store.write(url, lambda fs, path: fs.pipe_file(path, data))
    else:
        write_file(url, lambda f: f.write(data))


def write_file(url: str, fill) -> None:
    """Write the local file of ``url`` (file:// or a path) atomically: ``fill(f)`` writes a temporary file
    beside it, which is flushed to disk and renamed over it. A failure (a full disk, a read-only mount)
    removes the temporary file, leaves the old file as it was and raises StorageError naming ``url``."""
    staged = staging_path(url, "")
    try:
        with open(staged, "wb") as f:
            fill(f)
    except OSError as err:
        discard_staged(staged)
        raise StorageError(f"{url}: writing failed: {err.strerror or err}") from None
    publish_staged(staged, url)


def staging_path(url: str, tmp_dir: str) -> str:
    """Where to build a file bound for ``url`` before ``publish_staged`` puts it there: beside the
    destination when it is local (publishing is then a rename: the bytes are written once), else in
    ``tmp_dir`` (publishing uploads it), under a name made of the whole URL: files bound for different
    folders share ``tmp_dir`` (data_prep's streams are each other's ``shard-000000.tar``)."""
    loc = parse(url)
    if loc.scheme != "file":
        digest = hashlib.sha256(str(loc).encode()).hexdigest()[:16]
        return os.path.join(tmp_dir, f"{os.path.basename(loc.path)}.{digest}.tmp-{os.getpid()}")
    try:
        os.makedirs(os.path.dirname(loc.path), exist_ok=True)
    except OSError as err:
        raise StorageError(f"{url}: writing failed: {err.strerror or err}") from None
    return f"{loc.path}.tmp-{os.getpid()}"


def parallel_writes(url: str) -> bool:
    """Whether files may be written to ``url`` from several threads at once: a local folder, or S3 (boto3's
    clients are thread-safe); not the other fsspec schemes, some of which (ftp) share one connection."""
    return parse(url).scheme in ("file", "s3")


def publish_staged(staged: str, url: str) -> None:
    """Put the closed file ``staged`` (from ``staging_path(url, ...)``) at ``url`` atomically: a local file
    is flushed to disk and renamed over the destination, a remote one uploaded; the staged file is gone
    afterwards, also on failure (StorageError naming ``url``; the old object is left as it was)."""
    try:
        if parse(url).scheme != "file":
            upload_file(staged, url)
            return
        with open(staged, "rb") as f:
            os.fsync(f.fileno())
        os.replace(staged, parse(url).path)
    except OSError as err:
        raise StorageError(f"{url}: writing failed: {err.strerror or err}") from None
    finally:
        discard_staged(staged)


def discard_staged(staged: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(staged)


def write_json(url: str, obj) -> None:
    write_bytes(url, json_bytes(obj))


def upload_file(local_path: str, url: str) -> None:
    """Copy a local file to ``url``; boto3 switches to multipart uploads for large files."""
    loc = parse(url)
    if loc.scheme == "s3":
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=MULTIPART_BYTES)
        _s3_call(url, s3_client().upload_file, local_path, loc.bucket, loc.path, Config=cfg)
        return
    if loc.scheme != "file":
        fsspec_store.write(url, lambda fs, path: fs.put_file(local_path, path))
        return
    with open(local_path, "rb") as source:
        write_file(url, lambda f: shutil.copyfileobj(source, f, 1 << 20))


def download_file(url: str, local_path: str) -> None:
    loc = parse(url)
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    if loc.scheme == "s3":
        from boto3.s3.transfer import TransferConfig

        # s3transfer restarts a download part whose body breaks (botocore does not), ATTEMPTS times.
        cfg = TransferConfig(num_download_attempts=ATTEMPTS)
        try:
            _s3_call(url, s3_client().download_file, loc.bucket, loc.path, local_path, Config=cfg)
        except OSError as err:  # the local side: a full disk
            raise StorageError(f"{url}: downloading to {local_path} failed: {err.strerror or err}") from None
        return
    if loc.scheme != "file":
        fs, path = fsspec_store.filesystem(loc)
        fsspec_store.call(url, fs.get_file, path, local_path)
        return
    try:
        shutil.copyfile(loc.path, local_path)
    except OSError as err:
        where = "" if err.filename == loc.path else f" (to {local_path})"
        raise StorageError(f"{url}: {err.strerror}{where}") from None


def list_prefix(url: str) -> Iterator[str]:
    """Every object URL under ``url`` (recursively), sorted."""
    return (obj for obj, _ in list_sizes(url))


def list_sizes(url: str) -> Iterator[tuple[str, int]]:
    """(object URL, size in bytes) of every object under ``url`` (recursively), sorted."""
    loc = parse(url)
    if loc.scheme == "file":
        root = Path(loc.path)
        if root.is_dir():
            for p in sorted(root.rglob("*")):
                try:
                    size = p.stat().st_size if p.is_file() else None
                except FileNotFoundError:  # renamed or removed since it was listed (a temporary file): not there
                    size = None
                if size is not None:
                    yield f"file://{p}", size
        return
    if loc.scheme != "s3":
        fs, root = fsspec_store.filesystem(loc)
        # Only what is under the folder, as for s3 and file: find() of a file's own name returns it.
        prefix = root.rstrip("/") + "/"
        found = fsspec_store.call(url, fs.find, root, detail=True, missing={})
        for path, info in sorted(found.items()):
            if info["type"] == "file" and path.startswith(prefix):
                yield join(url, path[len(prefix):]), info["size"]
        return
    prefix = loc.path + "/" if loc.path else ""
    paginator = s3_client().get_paginator("list_objects_v2")
    pages = _s3_call(url, lambda: list(paginator.paginate(Bucket=loc.bucket, Prefix=prefix)))
    for page in pages:
        for obj in page.get("Contents", []):
            yield f"s3://{loc.bucket}/{obj['Key']}", obj["Size"]


def delete(url: str) -> None:
    loc = parse(url)
    if loc.scheme == "s3":
        _s3_call(url, s3_client().delete_object, Bucket=loc.bucket, Key=loc.path)
    elif loc.scheme != "file":  # an object, or a folder and all under it, like rmtree; none is no error
        fs, path = fsspec_store.filesystem(loc)
        fsspec_store.call(url, fs.rm, path, recursive=True, missing=None)
    elif os.path.isdir(loc.path):
        shutil.rmtree(loc.path)
    elif os.path.exists(loc.path):
        os.remove(loc.path)


def upload_dir(local_dir: str, url: str) -> None:
    for p in sorted(Path(local_dir).rglob("*")):
        if p.is_file():
            upload_file(str(p), join(url, str(p.relative_to(local_dir))))


def list_relative(url: str) -> Iterator[tuple[str, str]]:
    """(object URL, its name relative to the folder ``url``) of every object under ``url``, sorted."""
    base = parse(url).path.rstrip("/")
    for obj in list_prefix(url):
        yield obj, parse(obj).path[len(base):].lstrip("/")


def download_dir(url: str, local_dir: str) -> None:
    root = os.path.realpath(local_dir)
    for obj, rel in list_relative(url):
        target = os.path.realpath(os.path.join(root, rel))
        # An object's name may hold "../" (or start with "/"): it must not write outside the folder.
        if os.path.commonpath([root, target]) != root or target == root:
            raise StorageError(f"{obj}: the object's name leaves the folder it is downloaded into")
        download_file(obj, target)


def check_bucket(url: str) -> None:
    """Fail early, with a clear message, when an s3:// bucket is missing or the credentials are wrong;
    on other remote schemes, when ``url`` cannot be reached (its absence is no error)."""
    loc = parse(url)
    if loc.scheme == "file":
        return
    if loc.scheme != "s3":
        fs, path = fsspec_store.filesystem(loc)
        fsspec_store.call(url, fs.info, path, missing=None)
        return
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3_client().head_bucket(Bucket=loc.bucket)
    except ClientError as err:
        # HEAD responses have no body, so a missing bucket arrives as a bare "404" (not NoSuchBucket).
        if err.response.get("Error", {}).get("Code") in ("404", "NoSuchBucket", "NotFound"):
            raise StorageError(f"{url}: the bucket '{loc.bucket}' does not exist [NoSuchBucket]") from None
        raise _s3_error(url, err) from None
    except BotoCoreError as err:
        raise _s3_error(url, err) from None
