"""Argument types and error reporting shared by the ``python -m data_prep`` commands."""
from __future__ import annotations

import argparse
import sys


def positive(typ):
    """An argparse type: a number of type ``typ`` that must be > 0."""
    def parse(value: str):
        try:
            v = typ(value)
        except ValueError:
            v = 0
        if v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {typ.__name__}, got {value!r}")
        return v
    return parse


def fail(command: str, message: str, code: int = 2) -> int:
    """Print the one-line error every command uses and return its exit code."""
    print(f"data_prep {command}: error: {message}", file=sys.stderr)
    return code
