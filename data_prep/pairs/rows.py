"""What a row of ``data_prep pairs`` input means: its columns found by name, its values checked, its pairs.

Columns are found by name, case-insensitively (``ROLES``): a query, a positive (a string, or a list of strings
as in FlagEmbedding's ``{"query", "pos": [...], "neg": [...]}``: one pair per positive), negatives (one column
holding a list, or string columns ``negative``, ``negative_1`` … ``negative_N``), and optional ``source`` and
``instruction`` columns. Two columns that mean the same thing are an error naming both. Whatever the format
(``read`` reads each), a row arrives here as a dict of column → value, and gives its pairs with the 8-byte
digest that the main process drops exact duplicates by (``add_row``), or a ``RowError`` saying why it gives none.
"""
from __future__ import annotations

import collections
import hashlib
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from clsys import storage
from clsys.shards.blocks import Record

# Role → its spellings. "negatives" are columns holding a list; "negative" (and negative_1 … negative_N)
# a string each. A positive column holds a string or a list of strings (FlagEmbedding's "pos").
ROLES = {"query": ("query", "anchor", "question"), "positive": ("positive", "pos", "document", "passage"),
         "negatives": ("negatives", "neg"), "negative": ("negative",), "source": ("source",),
         "instruction": ("instruction", "prompt")}
NUMBERED_NEGATIVE = re.compile(r"negative_(\d+)\Z")
# A source names a folder (``pairs/<source>``): one path segment, nothing a shell or URL reads specially.
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
SOURCE_RULE = "letters, digits, '.', '_' and '-', starting with a letter or a digit, at most 100 characters"
# Why a row is skipped (``--skip-bad``; without it each is an error). ``unreadable`` counts pieces of input
# (a file, a Parquet row group, what is left of a file after a read fault), the others rows.
SKIP_REASONS = ("bad_line", "missing_query", "missing_positive", "wrong_type", "bad_text", "bad_source",
                "ambiguous_columns", "unreadable")
LINE_BREAK = re.compile(r"\r\n?|\n")  # a format 2 text is one line: a query's line breaks become spaces
MESSAGES_PER_PART = 5  # skipped rows' messages a part reports (the rest are counted)
DIGEST_BYTES = 8  # of a pair's SHA-256 (``add_row``): what the main process keeps of each distinct pair


class InputError(Exception):
    """An input or a row that cannot be used; the message names the file, the line or row, and the column."""


class RowError(Exception):
    """A row that gives no pair: ``reason`` (one of ``SKIP_REASONS``), the ``column`` at fault (None: the whole
    line), and the source it names, when it was read before the fault."""

    def __init__(self, reason: str, column: str | None, detail: str, source: str | None = None):
        super().__init__(f"column '{column}': {detail}" if column else detail)
        self.reason, self.column, self.source = reason, column, source


@dataclass(frozen=True)
class Columns:
    """Role → column name(s) of one header (or one JSON object's keys); ``None``: absent."""

    query: str | None
    positive: str | None
    negatives: tuple[str, ...]  # one list column, or the string columns negative, negative_1, … in that order
    negatives_listed: bool  # True: ``negatives`` is one column holding a list
    source: str | None
    instruction: str | None

    def names(self) -> list[str]:
        return [n for n in (self.query, self.positive, *self.negatives, self.source, self.instruction) if n]


def match_columns(names: list[str]) -> Columns:
    """The columns of each role among ``names``; ``RowError("ambiguous_columns")`` names two that mean one thing."""
    found: dict[str, list[str]] = collections.defaultdict(list)
    numbered = []
    for name in names:
        low = name.lower()
        role = next((r for r, spellings in ROLES.items() if low in spellings), None)
        if role is not None:
            found[role].append(name)
        elif match := NUMBERED_NEGATIVE.match(low):
            numbered.append((int(match.group(1)), name))
    for role, hits in found.items():
        if len(hits) > 1:
            raise RowError("ambiguous_columns", None, f"columns {' and '.join(repr(h) for h in hits)} both mean the "
                           f"{role} ({'/'.join(ROLES[role])}): rename or drop one")
    strings = found["negative"] + [name for _, name in sorted(numbered)]
    if found["negatives"] and strings:
        raise RowError("ambiguous_columns", None, f"column '{found['negatives'][0]}' (a list of negatives) and "
                       f"{', '.join(repr(s) for s in strings)} (one negative each) both give the negatives: keep one "
                       "form")
    one = {role: hits[0] if hits else None for role, hits in found.items()}
    return Columns(one.get("query"), one.get("positive"), tuple(found["negatives"] or strings),
                   bool(found["negatives"]), one.get("source"), one.get("instruction"))


def header_columns(names: list[str], where: str) -> Columns:
    """A header's (or schema's) columns: it must have a query and a positive column (every row would lack
    them), and no two columns of one meaning. ``InputError`` (never skipped) otherwise."""
    try:
        columns = match_columns(names)
    except RowError as err:
        raise InputError(f"{where}: {err}") from None
    missing = [f"{role} column ({' / '.join(ROLES[role])})" for role in ("query", "positive")
               if getattr(columns, role) is None]
    if missing:
        raise InputError(f"{where}: no {' and no '.join(missing)}; found: {', '.join(names) or 'nothing'}")
    return columns


