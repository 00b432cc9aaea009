"""Labelled classification data for few-shot fine-tuning.

Three file formats, told apart by extension and then by content:

- ``.csv`` (RFC 4180 quoting) / ``.tsv`` (no quoting) with a header row; the text column is the
  first of ``TEXT_FIELDS`` present, the label column the first of ``LABEL_FIELDS``, unless named
  (``text_field``, ``label_field``);
- ``.jsonl`` / ``.json``, and ``.txt`` whose first non-blank line starts with ``{``: JSON lines,
  one object a line, e.g. ``{"text": ..., "label": ..., "metadata": ...}`` (SciCite, ACL-ARC);
- anything else: ``LABEL sentence``, one example a line, the label being the first whitespace-
  separated word (SST ``stsa.*``, TREC ``TREC.*.all``, and raw TREC's ``DESC:manner`` words).

Blank lines are skipped; any other line that does not give a label and a non-empty text is a
``ValueError`` naming ``file:line`` and what is wrong. Labels become ids through ``label_names``:
dev and test must be read with the training set's names, so that id i means the same class in
every split (a label missing from them is an error); train derives them (sorted, numerically when
every label is an integer, so that SST's "0".."4" keep their values).
"""
from __future__ import annotations

import csv
import io
import json
import os
import random
import re
from dataclasses import dataclass
from typing import Iterator

from clsys import storage

TEXT_FIELDS = ("text", "sentence", "sentence1", "review", "question")
LABEL_FIELDS = ("label", "gold_label", "class", "y")


@dataclass
class LabeledSet:
    texts: list[str]
    labels: list[int]  # ids into label_names
    label_names: list[str]
    source: str  # the path or URL it was read from

    def __len__(self) -> int:
        return len(self.texts)


# One parsed example before label mapping: (line number, text, label as written).
_Row = tuple[int, str, str]


def load_labeled(path: str, label_names: list[str] | None = None, text_field: str | None = None,
                 label_field: str | None = None, encoding: str = "utf-8") -> LabeledSet:
    """Read a labelled file (local path, ``file://`` or ``s3://``); see the module docstring.

    ``encoding`` is for the odd legacy file: TREC.train.all has one Latin-1 byte (line 66).
    """
    data = storage.read_bytes(path)
    try:
        # A leading byte-order mark (spreadsheet exports) would end up in the first header name.
        text = data.decode(encoding).removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not {encoding} text (byte 0x{data[err.start]:02x}); "
                         f"pass the file's encoding, e.g. encoding='latin-1'") from None
    # Split on "\n" only: str.splitlines also breaks at U+2028, \x1c etc., which occur inside texts.
    lines = [line.rstrip("\r") for line in text.split("\n")]
    name = path.rstrip("/").rsplit("/", 1)[-1]
    ext = os.path.splitext(name)[1].lower()
    first = next((line.lstrip() for line in lines if line.strip()), "")

    if ext in (".csv", ".tsv"):
        rows = _table_rows(path, text, "," if ext == ".csv" else "\t", text_field, label_field)
    elif ext in (".jsonl", ".json") or (ext == ".txt" and first.startswith("{")):
        rows = _json_rows(path, lines, text_field, label_field)
    else:
        if text_field or label_field:
            raise ValueError(f"{path}: text_field/label_field apply to CSV, TSV and JSON lines, "
                             f"not to the 'LABEL sentence' format")
        rows = _word_rows(path, lines)
    if not rows:
        raise ValueError(f"{path}: no examples (empty file)")

    if label_names is None:
        label_names = _sorted_labels({label for _, _, label in rows})
    ids = {label: i for i, label in enumerate(label_names)}
    labels = []
    for line, _, label in rows:
        if label not in ids:
            raise ValueError(f"{path}:{line}: unknown label {label!r} (the known labels are {list(label_names)})")
        labels.append(ids[label])
    return LabeledSet([t for _, t, _ in rows], labels, list(label_names), path)


def _sorted_labels(labels: set[str]) -> list[str]:
    if all(re.fullmatch(r"-?\d+", label) for label in labels):
        return sorted(labels, key=int)
    return sorted(labels)


def _pick_field(path: str, where: str, fields: list[str], given: str | None, candidates: tuple[str, ...],
                kind: str) -> str:
    if given is not None:
        if given not in fields:
            raise ValueError(f"{path}:{where}: no {kind} field {given!r} (fields: {fields})")
        return given
    lowered = {f.lower(): f for f in fields}
    for candidate in candidates:
        if candidate in lowered:
            return lowered[candidate]
    raise ValueError(f"{path}:{where}: no {kind} field among {list(candidates)} (fields: {fields}); "
                     f"name it with {kind}_field")


