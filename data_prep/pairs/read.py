"""What ``data_prep pairs`` reads, and what its workers run: input files → (query, positive, negatives) records.

An input is checked whole before anything is written (``open_input``: its format, its header or schema, its
default source). It is then cut into *parts* (``read_parts``, run by the main process, or by a streaming Ray
task of its own with ``--ray``): about ``PART_BYTES`` of whole lines of a JSONL, CSV or TSV file (where they
start and end: the worker reads the bytes itself; of a gzip or zstd compressed one, the lines themselves,
decompressed by the reader of parts as it goes), one row group of a Parquet file (its rows read by the worker
itself), record batches of an Arrow IPC file (a Hugging Face ``save_to_disk`` folder holds such files). A worker
(``process_part``) reads a part's rows, each as a dict of column → value, and hands them to ``rows``,
which finds their columns, checks their values and makes their records, each with the 8-byte digest that the
main process drops exact duplicates by, and counts what it skips.

Memory: a part is at most ``PART_BYTES`` of text, decompressed (or one line, up to ``MAX_LINE_BYTES``), one
Parquet row group, or record batches up to ``PART_BYTES``; at most ``2 × workers`` parts are in flight, a
worker holding the records of its own until the main process admits them. Nothing is unpickled that this
program did not pickle itself: Arrow IPC is read with pyarrow.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from clsys import storage
from data_prep.pairs.compressed import READ_ERRORS, compression_of, decompressed, read_problem, uncompressed_name
from data_prep.pairs.rows import (SOURCE_NAME, SOURCE_RULE, Columns, InputError, PartResult, RowError, add_row,
                                  header_columns, match_columns, value_kind)

FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet",
           ".arrow": "arrow"}
TEXT_FORMATS = ("jsonl", "csv", "tsv")  # what may be compressed: read as a stream, in parts as a plain file
PART_BYTES = 1 << 20  # a part of a text file: whole lines, about this much (a worker's task)
MAX_LINE_BYTES = 64 << 20  # a longer line (or CSV record) stops the run: it cannot be read in parts
PARQUET_BATCH_ROWS = 4096  # rows decoded at a time from a row group, so a worker holds one batch's objects
_BOM = b"\xef\xbb\xbf"


class Unreadable(InputError):
    """An input, or a piece of one, that cannot be read at all (missing, not the format it says, corrupt):
    with ``--skip-bad`` it is counted (``unreadable``) and the run goes on."""


@dataclass
class PairsInput:
    """One ``--input``, checked: its format, the files read (a ``save_to_disk`` folder's Arrow files), the
    header and columns of a table or CSV/TSV (JSONL's are each object's keys), its default source."""

    index: int  # its position in --input
    path: str
    format: str
    source: str
    skip_bad: bool
    files: tuple[str, ...]
    size: int  # bytes of its files
    header: tuple[str, ...] = ()  # CSV/TSV
    columns: Columns | None = None  # None: JSONL


def default_source(path: str, given: str | None) -> str:
    """``--source``, else the file's name without its extension (a compressed file's: without both; a folder's
    name)."""
    return given or os.path.splitext(uncompressed_name(os.path.basename(os.path.normpath(path))))[0]


def check_source(path: str, source: str, given: bool) -> None:
    if not SOURCE_NAME.match(source):
        raise InputError(f"{path}: the source {source!r} {'(--source)' if given else '(the file name)'} is not a "
                         f"source name: {SOURCE_RULE}" + ("" if given else "; give --source NAME"))


def open_input(index: int, path: str, source: str | None, skip_bad: bool) -> PairsInput:
    """Check one input before anything is written: ``Unreadable`` when it cannot be read, ``InputError`` for an
    unusable header, format or source name."""
    name = default_source(path, source)
    check_source(path, name, source is not None)
    if os.path.isdir(path):
        return _open_saved(index, path, name, skip_bad)
    compression = compression_of(path)
    fmt = FORMATS.get(os.path.splitext(uncompressed_name(path))[1].lower())
    if fmt is None or (compression and fmt not in TEXT_FORMATS):
        raise InputError(f"{path}: cannot tell the format from the name: give .jsonl, .json (JSON lines), .csv, "
                         f".tsv (each also compressed: .gz, .zst), .parquet, .arrow, or a Hugging Face datasets "
                         f"save_to_disk folder")
    try:
        size = os.path.getsize(path)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            names = pq.ParquetFile(path).schema_arrow.names
        elif fmt == "arrow":
            names = _arrow_schema(path).names
        else:
            with open(path, "rb") as raw:
                f = decompressed(raw, compression) if compression else raw
                first = f.readline(MAX_LINE_BYTES).removeprefix(_BOM)
    except READ_ERRORS as err:
        raise Unreadable(f"{path}: cannot read: {read_problem(err)}") from None
    except Exception as err:  # pyarrow: not Parquet / Arrow, or a damaged footer
        raise Unreadable(f"{path}: cannot read as {fmt}: {err}") from None
    if fmt == "jsonl":
        if first.lstrip().startswith(b"["):
            raise InputError(f"{path}:1: a JSON array, not JSON lines (one object a line): convert it, e.g. "
                             "jq -c '.[]'")
        return PairsInput(index, path, fmt, name, skip_bad, (path,), size)
    if fmt in ("csv", "tsv"):
        try:
            header = next(_csv_reader(fmt, [first.decode()]), [])
        except UnicodeDecodeError:
            raise Unreadable(f"{path}:1: the header is not UTF-8") from None
        header = [h.strip() for h in header]
        return PairsInput(index, path, fmt, name, skip_bad, (path,), size, tuple(header),
                          header_columns(header, f"{path}:1"))
    return PairsInput(index, path, fmt, name, skip_bad, (path,), size, (), header_columns(names, path))


def _open_saved(index: int, path: str, name: str, skip_bad: bool) -> PairsInput:
    """A folder ``Dataset.save_to_disk`` wrote: ``state.json`` lists its Arrow IPC stream files in order."""
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        raise InputError(f"{path}: a DatasetDict folder (splits: {', '.join(splits)}): give a split's folder, e.g. "
                         f"{os.path.join(path, splits[0] if splits else 'train')}")
    state = os.path.join(path, "state.json")
    try:
        with open(state, encoding="utf-8") as f:
            listed = json.load(f)["_data_files"]
        names = [entry["filename"] for entry in listed]
        if any(not isinstance(n, str) or os.path.basename(n) != n or n in ("", ".", "..") for n in names):
            raise ValueError(f"_data_files names a file outside the folder: {names}")
        files = tuple(os.path.join(path, n) for n in names)
        size = sum(os.path.getsize(f) for f in files)
        names = _arrow_schema(files[0]).names if files else []
    except FileNotFoundError as err:
        what = "not a Hugging Face datasets save_to_disk folder (no state.json)" if err.filename == state else \
            f"cannot read {err.filename}: {err.strerror}"
        raise Unreadable(f"{path}: {what}") from None
    except OSError as err:
        raise Unreadable(f"{path}: cannot read: {err.strerror or err}") from None
    except Exception as err:  # state.json not what save_to_disk writes, or an Arrow file pyarrow cannot open
        raise Unreadable(f"{path}: cannot read as a save_to_disk folder: {type(err).__name__}: {err}") from None
    return PairsInput(index, path, "arrow", name, skip_bad, files, size, (), header_columns(names, path))


def _arrow_schema(path: str):
    import pyarrow as pa

    with pa.memory_map(path) as source:
        return _arrow_reader(source).schema


def _arrow_reader(source):
    """Arrow's IPC stream format (what ``datasets`` writes), or its file format (``ARROW1`` magic)."""
    import pyarrow as pa

    if source.read(6) == b"ARROW1":
        source.seek(0)
        return pa.ipc.open_file(source)
    source.seek(0)
    return pa.ipc.open_stream(source)


