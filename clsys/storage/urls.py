"""Storage URLs: parsing (``parse``: a ``Location``, checked), joining, and the one place that picks a scheme's
backend (``backend``)."""
from __future__ import annotations

import os
import posixpath
from pathlib import Path, PurePosixPath

from clsys.storage.redaction import userinfo_end
from clsys.storage.base import Backend, Location, StorageError
from clsys.storage.fsspec_store import Fsspec, check_scheme
from clsys.storage.local import LocalFiles
from clsys.storage.s3.store import S3

_LOCAL, _S3, _FSSPEC = LocalFiles(), S3(), Fsspec()


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
        check_scheme(url, scheme)  # an unknown scheme, or one whose package is missing, fails here
    return Location(scheme, bucket, key.strip("/"))


def backend(loc: Location) -> Backend:
    """The backend of ``loc``'s scheme."""
    return _LOCAL if loc.scheme == "file" else _S3 if loc.scheme == "s3" else _FSSPEC


def join(url: str, *parts: str) -> str:
    loc = parse(url)
    tail = "/".join(p.strip("/") for p in parts if p)
    if loc.scheme == "file":
        return f"file://{os.path.join(loc.path, tail)}"
    return f"{loc.scheme}://{loc.bucket}/{loc.path + '/' if loc.path else ''}{tail}"


def overlaps(a: str, b: str) -> bool:
    """Whether two URLs name the same place or one lies inside the other, however each is spelled: a path or
    file://, ".", ".." and "//" in it, a trailing "/", a symbolic link on the way; an object store's keys alike
    (s3://b/x/ is s3://b/x). Writing to the one may then replace or delete what is read from the other."""
    x, y = parse(a), parse(b)
    if (x.scheme, x.bucket) != (y.scheme, y.bucket):
        return False
    # Keys as paths: with ".", ".." or "//" they would be other objects to a store, but they are no more than
    # other spellings of one to its users (and to clients that normalise them), so they are taken as the same.
    x_path, y_path = (PurePosixPath(posixpath.normpath(posixpath.join("/", loc.path))) for loc in (x, y))
    return x_path.is_relative_to(y_path) or y_path.is_relative_to(x_path)


def is_local(url: str) -> bool:
    """Whether ``url`` is a folder on this machine (a local path or file://), which tools can use in place."""
    return parse(url).scheme == "file"
