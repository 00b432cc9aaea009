"""Training health in TensorBoard (written by rank 0 only): loss, lr, grad norm, throughput,
loader wait, alignment/uniformity and evaluation scores."""
from __future__ import annotations

import time

import torch


class Throughput:
    """Counts samples, tokens and time spent waiting for the loader between two log points."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.samples = self.tokens = 0
        self.wait = 0.0
        self.steps = 0

    def add(self, samples: int, tokens: torch.Tensor, wait: float) -> None:
        # ``tokens`` stays a tensor: summing on the host each step would force a sync.
        self.samples += samples
        self.tokens = self.tokens + tokens
        self.wait += wait
        self.steps += 1

    def rates(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        out = {"samples_per_s": self.samples / elapsed, "tokens_per_s": float(self.tokens) / elapsed,
               "loader_wait_fraction": self.wait / elapsed, "step_time_s": elapsed / max(self.steps, 1)}
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
