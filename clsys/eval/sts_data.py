"""STS data sets: the bundled ones, and the files and folders users bring, their layout detected by content.

One file is one set of sentence pairs with human similarity scores. The layouts read:

- JSONL, one object per line with ``sentence1``, ``sentence2`` and ``score`` (MTEB-style exports);
- SICK-R: SemEval 2014 task 1's files (``SICK_train.txt``, ``SICK_trial.txt``,
  ``SICK_test_annotated.txt``: pair_ID, sentence_A, sentence_B, relatedness_score,
  entailment_judgment, tab-separated) and the full ``SICK.txt`` (12 columns), with or without their
  header row. SICK.txt holds every split, and its ``SemEval_set`` column says which pair is in which:
  only the pairs of the split asked for are read (TEST; TRIAL for a dev set), and the set says so
  (``StsSet.note``). A SICK file that joins several without that column (a header row inside, a
  pair_ID twice, or more pairs than SICK's largest split) is refused: it cannot be scored as one set;
- a TSV whose header names ``sentence1``, ``sentence2`` and ``score`` (KorSTS);
- STS-Benchmark as distributed (``sts-test.csv``): headerless, tab-separated genre, file, year, id,
  score, sentence1, sentence2 (further columns ignored);
- SentEval's STS12-16 layout: ``STS.input.<name>.txt`` (two tab-separated sentences per line) with
  the gold scores in ``STS.gs.<name>.txt`` beside it, one per line; a pair whose gold line is empty
  is not scored and is skipped, as SentEval does;
- a headerless CSV ``sentence1,sentence2,score`` (stsb-multi-mt, the bundled sets).

A folder holding ``STS.input.*`` files is one STS year: its subsets are concatenated and scored
together, the "all" setting SimCSE reports for STS12-16. Any other folder is a suite: every set
found in it (files and year folders, recursively) is scored and the suite's average reported, as
SimCSE's table averages STS12-16, STS-B and SICK-R. Files named as train/dev/trial splits are left
out of a suite, and files in no known layout (readmes, licences) too; both are listed, not hidden.
"""
from __future__ import annotations

import collections
import csv
import re
from dataclasses import dataclass, field
from pathlib import Path

from clsys.data.labeled import jsonl_records

# Bundled dev/test splits of stsb-multi-mt (en, de) and KorSTS; origin and licences in LICENSE.md there.
STS_ASSETS = Path(__file__).parents[1] / "assets" / "sts"

SENTEVAL_INPUT = re.compile(r"STS\.input\.(.+)\.txt$")
SENTEVAL_GOLD = re.compile(r"STS\.gs\.(.+)\.txt$")
# A train/dev/trial split named in a file name ("sts-dev.csv", "SICK_train.txt", "trial"): not a test set.
TRAINING_SPLIT = re.compile(r"(^|[^a-z])(train|dev|trial)([^a-z]|$)")
SUITE_SUFFIXES = (".csv", ".tsv", ".txt", ".jsonl")
# Tab-separated layouts recognised by a header naming these columns: (sentence 1, sentence 2, score).
HEADER_LAYOUTS = {"tsv": ("sentence1", "sentence2", "score")}
SICK_PAIR = ("sentence_A", "sentence_B", "relatedness_score")
# SICK's published columns, recognised without a header row by the pair id, score and entailment label:
# SemEval 2014 task 1's files (one split each), and the full SICK.txt.
SICK_SEMEVAL_COLUMNS = ("pair_ID", "sentence_A", "sentence_B", "relatedness_score", "entailment_judgment")
SICK_FULL_COLUMNS = ("pair_ID", "sentence_A", "sentence_B", "entailment_label", "relatedness_score", "entailment_AB",
                     "entailment_BA", "sentence_A_original", "sentence_B_original", "sentence_A_dataset",
                     "sentence_B_dataset", "SemEval_set")
SICK_LABELS = ("NEUTRAL", "ENTAILMENT", "CONTRADICTION")
# The SemEval_set value of each split a caller asks for (the trainer's dev set: SemEval's trial split).
SICK_SPLITS = {"test": "TEST", "dev": "TRIAL"}
# SICK's largest split, SemEval's test set (train 4,500, trial 500): a file with more pairs joins splits.
SICK_LARGEST_SPLIT = 4927


