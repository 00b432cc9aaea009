"""The local filesystem's backend (plain paths and ``file://``): writes are atomic (a temporary file beside the
destination, flushed to disk and renamed over it), and compare-and-swap runs under an exclusive lock, so a run
lease works on a local or shared (NFS) folder."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO, Iterator

from clsys.storage.base import Backend, Location, StorageError, content_tag, discard_staged


def write_file(url: str, path: str, fill) -> None:
    """Write the local file ``path`` (``url``'s) atomically: ``fill(f)`` writes a temporary file beside it, which is
    flushed to disk and renamed over it. A failure (a full disk, a read-only mount) removes the temporary file,
    leaves the old file as it was and raises StorageError naming ``url``."""
    staged = staging_path(url, path)
    try:
        with open(staged, "wb") as f:
            fill(f)
    except OSError as err:
        discard_staged(staged)
        raise StorageError(f"{url}: writing failed: {err.strerror or err}") from None
    publish(staged, url, path)


def staging_path(url: str, path: str) -> str:
    """Beside the destination: publishing is then a rename, and the bytes are written once."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as err:
        raise StorageError(f"{url}: writing failed: {err.strerror or err}") from None
    return f"{path}.tmp-{os.getpid()}"


def publish(staged: str, url: str, path: str) -> None:
    """The closed file ``staged`` flushed to disk and renamed over ``path``; gone afterwards, also on failure."""
    try:
        with open(staged, "rb") as f:
            os.fsync(f.fileno())
        os.replace(staged, path)
    except OSError as err:
        raise StorageError(f"{url}: writing failed: {err.strerror or err}") from None
    finally:
        discard_staged(staged)


@contextlib.contextmanager
def _file_lock(path: str):
    """An exclusive lock around a compare-and-swap on a local (or NFS) file, held by a sidecar file."""
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


class LocalFiles(Backend):
    parallel_writes = True

    def open_read(self, url: str, loc: Location, start: int, end: int | None) -> BinaryIO:
        try:
            f = open(loc.path, "rb")
        except OSError as err:
            raise StorageError(f"{url}: {err.strerror}") from None
        if start:
            f.seek(start)
        return f

    def size(self, url: str, loc: Location) -> int:
        try:
            return os.path.getsize(loc.path)
        except OSError as err:
            raise StorageError(f"{url}: {err.strerror}") from None

    def exists(self, url: str, loc: Location) -> bool:
        return os.path.exists(loc.path)

    def write_bytes(self, url: str, loc: Location, data: bytes) -> None:
        write_file(url, loc.path, lambda f: f.write(data))

    def upload_file(self, local_path: str, url: str, loc: Location) -> None:
        with open(local_path, "rb") as source:
            write_file(url, loc.path, lambda f: shutil.copyfileobj(source, f, 1 << 20))

    def download_file(self, url: str, loc: Location, local_path: str) -> None:
        try:
            shutil.copyfile(loc.path, local_path)
        except OSError as err:
            where = "" if err.filename == loc.path else f" (to {local_path})"
            raise StorageError(f"{url}: {err.strerror}{where}") from None

    def list_sizes(self, url: str, loc: Location) -> Iterator[tuple[str, int]]:
        root = Path(loc.path)
        if root.is_dir():
            for p in sorted(root.rglob("*")):
                try:
                    size = p.stat().st_size if p.is_file() else None
                except FileNotFoundError:  # renamed or removed since it was listed (a temporary file): not there
                    size = None
                if size is not None:
                    yield f"file://{p}", size

    def delete(self, url: str, loc: Location) -> None:
        if os.path.isdir(loc.path):
            shutil.rmtree(loc.path)
        elif os.path.exists(loc.path):
            os.remove(loc.path)

    def check_reachable(self, url: str, loc: Location) -> None:
        pass  # a local folder is made when written to

    def staging_path(self, url: str, loc: Location, tmp_dir: str) -> str:
        return staging_path(url, loc.path)

    def publish_staged(self, staged: str, url: str, loc: Location) -> None:
        publish(staged, url, loc.path)

    def read_versioned(self, url: str, loc: Location) -> tuple[bytes, str] | None:
        try:
            with open(loc.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, content_tag(data)

    def write_if(self, url: str, loc: Location, data: bytes, version: str | None) -> str | None:
        with _file_lock(loc.path):
            current = self.read_versioned(url, loc)
            if (current[1] if current else None) != version:
                return None
            self.write_bytes(url, loc, data)
        return content_tag(data)

    def delete_if(self, url: str, loc: Location, version: str) -> bool:
        with _file_lock(loc.path):
            current = self.read_versioned(url, loc)
            if current is None or current[1] != version:
                return False
            os.remove(loc.path)
        return True
