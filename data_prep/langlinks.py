"""Streaming reader for Wikipedia's interlanguage-link dumps, ``<lang>wiki-<date>-langlinks.sql.gz``.

The file is mysqldump output: comments, ``CREATE TABLE `langlinks` (...)`` naming the columns, then
``INSERT INTO `langlinks` VALUES (ll_from,'ll_lang','ll_title'),(...),...;`` lines of a few MB each.
``ll_from`` is a page id of the dump's own wiki, ``ll_lang`` the target wiki's language and
``ll_title`` the target article's title (with spaces, UTF-8). Lines are read one at a time from
the gzip stream and each INSERT is scanned literal by literal (quoted strings with MySQL's backslash
escapes, numbers, NULL), so commas, parentheses and quotes inside titles are data, not syntax.

An INSERT line that does not scan (a truncated download, an edited file) is skipped whole and
counted, with ``file:line: column: reason`` kept for the warning; a file that is not a langlinks
dump at all, or whose gzip stream is corrupt, raises ``LanglinksError``.
"""
from __future__ import annotations

import gzip
import re
import zlib
from dataclasses import dataclass, field
from typing import Iterator

from data_prep.dumps import SiteInfo

COLUMNS = ("ll_from", "ll_lang", "ll_title")
_CREATE = re.compile(r"CREATE TABLE `(\w+)` \(")
_COLUMN = re.compile(r"\s*`(\w+)`")
_INSERT = re.compile(r"INSERT INTO `(\w+)` VALUES ")
_HOST_LINE = re.compile(r"-- Host: .*Database: (\w+)")
# One SQL literal: a quoted string (any char may be backslash-escaped), NULL, or a number.
_VALUE = re.compile(r"'((?:[^'\\]|\\.)*)'|(NULL)|(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", re.DOTALL)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
# mysqldump's escapes; \% and \_ keep their backslash (MySQL reads them so outside LIKE patterns).
_UNESCAPE = {"0": "\0", "b": "\b", "n": "\n", "r": "\r", "t": "\t", "Z": "\x1a", "%": "\\%", "_": "\\_"}
MAX_MESSAGES = 5


class LanglinksError(Exception):
    """The file cannot be used: missing, corrupt gzip, or not a dump of the langlinks table."""


class SqlSyntaxError(ValueError):
    """An INSERT line that does not scan; the message says where (1-based column) and why."""


@dataclass
class Langlink:
    page_id: int  # ll_from: a page of the dump's own wiki
    lang: str  # ll_lang: the target wiki
    title: str  # ll_title: the target page, as written (spaces)


