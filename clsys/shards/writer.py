"""Writing a stream: deterministic WebDataset tar shards, uploaded through ``clsys.storage``, then their
manifest (``clsys.shards.manifest``).

A stream is a folder ``URL/`` holding ``shard-000000.tar``, ``shard-000001.tar``, … and a
``manifest.json`` that is written last: a folder without a manifest is incomplete by definition.
Tar bytes depend only on the samples (mtime 0, uid/gid 0, no user names, members in a fixed
order), so re-running on the same input reproduces every shard's sha256 and the upload of an
unchanged shard can be skipped.

A sample's tar bytes (its members, headers and padding included) depend on the sample alone, so they are
built by ``encode_sample``, a pure function, wherever the sample is made: ``data_prep wiki``'s workers or
Ray tasks return their pages' samples encoded, and the single process that writes the shards in order only
concatenates them (``ShardWriter.write_encoded``) instead of building every header and JSON itself.

Format 2 (``block_records`` > 0, ``clsys.shards.blocks``): records (``write_records``: a text, its metadata,
optionally token ids) are held in the same shuffle window, then written as blocks of up to ``block_records``
records each, a tar sample per block.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import hashlib
import itertools
import json
import logging
import os
import random
import re
import tarfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO, NoReturn

from clsys import storage
from clsys.shards.blocks import FORMAT_V2, MAX_BLOCK_RECORDS, Record, block_members, record_bytes
from clsys.shards.manifest import FORMAT, MANIFEST, ShardInfo
from clsys.storage import StorageError

log = logging.getLogger(__name__)

# The fixed fields of ``ustar_header`` (mode 644, uid/gid 0 | mtime 0 | the checksum field counted as
# spaces, as the checksum is computed | type "regular file" | magic and version) and their byte sum.
_MODE_IDS = b"0000644\x000000000\x000000000\x00"
_MTIME = b"00000000000\x00"
_MAGIC = b"ustar\x0000"
_FIXED_SUM = sum(_MODE_IDS) + sum(_MTIME) + sum(b" " * 8) + ord("0") + sum(_MAGIC)
# From the type field on: "regular file", no link name, magic and version, no user/group names,
# devices or prefix.
_TAIL = b"0" + bytes(100) + _MAGIC + bytes(247)
_ZEROS = bytes(512)
# Samples are written (and hashed) in runs of this many: one call per sample costs more in Python than
# the copy, and one run for a whole shard would allocate (and fault in) its size in fresh memory.
_SAMPLES_PER_WRITE = 256
# gzip's level for ``compress``: on the bundled sample level 1 gives 0.52x the text's bytes against 0.45x for
# level 6, compressing ~4x faster in the one process that writes a data_prep run's shards (bench/shard_bytes.py).
GZIP_LEVEL = 1
# Finished shards being published (uploaded, or flushed to disk and renamed into place) by a writer's
# background threads at once. An upload is network time, not CPU: done in line, it stopped the writer, and
# with it the one process that writes a data_prep run's shards, for a 64 MiB shard at a time. More finished
# shards than this wait for the oldest, which bounds the staged files (on local disk, for object storage).
PUBLISHING = 4
# A shard being built beside its destination (a local stream): ``storage.staging_path``'s name for it.
_STAGED_SHARD = re.compile(r"shard-[\w-]+\.tar(\.gz)?\.tmp-\d+")


def ustar_header(name: str, size: int) -> bytes:
    """The 512-byte ustar header of a regular file as ``tarfile`` writes it for our members (mode 644,
    uid/gid 0, mtime 0, no user names), built directly: ``tarfile.addfile`` costs ~60 µs a member,
    most of the time of a whole ``data_prep`` shard writer, and keeps every member in a list. The
    checksum adds the name's and size's bytes to the fixed fields' sum (two members per sentence:
    this runs millions of times per dump)."""
    encoded = name.encode()
    if len(encoded) > 100:
        raise ValueError(f"tar member name longer than 100 bytes: {name!r}")
    if size >= 8 ** 11:
        raise ValueError(f"tar member {name!r} is too large for ustar ({size} bytes)")
    size_field = b"%011o\x00" % size
    checksum = b"%06o\x00 " % (_FIXED_SUM + sum(encoded) + sum(size_field))
    # name 0-100 | mode, uid, gid 100-124 | size 124-136 | mtime 136-148 | checksum 148-156 | the rest
    return b"".join((encoded.ljust(100, b"\0"), _MODE_IDS, size_field, _MTIME, checksum, _TAIL))


def encode_members(key: str, members: dict[str, bytes]) -> bytes:
    """A sample's members (extension → data) as tar bytes: for each, a ustar header and the data padded
    to 512 bytes, sorted by extension (.ids, .json, .txt), so that the bytes depend on the sample alone."""
    parts: list[bytes] = []
    for ext in sorted(members):
        data = members[ext]
        parts += (ustar_header(f"{key}.{ext}", len(data)), data, _ZEROS[:-len(data) % 512])
    return b"".join(parts)


def encode_meta(meta: dict) -> bytes:
    """A sample's ``json`` member."""
    return json.dumps(meta, ensure_ascii=False, sort_keys=True).encode()


