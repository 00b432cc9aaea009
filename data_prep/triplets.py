"""``python -m data_prep triplets``: NLI data → (anchor, positive, negative) shards for supervised SimCSE.

Triplets are built per premise as KR-BERT-SimCSE does (docs/training/objectives.md#simcse-triplets): the premise
is the anchor, one entailment hypothesis the positive and one contradiction hypothesis the negative.
When a premise has several hypotheses with the same label, the last one read wins; premises lacking
either label are dropped. Premises are grouped by exact text across all inputs, and triplets are
written in the order their premise was first read, so the output depends only on the inputs.

Inputs: CSV, TSV or JSON lines with columns premise/sentence1, hypothesis/sentence2, label/gold_label.
Labels: entailment/neutral/contradiction, or the SNLI/MNLI Hugging Face integers 0 = entailment,
1 = neutral, 2 = contradiction. Neutral rows are read (they are valid) but never used.
"""
from __future__ import annotations

import argparse
import csv
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from clsys import storage
from clsys.storage import StorageError
from data_prep import __version__
from data_prep import cli
from clsys.shards.manifest import previous_shas
from clsys.shards.writer import ShardWriter

log = logging.getLogger(__name__)

COLUMNS = {"premise": ("premise", "sentence1"), "hypothesis": ("hypothesis", "sentence2"),
           "label": ("label", "gold_label")}
LABELS = {"entailment": "entailment", "neutral": "neutral", "contradiction": "contradiction",
          "0": "entailment", "1": "neutral", "2": "contradiction"}  # integers: SNLI/MNLI on the HF hub
FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl"}


class InputError(Exception):
    """An input that cannot be read at all (missing file, unusable header); names ``file:line``."""


@dataclass
class Row:
    line: int
    premise: str
    hypothesis: str
    label: str  # entailment / neutral / contradiction


@dataclass
class NliFile:
    """One input file: its format, detected from the extension (else the first line), and its columns."""

    path: str
    format: str = field(init=False)
    columns: dict[str, str] = field(init=False, default_factory=dict)  # role → the header's column name

    def __post_init__(self):
        try:
            with open(self.path, encoding="utf-8-sig", newline="") as f:
                first = f.readline()
        except (OSError, UnicodeDecodeError) as err:
            raise InputError(f"{self.path}: cannot read: {getattr(err, 'strerror', None) or err}") from None
        if not first.strip():
            raise InputError(f"{self.path}: empty file")
        ext = os.path.splitext(self.path)[1].lower()
        self.format = FORMATS.get(ext) or ("jsonl" if first.lstrip().startswith("{") else
                                           "tsv" if "\t" in first else "csv")
        if self.format != "jsonl":
            header = next(self._reader([first]))
            self.columns = _match_columns([h.strip() for h in header], f"{self.path}:1")

    def _reader(self, lines) -> Iterator[list[str]]:
        # KorNLI/MNLI TSVs contain unbalanced quotes inside sentences: read them without quote processing.
        if self.format == "tsv":
            return csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
        return csv.reader(lines)

    def rows(self, malformed: list[str]) -> Iterator[Row]:
        """Usable rows; a line that is not is recorded as ``file:line: reason`` in ``malformed``."""
        with open(self.path, encoding="utf-8-sig", newline="") as f:
            if self.format == "jsonl":
                for n, line in enumerate(f, 1):
                    if line.strip():
                        yield from self._row(n, _json_fields(line), malformed)
                return
            reader = self._reader(f)
            header = [h.strip() for h in next(reader)]
            for fields in reader:
                if not fields:
                    continue  # blank line
                n = reader.line_num  # a quoted CSV field may span lines: report where the record ends
                if len(fields) != len(header):
                    malformed.append(f"{self.path}:{n}: {len(fields)} fields, header has {len(header)}")
                    continue
                yield from self._row(n, dict(zip(header, fields)), malformed)

    def _row(self, n: int, values: dict | None, malformed: list[str]) -> Iterator[Row]:
        where = f"{self.path}:{n}"
        if values is None:
            malformed.append(f"{where}: not a JSON object")
            return
        columns = self.columns or _match_columns(list(values), where, strict=False)
        if len(columns) < len(COLUMNS):
            malformed.append(f"{where}: missing {', '.join(sorted(set(COLUMNS) - set(columns)))}")
            return
        premise, hypothesis = (str(values[columns[r]] or "").strip() for r in ("premise", "hypothesis"))
        label = LABELS.get(str(values[columns["label"]]).strip().lower())
        if not premise or not hypothesis or label is None:
            # Includes SNLI's "-" / HF's -1: no annotator consensus, hence no usable label.
            malformed.append(f"{where}: empty sentence or label {values[columns['label']]!r} not one of "
                             f"{', '.join(LABELS)}")
            return
        yield Row(n, premise, hypothesis, label)


