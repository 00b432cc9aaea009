"""Argument types and error reporting shared by the ``python -m data_prep`` commands."""
from __future__ import annotations

import argparse
import sys

from clsys import storage


def positive(typ, allow_zero: bool = False):
    """An argparse type: a number of type ``typ`` that must be > 0 (>= 0 with ``allow_zero``)."""
    def parse(value: str):
        try:
            v = typ(value)
        except ValueError:
            v = -1
        if v < 0 or (v == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"expected a {'non-negative' if allow_zero else 'positive'} "
                                             f"{typ.__name__}, got {value!r}")
        return v
    return parse


def fail(command: str, message: str, code: int = 2) -> int:
    """Print the one-line error every command uses (without the secrets of the URLs it names) and return
    its exit code."""
    print(f"data_prep {command}: error: {storage.redact(message)}", file=sys.stderr)
    return code
