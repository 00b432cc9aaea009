"""clsys.storage's backend for every URL scheme fsspec knows besides s3:// and file:// (gs://, az://, hf://,
ftp://, memory://, …): the scheme's filesystem, calls retried and their errors named, whole-object writes.

``clsys.storage`` dispatches here (docs/operations/storage.md).

Other schemes go through ``fsspec.filesystem(scheme)``, whose package (gcsfs, adlfs,
huggingface_hub, …) finds its own credentials and reads fsspec's own configuration
(``FSSPEC_<SCHEME>_<OPTION>`` variables, ``~/.config/fsspec``). A write is one put to the final
name: atomic on object stores (gs://, az://, hf://), not on filesystems that write a file as it
arrives (ftp://, sftp://), where a reader may see part of one. They have no compare-and-swap, so
no run lease (``compare_and_swap.write_if``). Calls that fail with an OSError other than a missing file or a refused
permission (a reset connection, a timeout) are retried ``ATTEMPTS`` times with backoff, a read or
download as a whole; a stream from ``open_read`` relies on the filesystem's own retries.
"""
from __future__ import annotations

import functools
import os
import time

from clsys import storage


def check_scheme(url: str, scheme: str):
    from fsspec.registry import get_filesystem_class, known_implementations

    try:
        return get_filesystem_class(scheme)
    except ValueError:
        raise storage.StorageError(f"{url}: unsupported URL scheme {scheme}:// (use s3://, file://, a local path, or a "
                           f"scheme fsspec knows, such as gs://, az:// or hf://)") from None
    except ImportError as err:
        package = known_implementations[scheme]["class"].partition(".")[0]
        # fsspec's own implementations (sftp://, http://, …) need a package its message names.
        need = str(err) if package == "fsspec" else f"pip install {package}"
        raise storage.StorageError(f"{url}: the {scheme}:// scheme needs a package that is not installed ({need}): "
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


def filesystem(loc):
    """The fsspec filesystem of ``loc`` and the path that names it there."""
    fs = _filesystem(os.getpid(), loc.scheme, loc.bucket)
    return fs, fs._strip_protocol(str(loc))


# Failures that another try cannot mend; other OSErrors (ConnectionError, TimeoutError, …) are retried.
_PERMANENT = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)
_RAISE = object()


def call(url: str, fn, *args, missing=_RAISE, **kwargs):
    """``fn(*args, **kwargs)``, a call on an fsspec filesystem, tried up to ``storage.ATTEMPTS`` times. A missing
    object returns ``missing`` when given; every failure raises StorageError naming ``url``."""
    for failures in range(1, storage.ATTEMPTS + 1):
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            if missing is _RAISE:
                raise storage.StorageError(f"{url}: no such object") from None
            return missing
        except OSError as err:
            if isinstance(err, _PERMANENT) or failures == storage.ATTEMPTS:
                raise storage.StorageError(f"{url}: {type(err).__name__}: {err}") from None
            time.sleep(storage.backoff_s(failures))
        except Exception as err:  # the filesystem's own errors (an HTTP 403, a bad token, …)
            raise storage.StorageError(f"{url}: {type(err).__name__}: {err}") from None


def write(url: str, write) -> None:
    """``write(fs, path)`` puts the whole object at its final name."""
    fs, path = filesystem(storage.parse(url))
    # Filesystems rooted at "/" (ftp, sftp) have real folders, which must exist before a file goes in;
    # object stores have none, and making one there could create a bucket.
    if fs.root_marker == "/":
        call(url, fs.makedirs, fs._parent(path), exist_ok=True)
    call(url, write, fs, path)


def no_compare_and_swap(url: str) -> storage.StorageError:
    return storage.StorageError(f"{url}: {storage.parse(url).scheme}:// has no compare-and-swap write, which the run lease needs "
                        f"(clsys has it on s3:// and on local or shared folders); set cluster.lease_ttl_s=0 to "
                        f"run without a lease, and start only one driver on the run")
