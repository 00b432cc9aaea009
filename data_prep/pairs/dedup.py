"""The distinct pairs ``data_prep pairs`` has written to a source, as 8-byte digests: what its main process
drops exact duplicates by.

A set of ``bytes`` held each digest as an object of its own, ~100 bytes a pair (28 GB at 300M pairs). Here the
digests are unsigned 64-bit integers in a few sorted numpy arrays (*runs*) of decreasing size, like the levels
of a log-structured merge tree: a part's new digests become a run, and a run is merged (concatenated and
sorted in place) into the one before it while that one is at most twice its size, so there are at most
log2(pairs) runs and each digest is merged about that many times. A lookup is a binary search in each run.
Memory is 8 bytes a pair, 16 at most while the largest runs are merged (both and their merge held at once).

A 64-bit digest can make two different pairs look alike: among n distinct pairs of a source, the chance that
any two share a digest is about n² / 2^65 (1M pairs: 3·10^-8; 30M: 2.4·10^-5; 300M: 2.4·10^-3), and such a
collision drops one real pair as a duplicate: at 300M pairs, one run in ~400 loses one pair.
"""
from __future__ import annotations

import numpy as np

from data_prep.pairs.rows import DIGEST_BYTES

# A pair's DIGEST_BYTES as a number (any fixed byte order will do: the same on every machine).
DIGEST = np.dtype(f"<u{DIGEST_BYTES}")


class DigestSet:
    """The digests of one source's distinct pairs so far."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []  # sorted, without repeats, none in two; the largest first

    def __len__(self) -> int:
        return sum(len(run) for run in self.runs)

    def add(self, digests: np.ndarray) -> np.ndarray:
        """Add a part's digests, in input order; returns the places (ascending) of those already in the set
        or earlier in ``digests``: the duplicates, of which the first copy is the one kept."""
        unique, first = np.unique(digests, return_index=True)  # first: the place of each one's first copy
        known = np.zeros(len(unique), bool)
        for run in self.runs:
            at = np.minimum(np.searchsorted(run, unique), len(run) - 1)
            known |= run[at] == unique
        duplicate = np.ones(len(digests), bool)
        duplicate[first[~known]] = False
        if not known.all():
            self._add_run(unique[~known])
        return np.flatnonzero(duplicate)

    def _add_run(self, run: np.ndarray) -> None:
        self.runs.append(run)
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            merged = np.concatenate((self.runs.pop(-2), self.runs.pop()))
            merged.sort()  # in place (quicksort): no second copy, unlike a stable sort's buffer
            self.runs.append(merged)