def _checked(path: str, line: int, text, label) -> _Row:
    if not isinstance(text, str):
        raise ValueError(f"{path}:{line}: the text is {type(text).__name__}, not a string")
    if not text.strip():
        raise ValueError(f"{path}:{line}: empty text")
    # bool is an int subclass; true/false labels are more likely a mistake than a class.
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        raise ValueError(f"{path}:{line}: the label {label!r} is not a string or an integer")
    label = str(label).strip()
    if not label:
        raise ValueError(f"{path}:{line}: empty label")
    return line, text.strip(), label


def _table_rows(path: str, text: str, delimiter: str, text_field: str | None,
                label_field: str | None) -> list[_Row]:
    # TSV files (GLUE, KorNLI) are not quoted: a leading '"' is part of the text, never a quote.
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, quoting=quoting)
    header = next(reader, None)
    if header is None:
        return []
    text_col = header.index(_pick_field(path, "1", header, text_field, TEXT_FIELDS, "text"))
    label_col = header.index(_pick_field(path, "1", header, label_field, LABEL_FIELDS, "label"))
    rows = []
    end = reader.line_num
    for record in reader:
        # A quoted field may span lines: report the record's first line.
        line, end = end + 1, reader.line_num
        if not record or record == [""]:
            continue
        if len(record) != len(header):
            raise ValueError(f"{path}:{line}: {len(record)} fields, the header has {len(header)}")
        rows.append(_checked(path, line, record[text_col], record[label_col]))
    return rows


def jsonl_records(path, lines) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank JSONL line; a line that is not a JSON object is an error."""
    for line, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = storage.loads_json(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{line}: bad JSON ({err.msg} at column {err.colno})") from None
        except ValueError as err:  # nested too deeply
            raise ValueError(f"{path}:{line}: bad JSON ({err})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{line}: expected a JSON object, got {type(record).__name__}")
        yield line, record


def _json_rows(path: str, lines: list[str], text_field: str | None, label_field: str | None) -> list[_Row]:
    rows = []
    fields: tuple[str, str] | None = None
    for line, record in jsonl_records(path, lines):
        if fields is None:
            # The first record decides the field names; every later record must have them.
            keys = list(record)
            fields = (_pick_field(path, str(line), keys, text_field, TEXT_FIELDS, "text"),
                      _pick_field(path, str(line), keys, label_field, LABEL_FIELDS, "label"))
        for field in fields:
            if field not in record:
                raise ValueError(f"{path}:{line}: missing field {field!r}")
        rows.append(_checked(path, line, record[fields[0]], record[fields[1]]))
    return rows


def _word_rows(path: str, lines: list[str]) -> list[_Row]:
    rows = []
    for line, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        parts = raw.split(None, 1)
        if len(parts) < 2:
            raise ValueError(f"{path}:{line}: expected 'LABEL sentence', found no text after the label {parts[0]!r}")
        rows.append(_checked(path, line, parts[1], parts[0]))
    return rows


def few_shot(data: LabeledSet, shots: int, seed: int) -> LabeledSet:
    """``shots`` examples of every class, as the original few-shot code's ``extract_instance.py`` draws them.

    Classes are taken in label order; a class with at least ``shots`` examples gives a sample
    without replacement, a smaller one a sample with replacement (so every class has exactly
    ``shots`` rows and duplicates are possible). The result is then shuffled. One
    ``random.Random(seed)`` drives all of it, so a seed always gives the same set and order.
    ``shots=0`` keeps every example (shuffled the same way).
    """
    if shots < 0:
        raise ValueError(f"shots must be >= 0, got {shots}")
    rng = random.Random(seed)
    if shots == 0:
        chosen = list(range(len(data)))
    else:
        by_class: list[list[int]] = [[] for _ in data.label_names]
        for i, label in enumerate(data.labels):
            by_class[label].append(i)
        chosen = []
        for label, members in enumerate(by_class):
            if not members:
                raise ValueError(f"{data.source}: no example of class {data.label_names[label]!r} to sample from")
            if len(members) >= shots:
                chosen += rng.sample(members, shots)
            else:
                chosen += rng.choices(members, k=shots)
    rng.shuffle(chosen)
    return LabeledSet([data.texts[i] for i in chosen], [data.labels[i] for i in chosen],
                      list(data.label_names), data.source)