def _csv_reader(fmt: str, lines):
    # TSV without quote processing, as data_prep triplets reads it: KorNLI/MNLI TSVs hold unbalanced quotes.
    if fmt == "tsv":
        return csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
    return csv.reader(lines)


@dataclass
class Part:
    """A piece of one input for one worker. ``first``: the line (text formats) or row (tables) it starts at,
    from 1. Text: the ``nbytes`` from ``offset``, whole lines (CSV: whole records), which the worker reads from
    the file itself, or (a compressed file) those lines as ``data`` and ``nbytes`` the file's bytes read for
    them (what the progress bar counts); Parquet: ``row_group``; Arrow: ``batches``. ``error``: the piece could
    not be read (``--skip-bad``: counted as ``unreadable``)."""

    input: PairsInput
    file: str
    first: int
    nbytes: int
    offset: int = 0
    row_group: int | None = None
    batches: list = field(default_factory=list)
    data: bytes | None = None
    error: str | None = None


def read_parts(inp: PairsInput) -> Iterator[Part]:
    """An input's parts, in order. Runs in the main process, or as a streaming Ray task of its own."""
    for file in inp.files:
        try:
            if inp.format == "parquet":
                yield from _parquet_parts(inp, file)
            elif inp.format == "arrow":
                yield from _arrow_parts(inp, file)
            else:
                yield from _text_parts(inp, file)
        except Unreadable as err:
            if not inp.skip_bad:
                raise
            yield Part(inp, file, 0, 0, error=str(err))


