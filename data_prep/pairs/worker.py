"""What each ``data_prep pairs`` worker holds and does (a ``stateful_pool.StatefulPool`` worker: a process, a Ray
actor, or the main process when there is one worker).

A worker parses the parts the main process deals it (``parse``: ``read.process_part``) and answers with
their pairs' 8-byte digests and their counts, keeping the records. The main process, which holds every digest
seen, takes the answers in input order and tells the worker which of a part's pairs are duplicates
(``admit``); the worker hands the others to its own ``ShardWriter`` for their source, as ``wiki``'s main process
does its sentences: shuffled in windows that hold ``--shuffle-window-mb`` together (one ``WindowBudget`` for all
its sources), blocks of ``--block-records``, in shards named ``shard-<worker>-NNNNNN`` (one worker:
``shard-NNNNNN``, as every stream's). So the records cross no process boundary, only parts (to the worker) and
digests (back). ``close`` finishes the shards and says what they are; the main process writes the manifests.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import shutil

from clsys import storage
from clsys.shards.blocks import Record
from clsys.shards.manifest import ShardInfo
from clsys.shards.writer import ShardWriter, WindowBudget
from data_prep.pairs.read import Part, process_part
from data_prep.pairs.rows import PartResult


@dataclasses.dataclass
class WrittenShards:
    """What one worker wrote to a source's stream: its shards in order, how many it uploaded, and how many it
    left in place (the sha256 the stream's old manifest lists)."""

    shards: list[ShardInfo]
    uploaded: int
    unchanged: int


class PairsWorker:
    """Worker ``index`` of ``workers``: its parts held until admitted (oldest first), and its writer per source."""

    def __init__(self, args: argparse.Namespace, tmp_dir: str, index: int, workers: int):
        self.args = args
        self.shard_prefix = "shard-" if workers == 1 else f"shard-{index:03d}-"
        # Where its shards are staged before an upload to object storage (local ones are built in place); a
        # folder of the main process's temporary one, made here: a Ray actor may run on another machine.
        self.tmp_dir = os.path.join(tmp_dir, f"worker-{index}")
        os.makedirs(self.tmp_dir, exist_ok=True)
        self.held: collections.deque[dict[str, list[Record]]] = collections.deque()
        self.previous: dict[str, dict[str, str]] = {}  # source → its old manifest's shards (name → sha256)
        self.writers: dict[str, ShardWriter] = {}
        # Its writers' shuffle windows together hold --shuffle-window-mb, however many sources it writes.
        window = int(args.shuffle_window_mb * 2**20)
        self.windows = WindowBudget(window) if window else None

    def parse(self, part: Part) -> PartResult:
        """A part's rows → its result, its records held here until ``admit``: the answer is the rest."""
        result = process_part(part)
        self.held.append(result.records)
        return dataclasses.replace(result, records={})

    def admit(self, duplicates: dict[str, list[int]], previous: dict[str, dict[str, str]]) -> None:
        """Write the oldest held part's pairs but its ``duplicates`` (per source, their places among the part's
        pairs of that source). ``previous``: the old manifest's shards of each source this worker writes for
        the first time."""
        self.previous.update(previous)
        for source, records in self.held.popleft().items():
            if source in duplicates:
                dropped = set(duplicates[source])
                records = [record for i, record in enumerate(records) if i not in dropped]
            if records:
                self.writer(source).write_records(records)

    def writer(self, source: str) -> ShardWriter:
        writer = self.writers.get(source)
        if writer is None:
            args = self.args
            writer = self.writers[source] = ShardWriter(
                storage.join(args.out, "pairs", source), self.tmp_dir, int(args.shard_size_mb * 2**20),
                self.previous[source], int(args.shuffle_window_mb * 2**20), args.seed, args.block_records,
                args.compress == "gzip", self.shard_prefix, self.windows)
        return writer

    def close(self) -> dict[str, WrittenShards]:
        """Finish every writer (its shuffle window written, its shards published); what each wrote."""
        written = {}
        for source, writer in self.writers.items():
            writer.close()
            written[source] = WrittenShards(writer.shards, writer.uploaded, writer.unchanged)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return written
