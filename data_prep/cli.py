"""Argument types and error reporting shared by the ``python -m data_prep`` commands."""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
from collections.abc import Iterable, Iterator

from clsys import storage
from data_prep.process_pool import WorkerDied


def positive(typ, allow_zero: bool = False, most: int | None = None):
    """An argparse type: a number of type ``typ`` that must be > 0 (>= 0 with ``allow_zero``), and at most
    ``most`` where given."""
    def parse(value: str):
        try:
            v = typ(value)
        except ValueError:
            v = -1
        if v < 0 or (v == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"expected a {'non-negative' if allow_zero else 'positive'} "
                                             f"{typ.__name__}, got {value!r}")
        if most is not None and v > most:
            raise argparse.ArgumentTypeError(f"expected at most {most:,}, got {value!r}")
        return v
    return parse


def add_parallelism(p: argparse.ArgumentParser, work: str, ray_work: str, ray_needs: str = "",
                    output: str = "output is identical for any N",
                    ray_output: str = "failed tasks are retried; output is identical to a run in one process") -> None:
    """``--workers`` and ``--ray``, which the commands that spread their work over processes or Ray tasks
    (``ray_pool.RayPool``) share, in the command's words: ``work``, what a worker process does ("parse rows");
    ``ray_work``, what runs on Ray; ``ray_needs``, what a Ray run asks of the inputs, if anything; ``output``
    and ``ray_output``, what the output of a run with workers or on Ray is to that of one process."""
    p.add_argument("--workers", type=positive(int), metavar="N",
                   help=f"processes that {work}; {output} (default: 1; with --ray, the CPUs of the local cluster it "
                        "starts: all cores)")
    p.add_argument("--ray", action="store_true",
                   help=f"{ray_work}, on the cluster at RAY_ADDRESS (as under `ray job submit`; --workers is then "
                        f"ignored) or else on a local cluster on 127.0.0.1; {ray_needs + '; ' if ray_needs else ''}"
                        f"{ray_output}")


def out_problem(out: str, writes: Iterable[str], reads: Iterable[str]) -> str | None:
    """Why a command cannot write to ``out``: a folder it would write there (``writes``) is, holds or lies inside
    something it reads (``reads``), however either is spelled (``storage.overlaps``); None when they are apart.

    A stream's writer replaces the shards and deletes the manifest of its folder as it goes: writing onto an
    input would replace what is still to be read, and a failure half-way would leave neither stream."""
    reads = list(reads)
    for written in writes:
        for read in reads:
            if storage.overlaps(written, read):
                what = "it" if written == out else f"it writes {written}, which"
                return (f"--out {out}: {what} is, holds or lies inside the input {read}; writing there would "
                        f"replace what is being read: choose an --out apart from every input")
    return None


WORKER_DIED = 1  # the exit code of a run stopped by a worker process or Ray actor that died (``WorkerDied``)


class Stopped(KeyboardInterrupt):
    """SIGTERM (a scheduler's, ``kill``), raised in the main thread as Ctrl-C's ``KeyboardInterrupt`` is: the
    run's ``finally`` blocks end its workers and remove its unfinished files on the way out."""


def _raise_stopped(signum, frame) -> None:
    raise Stopped()


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises ``Stopped`` while the command runs; the handler before is put back after (the tests run
    commands in their own process)."""
    before = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def fail(command: str, message: str, code: int = 2) -> int:
    """Print the one-line error every command uses (without the secrets of the URLs it names) and return
    its exit code."""
    print(f"data_prep {command}: error: {storage.redact(message)}", file=sys.stderr)
    return code


def failed_run(command: str, err: WorkerDied | OSError) -> int:
    """The one line for a run stopped by no fault of its input: a worker process or Ray actor that died (exit
    ``WORKER_DIED``), or the local disk the shards are built on before they are uploaded (exit 2)."""
    if isinstance(err, WorkerDied):
        return fail(command, str(err), WORKER_DIED)
    return fail(command, f"{err.filename or 'a local file'}: {err.strerror or err} (shards are built in "
                         f"{tempfile.gettempdir()} before the upload: set TMPDIR to a disk with room)")