def _match_columns(names: list[str], where: str, strict: bool = True) -> dict[str, str]:
    """Role → column name, matching the accepted names case-insensitively."""
    lower = {name.lower(): name for name in names}
    columns = {role: next(lower[a] for a in aliases if a in lower)
               for role, aliases in COLUMNS.items() if any(a in lower for a in aliases)}
    if strict and len(columns) < len(COLUMNS):
        missing = [" or ".join(COLUMNS[r]) for r in COLUMNS if r not in columns]
        raise InputError(f"{where}: header has no {' / '.join(missing)} column (found: {', '.join(names)})")
    return columns


def _json_fields(line: str) -> dict | None:
    try:
        obj = storage.loads_json(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


@dataclass
class Triplets:
    """Premise → its last entailment and last contradiction hypothesis, in first-read order (dicts keep it)."""

    hypotheses: dict[str, dict[str, str]] = field(default_factory=dict)

    def add(self, row: Row) -> None:
        labels = self.hypotheses.setdefault(row.premise, {})
        if row.label != "neutral":
            labels[row.label] = row.hypothesis  # last one read wins, as KR-BERT-SimCSE

    def complete(self) -> Iterator[tuple[str, str, str]]:
        for premise, labels in self.hypotheses.items():
            if "entailment" in labels and "contradiction" in labels:
                yield premise, labels["entailment"], labels["contradiction"]

    def skipped(self) -> dict[str, int]:
        """Dropped premises, each counted once: no entailment at all, or an entailment but no contradiction."""
        no_ent = sum("entailment" not in labels for labels in self.hypotheses.values())
        no_con = sum("entailment" in labels and "contradiction" not in labels for labels in self.hypotheses.values())
        return {"no_entailment": no_ent, "no_contradiction": no_con}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="NLI files: .csv, .tsv or .jsonl (else detected from the first line)")
    p.add_argument("--out", required=True, metavar="URL", help="output folder: s3://bucket/prefix, file:///abs or a path")
    p.add_argument("--shard-size-mb", type=cli.positive(float), default=64.0, metavar="N",
                   help="roll shards over at this size in MiB, fractions allowed (default: 64)")


def main(args: argparse.Namespace) -> int:
    """Run ``triplets``; returns the exit code (0 ok, 2 unusable input, no triplet, or storage error)."""
    start = time.time()
    try:
        storage.check_bucket(args.out)
        url = storage.join(args.out, "triplets")
        if problem := cli.out_problem(args.out, [url], args.input):
            return cli.fail("triplets", problem)
        files = [NliFile(path) for path in args.input]  # every header checked before anything is written
        triplets, malformed, sources = Triplets(), [], []
        for nli in files:
            before, rows = len(malformed), 0
            for row in nli.rows(malformed):
                triplets.add(row)
                rows += 1
            sources.append({"file": os.path.basename(nli.path), "format": nli.format, "rows": rows,
                            "malformed": len(malformed) - before})
        for message in malformed[:5]:
            log.warning(f"data_prep triplets: warning: {message}")
        if len(malformed) > 5:
            log.warning(f"data_prep triplets: warning: ... {len(malformed) - 5} more malformed lines")
        skipped = {**triplets.skipped(), "malformed": len(malformed)}
        with tempfile.TemporaryDirectory(prefix="data_prep-") as tmp:
            writer = ShardWriter(url, tmp, int(args.shard_size_mb * 2**20), previous_shas(url))
            for n, (anchor, positive, negative) in enumerate(triplets.complete()):
                writer.write(f"nli-{n:09d}", anchor, {"anchor": anchor, "positive": positive, "negative": negative})
            if writer.samples == 0:
                return cli.fail("triplets", f"{', '.join(args.input)}: no premise has both an entailment and a "
                            f"contradiction hypothesis ({', '.join(f'{k}={v}' for k, v in skipped.items())}); "
                            "nothing written")
            writer.close()
            manifest = writer.write_manifest({"tool": f"data_prep {__version__}", "sources": sources,
                                              "premises": len(triplets.hypotheses), "skipped": skipped})
    except (InputError, StorageError) as err:
        return cli.fail("triplets", str(err))
    print(storage.redact(f"premises: {len(triplets.hypotheses)} in {time.time() - start:.1f}s; triplets: "
                         f"{writer.samples} in {len(writer.shards)} shards ({writer.uploaded} uploaded, "
                         f"{writer.unchanged} unchanged: upload skipped) -> {manifest}"))
    print("skipped: " + ", ".join(f"{k}={v}" for k, v in skipped.items()))
    return 0
