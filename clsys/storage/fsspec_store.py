"""The backend for every URL scheme fsspec knows besides s3:// and file:// (gs://, az://, hf://, ftp://,
memory://, …): the scheme's filesystem, calls retried and their errors named, whole-object writes
(docs/operations/storage.md).

Other schemes go through ``fsspec.filesystem(scheme)``, whose package (gcsfs, adlfs,
huggingface_hub, …) finds its own credentials and reads fsspec's own configuration
(``FSSPEC_<SCHEME>_<OPTION>`` variables, ``~/.config/fsspec``). A write is one put to the final
name: atomic on object stores (gs://, az://, hf://), not on filesystems that write a file as it
arrives (ftp://, sftp://), where a reader may see part of one. They have no compare-and-swap, so
no run lease (``Backend.write_if``). Calls that fail with an OSError other than a missing file or a refused
permission (a reset connection, a timeout) are retried ``ATTEMPTS`` times with backoff, a read or
download as a whole; a stream from ``open_read`` relies on the filesystem's own retries.
"""
from __future__ import annotations

import functools
import os
import time
from typing import BinaryIO, Iterator

from clsys.storage import base
from clsys.storage.base import Backend, Location, StorageError, backoff_s, content_tag


def check_scheme(url: str, scheme: str):
    from fsspec.registry import get_filesystem_class, known_implementations

    try:
        return get_filesystem_class(scheme)
    except ValueError:
        raise StorageError(f"{url}: unsupported URL scheme {scheme}:// (use s3://, file://, a local path, or a "
                           f"scheme fsspec knows, such as gs://, az:// or hf://)") from None
    except ImportError as err:
        package = known_implementations[scheme]["class"].partition(".")[0]
        # fsspec's own implementations (sftp://, http://, …) need a package its message names.
        need = str(err) if package == "fsspec" else f"pip install {package}"
        raise StorageError(f"{url}: the {scheme}:// scheme needs a package that is not installed ({need}): "
                           f"{err.__cause__ or err}") from None


@functools.lru_cache(maxsize=None)
def _filesystem(pid: int, scheme: str, bucket: str):
    # One filesystem per process and bucket or host (an ftp:// URL's host carries its options), like
    # the S3 client: the pid, because async filesystems hold an event loop that a fork does not carry.
    # Listings are read fresh, never from fsspec's cache: other processes write the same store (Ray
    # workers, data_prep), and a stale listing would hide a checkpoint or a shard.
    import fsspec.core

    del pid
    return fsspec.core.url_to_fs(f"{scheme}://{bucket}/", use_listings_cache=False)[0]


def filesystem(loc: Location):
    """The fsspec filesystem of ``loc`` and the path that names it there."""
    fs = _filesystem(os.getpid(), loc.scheme, loc.bucket)
    return fs, fs._strip_protocol(str(loc))


# Failures that another try cannot mend; other OSErrors (ConnectionError, TimeoutError, …) are retried.
_PERMANENT = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)
_RAISE = object()


def call(url: str, fn, *args, missing=_RAISE, **kwargs):
    """``fn(*args, **kwargs)``, a call on an fsspec filesystem, tried up to ``base.ATTEMPTS`` times. A missing
    object returns ``missing`` when given; every failure raises StorageError naming ``url``."""
    for failures in range(1, base.ATTEMPTS + 1):
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            if missing is _RAISE:
                raise StorageError(f"{url}: no such object") from None
            return missing
        except OSError as err:
            if isinstance(err, _PERMANENT) or failures == base.ATTEMPTS:
                raise StorageError(f"{url}: {type(err).__name__}: {err}") from None
            time.sleep(backoff_s(failures))
        except Exception as err:  # the filesystem's own errors (an HTTP 403, a bad token, …)
            raise StorageError(f"{url}: {type(err).__name__}: {err}") from None


def write(url: str, loc: Location, write) -> None:
    """``write(fs, path)`` puts the whole object at its final name."""
    fs, path = filesystem(loc)
    # Filesystems rooted at "/" (ftp, sftp) have real folders, which must exist before a file goes in;
    # object stores have none, and making one there could create a bucket.
    if fs.root_marker == "/":
        call(url, fs.makedirs, fs._parent(path), exist_ok=True)
    call(url, write, fs, path)


class Fsspec(Backend):
    def open_read(self, url: str, loc: Location, start: int, end: int | None) -> BinaryIO:
        fs, path = filesystem(loc)
        f = call(url, fs.open, path, "rb")
        if start:
            f.seek(start)
        return f

    def size(self, url: str, loc: Location) -> int:
        fs, path = filesystem(loc)
        return call(url, fs.size, path)

    def read_bytes(self, url: str, loc: Location) -> bytes:
        fs, path = filesystem(loc)
        return call(url, fs.cat_file, path)  # one call, so that a retry reads the object again

    def exists(self, url: str, loc: Location) -> bool:
        fs, path = filesystem(loc)
        return call(url, fs.info, path, missing=None) is not None

    def write_bytes(self, url: str, loc: Location, data: bytes) -> None:
        write(url, loc, lambda fs, path: fs.pipe_file(path, data))

    def upload_file(self, local_path: str, url: str, loc: Location) -> None:
        write(url, loc, lambda fs, path: fs.put_file(local_path, path))

    def download_file(self, url: str, loc: Location, local_path: str) -> None:
        fs, path = filesystem(loc)
        call(url, fs.get_file, path, local_path)

    def list_sizes(self, url: str, loc: Location) -> Iterator[tuple[str, int]]:
        fs, root = filesystem(loc)
        # Only what is under the folder, as for s3 and file: find() of a file's own name returns it.
        prefix = root.rstrip("/") + "/"
        found = call(url, fs.find, root, detail=True, missing={})
        base = str(loc).rstrip("/")
        for path, info in sorted(found.items()):
            if info["type"] == "file" and path.startswith(prefix):
                yield f"{base}/{path[len(prefix):]}", info["size"]

    def delete(self, url: str, loc: Location) -> None:
        # An object, or a folder and all under it, like rmtree; none is no error.
        fs, path = filesystem(loc)
        call(url, fs.rm, path, recursive=True, missing=None)

    def check_reachable(self, url: str, loc: Location) -> None:
        fs, path = filesystem(loc)
        call(url, fs.info, path, missing=None)  # its absence is no error

    def read_versioned(self, url: str, loc: Location) -> tuple[bytes, str] | None:
        fs, path = filesystem(loc)
        data = call(url, fs.cat_file, path, missing=None)
        return None if data is None else (data, content_tag(data))
