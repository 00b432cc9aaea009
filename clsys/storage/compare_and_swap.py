"""Compare-and-swap on one object, what the run lease (``clsys.storage.lease``) is built on: read an object with a
version tag, write or delete it only if it is still at that version (or, to create it, absent). On S3 the
tag is the ETag and the condition goes with the request (``If-None-Match: *``, ``If-Match``); on a local (or
NFS) folder the object is a series of generation files, the tag is the newest one's number, and a write is a
hard link to the next number's name, which fails if another writer took it (``clsys.storage.local``: no lock
that a stopped writer could keep). Other schemes have no such write: StorageError
(``Backend.no_compare_and_swap``).
"""
from __future__ import annotations

from clsys.storage.urls import backend, parse


def read_versioned(url: str) -> tuple[bytes, str] | None:
    """(content, version tag) of the object, None when there is none; the tag is what ``write_if`` compares."""
    loc = parse(url)
    return backend(loc).read_versioned(url, loc)


def write_if(url: str, data: bytes, version: str | None) -> str | None:
    """Compare-and-swap: write ``data`` only if the object is absent (``version`` None) or still at
    ``version``; the new version tag, or None when the condition did not hold."""
    loc = parse(url)
    return backend(loc).write_if(url, loc, data, version)


def delete_if(url: str, version: str) -> bool:
    """Delete the object if it is still at ``version``; whether it was."""
    loc = parse(url)
    return backend(loc).delete_if(url, loc, version)