@dataclass
class StsSet:
    name: str
    sent1: list[str]
    sent2: list[str]
    scores: list[float]
    # A SentEval year: (name, pair count) of each concatenated subset, in order, for the "mean" and
    # "wmean" aggregations reported beside "all".
    subsets: list[tuple[str, int]] = field(default_factory=list)
    note: str = ""  # what was read of a file that holds more than this set (SICK.txt: one split), to be shown


@dataclass
class StsSuite:
    """What one ``--sts`` value names: a single set, or a folder's sets (then also their average)."""
    name: str
    sets: list[StsSet]
    left_out: list[str] = field(default_factory=list)  # "path (why)" for each file a folder scan passed over


def bundled_sts() -> list[str]:
    return sorted(p.stem for p in STS_ASSETS.iterdir() if p.suffix in (".csv", ".tsv"))


def resolve_sts(name_or_path: str) -> Path:
    """A file or folder path as is, or a bundled set name (``stsb-en-test``, ``korsts-dev``, ...) -> its file."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    for suffix in (".csv", ".tsv"):
        if (STS_ASSETS / f"{name_or_path}{suffix}").is_file():
            return STS_ASSETS / f"{name_or_path}{suffix}"
    raise FileNotFoundError(f"STS set '{name_or_path}' is neither a file, a folder nor a bundled set "
                            f"({', '.join(bundled_sts())})")


def read_sts(name_or_path: str) -> StsSuite:
    """The set(s) a ``--sts`` value names: a bundled name, a file, a year folder or a suite folder."""
    path = resolve_sts(name_or_path)
    if path.is_file():
        return StsSuite(path.stem, [load_sts(path)])
    if _year_inputs(path):
        return StsSuite(path.name, [load_senteval_year(path)])
    sets, left_out = [], []
    _scan_suite(path, sets, left_out)
    if not sets:
        raise ValueError(f"{path}: no STS set found in this folder (passed over: {', '.join(left_out) or 'nothing'})")
    return StsSuite(path.name, sets, left_out)


def _scan_suite(folder: Path, sets: list[StsSet], left_out: list[str]) -> None:
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            if _year_inputs(path):
                sets.append(load_senteval_year(path))
            else:
                _scan_suite(path, sets, left_out)
        elif path.suffix.lower() in SUITE_SUFFIXES:
            if TRAINING_SPLIT.search(path.stem.lower()):
                left_out.append(f"{path} (a train/dev/trial split)")
            elif SENTEVAL_GOLD.match(path.name):
                continue  # read with its STS.input file
            elif sniff(path) is None:
                left_out.append(f"{path} (not an STS layout)")
            else:
                sets.append(load_sts(path))


def _year_inputs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and SENTEVAL_INPUT.match(p.name))


def _first_line(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readline().rstrip("\r\n")


def sniff(path: Path) -> str | None:
    """The layout of an STS file from its name (SentEval) or first line; None if it is in none of them."""
    if SENTEVAL_INPUT.match(path.name) or SENTEVAL_GOLD.match(path.name):
        return "senteval"
    line = _first_line(path)
    if line.lstrip().startswith("{"):
        return "jsonl"
    fields = line.split("\t")
    for layout, columns in HEADER_LAYOUTS.items():
        if set(columns) <= set(fields):
            return layout
    if _sick_columns(fields) is not None:
        return "sick"
    if len(fields) >= 7 and _is_number(fields[4]):
        return "stsbenchmark"
    row = next(csv.reader([line]), [])
    if len(row) == 3 and _is_number(row[2]):
        return "csv"
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def load_sts(path: str | Path, split: str = "test") -> StsSet:
    """Read one STS file in any of the layouts above; a malformed line is reported as ``file:line``.
    ``split`` (test or dev) is the split read of a file that holds several and marks them (SICK.txt)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: a folder, not one STS file")
    layout = sniff(path)
    if layout is None:
        raise ValueError(f"{path}:1: not a known STS layout (JSONL with sentence1/sentence2/score; SICK; a TSV "
                         f"with a sentence1/sentence2/score header; STS-Benchmark; SentEval STS.input/STS.gs; "
                         f"CSV sentence1,sentence2,score)")
    if layout == "senteval":
        return _load_senteval_pair(path)
    sent1, sent2, scores, note = [], [], [], ""
    with open(path, newline="", encoding="utf-8") as f:
        if layout == "sick":
            rows, note = _rows_sick(path, f, split)
        else:
            rows = _READERS[layout](path, f)
        for number, row in rows:
            try:
                score = float(row[2])
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{number}: score {row[2]!r} is not a number") from None
            sent1.append(row[0])
            sent2.append(row[1])
            scores.append(score)
    if not scores:
        raise ValueError(f"{path}: no sentence pairs")
    return StsSet(path.stem, sent1, sent2, scores, note=note)


