"""The local filesystem's backend (plain paths and ``file://``): writes are atomic (a temporary file beside the
destination, flushed to disk and renamed over it), and compare-and-swap is a hard link that takes a new name or
fails, so a run lease works on a local or shared (NFS) folder.

Compare-and-swap without a lock. An object written by ``write_if`` is a series of generation files,
``<path>.000000000001``, ``.000000000002``…, the highest one current; its version tag is that number. A write
conditioned on generation n writes a whole file, flushes it, and links it to generation n+1's name: ``link()``
creates a name only where there is none, in one step, also on NFS (on the server), so of two writers
conditioned on n one gets the name and the other EEXIST. A lock would be held across the read, the compare and
the write, and a writer stopped or hung inside it (SIGSTOP, a stalled disk) would stop every other one,
including the driver that should take the run over from it; a link either happened or did not. A deletion is
a generation too (a tombstone), so a writer still conditioned on an older one is refused; generations below
the newest are removed, and a writer whose name was free only because it had been removed (its condition
older than that) sees the newer generation and reports its write refused."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO, Iterator

from clsys.storage.base import Backend, Location, StorageError, discard_staged


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


def check_link_inside(folder: Location, link: Path) -> None:
    """Refuse the symbolic link ``link`` under ``folder`` (resolved) when its target lies outside it: whoever wrote
    the folder (a checkpoint, an export) chose where it points, and a copy of the folder would take that file of
    the reader's machine in (a key, another user's data) under the link's name."""
    target = os.path.realpath(link)
    if os.path.commonpath([folder.path, target]) != folder.path:
        raise StorageError(f"file://{link}: a symbolic link to {target}, outside the folder {folder} being read: "
                           "refused (copy the file into it instead)")


RECORD, TOMBSTONE = b"+", b"-"  # a generation file's first byte: the object's content follows, or it was deleted


def _generation_path(path: str, generation: int) -> str:
    return f"{path}.{generation:012d}"


def _generations(path: str) -> list[int]:
    """The generation numbers of ``path``'s compare-and-swap files, newest first (none: an empty list)."""
    folder, name = os.path.split(path)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    suffixes = (n[len(name) + 1:] for n in names if n.startswith(f"{name}."))
    return sorted((int(s) for s in suffixes if s.isdigit()), reverse=True)


def _current(path: str) -> tuple[int, bytes | None]:
    """(the newest generation, 0 when there is none; the object's content, None when absent or deleted)."""
    while generations := _generations(path):
        try:
            with open(_generation_path(path, generations[0]), "rb") as f:
                stored = f.read()
        except FileNotFoundError:  # superseded and removed since it was listed: list again
            continue
        return generations[0], stored[1:] if stored[:1] == RECORD else None
    return 0, None


def _link_generation(url: str, path: str, generation: int, stored: bytes) -> bool:
    """Make ``stored`` generation ``generation`` of ``path`` if no writer has taken that number; whether it did."""
    staged = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(staged, "wb") as f:
            f.write(stored)
            f.flush()
            os.fsync(f.fileno())
        os.link(staged, _generation_path(path, generation))
    except FileExistsError:
        return False
    except OSError as err:
        hint = (" (this filesystem has no hard links, which compare-and-swap on a folder is built on: set "
                "cluster.lease_ttl_s=0 to run without a lease, and start only one driver on the run)"
                if err.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS) else "")
        raise StorageError(f"{url}: writing failed: {err.strerror or err}{hint}") from None
    finally:
        discard_staged(staged)
    others = [g for g in _generations(path) if g != generation]
    if others and others[0] > generation:
        return False  # the name was free only because it had been removed below a newer generation
    for older in others:
        with contextlib.suppress(FileNotFoundError):  # another writer removed it first
            os.remove(_generation_path(path, older))
    return True


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
            # Listed under the names they have in the folder; rglob follows no link to a folder.
            for p in sorted(root.rglob("*")):
                if p.is_symlink():
                    check_link_inside(loc, p)
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
        generation, data = _current(loc.path)
        return None if data is None else (data, str(generation))

    def write_if(self, url: str, loc: Location, data: bytes, version: str | None) -> str | None:
        generation, current = _current(loc.path)
        if (None if current is None else str(generation)) != version:
            return None
        return str(generation + 1) if _link_generation(url, loc.path, generation + 1, RECORD + data) else None

    def delete_if(self, url: str, loc: Location, version: str) -> bool:
        generation, current = _current(loc.path)
        if current is None or str(generation) != version:
            return False
        return _link_generation(url, loc.path, generation + 1, TOMBSTONE)
