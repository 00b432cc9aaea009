"""``python -m data_prep <command>``: one subcommand per corpus/stage.

Each command module exposes ``add_arguments(parser)`` and ``main(args) -> exit code``; adding a
stage (``align``, ``manifest``, ``pairs``, ``tokenizer``, ``tokenize``, ``triplets``) means adding one line to ``COMMANDS``.
"""
from __future__ import annotations

import argparse
import signal
import sys

from clsys import logs
from data_prep import __version__, align, cli, manifest, pretokenize, tokenizer, triplets, wiki
from data_prep.pairs import command as pairs

COMMANDS = {
    "wiki": (wiki, "MediaWiki XML dumps -> sentence and passage shards"),
    "triplets": (triplets, "NLI data (CSV/TSV/JSONL) -> (anchor, positive, negative) shards for supervised SimCSE"),
    "pairs": (pairs, "(query, positive, negatives) data (JSONL, CSV/TSV, Parquet, datasets folders) -> a stream per source"),
    "align": (align, "MediaWiki dumps + langlinks -> aligned cross-language section pairs for CLIR pretraining"),
    "tokenizer": (tokenizer, "sentences stream(s) -> language-balanced SentencePiece model + Hugging Face tokenizer"),
    "tokenize": (pretokenize, "a stream -> the same stream with token ids, so training collates without tokenizing"),
    "manifest": (manifest, "WebDataset shards written by other tools -> a clsys stream (manifest.json), shards left in place"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep",
                                     description="Offline data preparation: raw corpora -> WebDataset shards + manifest.")
    parser.add_argument("--version", action="version", version=f"data_prep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        logs.add_level_option(p)
        p.set_defaults(run=module.main)
    args = parser.parse_args(argv)
    logs.configure(args.log_level, progress_stream="stderr")  # stdout is each command's summary of what it wrote
    try:
        with cli.stop_on_sigterm():
            return args.run(args)
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM, once the command's cleanup has run: one line, 128 + N
        sig = signal.SIGTERM if isinstance(stop, cli.Stopped) else signal.SIGINT
        return cli.fail(args.command, f"stopped by {sig.name}", 128 + sig)


if __name__ == "__main__":
    sys.exit(main())
