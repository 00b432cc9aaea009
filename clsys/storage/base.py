"""What every storage backend shares: the error, a parsed URL, the retry limits, and the interface ``Backend``
that each URL scheme's backend implements (``local.py``, ``s3/``, ``fsspec_store.py``)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import random
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from clsys.storage.redaction import redact

# Read where they are used, at the time (tests lower them).
ATTEMPTS = 8  # tries per request (botocore), per download part (s3transfer), per stalled read (S3Reader)
BACKOFF_S = 0.05  # longest wait before the first resume of a broken read; it doubles per failure in a row
MULTIPART_BYTES = 64 * 2**20  # uploads this big go in parts of this size


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URL and the cause, never a secret the URL
    holds (the cause may be a library's message, which quotes the URL whole)."""

    def __init__(self, message: str):
        super().__init__(redact(message))


@dataclass(frozen=True)
class Location:
    scheme: str  # "file", "s3", or another fsspec protocol ("gs", "az", "hf", "memory", …)
    bucket: str  # what follows "://" up to the first "/" (bucket, container, host); empty for file
    path: str  # key for object stores (no leading slash), absolute path for file

    def __str__(self) -> str:
        return f"file://{self.path}" if self.scheme == "file" else f"{self.scheme}://{self.bucket}/{self.path}"


def backoff_s(failures: int) -> float:
    """Exponential backoff with full jitter, so that readers that failed together spread out."""
    return random.uniform(0, BACKOFF_S * 2 ** (failures - 1))


def content_tag(data: bytes) -> str:
    """A version tag made from an object's content, where the store keeps none that a write can be conditioned on."""
    return hashlib.sha256(data).hexdigest()[:32]


def discard_staged(staged: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(staged)


class Backend:
    """One URL scheme's operations. ``clsys.storage`` parses a URL and calls its scheme's backend, so nothing else
    tests a scheme. Each method gets the URL as the caller gave it (for messages) and its ``Location``. What is
    written here is what the remote backends share: a file bound for the store is built in a local folder and
    uploaded; no compare-and-swap."""

    parallel_writes = False  # whether several threads may write to the store at once

    def open_read(self, url: str, loc: Location, start: int, end: int | None) -> BinaryIO:
        raise NotImplementedError

    def size(self, url: str, loc: Location) -> int:
        raise NotImplementedError

    def read_bytes(self, url: str, loc: Location) -> bytes:
        with self.open_read(url, loc, 0, None) as f:
            return f.read()

    def exists(self, url: str, loc: Location) -> bool:
        raise NotImplementedError

    def write_bytes(self, url: str, loc: Location, data: bytes) -> None:
        raise NotImplementedError

    def upload_file(self, local_path: str, url: str, loc: Location) -> None:
        raise NotImplementedError

    def download_file(self, url: str, loc: Location, local_path: str) -> None:
        raise NotImplementedError

    def list_sizes(self, url: str, loc: Location) -> Iterator[tuple[str, int]]:
        raise NotImplementedError

    def delete(self, url: str, loc: Location) -> None:
        raise NotImplementedError

    def check_reachable(self, url: str, loc: Location) -> None:
        raise NotImplementedError

    def staging_path(self, url: str, loc: Location, tmp_dir: str) -> str:
        # Under a name made of the whole URL: files bound for different folders share ``tmp_dir``.
        digest = hashlib.sha256(str(loc).encode()).hexdigest()[:16]
        return os.path.join(tmp_dir, f"{os.path.basename(loc.path)}.{digest}.tmp-{os.getpid()}")

    def publish_staged(self, staged: str, url: str, loc: Location) -> None:
        self.upload_file(staged, url, loc)

    def read_versioned(self, url: str, loc: Location) -> tuple[bytes, str] | None:
        raise NotImplementedError

    def write_if(self, url: str, loc: Location, data: bytes, version: str | None) -> str | None:
        raise self.no_compare_and_swap(url, loc)

    def delete_if(self, url: str, loc: Location, version: str) -> bool:
        raise self.no_compare_and_swap(url, loc)

    @staticmethod
    def no_compare_and_swap(url: str, loc: Location) -> StorageError:
        return StorageError(f"{url}: {loc.scheme}:// has no compare-and-swap write, which the run lease needs "
                            f"(clsys has it on s3:// and on local or shared folders); set cluster.lease_ttl_s=0 to "
                            f"run without a lease, and start only one driver on the run")
