"""``data_prep manifest``: WebDataset shards written by other tools → a clsys stream, without copying them.

Tools such as webdataset's ``TarWriter``, img2dataset or a Hugging Face export write tar shards of
samples (``key.txt``, ``key.jpg``, ``key.json``, …) but no clsys ``manifest.json``, which training needs
for its epoch plan (samples per shard) and its integrity checks (size, sha256). This command reads
every ``.tar``/``.tar.gz``/``.tgz`` directly under a folder, checks it the way training will (its name,
its tar structure within the size limit, each sample's text member present and UTF-8, no shard listed twice:
a copy is one) and writes the manifest:

- beside the shards (the default): shard names are file names, the folder is the stream;
- elsewhere (``--out``, e.g. when the shards' bucket is read-only): shard names are absolute URLs.

The stream's name is its folder's (``sentences`` for SimCSE, SG and a retrieval recipe's corpus, ``documents`` for TaCL);
train with ``data.url`` = the folder's parent. Only the text member (``--text-member``) is ever read;
other members (images, labels, other tools' json, pickles) are counted and skipped, never decoded.
A bad shard stops the command, naming it and the reason, unless ``--skip-bad`` leaves it out (counted).
clsys's own format 2 shards (blocks of records) are not indexed: a format 1 manifest would read each block as
one sample; they are read with the manifest data_prep wrote with them.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from clsys import storage
from clsys.shards.names import clip
from clsys.shards.reader import MAX_SHARD_BYTES, BadData, format2_block, read_stored, sample_members, untar_bytes
from clsys.storage import StorageError
from data_prep import __version__, cli
from clsys.shards.manifest import (FORMAT, MANIFEST, repeated_shard_problem, repeated_shards, shard_name_problem,
                                   text_member_problem)

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="URL", help="the folder holding the shards: file:///abs, s3://bucket/prefix or a path")
    p.add_argument("--out", metavar="URL", default=None,
                   help="the stream folder to write manifest.json in (default: URL itself); its name is the "
                        "stream's, e.g. .../sentences (train with data.url = its parent)")
    p.add_argument("--text-member", default="txt", metavar="EXT",
                   help="the member holding each sample's text, by extension: txt, text, caption, … (default: txt)")
    p.add_argument("--skip-bad", action="store_true",
                   help="leave bad shards out of the manifest (counted) instead of stopping")
    p.add_argument("--jobs", type=cli.positive(int), default=8, metavar="N",
                   help="shards read at once (default: 8)")
    p.add_argument("--max-shard-mb", type=cli.positive(int), default=MAX_SHARD_BYTES >> 20, metavar="N",
                   help="the most MiB a shard's tar may take, decompressed: a larger shard is bad "
                        "(default: %(default)s, as training's data.max_shard_mb)")


@dataclass
class ShardScan:
    """What reading one shard found."""

    url: str
    name: str  # as the manifest lists it
    bytes: int
    sha256: str = ""
    samples: int = 0
    members: collections.Counter = field(default_factory=collections.Counter)  # extension → count
    error: str | None = None  # why the shard cannot be trained on


def scan_shard(url: str, name: str, text_member: str, max_bytes: int) -> ShardScan:
    """Check a shard as training will: the name the manifest lists it by, then (read whole, stored and
    decompressed within ``max_bytes``) its tar structure, that it is not clsys's own format 2
    (``format2_block``), and each sample's text present and UTF-8."""
    if problem := shard_name_problem(name):
        return ShardScan(url, name, 0, error=f"name {clip(name)!r}: {problem}")
    scan = ShardScan(url, name, 0)
    try:
        data = read_stored(url, max_bytes)
        scan.bytes, scan.sha256 = len(data), hashlib.sha256(data).hexdigest()
        tar = untar_bytes(url, data, max_bytes)
        samples = sample_members(tar, text_member, scan.members)
    except BadData as fault:
        scan.error = str(fault)
        return scan
    if problem := format2_block(tar):
        scan.error = problem
        return scan
    scan.samples = len(samples)
    for key, members in samples:
        if text_member not in members:
            found = ", ".join(sorted({ext for ext in scan.members if ext})) or "none"
            scan.error = (f"sample {clip(key)} has no .{text_member} member (the shard's members: {clip(found)}; "
                          f"choose another with --text-member)")
            return scan
        offset, size = members[text_member]
        try:
            tar[offset:offset + size].decode("utf-8")
        except UnicodeDecodeError as err:
            scan.error = f"sample {clip(key)}: its .{text_member} member is not UTF-8 ({err})"
            return scan
    return scan


