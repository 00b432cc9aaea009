"""Bytes per sentence in shards: format 2 (blocks of records) against format 1 (a tar sample per sentence),
and what gzip and zstd make of format 2's shards (size, and the rate at which one core decompresses them).

    python bench/shard_bytes.py

The bundled Wikipedia sample's sentences stream (``data_prep wiki``, written once by ``sample_data``) is read
back record by record; its text is the sentences' UTF-8 bytes. Format 2's bytes are the stream's shards as
written; format 1's are the same records written by ``ShardWriter`` one sample each (``txt`` + ``json`` of
the record's metadata), as data_prep wrote before format 2. Compression: each format 2 shard compressed
whole (gzip: ``.tar.gz``, read by clsys, webdataset, Hugging Face datasets and Ray Data alike; zstd
through the ``zstandard`` package, if installed: what the tar readers of those tools do not open), its
decompression timed 5 times (best). Prints a table, then ``ratio`` lines (bytes over the text's: targets
≤ 1.5 uncompressed, ≤ 0.6 compressed). Not part of the test suite.
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from clsys import storage  # noqa: E402
from clsys.shards.blocks import Record  # noqa: E402
from clsys.shards.reader import load_shards, read_shard  # noqa: E402
from clsys.shards.writer import ShardWriter  # noqa: E402
from sample_data import sample_shards  # noqa: E402


def best_rate(decompress, data: bytes, size: int) -> float:
    """MB/s of decompressed output, best of 5."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        decompress(data)
        best = min(best, time.perf_counter() - start)
    return size / best / 1e6


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

    stream = storage.join(str(sample_shards()), "sentences")
    shards = load_shards(stream)
    records = [Record(s["txt"], s["json"]) for shard in shards for s in read_shard(shard)]
    text = sum(len(r.text.encode()) for r in records)
    tars = [storage.read_bytes(shard.url) for shard in shards]
    rows = [("format 2 (blocks), as written", "format2", sum(map(len, tars)), None)]
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter(os.path.join(tmp, "v1"), tmp, 1 << 40)
        for i, record in enumerate(records):
            writer.write(f"{record.meta['lang']}-{record.meta['page_id']}-{i:07d}", record.text, record.meta)
        writer.close()
        rows.append(("format 1 (a sample per sentence)", "format1", writer.shards[0].bytes, None))
    whole = b"".join(tars)
    for level in (1, 6, 9):
        packed = [gzip.compress(t, compresslevel=level, mtime=0) for t in tars]
        rows.append((f"format 2, gzip -{level}", f"format2_gzip{level}", sum(map(len, packed)),
                     best_rate(lambda d: [gzip.decompress(p) for p in d], packed, len(whole))))
    try:
        import zstandard
    except ImportError:
        print("(zstandard not installed: pip install zstandard for its rows)")
    else:
        for level in (3, 9, 19):
            packed = [zstandard.ZstdCompressor(level=level).compress(t) for t in tars]
            rows.append((f"format 2, zstd -{level}", f"format2_zstd{level}", sum(map(len, packed)),
                         best_rate(lambda d: [zstandard.ZstdDecompressor().decompress(p) for p in d], packed,
                                   len(whole))))

    print(f"\nbundled sample, sentences stream: {len(records):,} sentences, {text:,} bytes of UTF-8 text, "
          f"{len(shards)} shards, blocks of data_prep wiki's default --block-records")
    print(f"{'layout':<36} {'bytes':>12} {'× text':>7} {'bytes/sentence':>15} {'decompress MB/s':>16}")
    for name, _, size, rate in rows:
        print(f"{name:<36} {size:>12,} {size / text:>7.2f} {size / len(records):>15.1f} "
              f"{'' if rate is None else f'{rate:,.0f}':>16}")
    print()
    for _, key, size, _ in rows:
        print(f"ratio {key}_bytes_over_text {size / text:.3f}")


if __name__ == "__main__":
    main()
