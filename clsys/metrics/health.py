"""Training health in TensorBoard (written by rank 0 only): loss, lr, grad norm, throughput,
loader wait, model FLOP/s and MFU, alignment/uniformity and evaluation scores, steps and loss per data source;
the run's config (text and hparams panels); a collapse alarm."""
from __future__ import annotations

import time

import torch

from clsys import storage

# Peak dense bf16 tensor-core TFLOP/s per device, by a substring of torch.cuda.get_device_name(); the
# first match wins, so more specific names come first. From NVIDIA's data sheets (without sparsity).
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4),
                    ("A100", 312.0), ("L40S", 362.1), ("L4", 121.0), ("A10G", 70.0))


def peak_tflops(configured: float, use_gpu: bool, precision: str) -> float:
    """The per-device peak that perf/mfu divides by: ``train.peak_tflops`` when set, else the data-sheet
    bf16 figure of a known GPU when the step computes in bf16; 0 (no MFU) otherwise."""
    if configured:
        return configured
    if not (use_gpu and precision in ("bf16", "bf16_weights") and torch.cuda.is_available()):
        return 0.0
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), 0.0)


def encoder_train_flops(config, attention_mask: torch.Tensor) -> torch.Tensor:
    """Model FLOPs of one forward + backward of a BERT-style encoder over a batch's rows (the batch's
    ``attention_mask``: one row a sequence, padding not counted), counted the usual way for MFU: 2 FLOPs a
    multiply-add, the backward twice the forward. Per layer and token: Q, K, V and output projections
    (4·d²) and the feed-forward (2·d·d_ff) multiply-adds; per layer and row of n tokens: QKᵀ and the
    weighted sum of values (2·n²·d). Embedding lookups and heads are left out (a few % of a layer)."""
    lengths = attention_mask.sum(-1).to(torch.float64)
    d, layers, ff = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    macs = layers * ((4 * d * d + 2 * d * ff) * lengths.sum() + 2 * d * (lengths * lengths).sum())
    return 3 * 2 * macs


def batch_work(encoder_config, attention_masks: list[torch.Tensor]) -> tuple[torch.Tensor | int, torch.Tensor | int]:
    """Tokens and model FLOPs (``encoder_train_flops``, from each 2-D mask; 0 for an encoder without
    BERT's config fields) of one batch, as device tensors: no host sync."""
    tokens = sum(mask.sum() for mask in attention_masks)
    if not all(hasattr(encoder_config, a) for a in ("hidden_size", "num_hidden_layers", "intermediate_size")):
        return tokens, 0
    return tokens, sum(encoder_train_flops(encoder_config, m) for m in attention_masks if m.dim() == 2)


class Throughput:
    """Counts samples, tokens, model FLOPs and time by phase (``clsys.engine.profile.StepClock``) of one
    rank between two log points."""

    def __init__(self, peak_tflops: float = 0.0):
        self.peak_tflops = peak_tflops
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.samples = self.tokens = self.flops = 0
        self.phases: dict[str, float] = {}
        self.steps = 0

    def add(self, samples: int, tokens: torch.Tensor, phases: dict[str, float], flops: torch.Tensor | float = 0) -> None:
        # ``tokens`` and ``flops`` stay tensors: summing on the host each step would force a sync.
        self.samples += samples
        self.tokens = self.tokens + tokens
        self.flops = self.flops + flops
        for phase, seconds in phases.items():
            self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        self.steps += 1

    def rates(self, phases: bool = False) -> dict[str, float]:
        """This rank's rates since the last call (``*_per_device``: the rank's own, which callers keep
        when they scale the others by the world size); model TFLOP/s and, given a peak, MFU; with
        ``phases``, also seconds per step by phase, and ``other``: the rest of the interval (metrics,
        logging, evaluation, checkpoints)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        steps = max(self.steps, 1)
        tokens_per_s = float(self.tokens) / elapsed
        out = {"samples_per_s": self.samples / elapsed, "tokens_per_s": tokens_per_s,
               "tokens_per_s_per_device": tokens_per_s,
               "loader_wait_fraction": self.phases.get("loader_wait", 0.0) / elapsed, "step_time_s": elapsed / steps}
        if self.flops:
            out["model_tflops_per_device"] = float(self.flops) / elapsed / 1e12
            if self.peak_tflops:
                out["mfu"] = out["model_tflops_per_device"] / self.peak_tflops
        if phases:
            out.update({f"time_{phase}_s": seconds / steps for phase, seconds in self.phases.items()})
            out["time_other_s"] = (elapsed - sum(self.phases.values())) / steps
        self.reset()
        return out


class SourceMeter:
    """Per source (the ``source`` a batch of several streams carries, ``clsys.data.mixing``): how many optimizer
    steps drew it so far (its micro-batches / ``micro_steps``: in ``data.source_batches: same`` the steps that drew
    it, in ``mixed`` their share of the steps) and the mean loss of its micro-batches since the last log point.

    A trainer part: the counts are saved in checkpoints, so they go on after a resume. Losses are summed as
    tensors, on their device: reading each on the host would wait for the step."""

    def __init__(self, micro_steps: int):
        self.micro_steps = micro_steps
        self.batches: dict[str, int] = {}  # micro-batches of each source, the whole run
        self.losses: dict[str, tuple[torch.Tensor, int]] = {}  # since the last log point: sum and count

    def add(self, source: str, loss: torch.Tensor) -> None:
        self.batches[source] = self.batches.get(source, 0) + 1
        total, count = self.losses.get(source, (0.0, 0))
        self.losses[source] = (total + loss.detach().float(), count + 1)

    def take(self) -> dict[str, float]:
        """``<source>/steps`` of every source drawn so far and ``<source>/loss`` of those drawn since the last
        call; starts the next window."""
        out = {f"{source}/steps": n / self.micro_steps for source, n in sorted(self.batches.items())}
        out.update({f"{source}/loss": float(total) / count for source, (total, count) in sorted(self.losses.items())})
        self.losses = {}
        return out

    def state_dict(self) -> dict:
        return {"batches": dict(self.batches)}

    def load_state_dict(self, state: dict) -> None:
        self.batches = dict(state["batches"])


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

    def config(self, cfg, metric: str | None) -> None:
        """The run's resolved config: as YAML in the Text panel, and its scalar keys in the HParams panel,
        with ``metric`` (an ``eval/...`` tag this run logs) as the column to compare runs by. Event files
        are shared and uploaded: the config's URLs go in without their secrets."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        self.writer.add_text("config", "```yaml\n" + storage.redact(cfg.to_yaml()) + "```", 0)

        def flat(values: dict, prefix: str = "") -> dict:
            out = {}
            for key, value in values.items():
                if isinstance(value, dict):
                    out.update(flat(value, f"{prefix}{key}."))
                elif isinstance(value, (bool, int, float, str)):
                    out[f"{prefix}{key}"] = value
            return out

        # hparams() only, not SummaryWriter.add_hparams, which opens a second run folder for the panel.
        metrics = {f"eval/{metric}": float("nan")} if metric else {}
        for summary in hparams(flat(storage.redact_values(cfg.to_dict())), metrics):
            self.writer.file_writer.add_summary(summary)

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


def collapsed(metrics: dict[str, float], threshold: float) -> bool:
    """Whether the embeddings are collapsing: uniformity (log E exp(−2‖u−v‖²) over distinct rows, 0 when
    every embedding is the same point) above ``threshold``; ``threshold`` 0 turns the check off."""
    return threshold < 0 and metrics.get("uniformity", float("-inf")) > threshold


def duration(seconds: float) -> str:
    """A console duration: 45s, 3m12s, 1h02m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