def main(args: argparse.Namespace) -> int:
    """Run ``manifest``; returns the exit code (0 ok, 2 no shards, a bad shard, an unusable folder or a storage error)."""
    start = time.time()
    source = str(storage.parse(args.url))
    out = str(storage.parse(args.out)) if args.out else source
    if problem := text_member_problem(args.text_member):
        return cli.fail("manifest", f"--text-member {args.text_member!r}: {problem}")
    max_bytes = args.max_shard_mb << 20
    try:
        storage.check_bucket(out)
        existing = storage.join(out, MANIFEST)
        if storage.exists(existing) and "foreign" not in storage.read_json(existing):
            return cli.fail("manifest", f"{existing}: a manifest written by data_prep is there already; "
                                        "its stream needs no other (pass --out to index the shards elsewhere)")
        prefix = source.rstrip("/") + "/"
        # (URL, name in the manifest): a file name when the manifest sits beside the shards, else the URL.
        jobs = [(url, url[len(prefix):] if out == source else url) for url, _ in storage.list_sizes(source)
                if "/" not in url[len(prefix):] and url.endswith(SHARD_SUFFIXES)]
        if not jobs:
            return cli.fail("manifest", f"{source}: no {', '.join(SHARD_SUFFIXES)} shards directly in this folder")
        with ThreadPoolExecutor(args.jobs) as pool:
            scans = list(pool.map(lambda job: scan_shard(*job, args.text_member, max_bytes), jobs))
    except StorageError as err:
        return cli.fail("manifest", str(err))

    readable = [s for s in scans if not s.error]
    entries = [{"name": s.name, "samples": s.samples, "sha256": s.sha256} for s in readable]
    for i, j, how in repeated_shards(out, entries):
        readable[j].error = repeated_shard_problem(entries, i, j, how)
    bad = [s for s in scans if s.error]
    for scan in bad:
        what = "skipped" if args.skip_bad else "bad shard"
        # The command's verdict on each shard, part of its report on stdout (the error after it points "above").
        print(storage.redact(f"data_prep manifest: {what} {scan.url}: {scan.error}"))
    if bad and not args.skip_bad:
        return cli.fail("manifest", f"{len(bad)} of {len(scans)} shards cannot be trained on (above); "
                                    "fix them or pass --skip-bad to leave them out")
    good = [s for s in scans if not s.error]
    if not good:
        return cli.fail("manifest", f"{source}: no shard is usable")
    members = collections.Counter()
    for scan in good:
        members.update(scan.members)
    manifest = {"format": FORMAT, "stream": os.path.basename(out.rstrip("/")),
                "shards": [{"name": s.name, "samples": s.samples, "bytes": s.bytes, "sha256": s.sha256} for s in good],
                "samples": sum(s.samples for s in good), "tool": f"data_prep {__version__} manifest",
                "foreign": {"source": source, "text_member": args.text_member,
                            "members": dict(sorted(members.items())), "shards_skipped": len(bad)}}
    try:
        storage.write_json(storage.join(out, MANIFEST), manifest)
    except StorageError as err:
        return cli.fail("manifest", str(err))
    others = clip(", ".join(f".{ext} {n}" for ext, n in sorted(members.items()) if ext != args.text_member))
    print(storage.redact(f"{manifest['samples']} samples in {len(good)} shards ({len(bad)} skipped), text from "
                         f".{args.text_member}{f' (skipped unread: {others})' if others else ''} in "
                         f"{time.time() - start:.1f}s -> {storage.join(out, MANIFEST)}; train with "
                         f"data.url={os.path.dirname(out.rstrip('/'))} (stream '{manifest['stream']}')"))
    return 0