# Each reader yields (line number, (sentence1, sentence2, score text)) and raises on a malformed line.

def _rows_jsonl(path: Path, f):
    for number, record in jsonl_records(path, f):
        missing = [k for k in ("sentence1", "sentence2", "score") if k not in record]
        if missing:
            raise ValueError(f"{path}:{number}: missing field {', '.join(map(repr, missing))}")
        yield number, (str(record["sentence1"]), str(record["sentence2"]), record["score"])


def _rows_with_header(names: tuple[str, str, str]):
    def rows(path: Path, f):
        # Read without quote processing: quotes in KorSTS are sentence text.
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader)
        columns = [header.index(name) for name in names]
        for row in reader:
            if len(row) != len(header):
                raise ValueError(f"{path}:{reader.line_num}: expected {len(header)} fields, found {len(row)}")
            yield reader.line_num, tuple(row[c] for c in columns)
    return rows


def _sick_columns(fields: list[str]) -> tuple[list[str], bool] | None:
    """(column names, whether ``fields`` is the header row) of a SICK file's line; None if it is not SICK."""
    if set(SICK_PAIR) <= set(fields):
        return fields, True
    for columns in (SICK_SEMEVAL_COLUMNS, SICK_FULL_COLUMNS):
        if len(fields) == len(columns):
            row = dict(zip(columns, fields))
            label = row.get("entailment_judgment", row.get("entailment_label"))
            if row["pair_ID"].isdigit() and _is_number(row["relatedness_score"]) and label in SICK_LABELS:
                return list(columns), False
    return None


def _rows_sick(path: Path, f, split: str) -> tuple[list[tuple[int, tuple[str, str, str]]], str]:
    """The rows of a SICK file (of SICK.txt, those of ``split``), and what was left out; a file that joins
    several SICK files, with nothing that says which pair came from which, is refused."""
    # Read without quote processing: quotes in SICK are sentence text. One record per line, so the
    # record's index is its line number.
    lines = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    columns, has_header = _sick_columns(lines[0])
    pair = [columns.index(name) for name in SICK_PAIR]
    pair_id = columns.index("pair_ID") if "pair_ID" in columns else None
    semeval_set = columns.index("SemEval_set") if "SemEval_set" in columns else None
    wanted = SICK_SPLITS[split]
    rows, per_split, first_seen = [], collections.Counter(), {}
    for number, row in enumerate(lines[1:] if has_header else lines, 2 if has_header else 1):
        if set(SICK_PAIR) <= set(row):
            raise ValueError(f"{path}:{number}: a second header row: the file joins several SICK files (e.g. "
                             f"SemEval's train, trial and test files); score the test file alone, or SICK.txt, "
                             f"whose SemEval_set column marks each pair's split")
        if len(row) != len(columns):
            raise ValueError(f"{path}:{number}: expected {len(columns)} fields, found {len(row)}")
        if pair_id is not None:
            first = first_seen.setdefault(row[pair_id], number)
            if first != number:
                raise ValueError(f"{path}:{number}: pair_ID {row[pair_id]} again (first on line {first}): the file "
                                 f"joins several sets; score one of them alone")
        if semeval_set is not None:
            per_split[row[semeval_set]] += 1
            if row[semeval_set] != wanted:
                continue
        rows.append((number, tuple(row[c] for c in pair)))
    if semeval_set is None:
        if len(rows) > SICK_LARGEST_SPLIT:
            raise ValueError(f"{path}: {len(rows)} pairs, more than any SICK split holds (its test set: "
                             f"{SICK_LARGEST_SPLIT}): the file joins several splits and no SemEval_set column says "
                             f"which pair is in which; score SemEval's test file (SICK_test_annotated.txt) or SICK.txt")
        return rows, ""
    if not rows:
        raise ValueError(f"{path}: no pair of SemEval_set {wanted} (the {split} split); the file has "
                         f"{', '.join(f'{name} {n}' for name, n in sorted(per_split.items()))}")
    others = ", ".join(f"{name} {n}" for name, n in sorted(per_split.items()) if name != wanted)
    return rows, (f"the {split} split only, SemEval_set {wanted}: {len(rows)} of {sum(per_split.values())} pairs "
                  f"({others} left out)")


