"""A dump's bz2 streams: decompressed a bounded piece at a time, and found by a multistream dump's index.

Memory stays bounded on a hostile dump: each decompress call returns ``OUT_BYTES`` at most (``inflate``), so a
bz2 "bomb" (611 bytes that decompress to 600 MiB) is read a piece at a time, by ``dumps.DumpReader`` reading a
whole dump as by ``bz2_stream`` reading one stream.

A Wikimedia *multistream* dump is many bz2 streams back to back: a header stream (the ``<siteinfo>``), streams of
100 pages each, a closing one. Its index gives the byte offset of each stream of pages (``index_blocks``, checked
by ``check_index``); ``bz2_stream`` decompresses one, from a local file or an object (``s3://``, ``gs://``, …
through ``clsys.storage``), as one ranged read from its offset to the next listed one's, never a download of the
whole dump. (``dumps.BlockReader`` parses the pages of one.)
"""
from __future__ import annotations

import bz2
import collections
import contextlib
import re
from dataclasses import dataclass
from typing import Generator, Iterator

from clsys import storage
from clsys.storage import StorageError

CHUNK_BYTES = 1 << 16  # small enough that a fault is located to within 64 KiB of input
OUT_BYTES = 1 << 20  # the most one decompress call returns
# The most the header stream (the <siteinfo>) or the closing one of a multistream dump may hold: a few KiB.
MAX_SMALL_STREAM_BYTES = 1 << 24
# A bz2 stream starts with "BZh", the block size digit and the magic of its first block (or of its
# end-of-stream marker, for an empty stream). Ten bytes are enough to tell an offset that is a few
# bytes off.
_BZ2_STREAM_START = re.compile(rb"BZh[1-9](?:1AY&SY|\x17rE8P\x90)")


class DumpError(Exception):
    """The input cannot be used at all (missing, empty, not XML, not a MediaWiki dump, a DOCTYPE in it). Raised
    here and by ``dumps.DumpReader``, as ``TruncatedDump`` is: the errors of reading a dump, wherever it fails."""


class TruncatedDump(Exception):
    """Reading stopped early (corrupt/truncated bz2 or XML); pages before ``byte_offset`` are good."""

    def __init__(self, message: str, byte_offset: int):
        super().__init__(message, byte_offset)
        self.message, self.byte_offset = message, byte_offset


class BadIndex(Exception):
    """A multistream index that is malformed or does not describe its dump; the message names file:line."""


def inflate(dec: bz2.BZ2Decompressor, data: bytes) -> Iterator[bytes]:
    """What ``dec`` makes of ``data``, ``OUT_BYTES`` at most a piece, up to its stream's end (what follows the end
    is left in ``dec.unused_data``). Raises what ``dec`` raises on corrupt data (OSError, EOFError)."""
    out = dec.decompress(data, OUT_BYTES)
    while True:
        if out:
            yield out
        if dec.eof or dec.needs_input:
            return
        out = dec.decompress(b"", OUT_BYTES)


@dataclass
class Block:
    """One bz2 stream of a multistream dump, as its index lists it."""

    offset: int
    line: int  # the index line of its first page
    page_ids: list[int]
    next_offset: int | None = None  # where the next listed stream starts; None for the last one


def bz2_stream(path: str, offset: int, end: int | None = None) -> Generator[bytes, None, int]:
    """The one bz2 stream starting at byte ``offset``, decompressed, ``OUT_BYTES`` at most a piece; returns the
    offset just past it. ``end``: where it should end at the latest (reads from object storage ask for no more).

    A fault raises ``TruncatedDump`` at ``offset``: the whole stream is lost, so that is where the loss starts.
    A storage error (after ``clsys.storage``'s retries) raises ``StorageError``: the stream may be readable later.
    """
    dec, pos = bz2.BZ2Decompressor(), offset
    with storage.open_read(path, offset, end) as f:
        while not dec.eof:
            # Never past ``end``, local files included, so that a stream without its end-of-stream marker is
            # reported alike wherever the dump is stored.
            chunk = f.read(CHUNK_BYTES if end is None else min(CHUNK_BYTES, end - pos))
            if not chunk:
                raise TruncatedDump("bz2 stream ends before its end-of-stream marker (truncated file)", offset)
            try:
                yield from inflate(dec, chunk)
            except (OSError, EOFError) as err:
                raise TruncatedDump(f"corrupt bz2 data ({err})", offset) from None
            pos += len(chunk)
    return pos - len(dec.unused_data)