def encode_sample(key: str, text: str, meta: dict, extra: dict[str, bytes] | None = None) -> bytes:
    """A sample's bytes in a tar (``encode_members`` of ``key.json``, ``key.txt`` and ``key.EXT`` for each
    of ``extra``). ``ShardWriter.write`` writes exactly these."""
    return encode_members(key, {"json": encode_meta(meta), "txt": text.encode(), **(extra or {})})


@dataclass(eq=False)
class WindowBudget:
    """The bytes that the shuffle windows of several writers hold together, at most ``limit`` (plus the record
    or sample that reaches it): when one brings their total to ``limit``, the writer whose window holds the
    most (the first of them made, on a tie) writes its window out. A ``data_prep pairs`` worker's writers, one a
    source, share one, so that its memory does not grow with the sources; a writer alone has its own."""

    limit: int
    held: int = 0
    writers: list[ShardWriter] = field(default_factory=list, repr=False)


@dataclass(eq=False)
class ShardWriter:
    """Writes samples (``key`` + ``txt`` + ``json``, plus any ``extra`` members) into rolling tar shards under ``url``.

    A shard is built beside its destination when that is local (and renamed into place when full), else
    in ``tmp_dir`` (and uploaded when full), and hashed as it is written. Publishing a full shard (the
    upload, or the flush to disk and the rename) runs in background threads, up to ``PUBLISHING`` shards at
    once, while the next one is written (local folders and S3: ``storage.parallel_writes``); ``close`` waits
    for them. ``previous`` maps shard names to the
    sha256 the existing manifest lists, to skip re-uploading identical shards.

    ``shuffle_window`` > 0: samples are held back until that many bytes (as written to tar; format 2:
    ``blocks.record_bytes``) have come, or, with a shared ``budget``, until the windows of all its writers hold
    its ``limit`` and this one holds the most; then they are written in an order shuffled with a seed made of
    ``seed``, the stream's name and the window's number. Input in document order (a Wikipedia article's sentences one after another) then reaches
    the shards mixed across every document of the window, so a training batch, drawn through the
    loader's much smaller shuffle buffer, holds sentences of as many articles as a global shuffle
    would give it. The order depends on the samples and the seed alone: re-runs reproduce every shard.

    ``block_records`` > 0 writes format 2: ``write_records`` takes records (``write`` and ``write_encoded``
    refuse), which the window shuffles as it does samples; each window (or, without one, every
    ``block_records`` records) is cut into blocks of that many, its last one shorter. ``write_block`` writes
    one block as given (``data_prep tokenize`` keeps its input's blocks).

    ``compress``: each shard a gzip stream (``shard-NNNNNN.tar.gz``, level ``GZIP_LEVEL``, no timestamp: the bytes
    still depend on the samples alone), compressed as it is written; ``max_bytes`` counts the tar inside, and
    the manifest lists the compressed bytes and their sha256.

    ``write_encoded`` takes samples ``encode_sample`` already made (elsewhere, e.g. in a worker process):
    the same bytes, windows and order as ``write`` with each sample's fields.

    ``shard_prefix``: what the shards' names start with, before their number: writers that fill one stream
    together (``data_prep pairs``' worker processes) each need names of their own.
    """

    url: str
    tmp_dir: str
    max_bytes: int
    previous: dict[str, str] = field(default_factory=dict)
    shuffle_window: int = 0
    seed: int = 0
    block_records: int = 0
    compress: bool = False
    shard_prefix: str = "shard-"
    budget: WindowBudget | None = field(default=None, repr=False)  # None: one of its own, of ``shuffle_window``
    shards: list[ShardInfo] = field(default_factory=list, init=False)
    uploaded: int = field(default=0, init=False)
    unchanged: int = field(default=0, init=False)
    # The shard being filled: its open tar at the staging path, sha256 so far, samples and bytes.
    _tar: BinaryIO | None = field(default=None, init=False, repr=False)
    _path: str = field(default="", init=False, repr=False)
    _sha: Any = field(default=None, init=False, repr=False)
    _gzip: Any = field(default=None, init=False, repr=False)  # the shard's zlib compressor (``compress``)
    _samples: int = field(default=0, init=False, repr=False)
    _records: int = field(default=0, init=False, repr=False)  # format 2: the records of the shard's blocks
    _blocks: int = field(default=0, init=False, repr=False)  # format 2: blocks written, the next one's key
    _size: int = field(default=0, init=False, repr=False)
    _old_manifest_removed: bool = field(default=False, init=False, repr=False)
    # Samples held back for the shuffle: each one's tar bytes (``encode_sample``; format 2: each ``Record``),
    # their total size, and windows written so far.
    _window: list = field(default_factory=list, init=False, repr=False)
    _window_size: int = field(default=0, init=False, repr=False)
    _windows: int = field(default=0, init=False, repr=False)
    # Finished shards still being published, oldest first, and the threads that publish them.
    _publishing: collections.deque[Future] = field(default_factory=collections.deque, init=False, repr=False)
    _publisher: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.block_records > MAX_BLOCK_RECORDS:  # before any input is read: every block would be refused
            raise ValueError(f"block_records {self.block_records:,}: a block holds at most {MAX_BLOCK_RECORDS:,} "
                             "records (readers refuse larger ones)")
        if self.shuffle_window:
            if self.budget is None:
                self.budget = WindowBudget(self.shuffle_window)
            self.budget.writers.append(self)

    @property
    def samples(self) -> int:
        """Samples written so far (format 2: records)."""
        held = self._records if self.block_records else self._samples
        return sum(s.samples for s in self.shards) + held + len(self._window)

    def write(self, key: str, text: str, meta: dict, extra: dict[str, bytes] | None = None) -> None:
        """One sample; ``extra`` maps further member extensions to their bytes (``ids``: pre-tokenized)."""
        self.write_encoded([encode_sample(key, text, meta, extra)])

    def write_records(self, records: list[Record]) -> None:
        """Format 2: records in order (an article's: a call per article). A window is cut into blocks right
        after the record that brings the budget to its limit (each counted as ``record_bytes``)."""
        if not self.block_records:
            raise TypeError("write_records writes format 2 blocks: make the writer with block_records > 0")
        for record in records:
            self._window.append(record)
            if self.shuffle_window:
                self._hold(record_bytes(record))
            elif len(self._window) >= self.block_records:
                self._write_window()

    def write_block(self, records: list[Record]) -> None:
        """Format 2: one block of exactly these records, after whatever the window holds."""
        if self._window:
            self._write_window()
        self._append_blocks([records])

    def write_encoded(self, samples: list[bytes]) -> None:
        """Samples as ``encode_sample`` returns them, in order (an article's: a call per article, not per
        sample). A window is written out right after the sample that brings it to ``shuffle_window`` bytes."""
        if self.block_records:
            raise TypeError("a format 2 writer (block_records > 0) takes records: write_records")
        if not self.shuffle_window:
            self._append(samples)
            return
        size = sum(map(len, samples))
        if self.budget.held + size < self.budget.limit:  # nearly always: the windows are not full yet
            self._window += samples
            self._window_size += size
            self.budget.held += size
            return
        for sample in samples:
            self._window.append(sample)
            self._hold(len(sample))

    def _hold(self, size: int) -> None:
        """The window's newest sample or record, of ``size`` bytes: the budget's largest window is written out
        when it brings the budget to its limit."""
        self._window_size += size
        budget = self.budget
        budget.held += size
        if budget.held >= budget.limit:
            max(budget.writers, key=lambda writer: writer._window_size)._write_window()

    def _write_window(self) -> None:
        # A string seed is hashed with SHA-512 by random.Random: the same order on every machine and run.
        # The permutation depends on the seed and the number of samples alone, not on what the list holds.
        if self.shuffle_window:
            random.Random(f"{self.seed}/{os.path.basename(self.url.rstrip('/'))}/{self._windows}").shuffle(self._window)
        if self.block_records:
            self._append_blocks([self._window[i:i + self.block_records]
                                 for i in range(0, len(self._window), self.block_records)])
        else:
            self._append(self._window)
        if self.budget is not None:
            self.budget.held -= self._window_size
        self._window, self._window_size, self._windows = [], 0, self._windows + 1

    def _append_blocks(self, blocks: list[list[Record]]) -> None:
        encoded = []
        for records in blocks:
            key = f"{self._blocks:09d}"
            try:
                encoded.append(encode_members(key, block_members(records)))
            except ValueError as err:
                raise ValueError(f"{self.url}: block {key}: {err}") from None
            self._blocks += 1
        self._append(encoded, [len(records) for records in blocks])

    def _append(self, samples: list[bytes], records: list[int] | None = None) -> None:
        """Write ``samples`` in order. A shard is finished before a sample that would take it past
        ``max_bytes`` with the 1 KiB end-of-archive marker and the padding to a whole tar record; a new
        shard takes its first sample whatever its size. The samples that fit are found by bisecting their
        running sizes and written in runs: a window holds ~10^5 samples, too many to handle one by one.
        ``records``: format 2, the records of each sample (a block)."""
        room = self.max_bytes - 1024 - tarfile.RECORDSIZE
        ends = list(itertools.accumulate(map(len, samples)))  # bytes up to and including each sample
        done = 0
        while done < len(samples):
            before = ends[done - 1] if done else 0
            fit = bisect.bisect_right(ends, room - self._size + before, lo=done) - done
            if self._tar is None:
                self._path = storage.staging_path(self._shard_url(), self.tmp_dir)
                try:
                    self._tar, self._sha = open(self._path, "wb"), hashlib.sha256()
                    # wbits 31: a gzip stream, its header without a file name or a time
                    self._gzip = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31) if self.compress else None
                except OSError as err:
                    self._fail(err)
                fit = max(fit, 1)
            elif not fit:
                self._finish()
                continue
            for start in range(done, done + fit, _SAMPLES_PER_WRITE):
                self._write(b"".join(samples[start:min(start + _SAMPLES_PER_WRITE, done + fit)]))
            self._samples += fit
            if records is not None:
                self._records += sum(records[done:done + fit])
            self._size += ends[done + fit - 1] - before
            done += fit

    def close(self) -> None:
        """Write what the shuffle window holds, finish the shard being filled and wait until every shard is
        published (a ``StorageError`` names the first that failed); a later ``write`` starts the next one."""
        if self._window:
            self._write_window()
        if self._tar is not None:
            self._finish()
        self._wait_published()

    def _shard_url(self) -> str:
        return storage.join(self.url, f"{self.shard_prefix}{len(self.shards):06d}.tar{'.gz' * self.compress}")

    def _write(self, data: bytes, last: bool = False) -> None:
        if self._gzip is not None:
            data = self._gzip.compress(data) + (self._gzip.flush() if last else b"")
        try:
            self._tar.write(data)
        except OSError as err:
            self._fail(err)
        self._sha.update(data)

    def _fail(self, err: OSError) -> NoReturn:
        """Writing the staged shard failed (a full disk): it is removed and the error names the shard."""
        if self._tar is not None:
            with contextlib.suppress(OSError):
                self._tar.close()
        storage.discard_staged(self._path)
        self._tar = self._sha = None
        self._samples = self._records = self._size = 0
        where = "" if storage.is_local(self.url) else \
            f" (shards are built in {self.tmp_dir} before the upload: set TMPDIR to a disk with room)"
        raise StorageError(f"{self._shard_url()}: writing failed: {err.strerror or err}{where}") from None

    def _finish(self) -> None:
        # End of archive as tarfile writes it: two zero blocks, then zeros up to a whole record.
        self._size += 1024
        self._write(bytes(1024 + -self._size % tarfile.RECORDSIZE), last=True)
        try:
            self._tar.close()
        except OSError as err:
            self._fail(err)
        dest, staged = self._shard_url(), self._path
        name, size, sha256 = dest.rsplit("/", 1)[-1], os.path.getsize(staged), self._sha.hexdigest()
        info = (ShardInfo(name, self._records, size, sha256, blocks=self._samples) if self.block_records
                else ShardInfo(name, self._samples, size, sha256))
        self.shards.append(info)
        self._tar, self._sha, self._samples, self._records, self._size = None, None, 0, 0, 0
        if self.previous.get(info.name) == info.sha256 and storage.exists(dest):
            self.unchanged += 1
            storage.discard_staged(staged)
            log.info(storage.redact(f"{dest}: unchanged (sha256 matches the existing manifest), upload skipped"))
        else:
            self._remove_old_manifest()
            self.uploaded += 1
            self._publish(staged, dest)  # may raise an earlier shard's failed upload: this one is done with

    def _publish(self, staged: str, dest: str) -> None:
        """``storage.publish_staged`` in a background thread, while the next shard is written (where the
        storage allows writes from several threads; else here). An upload that failed is raised here (by a
        later call) or by ``close``, once the others under way have ended."""
        if not storage.parallel_writes(dest):
            storage.publish_staged(staged, dest)
            return
        if self._publisher is None:
            self._publisher = ThreadPoolExecutor(PUBLISHING, thread_name_prefix="shard-publish")
        self._publishing.append(self._publisher.submit(storage.publish_staged, staged, dest))
        while self._publishing and (self._publishing[0].done() or len(self._publishing) > PUBLISHING):
            self._take_published()

    def _wait_published(self) -> None:
        while self._publishing:
            self._take_published()
        self._stop_publisher()

    def _take_published(self) -> None:
        """Wait for the oldest upload; if it failed, let the rest end (each removes its staged file) and raise."""
        try:
            self._publishing.popleft().result()
        except BaseException:
            for other in self._publishing:
                other.exception()  # waits; a second failure is not the one reported
            self._publishing.clear()
            self._stop_publisher()
            raise

    def _stop_publisher(self) -> None:
        if self._publisher is not None:
            self._publisher.shutdown()
            self._publisher = None

    def _remove_old_manifest(self) -> None:
        """Before the first changed shard lands, the old manifest stops describing the folder."""
        if self.previous and not self._old_manifest_removed:
            storage.delete(storage.join(self.url, MANIFEST))
        self._old_manifest_removed = True

    def write_manifest(self, extra: dict) -> str:
        """Write ``manifest.json`` (after every shard is published: ``close`` first) and return its URL."""
        self._wait_published()
        return write_manifest(self.url, self.shards, self.samples, FORMAT_V2 if self.block_records else FORMAT, extra,
                              self.previous)


