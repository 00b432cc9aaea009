"""One place for storage URLs: ``s3://bucket/key``, ``file:///abs/path`` and plain local paths.

Everything that reads or writes shards, manifests, checkpoints or logs goes through here, so
that S3 specifics (endpoint, retries, multipart) live in one file. Credentials and the endpoint
come only from the standard AWS chain (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, profiles, …);
nothing here logs them.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URL and the cause."""


@dataclass(frozen=True)
class Location:
    scheme: str  # "s3" or "file"
    bucket: str  # empty for file
    path: str  # key for s3 (no leading slash), absolute path for file

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.path}" if self.scheme == "s3" else f"file://{self.path}"


def parse(url: str | os.PathLike) -> Location:
    url = str(url)
    if url.startswith("s3://"):
        bucket, _, key = url[5:].partition("/")
        if not bucket:
            raise StorageError(f"{url}: an s3:// URL needs a bucket name")
        return Location("s3", bucket, key.strip("/"))
    if url.startswith("file://"):
        url = url[7:]
    elif "://" in url:
        raise StorageError(f"{url}: unsupported URL scheme (use s3://, file:// or a local path)")
    return Location("file", "", str(Path(url).expanduser().resolve()))


def join(url: str, *parts: str) -> str:
    loc = parse(url)
    tail = "/".join(p.strip("/") for p in parts if p)
    if loc.scheme == "s3":
        return f"s3://{loc.bucket}/{loc.path + '/' if loc.path else ''}{tail}"
    return f"file://{os.path.join(loc.path, tail)}"


def is_s3(url: str) -> bool:
    return str(url).startswith("s3://")


@functools.lru_cache(maxsize=None)
def _s3_client(pid: int):
    # One client per process (boto3 clients are not fork-safe, hence the pid in the cache key).
    import boto3
    from botocore.config import Config

    del pid
    return boto3.client(
        "s3",
        config=Config(retries={"max_attempts": 8, "mode": "adaptive"}, connect_timeout=10, read_timeout=120),
    )


def s3_client():
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
        }
        return StorageError(f"{url}: {hints.get(code, 'S3 error')} [{code}]")
    return StorageError(f"{url}: {type(err).__name__}: {err}")


def _s3_call(url: str, fn, *args, **kwargs):
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(*args, **kwargs)
    except (BotoCoreError, ClientError) as err:
        raise _s3_error(url, err) from None


def open_read(url: str) -> BinaryIO:
    """A binary stream over the object; S3 objects are streamed, not downloaded first."""
    loc = parse(url)
    if loc.scheme == "s3":
        return _s3_call(url, s3_client().get_object, Bucket=loc.bucket, Key=loc.path)["Body"]
    try:
        return open(loc.path, "rb")
    except OSError as err:
        raise StorageError(f"{url}: {err.strerror}") from None


def read_bytes(url: str) -> bytes:
    with open_read(url) as f:
        return f.read()


def read_json(url: str):
    data = read_bytes(url)
    try:
        return json.loads(data)
    except json.JSONDecodeError as err:
        raise StorageError(f"{url}: not valid JSON ({err})") from None


def exists(url: str) -> bool:
    loc = parse(url)
    if loc.scheme == "file":
        return os.path.exists(loc.path)
    from botocore.exceptions import ClientError

    try:
        s3_client().head_object(Bucket=loc.bucket, Key=loc.path)
        return True
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise _s3_error(url, err) from None


def write_bytes(url: str, data: bytes) -> None:
    """Write atomically: a reader sees the old object or the whole new one, never a part."""
    loc = parse(url)
    if loc.scheme == "s3":
        _s3_call(url, s3_client().put_object, Bucket=loc.bucket, Key=loc.path, Body=data)
        return
    os.makedirs(os.path.dirname(loc.path), exist_ok=True)
    tmp = f"{loc.path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, loc.path)


def write_json(url: str, obj) -> None:
    write_bytes(url, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False).encode())


def upload_file(local_path: str, url: str) -> None:
    """Copy a local file to ``url``; boto3 switches to multipart uploads for large files."""
    loc = parse(url)
    if loc.scheme == "s3":
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20)
        _s3_call(url, s3_client().upload_file, local_path, loc.bucket, loc.path, Config=cfg)
        return
    os.makedirs(os.path.dirname(loc.path), exist_ok=True)
    tmp = f"{loc.path}.tmp-{os.getpid()}"
    shutil.copyfile(local_path, tmp)
    os.replace(tmp, loc.path)


def download_file(url: str, local_path: str) -> None:
    loc = parse(url)
    os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
    if loc.scheme == "s3":
        _s3_call(url, s3_client().download_file, loc.bucket, loc.path, local_path)
    else:
        shutil.copyfile(loc.path, local_path)


def list_prefix(url: str) -> Iterator[str]:
    """Every object URL under ``url`` (recursively), sorted."""
    loc = parse(url)
    if loc.scheme == "file":
        root = Path(loc.path)
        if root.is_dir():
            for p in sorted(root.rglob("*")):
                if p.is_file():
                    yield f"file://{p}"
        return
    prefix = loc.path + "/" if loc.path else ""
    paginator = s3_client().get_paginator("list_objects_v2")
    pages = _s3_call(url, lambda: list(paginator.paginate(Bucket=loc.bucket, Prefix=prefix)))
    for page in pages:
        for obj in page.get("Contents", []):
            yield f"s3://{loc.bucket}/{obj['Key']}"


def delete(url: str) -> None:
    loc = parse(url)
    if loc.scheme == "s3":
        _s3_call(url, s3_client().delete_object, Bucket=loc.bucket, Key=loc.path)
    elif os.path.isdir(loc.path):
        shutil.rmtree(loc.path)
    elif os.path.exists(loc.path):
        os.remove(loc.path)


def upload_dir(local_dir: str, url: str) -> None:
    for p in sorted(Path(local_dir).rglob("*")):
        if p.is_file():
            upload_file(str(p), join(url, str(p.relative_to(local_dir))))


def download_dir(url: str, local_dir: str) -> None:
    base = parse(url).path.rstrip("/")
    for obj in list_prefix(url):
        rel = parse(obj).path[len(base):].lstrip("/")
        download_file(obj, os.path.join(local_dir, rel))


def check_bucket(url: str) -> None:
    """Fail early, with a clear message, when an s3:// bucket is missing or the credentials are wrong."""
    loc = parse(url)
    if loc.scheme != "s3":
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
