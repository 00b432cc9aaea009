"""The plan of an epoch over ranks and loader workers, and the loader's position in it (what checkpoints store).

Its nouns:
  - *sample stream*: what one (rank, loader worker) of an epoch's first geometry reads: its shards' samples through
    a shuffle buffer seeded with (seed, epoch, rank, worker); a fixed sequence, which any worker can replay;
  - ``Span``: samples [start, stop) of one sample stream;
  - ``Piece``: what one loader worker reads in a segment: spans, cut into a number of batches;
  - ``EpochPlan``: the shards of an epoch's sample streams, and each (rank, loader worker)'s piece of them in the
    current geometry (``plan_epoch``: in the first; ``plan_last_segment``: remapped to the last segment's);
  - ``Segment``: a stretch of an epoch read under one geometry (ranks, loader workers, micro-batch, length grouping
    K), with the batches every rank consumed in it;
  - ``LoaderState``: one rank's position, which checkpoints store.

How an epoch is laid out (every rank computes the same plan from the manifest, no communication):
  1. the shard list is shuffled with ``seed + epoch``;
  2. shard i goes to slot i mod (ranks × loader_workers); slot s is loader worker s // ranks of rank
     s mod ranks, so each rank gets whole shards and no shard is read twice;
  3. each loader worker reads its shards as one sample stream, cut into micro-batches (a trailing partial
     batch is dropped);
  4. every rank stops after the same number of batches: the minimum over ranks of what its
     workers can produce. Equal counts are what keeps collectives from hanging at epoch end.

Position (``LoaderState``, plain ints, lists and dicts, stored in checkpoints): the epoch; its
*segments*, one per geometry (ranks, loader workers, micro-batch, K) the epoch was read under, each with
the batches every rank consumed in it; the shuffle buffer of the epoch's streams; and, for this rank
in the current segment, the batches each loader worker handed out and whose turn is next
(``DataLoader`` takes batches from its workers round-robin).

Elastic resume (a state saved under another geometry): the same epoch continues. A stream of the
epoch's first geometry is a fixed sample sequence, and the saved position says how much of each was
consumed (``round_robin_position`` over the batches every rank consumed; with length grouping a
window a worker had begun counts as consumed whole, so a resume mid-window leaves out at most K − 1
of that worker's batches for the rest of the epoch rather than reading any sample twice). What is left of every
stream, tails the equal-count rule would have dropped included, is concatenated in (rank, worker)
order, N samples, and cut into B = ⌊N / (ranks × micro_batch)⌋ batches per new rank, dealt to its
workers as evenly as possible in contiguous spans (a worker replays a stream's shuffle to reach its
span). So no sample consumed before the checkpoint is read again in the epoch, and of the N only
N − B × ranks × micro_batch < ranks × micro_batch go unread; those stay in the state, so a further
change of geometry within the epoch deals them too. Later epochs use the new geometry's plan.
Every new rank may be given any old rank's state: in ``error`` mode they agree on all the elastic
resume reads. With ``skip`` it assumes that every old worker yielded its planned batches, so after
data was skipped in that epoch a few samples may be read twice or not at all.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from clsys.shards.reader import Shard


@dataclass(frozen=True)
class Span:
    """Samples [start, stop) of the sample stream of (rank, worker) in the epoch's first geometry."""

    rank: int
    worker: int
    start: int
    stop: int


@dataclass(frozen=True)
class Piece:
    """What one loader worker reads in a segment: spans of sample streams, cut into ``batches`` batches. The samples
    past them (a stream's tail short of a batch; in the last worker's piece after a remapping, all that no new
    batch holds, which can be more than a batch) are left for a later change of geometry: hence a count, not one
    derived from the spans."""

    spans: list[Span]
    batches: int


@dataclass(frozen=True)
class EpochPlan:
    """What each (rank, loader worker) reads in one epoch: the shards of the first geometry's sample streams, and each
    (rank, worker) of the current geometry's piece of them."""

    shards: list[list[list[Shard]]]  # [rank][worker] of the first geometry -> the shards of its stream
    pieces: list[list[Piece]]  # [rank][worker] of the current geometry

    @property
    def batches_per_rank(self) -> int:
        return min(sum(piece.batches for piece in row) for row in self.pieces)

    def worker_batches(self, rank: int) -> list[int]:
        return [piece.batches for piece in self.pieces[rank]]