def remove_staged(url: str) -> None:
    """Delete the shards being built in the local stream folder ``url`` (``shard-….tar.tmp-PID``): those of a run
    that failed or was killed, which no writer will finish. Only while no writer of the stream is running. A
    stream in object storage has none: its shards are built in a local temporary folder."""
    if storage.is_local(url):
        for file_url in storage.list_prefix(url):
            if _STAGED_SHARD.fullmatch(file_url.rpartition("/")[2]):
                storage.delete(file_url)


def write_manifest(url: str, shards: list[ShardInfo], samples: int, fmt: str, extra: dict,
                   previous: dict[str, str]) -> str:
    """Write the ``manifest.json`` of the stream ``url`` listing ``shards`` (every one published) and ``samples``,
    then delete the shards of its old manifest (``previous``) that it no longer lists; returns its URL. What
    ``ShardWriter.write_manifest`` writes, and ``data_prep pairs`` for the shards its workers' writers wrote."""
    listed = [{k: v for k, v in asdict(s).items() if v is not None} for s in shards]
    manifest = {"format": fmt, "stream": os.path.basename(url.rstrip("/")), "shards": listed, "samples": samples,
                **extra}
    manifest_url = storage.join(url, MANIFEST)
    storage.write_json(manifest_url, manifest)
    # Shards of an earlier, bigger run that the new manifest no longer lists.
    for name in sorted(set(previous) - {s.name for s in shards}):
        storage.delete(storage.join(url, name))
    return manifest_url
