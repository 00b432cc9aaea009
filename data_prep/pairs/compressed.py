"""Compressed text inputs (``.gz``, ``.zst``), read as streams of their decompressed bytes: what
``data_prep pairs`` reads its JSONL, CSV and TSV files through. Nothing is decompressed whole: a read returns
at most what was asked for (zstd: compressed bytes go to the decoder ``ZSTD_READ`` at a time), and a file that
ends before its compressed data does raises ``EOFError``."""
from __future__ import annotations

import gzip
import io
import os
import zlib

COMPRESSIONS = (".gz", ".zst")
ZSTD_READ = 1 << 10  # compressed bytes given to the zstd decoder at a time: one call expands them 32,768x at most
READ_BUFFER = 1 << 20  # a zstd stream's buffer


def compression_of(path: str) -> str:
    """The compression suffix of ``path`` (``.gz``, ``.zst``), or ""."""
    suffix = os.path.splitext(path)[1].lower()
    return suffix if suffix in COMPRESSIONS else ""


def uncompressed_name(path: str) -> str:
    return path[:len(path) - len(compression_of(path))]


class _ZstdReader(io.RawIOBase):
    """A zstd file's text, frame after frame. zstandard's own stream readers end silently where a file ends
    inside a frame, as if it were whole: this one raises ``EOFError`` there, as ``gzip`` does."""

    def __init__(self, raw):
        import zstandard

        self.raw, self.decoder, self.frame, self.error = raw, zstandard.ZstdDecompressor(), None, zstandard.ZstdError
        self.pending, self.at = b"", 0  # decompressed bytes not yet read, and where the next read starts

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.at == len(self.pending):
            data = self.raw.read(ZSTD_READ)
            if not data:
                if self.frame is not None and not self.frame.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self.pending, self.at = b"", 0
            try:
                while data:
                    if self.frame is None or self.frame.eof:
                        self.frame = self.decoder.decompressobj()
                    self.pending += self.frame.decompress(data)
                    data = self.frame.unused_data if self.frame.eof else b""
            except self.error as err:
                raise OSError(f"not zstd data ({err})") from None
        n = min(len(buffer), len(self.pending) - self.at)
        buffer[:n] = self.pending[self.at:self.at + n]
        self.at += n
        return n


def decompressed(raw, compression: str):
    """A binary stream of ``raw``'s decompressed bytes."""
    if compression == ".gz":
        return gzip.GzipFile(fileobj=raw)
    return io.BufferedReader(_ZstdReader(raw), READ_BUFFER)


def read_problem(err: Exception) -> str:
    """What went wrong reading a file, compressed or not, in the words of an error message."""
    if isinstance(err, EOFError):
        return "the file ends before its compressed data does (truncated?)"
    return f"{err.strerror or err}" if isinstance(err, OSError) else f"not valid compressed data ({err})"


READ_ERRORS = (OSError, EOFError, zlib.error)  # what reading a file can raise (zlib.error: a damaged gzip stream)
