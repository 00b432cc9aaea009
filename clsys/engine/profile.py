"""Where a training step's time goes (``train.profile``), logged as ``perf/time_<phase>_s`` per step.

The loop marks the end of each phase of a micro-step: waiting for the loader, the forward and
backward passes, the optimizer step. Collectives (the gradient reduction of ZeRO, the embedding
gathers of in-batch negatives) are timed one by one and counted as ``communication``, not in the
phase they ran in. What is left of a logging interval (metrics, TensorBoard,
evaluation, checkpoints) is ``other`` (``clsys.metrics.health.Throughput``).

On a GPU every mark and every collective first synchronises the device, so each phase is charged
for its own kernels; that costs some overlap, which is why profiling is off by default. On a CPU
the work is done when the call returns, and a "host sync" costs nothing by construction.
"""
from __future__ import annotations

import collections
import functools
import time

import torch
import torch.distributed as dist

# The torch.distributed calls DeepSpeed's communication backend and clsys's gathers go through.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "reduce", "broadcast", "all_to_all_single")


class StepClock:
    def __init__(self, device: torch.device, profile: bool):
        self.profile = profile
        self.cuda = device.type == "cuda"
        self.phases: collections.Counter = collections.Counter()
        self.communication = 0.0  # seconds inside collectives so far
        self.originals = {}
        if profile:
            self._time_collectives()
        self.start()

    def _sync(self) -> None:
        if self.profile and self.cuda:
            torch.cuda.synchronize()

    def start(self) -> None:
        """A micro-step begins: nothing before this point is charged to a phase."""
        self._sync()
        self.last, self.communication_mark = time.perf_counter(), self.communication

    def lap(self, phase: str) -> None:
        """Charge the time since the last mark to ``phase`` (collectives to ``communication``)."""
        self._sync()
        now = time.perf_counter()
        communication = self.communication - self.communication_mark
        elapsed = now - self.last - communication
        self.phases[phase] += elapsed
        self.phases["communication"] += communication
        self.last, self.communication_mark = now, self.communication

    def take(self) -> dict[str, float]:
        """The seconds per phase since the last ``take``."""
        out = dict(self.phases)
        self.phases.clear()
        return out

    def _time_collectives(self) -> None:
        for name in COLLECTIVES:
            original = self.originals[name] = getattr(dist, name)

            @functools.wraps(original)
            def timed(*args, _original=original, **kwargs):
                self._sync()
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self._sync()
                    self.communication += time.perf_counter() - start

            setattr(dist, name, timed)

    def close(self) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)
        self.originals.clear()