@dataclass
class PartResult:
    """A part's pairs per source, in input order: their digests (``DIGEST_BYTES`` each, end to end) and their
    records (which stay in the worker: the main process gets the rest); its counts per source (``rows``,
    ``query_line_breaks`` and skip reasons), and where each source's first row is (``--max-sources`` names
    it); the first skipped rows' messages."""

    input: int
    nbytes: int
    digests: dict[str, bytearray] = field(default_factory=dict)
    records: dict[str, list[Record]] = field(default_factory=dict)
    counts: dict[str, collections.Counter] = field(default_factory=dict)
    first_rows: dict[str, str] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)

    def count(self, source: str, key: str) -> None:
        counter = self.counts.get(source)
        if counter is None:
            counter = self.counts[source] = collections.Counter()
        counter[key] += 1

    def skip(self, source: str, reason: str, message: str) -> None:
        self.count(source, reason)
        if len(self.messages) < MESSAGES_PER_PART:
            self.messages.append(message)


def value_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true or false", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def _blank(text: str) -> bool:
    return not text or text.isspace()  # isspace stops at the first other character: no copy, unlike strip


def _text(values: dict, column: str, source: str | None) -> str | None:
    """A string column's value; None when absent, null or blank."""
    value = values.get(column)
    if value is None or (isinstance(value, str) and _blank(value)):
        return None
    if not isinstance(value, str):
        raise RowError("wrong_type", column, f"is {value_kind(value)}, not a string", source)
    return value


def _texts(values: dict, column: str, source: str | None, *, string_ok: bool, in_cell: bool) -> list[str]:
    """A column holding a list of strings: its non-blank ones. ``string_ok``: a string is a list of one (a
    positive column); ``in_cell``: a CSV/TSV cell, which holds a list as a JSON array."""
    value = values.get(column)
    if isinstance(value, str):
        if _blank(value):
            return []
        if string_ok:
            return [value]
        if not in_cell:
            raise RowError("wrong_type", column, "is a string, not a list of strings", source)
        try:
            value = storage.loads_json(value)
        except ValueError as err:
            raise RowError("wrong_type", column, f"is not a JSON list of strings: {err} ({value[:60]!r})",
                           source) from None
    if value is None:
        return []
    if not isinstance(value, list):
        raise RowError("wrong_type", column, f"is {value_kind(value)}, not {'a string or ' * string_ok}a list of strings",
                       source)
    for i, item in enumerate(value):
        if item is not None and not isinstance(item, str):
            raise RowError("wrong_type", column, f"item {i} is {value_kind(item)}, not a string", source)
    return [item for item in value if item is not None and not _blank(item)]


def _encoded(texts: list[tuple[str, str]], source: str) -> list[bytes]:
    """(column, text) pairs → the texts' UTF-8; ``RowError`` names the column of one that has none."""
    encoded = []
    for column, text in texts:
        try:
            encoded.append(text.encode())
        except UnicodeEncodeError:  # JSON's "\ud800": no UTF-8 for it, so no shard can hold it
            raise RowError("bad_text", column, "holds a lone surrogate (\\ud800-\\udfff), not valid Unicode",
                           source) from None
    return encoded


def add_row(result: PartResult, values: dict, columns: Columns, source: str, lists_in_cells: bool) -> None:
    """One row → its pairs (one per positive), their digests and counts; ``RowError`` when it gives none.
    ``source``: the input's, unless the row names its own; ``lists_in_cells``: a CSV/TSV row, whose negatives
    column holds its list as a JSON array."""
    if columns.source is not None:
        named = _text(values, columns.source, None)
        if named is not None:
            if not SOURCE_NAME.match(named):
                raise RowError("bad_source", columns.source, f"{named[:60]!r} is not a source name: {SOURCE_RULE}")
            source = named
    if columns.query is None:
        raise RowError("missing_query", None, f"no query ({' / '.join(ROLES['query'])})", source)
    query = _text(values, columns.query, source)
    if query is None:
        raise RowError("missing_query", columns.query, "is empty or missing", source)
    if columns.positive is None:
        raise RowError("missing_positive", None, f"no positive ({' / '.join(ROLES['positive'])})", source)
    positives = _texts(values, columns.positive, source, string_ok=True, in_cell=False)
    if not positives:
        raise RowError("missing_positive", columns.positive, "is empty or missing", source)
    if columns.negatives_listed:
        name = columns.negatives[0]
        negatives = [(name, text) for text in _texts(values, name, source, string_ok=False,
                                                     in_cell=lists_in_cells)]
    else:
        negatives = [(name, text) for name in columns.negatives if (text := _text(values, name, source)) is not None]
    instruction = (_text(values, columns.instruction, source) if columns.instruction else None) or ""
    if "\n" in query or "\r" in query:
        query = LINE_BREAK.sub(" ", query)
        result.count(source, "query_line_breaks")
    # The digest: the number of fields and each one's length, then the fields (the query, the instruction, the
    # negatives), then each positive in turn (the rest of the bytes): no two rows give the same bytes. SHA-256
    # (3.3 µs a 2 KB pair with the CPU's SHA instructions, blake2b 5.2), cut to DIGEST_BYTES (its chance of
    # a collision: ``dedup``).
    encoded = _encoded([(columns.query, query), (columns.instruction, instruction), *negatives,
                        *((columns.positive, p) for p in positives)], source)
    fields = encoded[:2 + len(negatives)]
    digest = hashlib.sha256(struct.pack(f"<{len(fields) + 1}Q", len(fields), *map(len, fields)))
    digest.update(b"".join(fields))
    texts = [text for _, text in negatives]
    digests = result.digests.get(source)
    if digests is None:
        digests, records = result.digests[source], result.records[source] = bytearray(), []
    else:
        records = result.records[source]
    for positive, data in zip(positives, encoded[len(fields):]):
        pair = digest.copy()
        pair.update(data)
        digests += pair.digest()[:DIGEST_BYTES]
        records.append(Record(query, {"positive": positive, "negatives": texts, "source": source,
                                      "instruction": instruction}))
    result.count(source, "rows")
