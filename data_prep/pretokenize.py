"""``python -m data_prep tokenize``: a stream → the same stream with each sample's token ids added.

Every sample of the input stream (``txt`` + ``json``) is written again, same key and members, plus an
``ids`` member: its ``txt`` tokenized without special tokens and cut at ``--max-tokens``, as raw
little-endian int32 (``clsys.shards.blocks.encode_ids``). A format 2 stream keeps its blocks: each block is
written again with its records' ids (``clsys.shards.blocks``). Each input shard becomes one output
shard, so the shard layout, and with it every training epoch's plan, is the input's. The manifest
records the tokenizer's name and fingerprint (``clsys.data.pretokenized.tokenizer_fingerprint``):
training with another tokenizer refuses the stream. The output depends only on the input and the
tokenizer, so a re-run reproduces every shard and skips the unchanged uploads.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time

from clsys import storage
from clsys.storage import StorageError
from data_prep import __version__, cli
from clsys.shards.blocks import FORMAT_V2, Record, encode_ids
from clsys.shards.manifest import MANIFEST, previous_shas, read_manifest
from clsys.shards.writer import ShardWriter

BATCH = 1024  # texts per tokenizer call: fast tokenizers encode a batch on several threads
_STREAM_FIELDS = ("format", "stream", "shards", "samples")  # what write_manifest writes anew


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, metavar="URL",
                   help="a stream folder written by data_prep (e.g. wiki's OUT/sentences): file:///abs, s3:// or path")
    p.add_argument("--tokenizer", required=True, metavar="T",
                   help="the training tokenizer: a packaged alias (all-MiniLM-L6-v2), a folder or URL "
                        "(e.g. data_prep tokenizer's output), or a hub id")
    p.add_argument("--out", required=True, metavar="URL",
                   help="output stream folder; its name is the stream's (train with data.url = its parent)")
    p.add_argument("--max-tokens", type=cli.positive(int), default=512, metavar="N",
                   help="keep at most N tokens of a sample, special tokens not counted; at least "
                        "data.max_length - 2 for BERT (default: 512)")


def main(args: argparse.Namespace) -> int:
    """Run ``tokenize``; returns the exit code (0 ok, 2 unusable input or tokenizer, bad data or storage error)."""
    # Imported here, not at module level: torch and transformers would add seconds to every data_prep command.
    from clsys.data.pretokenized import tokenizer_fingerprint
    from clsys.shards.reader import COMPRESSED, ShardError, load_shards, read_shard
    from clsys.model.encoder import load_tokenizer

    start = time.time()
    try:
        storage.check_bucket(args.out)
        if not storage.exists(storage.join(args.input, MANIFEST)):
            return cli.fail("tokenize", f"{args.input}: no {MANIFEST} (not a stream folder written by data_prep, "
                                        "or an unfinished one)")
        manifest = read_manifest(args.input)
        shards = load_shards(args.input)
        # The shards too: a foreign stream's manifest may list them by URL, in another folder.
        if problem := cli.out_problem(args.out, [args.out], [args.input, *(s.url for s in shards)]):
            return cli.fail("tokenize", problem)
    except StorageError as err:
        return cli.fail("tokenize", str(err))
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        fingerprint = tokenizer_fingerprint(tokenizer)
    except (OSError, ValueError, StorageError) as err:  # what transformers raises for a folder it cannot load
        reason = str(err).strip().splitlines()[0]
        return cli.fail("tokenize", f"--tokenizer {args.tokenizer}: cannot load it ({reason})")

    tokens = 0
    try:
        with tempfile.TemporaryDirectory(prefix="data_prep-") as tmp:
            # No size limit: shards end where the input's do (close() below). Format 2 keeps the input's blocks.
            blocked = manifest["format"] == FORMAT_V2
            writer = ShardWriter(args.out, tmp, sys.maxsize, previous_shas(args.out), block_records=int(blocked),
                                 compress=any(s.url.endswith(COMPRESSED) for s in shards))  # as the input's
            for shard in shards:
                samples = list(read_shard(shard))  # checksum-verified; a bad shard stops the command
                ids = []
                for i in range(0, len(samples), BATCH):
                    ids += tokenizer([s["txt"] for s in samples[i:i + BATCH]], add_special_tokens=False,
                                     truncation=True, max_length=args.max_tokens)["input_ids"]
                tokens += sum(map(len, ids))
                if blocked:  # a record's key is its block's, "/", its place in it
                    rows = iter(zip(samples, ids))
                    for _, block in itertools.groupby(rows, key=lambda row: row[0]["__key__"].rpartition("/")[0]):
                        writer.write_block([Record(s["txt"], s["json"], row) for s, row in block])
                else:
                    for sample, row in zip(samples, ids):
                        writer.write(sample["__key__"], sample["txt"], sample["json"], {"ids": encode_ids(row)})
                writer.close()
            kept = {k: v for k, v in manifest.items() if k not in _STREAM_FIELDS}  # languages, sources, …
            url = writer.write_manifest({**kept, "tool": f"data_prep {__version__}", "tokenized_from": args.input,
                                         "tokenizer": {"name": args.tokenizer, "fingerprint": fingerprint,
                                                       "max_tokens": args.max_tokens}})
    except (StorageError, ShardError) as err:
        return cli.fail("tokenize", str(err))
    print(storage.redact(f"{writer.samples} samples, {tokens} tokens (tokenizer {args.tokenizer}, fingerprint "
                         f"{fingerprint[:12]}, at most {args.max_tokens} per sample) in {len(writer.shards)} shards "
                         f"({writer.uploaded} uploaded, {writer.unchanged} unchanged: upload skipped) in "
                         f"{time.time() - start:.1f}s -> {url}"))
    return 0