def _rows_stsbenchmark(path: Path, f):
    # Tab-split raw lines, as SentEval reads it: its sentences hold stray quotes.
    for number, line in enumerate(f, 1):
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) < 7:
            raise ValueError(f"{path}:{number}: expected at least 7 tab-separated fields, found {len(fields)}")
        yield number, (fields[5], fields[6], fields[4])


def _rows_csv(path: Path, f):
    reader = csv.reader(f)
    try:
        for row in reader:
            if len(row) != 3:
                raise ValueError(f"{path}:{reader.line_num}: expected 3 fields, found {len(row)}")
            yield reader.line_num, tuple(row)
    except csv.Error as e:
        raise ValueError(f"{path}:{reader.line_num}: malformed CSV: {e}") from None


_READERS = {
    "jsonl": _rows_jsonl,
    **{layout: _rows_with_header(columns) for layout, columns in HEADER_LAYOUTS.items()},
    "stsbenchmark": _rows_stsbenchmark,
    "csv": _rows_csv,
}


def _load_senteval_pair(path: Path) -> StsSet:
    """An ``STS.input.<name>.txt`` (or its ``STS.gs`` file) with its gold scores; unscored pairs skipped."""
    name = (SENTEVAL_INPUT.match(path.name) or SENTEVAL_GOLD.match(path.name)).group(1)
    inputs, gold = path.with_name(f"STS.input.{name}.txt"), path.with_name(f"STS.gs.{name}.txt")
    for needed in (inputs, gold):
        if not needed.is_file():
            raise FileNotFoundError(f"{needed}: missing (SentEval's layout pairs STS.input.{name}.txt with "
                                    f"STS.gs.{name}.txt)")
    pair_lines = inputs.read_text(encoding="utf-8").splitlines()
    gold_lines = gold.read_text(encoding="utf-8").splitlines()
    if len(pair_lines) != len(gold_lines):
        raise ValueError(f"{gold}: {len(gold_lines)} lines, but {inputs} has {len(pair_lines)}")
    sent1, sent2, scores = [], [], []
    for number, (pair, score) in enumerate(zip(pair_lines, gold_lines), 1):
        if not score.strip():
            continue
        fields = pair.split("\t")
        if len(fields) < 2:
            raise ValueError(f"{inputs}:{number}: expected two tab-separated sentences, found {len(fields)} field")
        try:
            scores.append(float(score))
        except ValueError:
            raise ValueError(f"{gold}:{number}: score {score!r} is not a number") from None
        sent1.append(fields[0])
        sent2.append(fields[1])
    if not scores:
        raise ValueError(f"{gold}: no scored pairs")
    return StsSet(name, sent1, sent2, scores)


def load_senteval_year(folder: Path) -> StsSet:
    """A SentEval STS year folder as one set: every subset concatenated (the "all" setting)."""
    parts = [_load_senteval_pair(p) for p in _year_inputs(folder)]
    return StsSet(folder.name, [s for p in parts for s in p.sent1], [s for p in parts for s in p.sent2],
                  [s for p in parts for s in p.scores], [(p.name, len(p.scores)) for p in parts])