def read_bz2_stream(path: str, offset: int, end: int | None = None) -> tuple[bytes, int]:
    """``bz2_stream`` whole: (its data, the offset just past it), for the streams of a few KiB, a multistream
    dump's header and closing one. One that holds more than ``MAX_SMALL_STREAM_BYTES`` raises ``TruncatedDump``."""
    parts, size = [], 0
    with contextlib.closing(bz2_stream(path, offset, end)) as stream:
        while True:
            try:
                part = next(stream)
            except StopIteration as stop:
                return b"".join(parts), stop.value
            size += len(part)
            if size > MAX_SMALL_STREAM_BYTES:
                raise TruncatedDump(f"the bz2 stream holds more than {MAX_SMALL_STREAM_BYTES >> 20} MiB, where a "
                                    f"dump's header or closing stream holds a few KiB", offset)
            parts.append(part)


def _index_entry(raw: bytes, index: str, line: int) -> tuple[int, int]:
    """(offset, page id) of one ``OFFSET:PAGE_ID:TITLE`` line (titles may hold ':' and are not needed)."""
    parts = raw.rstrip(b"\r\n").split(b":", 2)
    if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
        return int(parts[0]), int(parts[1])
    raise BadIndex(f"{index}:{line}: expected OFFSET:PAGE_ID:TITLE, got {raw[:80]!r}")


def _index_lines(index: str) -> Iterator[bytes]:
    """The lines of an index file (.txt or .txt.bz2; a local file or an object), streamed."""
    try:
        with storage.open_read(index, 0, 3) as f:
            compressed = f.read(3) == b"BZh"
        f = storage.open_read(index)
    except StorageError as err:
        raise BadIndex(f"{index}: cannot open: {str(err).removeprefix(f'{index}: ')}") from None
    with f:
        source = bz2.open(f) if compressed else f
        rest = b""
        while chunk := source.read(CHUNK_BYTES):
            *lines, rest = (rest + chunk).split(b"\n")
            yield from lines
        if rest:
            yield rest


def index_blocks(index: str, dump: str) -> Iterator[Block]:
    """The blocks of a multistream index (.txt or .txt.bz2), in file order, streamed: enwiki's has ~24 M lines.

    Checks every line's form, that offsets ascend, and that each offset is within ``dump``; for a local dump, that
    each starts a bz2 stream too. A dump in object storage is not read here (that would be one request per block):
    an offset that does not start a stream is found when the blocks are read, each having to end where the next
    listed one starts.
    """
    size = storage.size(dump)
    with contextlib.ExitStack() as stack:
        d = stack.enter_context(open(dump, "rb")) if "://" not in dump else None
        block, line = None, 0
        try:
            for line, raw in enumerate(_index_lines(index), 1):
                offset, page_id = _index_entry(raw, index, line)
                if block is not None and offset == block.offset:
                    block.page_ids.append(page_id)
                    continue
                if block is not None:
                    if offset < block.offset:
                        raise BadIndex(f"{index}:{line}: offset {offset} is below the previous line's {block.offset}; "
                                       "an index lists the streams in file order")
                    block.next_offset = offset
                    yield block
                if offset >= size:
                    raise BadIndex(f"{index}:{line}: offset {offset} is beyond the end of {dump} ({size} bytes)")
                if d is not None:
                    d.seek(offset)
                    if not _BZ2_STREAM_START.fullmatch(d.read(10)):
                        raise BadIndex(f"{index}:{line}: offset {offset} is not the start of a bz2 stream in {dump}: "
                                       "not this dump's index?")
                block = Block(offset, line, [page_id])
        except (OSError, EOFError) as err:  # a corrupt .bz2 index
            raise BadIndex(f"{index}:{line + 1}: cannot read ({err})") from None
    if block is None:
        raise BadIndex(f"{index}: no index lines")
    yield block


def check_index(index: str, dump: str) -> None:
    """Read the whole index once, before anything is written (``index_blocks`` checks each line), and check that
    the dump's first bz2 stream (the ``<siteinfo>`` header, no pages) ends where the first listed block starts."""
    blocks = index_blocks(index, dump)
    first = next(blocks)
    collections.deque(blocks, maxlen=0)
    with storage.open_read(dump, 0, 10) as d:
        if not _BZ2_STREAM_START.fullmatch(d.read(10)):
            raise BadIndex(f"{index}: a multistream index, but {dump} is not a bz2 file")
    try:
        header, end = read_bz2_stream(dump, 0)
    except TruncatedDump as err:
        raise DumpError(f"its first bz2 stream (the header): {err.message}") from None
    if end != first.offset or b"<page>" in header:
        raise BadIndex(f"{index}:{first.line}: the dump's first bz2 stream (ending at byte {end}) should be its "
                       f"<siteinfo> header alone, ending where this first listed block starts ({first.offset})")
