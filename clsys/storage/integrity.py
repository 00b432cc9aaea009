"""sha256 checksums of a folder, written with it and compared with its files whenever clsys reads it.

Checkpoints and exported model folders hold a ``SHA256SUMS`` file in coreutils' format, one line
``<sha256 hex>  <path relative to the folder>`` per file, so that ``sha256sum -c SHA256SUMS`` checks a
copy by hand too. The list itself is sealed: the folder's ``COMPLETE`` marker, written last, holds
SHA256SUMS's own line (``sha256sum -c COMPLETE``). A folder passes when its list matches the seal,
lists every file the folder holds (but the few its kind leaves out, e.g. a model card) and every file
its format requires, and each listed file has its recorded sha256. Who checks what: resume
(``clsys.engine.checkpoint``) falls back to the previous complete checkpoint when one fails;
``clsys.export`` refuses such a checkpoint; ``clsys.evaluate`` and training from an exported folder
refuse such a folder.

A folder without ``SHA256SUMS`` (written by another tool, or before clsys wrote one) is read
unverified. One whose ``COMPLETE`` is empty or absent (written before clsys sealed the list) is
checked for all of the above but the seal.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Callable, Iterable

from clsys import storage

MODEL_CARD = "README.md"  # an exported folder's model card, which its SHA256SUMS leaves out
SUMS = "SHA256SUMS"
SEAL = "COMPLETE"
_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")


class IntegrityError(ValueError):
    """A folder's files differ from its SHA256SUMS; the message names the folder and every bad file."""


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def folder_sums(folder: str | os.PathLike, skip: Callable[[str], bool] = lambda rel: False) -> dict[str, str]:
    """Relative path (``/``-separated) → sha256 of every file under ``folder``, but SHA256SUMS, COMPLETE
    and ``skip``'s."""
    root = Path(folder)
    sums = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel not in (SUMS, SEAL) and not skip(rel):
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


def seal(sums_data: bytes) -> bytes:
    """COMPLETE's content for a folder whose SHA256SUMS holds ``sums_data``: that file's own line."""
    return format_sums({SUMS: hashlib.sha256(sums_data).hexdigest()})


def sealed_sums(sums_data: bytes, seal_data: bytes | None, folder: str) -> dict[str, str]:
    """The path → sha256 map of ``folder``'s SHA256SUMS (``sums_data``), once it is shown to be the list
    its writer sealed in COMPLETE (``seal_data``; empty or None: a folder of before the seal, whose list
    is taken as it is). IntegrityError names the folder and the file."""
    if seal_data:
        recorded = parse_sums(seal_data, f"{folder}/{SEAL}")
        if set(recorded) != {SUMS}:
            raise IntegrityError(f"{folder}: {SEAL} records {', '.join(sorted(recorded))}, not {SUMS}")
        got = hashlib.sha256(sums_data).hexdigest()
        if got != recorded[SUMS]:
            raise IntegrityError(f"{folder}: {SUMS}: sha256 {got[:12]}… differs from the one recorded in {SEAL} "
                                 f"({recorded[SUMS][:12]}…)")
    return parse_sums(sums_data, f"{folder}/{SUMS}")


def listing_problems(present: Iterable[str], sums: dict[str, str], listed_apart: Callable[[str], bool],
                     required: dict[str, str]) -> list[str]:
    """How ``sums`` fails to cover a folder: one line per file of ``present`` (every path the folder
    holds) that it does not list, but SHA256SUMS, COMPLETE and those ``listed_apart`` (files of the
    folder's kind that are checked otherwise, or not read), and one per file the folder's format
    requires that it does not list (``required``: how the message names it → a regular expression of
    the paths that are it). Without these, a list cut short, or edited along with its seal, would leave
    the files it drops unchecked."""
    problems = [f"{rel}: not listed in {SUMS}" for rel in sorted(present)
                if rel not in sums and rel not in (SUMS, SEAL) and not listed_apart(rel)]
    return problems + [f"{name}: required, not listed in {SUMS}" for name, pattern in required.items()
                       if not any(re.fullmatch(pattern, rel) for rel in sums)]


def differences(folder: str | os.PathLike, sums: dict[str, str], wanted: Callable[[str], bool] = lambda rel: True
                ) -> list[str]:
    """How the files under ``folder`` differ from ``sums``, for the recorded paths ``wanted`` selects: one
    line per missing or changed file (files that ``sums`` does not list: ``listing_problems``)."""
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
    """Record the checksums of every file under the local ``folder`` (but ``skip``'s) in its SHA256SUMS,
    sealed in its COMPLETE (``upload_sealed`` copies such a folder with COMPLETE last)."""
    data = format_sums(folder_sums(folder, skip))
    Path(folder, SUMS).write_bytes(data)
    Path(folder, SEAL).write_bytes(seal(data))


def upload_sealed(folder: str, url: str) -> None:
    """Upload the local ``folder`` to ``url`` with its COMPLETE, where it has one, last: a copy cut short
    has none."""
    files = [path.relative_to(folder).as_posix() for path in sorted(Path(folder).rglob("*")) if path.is_file()]
    for rel in sorted(files, key=lambda rel: rel == SEAL):
        storage.upload_file(os.path.join(folder, rel), storage.join(url, rel))


def model_file_apart(rel: str) -> bool:
    """The files of an exported model folder that its SHA256SUMS need not list: the model card, meant to be
    edited (evaluation tables, a hub's metadata), and hidden files, which come with a hub download or a
    git clone (.gitattributes, .cache/, .git/). No loader reads them as the model."""
    return rel == MODEL_CARD or any(part.startswith(".") for part in rel.split("/"))


_MODEL_REQUIRED = {"config.json": r"config\.json"}  # what every Hugging Face model folder holds


def check_folder(folder: str | os.PathLike, name: str | None = None, recorded: bool = False,
                 listed_apart: Callable[[str], bool] = model_file_apart,
                 required: dict[str, str] = _MODEL_REQUIRED) -> bool:
    """Raise IntegrityError, naming ``name`` (default: the folder) and the bad files, when the local
    ``folder`` fails its SHA256SUMS (see the module's docstring; ``listed_apart`` and ``required`` as
    ``listing_problems`` takes them: by default an exported model folder's); False (nothing checked)
    when it has no SHA256SUMS, unless ``recorded`` (its writer recorded one)."""
    name = name or str(folder)
    sums_path, seal_path = Path(folder, SUMS), Path(folder, SEAL)
    if not sums_path.is_file():
        if recorded:
            raise IntegrityError(f"{name}: {SUMS}: missing")
        return False
    sums = sealed_sums(sums_path.read_bytes(), seal_path.read_bytes() if seal_path.is_file() else None, name)
    present = [path.relative_to(folder).as_posix() for path in Path(folder).rglob("*") if path.is_file()]
    bad = listing_problems(present, sums, listed_apart, required) + differences(folder, sums)
    if bad:
        raise IntegrityError(f"{name}: files differ from {SUMS}: " + "; ".join(bad))
    return True
