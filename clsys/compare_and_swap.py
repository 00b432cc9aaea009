"""Compare-and-swap on one object, what the run lease (``clsys.lease``) is built on: read an object with a
version tag, write or delete it only if it is still at that version (or, to create it, absent). On S3 the
tag is the ETag and the condition goes with the request (``If-None-Match: *``, ``If-Match``); a local (or
NFS) file gets a tag from its content and is compared and written under an exclusive lock. Other schemes
have no such write: StorageError (``fsspec_store.no_compare_and_swap``).
"""
from __future__ import annotations

import contextlib
import hashlib
import os

from clsys import fsspec_store, storage

# The condition of a conditional request did not hold (412), another conditional write to the key was in
# flight (409, AWS), or the object a write or delete was conditioned on is gone.
_CONDITION_FAILED = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409", *storage.MISSING)


@contextlib.contextmanager
def _file_lock(path: str):
    """An exclusive lock around a compare-and-swap on a local (or NFS) file, held by a sidecar file."""
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _content_etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def read_versioned(url: str) -> tuple[bytes, str] | None:
    """(content, version tag) of the object, None when there is none; the tag is what ``write_if`` compares."""
    loc = storage.parse(url)
    if loc.scheme == "s3":
        resp = storage.s3_or_none(url, storage.s3_client().get_object, storage.MISSING, Bucket=loc.bucket,
                                  Key=loc.path)
        return None if resp is None else (resp["Body"].read(), resp["ETag"])
    if loc.scheme != "file":
        fs, path = fsspec_store.filesystem(loc)
        data = fsspec_store.call(url, fs.cat_file, path, missing=None)
        return None if data is None else (data, _content_etag(data))
    try:
        with open(loc.path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return data, _content_etag(data)


def write_if(url: str, data: bytes, version: str | None) -> str | None:
    """Compare-and-swap: write ``data`` only if the object is absent (``version`` None) or still at
    ``version``; the new version tag, or None when the condition did not hold. S3 conditional writes
    (If-None-Match / If-Match); a file under an exclusive lock. Other schemes have none: StorageError."""
    loc = storage.parse(url)
    if loc.scheme not in ("s3", "file"):
        raise fsspec_store.no_compare_and_swap(url)
    if loc.scheme == "s3":
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        resp = storage.s3_or_none(url, storage.s3_client().put_object, _CONDITION_FAILED, Bucket=loc.bucket,
                                  Key=loc.path, Body=data, **condition)
        return None if resp is None else resp["ETag"]
    with _file_lock(loc.path):
        current = read_versioned(url)
        if (current[1] if current else None) != version:
            return None
        storage.write_bytes(url, data)
    return _content_etag(data)


def delete_if(url: str, version: str) -> bool:
    """Delete the object if it is still at ``version``; whether it was."""
    loc = storage.parse(url)
    if loc.scheme not in ("s3", "file"):
        raise fsspec_store.no_compare_and_swap(url)
    if loc.scheme == "s3":
        return storage.s3_or_none(url, storage.s3_client().delete_object, _CONDITION_FAILED, Bucket=loc.bucket,
                                  Key=loc.path, IfMatch=version) is not None
    with _file_lock(loc.path):
        current = read_versioned(url)
        if current is None or current[1] != version:
            return False
        os.remove(loc.path)
    return True
