"""sha256 checksums of a folder, written with it and compared with its files whenever clsys reads it.

Checkpoints and exported model folders hold a ``SHA256SUMS`` file in coreutils' format, one line
``<sha256 hex>  <path relative to the folder>`` per file, so that ``sha256sum -c SHA256SUMS`` checks a
copy by hand too. Who checks what: resume (``clsys.engine.checkpoint``) falls back to the previous
complete checkpoint when a file it needs differs or is missing; ``clsys.export`` refuses such a
checkpoint; ``clsys.evaluate`` and training from an exported folder refuse such a folder.

A folder without ``SHA256SUMS`` (written by another tool, or before clsys wrote one) is read unverified.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Callable

SUMS = "SHA256SUMS"
_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")


class IntegrityError(ValueError):
    """A folder's files differ from its SHA256SUMS; the message names the folder and every bad file."""


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def folder_sums(folder: str | os.PathLike, skip: Callable[[str], bool] = lambda rel: False) -> dict[str, str]:
    """Relative path (``/``-separated) → sha256 of every file under ``folder``, but SHA256SUMS and ``skip``'s."""
    root = Path(folder)
    sums = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel != SUMS and not skip(rel):
            sums[rel] = file_sha256(path)
    return sums


def format_sums(sums: dict[str, str]) -> bytes:
    return "".join(f"{digest}  {rel}\n" for rel, digest in sorted(sums.items())).encode()


def parse_sums(data: bytes, source: str) -> dict[str, str]:
    """The path → sha256 map of a SHA256SUMS file's bytes; ``source`` names it in errors."""
    sums = {}
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        match = _LINE.fullmatch(line)
        if not match:
            raise IntegrityError(f"{source}, line {number}: not '<sha256 hex>  <path>': {line[:120]!r}")
        rel = match.group(2)
        # The paths are joined to a local folder: none may leave it.
        if rel.startswith("/") or ".." in rel.split("/"):
            raise IntegrityError(f"{source}, line {number}: path '{rel}' leaves the folder")
        sums[rel] = match.group(1)
    return sums


def differences(folder: str | os.PathLike, sums: dict[str, str], wanted: Callable[[str], bool] = lambda rel: True
                ) -> list[str]:
    """How the files under ``folder`` differ from ``sums``, for the recorded paths ``wanted`` selects: one
    line per missing or changed file (files that ``sums`` does not list are not looked at)."""
    found = []
    for rel, digest in sorted(sums.items()):
        if not wanted(rel):
            continue
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            found.append(f"{rel}: missing")
        elif (got := file_sha256(path)) != digest:
            found.append(f"{rel}: sha256 {got[:12]}… differs from the recorded {digest[:12]}…")
    return found


def write_folder_sums(folder: str | os.PathLike, skip: Callable[[str], bool] = lambda rel: False) -> None:
    """Record the checksums of every file under the local ``folder`` (but ``skip``'s) in its SHA256SUMS."""
    Path(folder, SUMS).write_bytes(format_sums(folder_sums(folder, skip)))


def check_folder(folder: str | os.PathLike, required: bool = False, name: str | None = None) -> bool:
    """Raise IntegrityError naming the bad files when the local ``folder``'s files differ from its
    SHA256SUMS; False (nothing checked) when it has none, unless ``required`` (its writer recorded one).
    ``name`` (default: the folder) heads the message."""
    sums_path = Path(folder, SUMS)
    if not sums_path.is_file():
        if required:
            raise IntegrityError(f"{name or folder}: files differ from {SUMS}: {SUMS}: missing")
        return False
    bad = differences(folder, parse_sums(sums_path.read_bytes(), f"{name or folder}/{SUMS}"))
    if bad:
        raise IntegrityError(f"{name or folder}: files differ from {SUMS}: " + "; ".join(bad))
    return True