def _text_parts(inp: PairsInput, file: str) -> Iterator[Part]:
    """Whole lines, about ``PART_BYTES`` at a time. A CSV part ends only where the double quotes before it are
    even (outside a quoted field): a quoted field may hold line breaks. (A quote inside an unquoted field,
    ``it"s``, which the csv module reads as a character, then counts too: with quoted line breaks elsewhere in
    the file, a part may end inside a record, which then reads as malformed.) A compressed file is read through
    its decompressor, and each part carries its lines."""
    quoted = inp.format == "csv"
    compression = compression_of(file)
    line, buf = 1, bytearray()
    try:
        with open(file, "rb") as raw:
            f = decompressed(raw, compression) if compression else raw
            if inp.format != "jsonl":
                f.readline(MAX_LINE_BYTES)  # the header, checked by open_input
                line = 2
            offset = 0 if compression else f.tell()  # of the first byte of ``buf``
            read = raw.tell()  # bytes of the file given to parts so far (compressed: of the compressed file)
            while block := f.read(PART_BYTES):
                if line == 1 and not buf and block.startswith(_BOM):
                    block = block[len(_BOM):]
                    offset += len(_BOM)
                buf += block
                cut = _cut(buf, quoted)
                if not cut:
                    if len(buf) > MAX_LINE_BYTES:
                        what = "a record (a quoted field never closed?)" if quoted else "a line"
                        raise InputError(f"{file}:{line}: {what} longer than {MAX_LINE_BYTES >> 20} MiB")
                    continue
                if compression:
                    yield Part(inp, file, line, raw.tell() - read, data=bytes(buf[:cut]))
                    read = raw.tell()
                else:
                    yield Part(inp, file, line, cut, offset)
                line += buf.count(b"\n", 0, cut)
                offset += cut
                del buf[:cut]
            if buf:
                yield (Part(inp, file, line, raw.tell() - read, data=bytes(buf)) if compression else
                       Part(inp, file, line, len(buf), offset))
    except READ_ERRORS as err:
        raise Unreadable(f"{file}:{line}: cannot read: {read_problem(err)}") from None


def _part_bytes(part: Part) -> bytes:
    """A text part's bytes, read by the worker: only where each part starts and ends crosses processes (a
    compressed file's part brings its bytes)."""
    if part.data is not None:
        return part.data
    try:
        with open(part.file, "rb") as f:
            f.seek(part.offset)
            data = f.read(part.nbytes)
    except OSError as err:
        raise Unreadable(f"{part.file}:{part.first}: cannot read: {err.strerror or err}") from None
    if len(data) != part.nbytes:
        raise Unreadable(f"{part.file}:{part.first}: cannot read: the file ends before this part's {part.nbytes} "
                         f"bytes from byte {part.offset} (it changed while it was read?)")
    return data