def plan_epoch(shards: list[Shard], epoch: int, seed: int, ranks: int, workers: int, micro_batch: int) -> EpochPlan:
    """The epoch's plan in its first geometry: each (rank, worker) reads its own stream whole."""
    slots = ranks * workers
    if len(shards) < slots:
        raise ValueError(f"too few shards: {len(shards)} shard(s) for {ranks} rank(s) × {workers} loader worker(s) "
                         f"= {slots} readers; write smaller shards (data_prep --shard-size-mb) or use fewer workers")
    order = list(shards)
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    table = [[[] for _ in range(workers)] for _ in range(ranks)]
    for i, shard in enumerate(order):
        slot = i % slots
        table[slot % ranks][slot // ranks].append(shard)
    samples = [[sum(s.samples for s in stream) for stream in row] for row in table]
    plan = EpochPlan(table, [[Piece([Span(r, w, 0, n)], n // micro_batch) for w, n in enumerate(row)]
                             for r, row in enumerate(samples)])
    if plan.batches_per_rank == 0:
        raise ValueError(f"a rank would get no batch of {micro_batch} samples in epoch {epoch}: "
                         f"samples per rank {[sum(row) for row in samples]}")
    return plan


def round_robin_position(worker_batches: list[int], consumed: int) -> tuple[list[int], int]:
    """After the DataLoader has handed out ``consumed`` batches: how many each worker produced, and
    which worker is next in turn. DataLoader asks workers in turn and skips exhausted ones."""
    produced, turn = [0] * len(worker_batches), 0
    while consumed > 0:
        if produced[turn] < worker_batches[turn]:
            produced[turn] += 1
            consumed -= 1
        turn = (turn + 1) % len(worker_batches)
    return produced, turn


@dataclass
class Segment:
    """A stretch of an epoch read under one geometry."""

    ranks: int
    workers: int  # loader workers per rank
    micro_batch: int
    batches: int = 0  # batches every rank consumed in it
    length_group: int = 0  # K > 0: each window of K batches was regrouped by length (0: read in order)

    def geometry(self) -> tuple[int, int, int, int]:
        return self.ranks, self.workers, self.micro_batch, self.length_group

    def consumed_batches(self, produced: int, planned: int) -> int:
        """How many of a worker's ``planned`` batches' samples are used up once it has handed out
        ``produced`` batches: with length grouping, a window that has begun counts whole."""
        window = max(self.length_group, 1)
        return min(-(-produced // window) * window, planned)


@dataclass
class LoaderState:
    """Where one rank stands; ``asdict`` of it is plain ints and lists, as checkpoints store it."""

    epoch: int
    shuffle_buffer: int  # the epoch's streams are shuffled with it, whatever the loader is given later
    segments: list[Segment]  # the epoch so far, one per geometry; the last one is being read
    rank: int
    produced: list[int]  # batches each loader worker of this rank handed out in the last segment
    next_worker: int = 0  # whose turn it is

    @classmethod
    def from_dict(cls, state: dict) -> LoaderState:
        return cls(**{**state, "segments": [Segment(**s) for s in state["segments"]]})


def _split(spans: list[Span], n: int) -> tuple[list[Span], list[Span]]:
    """The first ``n`` samples of a list of spans, and the rest."""
    head, rest = [], list(spans)
    while n > 0 and rest:
        span = rest.pop(0)
        cut = min(span.stop, span.start + n)
        head.append(replace(span, stop=cut))
        if cut < span.stop:
            rest.insert(0, replace(span, start=cut))
        n -= cut - span.start
    return head, rest


def _remap(pieces: list[list[Piece]], old: Segment, new: Segment) -> list[list[Piece]]:
    """Deal what the ranks of ``old`` left unread, after ``old.batches`` batches each, to the ranks and
    workers of ``new``: equal batch counts per rank, contiguous spans per worker."""
    rest: list[Span] = []
    for row in pieces:
        produced, _ = round_robin_position([p.batches for p in row], old.batches)
        for piece, n in zip(row, produced):
            rest += _split(piece.spans, old.consumed_batches(n, piece.batches) * old.micro_batch)[1]
    per_rank = sum(s.stop - s.start for s in rest) // new.micro_batch // new.ranks
    remapped = []
    for _ in range(new.ranks):
        row = []
        for worker in range(new.workers):
            batches = per_rank // new.workers + (worker < per_rank % new.workers)
            spans, rest = _split(rest, batches * new.micro_batch)
            row.append(Piece(spans, batches))
        remapped.append(row)
    # Fewer than ranks × micro_batch samples fit no batch: the last worker keeps them unread, so that
    # another change of geometry in this epoch deals them again.
    last = remapped[-1][-1]
    remapped[-1][-1] = Piece(last.spans + rest, last.batches)
    return remapped


def plan_last_segment(shards: list[Shard], epoch: int, seed: int, segments: list[Segment]) -> EpochPlan:
    """The plan of an epoch as the last of ``segments`` reads it: the first geometry's plan, its pieces remapped at
    each change of geometry."""
    first = segments[0]
    plan = plan_epoch(shards, epoch, seed, first.ranks, first.workers, first.micro_batch)
    pieces = plan.pieces
    for old, new in zip(segments, segments[1:]):
        pieces = _remap(pieces, old, new)
    return replace(plan, pieces=pieces)
