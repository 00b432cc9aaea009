"""The loader's transfer settings that the loader benchmarks can change, to measure each against its default.

Both are module constants (of ``clsys.data.transport`` and ``clsys.data.loader_workers``) read in the
trainer's process when a loader starts its workers (the niceness travels to them with their start function), so setting them
here, before any loader, is enough.
"""
from __future__ import annotations

import argparse

from clsys.data import loader_workers, transport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--result-pipe-kib", type=int, default=transport.RESULT_PIPE_BYTES >> 10,
                        help="the pipe that carries finished bundles to the trainer (64: a pipe's default size)")
    parser.add_argument("--worker-niceness", type=int, default=loader_workers.LOADER_WORKER_NICENESS,
                        help="how much nicer than the trainer the loader workers run (0: the same priority)")


def apply(args: argparse.Namespace) -> str:
    """Set the loader's constants from ``args``; what they are, in words, for the report."""
    transport.RESULT_PIPE_BYTES = args.result_pipe_kib << 10
    loader_workers.LOADER_WORKER_NICENESS = args.worker_niceness
    return f"a {args.result_pipe_kib} KiB result pipe, workers {args.worker_niceness} nicer than the trainer"