def _cut(buf: bytearray, quoted: bool) -> int:
    """Where a part of ``buf`` can end: just after its last line feed (CSV: the last one outside quotes); 0: none."""
    end = buf.rfind(b"\n")
    if quoted and end >= 0:
        quotes = buf.count(b'"', 0, end)
        while end >= 0 and quotes % 2:
            before = buf.rfind(b"\n", 0, end)
            quotes -= buf.count(b'"', before + 1, end)
            end = before
    return end + 1


def _parquet_parts(inp: PairsInput, file: str) -> Iterator[Part]:
    """One part per row group: the worker reads it (only the columns it needs) from the file itself."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file).metadata
    except Exception as err:
        raise Unreadable(f"{file}: cannot read as parquet: {err}") from None
    row = 1
    for group in range(meta.num_row_groups):
        info = meta.row_group(group)
        stored = sum(info.column(i).total_compressed_size for i in range(info.num_columns))  # the file's bytes
        yield Part(inp, file, row, stored, row_group=group)
        row += info.num_rows


def _arrow_parts(inp: PairsInput, file: str) -> Iterator[Part]:
    """Record batches (``datasets`` writes 1,000 rows each) gathered up to ``PART_BYTES``; the file is memory
    mapped, so a batch is only copied when it is sent to a worker."""
    import pyarrow as pa

    row, batches, nbytes = 1, [], 0
    try:
        with pa.memory_map(file) as source:
            reader = _arrow_reader(source)
            # A file reader gives its batches by number, a stream reader one after another.
            batches_read = (map(reader.get_batch, range(reader.num_record_batches))
                            if isinstance(reader, pa.ipc.RecordBatchFileReader) else reader)
            for batch in batches_read:
                batches.append(batch.select(inp.columns.names()))
                nbytes += batch.nbytes
                if nbytes >= PART_BYTES:
                    yield Part(inp, file, row, nbytes, batches=batches)
                    row += sum(b.num_rows for b in batches)
                    batches, nbytes = [], 0
            if batches:  # inside the with: the batches are views of the mapped file
                yield Part(inp, file, row, nbytes, batches=batches)
    except (OSError, KeyError, pa.ArrowException) as err:  # KeyError: a file of the folder without a column
        raise Unreadable(f"{file}: row {row + sum(b.num_rows for b in batches)} on: cannot read: {err}") from None


def process_part(part: Part) -> PartResult:
    """A part's rows → records. Runs in the workers (processes, Ray actors). A bad row raises ``InputError``
    naming it, unless ``--skip-bad``: then it is counted by reason."""
    inp = part.input
    result = PartResult(inp.index, part.nbytes)
    if part.error is not None:
        result.skip(inp.source, "unreadable", part.error)
        return result
    if inp.format == "parquet":
        rows = _parquet_rows(part, result)
    elif inp.format == "arrow":
        rows = _table_rows(part.batches, part.first, inp.columns)
    else:
        try:
            data = _part_bytes(part)
        except Unreadable as err:
            if not inp.skip_bad:
                raise
            result.skip(inp.source, "unreadable", str(err))
            return result
        rows = _json_rows(part, data) if inp.format == "jsonl" else _csv_rows(part, data)
    cache: dict[tuple, Columns | RowError] = {}
    for number, values, columns in rows:
        try:
            if isinstance(values, RowError):
                raise values
            if columns is None:  # a JSON object: its own keys are its header
                keys = tuple(values)
                columns = cache.get(keys)
                if columns is None:
                    if len(cache) > 1000:  # objects whose keys vary without end: a bounded cache
                        cache.clear()
                    try:
                        columns = cache[keys] = match_columns(list(keys))
                    except RowError as err:
                        columns = cache[keys] = err
                if isinstance(columns, RowError):
                    raise columns
            add_row(result, values, columns, inp.source, inp.format in ("csv", "tsv"))
        except RowError as err:
            message = f"{_where(part, number)}: {err}"
            if not inp.skip_bad:
                raise InputError(message) from None
            result.skip(err.source or inp.source, err.reason, message)
        if new := len(result.counts) - len(result.first_rows):  # sources new to the part: counted last
            for source in itertools.islice(reversed(result.counts), new):
                result.first_rows[source] = _where(part, number)
    return result


def _where(part: Part, number: int) -> str:
    if part.input.format == "parquet":
        return f"{part.file}: row {number} (row group {part.row_group})"
    if part.input.format == "arrow":
        return f"{part.file}: row {number}"
    return f"{part.file}:{number}"


def _json_rows(part: Part, data: bytes) -> Iterator[tuple[int, Any, None]]:
    for number, line in enumerate(data.split(b"\n"), part.first):
        if not line or line.isspace():
            continue
        try:
            values = storage.loads_json(line)
        except ValueError as err:  # UnicodeDecodeError and nesting too deep included
            yield number, RowError("bad_line", None, f"not JSON: {err}"), None
            continue
        if not isinstance(values, dict):
            yield number, RowError("bad_line", None, f"not a JSON object but {value_kind(values)}"), None
            continue
        yield number, values, None


def _csv_rows(part: Part, data: bytes) -> Iterator[tuple[int, Any, Columns]]:
    inp = part.input
    try:
        text = data.decode()
        undecodable: list[int] = []
    except UnicodeDecodeError as err:
        at = part.first + data.count(b"\n", 0, err.start)
        if not inp.skip_bad:
            raise InputError(f"{part.file}:{at}: not UTF-8 ({err.reason})") from None
        # Each undecodable line becomes an empty one (skipped by the csv module): the others keep their numbers.
        lines = data.split(b"\n")
        undecodable = []
        for i, raw in enumerate(lines):
            try:
                raw.decode()
            except UnicodeDecodeError:
                undecodable.append(part.first + i)
                lines[i] = b""
        text = b"\n".join(lines).decode()
    for number in undecodable:
        yield number, RowError("bad_line", None, "not UTF-8"), inp.columns
    header = inp.header
    csv.field_size_limit(MAX_LINE_BYTES)  # the default, 128 KiB, is shorter than some passages
    reader = _csv_reader(inp.format, io.StringIO(text, newline=""))
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            yield part.first + reader.line_num - 1, RowError("bad_line", None, f"not CSV: {err}"), inp.columns
            continue
        if not fields:
            continue  # a blank line
        number = part.first + reader.line_num - 1  # a quoted field may span lines: where the record ends
        if len(fields) != len(header):
            yield number, RowError("bad_line", None, f"{len(fields)} fields, the header has {len(header)}"), \
                inp.columns
            continue
        yield number, dict(zip(header, fields)), inp.columns


def _parquet_rows(part: Part, result: PartResult) -> Iterator[tuple[int, Any, Columns]]:
    """A row group's rows, read here, a batch of ``PARQUET_BATCH_ROWS`` at a time. A row group that cannot be
    read is an error naming it; with ``--skip-bad`` what is left of it counts as one unreadable piece."""
    import pyarrow.parquet as pq

    names = part.input.columns.names()
    row = part.first
    try:
        batches = pq.ParquetFile(part.file).iter_batches(PARQUET_BATCH_ROWS, row_groups=[part.row_group],
                                                         columns=names)
        for batch in batches:
            yield from _table_rows([batch], row, part.input.columns)
            row += batch.num_rows
    except Exception as err:  # OSError, pyarrow's ArrowException, a damaged page's own errors
        message = f"{part.file}: row group {part.row_group} (from row {row}): cannot read: {err}"
        if not part.input.skip_bad:
            raise Unreadable(message) from None
        result.skip(part.input.source, "unreadable", message)


def _table_rows(batches: list, first: int, columns: Columns) -> Iterator[tuple[int, Any, Columns]]:
    number = first
    for batch in batches:
        names = batch.schema.names
        values = [batch.column(i).to_pylist() for i in range(len(names))]
        for row in zip(*values):
            yield number, dict(zip(names, row)), columns
            number += 1
