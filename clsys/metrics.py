"""Training health in TensorBoard (written by rank 0 only): loss, lr, grad norm, throughput,
loader wait, alignment/uniformity and evaluation scores."""
from __future__ import annotations

import time

import torch


class Throughput:
    """Counts samples, tokens, and time by phase (``clsys.engine.profile.StepClock``) between two log points."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.samples = self.tokens = 0
        self.phases: dict[str, float] = {}
        self.steps = 0

    def add(self, samples: int, tokens: torch.Tensor, phases: dict[str, float]) -> None:
        # ``tokens`` stays a tensor: summing on the host each step would force a sync.
        self.samples += samples
        self.tokens = self.tokens + tokens
        for phase, seconds in phases.items():
            self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        self.steps += 1

    def rates(self, phases: bool = False) -> dict[str, float]:
        """Rates since the last call; with ``phases``, also seconds per step by phase, and ``other``: the
        rest of the interval (metrics, logging, evaluation, checkpoints)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        steps = max(self.steps, 1)
        out = {"samples_per_s": self.samples / elapsed, "tokens_per_s": float(self.tokens) / elapsed,
               "loader_wait_fraction": self.phases.get("loader_wait", 0.0) / elapsed, "step_time_s": elapsed / steps}
        if phases:
            out.update({f"time_{phase}_s": seconds / steps for phase, seconds in self.phases.items()})
            out["time_other_s"] = (elapsed - sum(self.phases.values())) / steps
        self.reset()
        return out


class TensorBoard:
    """A SummaryWriter on rank 0; a no-op elsewhere so callers need no rank checks."""

    def __init__(self, logdir: str | None):
        self.writer = None
        if logdir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(logdir)

    def scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(f"{prefix}/{name}", float(value), step)

    def image(self, tag: str, png: bytes, step: int) -> None:
        if self.writer is None:
            return
        import io

        import numpy as np
        from PIL import Image

        self.writer.add_image(tag, np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), step, dataformats="HWC")

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