@dataclass
class LanglinksFile:
    """One langlinks dump; ``links()`` streams its rows, counting what it cannot read."""

    path: str
    expected_lang: str | None = None  # the language the caller takes the file for: checked against the header
    dbname: str | None = field(default=None, init=False)  # from the "-- Host: ... Database:" comment
    rows: int = field(default=0, init=False)
    malformed_lines: int = field(default=0, init=False)
    messages: list[str] = field(default_factory=list, init=False)  # the first malformed lines, file:line: why

    @property
    def lang(self) -> str | None:
        return SiteInfo(dbname=self.dbname).lang if self.dbname else None

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        try:
            with open(self.path, "rb") as f:
                gzipped = f.read(2) == b"\x1f\x8b"
            f = gzip.open(self.path, "rb") if gzipped else open(self.path, "rb")
        except OSError as err:
            raise LanglinksError(f"{self.path}: cannot open: {err.strerror}") from None
        n = 0
        with f:
            try:
                for n, line in enumerate(f, 1):
                    yield n, line
            except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
                raise LanglinksError(f"{self.path}:{n + 1}: corrupt or truncated gzip data ({err})") from None

    def links(self) -> Iterator[Langlink]:
        """Every row of every INSERT line, in file order; checks the table and its columns first."""
        columns: list[str] | None = None  # set once the CREATE TABLE statement has been read
        in_create = False
        for n, raw in self._lines():
            line = raw.decode("utf-8", "replace")  # varbinary: a title cut at 255 bytes may end mid-character
            if columns is None:
                if (m := _HOST_LINE.match(line)) and not self.dbname:
                    self.dbname = m.group(1)
                elif m := _CREATE.match(line):
                    if m.group(1) != "langlinks":
                        raise LanglinksError(f"{self.path}:{n}: a dump of table `{m.group(1)}`, not `langlinks`")
                    in_create, names = True, []
                elif in_create and (m := _COLUMN.match(line)):
                    names.append(m.group(1))
                elif in_create and line.startswith(")"):
                    missing = [c for c in COLUMNS if c not in names]
                    if missing:
                        raise LanglinksError(f"{self.path}:{n}: table `langlinks` has no column {', '.join(missing)}")
                    columns = names
                    if self.expected_lang and self.lang and self.lang != self.expected_lang:
                        raise LanglinksError(f"{self.path}: given as '{self.expected_lang}=' but it is the "
                                             f"langlinks dump of {self.dbname}")
                elif _INSERT.match(line):
                    raise LanglinksError(f"{self.path}:{n}: INSERT before any CREATE TABLE `langlinks`: "
                                         "not a langlinks SQL dump")
                continue
            if not (m := _INSERT.match(line)):
                continue
            try:
                rows = parse_values(line.rstrip("\r\n"), m.end())
                links = [_langlink(dict(zip(columns, row)), len(columns), len(row)) for row in rows]
            except SqlSyntaxError as err:
                self.malformed_lines += 1
                if len(self.messages) < MAX_MESSAGES:
                    self.messages.append(f"{self.path}:{n}: {err}")
                continue
            self.rows += len(links)
            yield from links
        if columns is None:
            raise LanglinksError(f"{self.path}: no CREATE TABLE `langlinks` statement: not a langlinks SQL dump")


def _langlink(row: dict, n_columns: int, n_values: int) -> Langlink:
    if n_values != n_columns:
        raise SqlSyntaxError(f"a row has {n_values} values, the table {n_columns} columns")
    page_id, lang, title = (row[c] for c in COLUMNS)
    if not isinstance(page_id, int) or not isinstance(lang, str) or not isinstance(title, str):
        raise SqlSyntaxError(f"row {(page_id, lang, title)!r} is not (int, string, string)")
    return Langlink(page_id, lang, title)


def parse_values(text: str, pos: int) -> list[tuple]:
    """The tuples of ``(v, ...),(v, ...),...;`` starting at ``text[pos]``; the ``;`` must end the line."""
    rows = []
    while True:
        pos = _expect(text, pos, "(")
        row = []
        while True:
            m = _VALUE.match(text, pos)
            if m is None:
                raise SqlSyntaxError(f"column {pos + 1}: expected a value, found {text[pos:pos + 20]!r}")
            row.append(_literal(m))
            pos = m.end()
            if text.startswith(")", pos):
                break
            pos = _expect(text, pos, ",")
        rows.append(tuple(row))
        pos += 1
        if text.startswith(";", pos):
            if text[pos + 1:].strip():
                raise SqlSyntaxError(f"column {pos + 2}: text after the closing ';'")
            return rows
        pos = _expect(text, pos, ",")


def _expect(text: str, pos: int, char: str) -> int:
    if not text.startswith(char, pos):
        found = repr(text[pos:pos + 20]) if pos < len(text) else "the end of the line"
        raise SqlSyntaxError(f"column {pos + 1}: expected '{char}', found {found}")
    return pos + 1


def _literal(m: re.Match):
    string, null, number = m.groups()
    if string is not None:
        return _ESCAPE.sub(lambda e: _UNESCAPE.get(e.group(1), e.group(1)), string)
    if null is not None:
        return None
    return float(number) if any(c in number for c in ".eE") else int(number)
