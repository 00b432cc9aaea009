"""Best-checkpoint selection (``eval.select``): the run's checkpoint that scored best on a dev metric.

SimCSE keeps the checkpoint with the best STS-B dev score, not the last one (docs/training/objectives.md#selection).
Here every evaluation that improves on the best so far is saved as a checkpoint at that step (a
step that is not a ``train.ckpt_every`` multiple gets one too), and ``<run>/best.json`` names it.
keep-last-k never deletes the checkpoint best.json names; a superseded best is deleted once it is
neither the best nor one of the last k. The record is written after its checkpoint is complete, so
it always names a complete checkpoint, and a restarted run reads it back and goes on comparing
with it. Step 0 (the starting model) is evaluated and logged, but is not a candidate: it has no
checkpoint, and an export should hold trained weights.
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from clsys import storage
from clsys.config import Config, ConfigError
from clsys.engine import checkpoint

BEST_RECORD = "best.json"
STS_DEV = "sts_dev"  # eval.select's alias for the dev STS set's Spearman, whatever the set is called
RETRIEVAL_DEV = "retrieval_dev"  # eval.select's alias for the eval.retrieval_dev set's nDCG@10, likewise


@dataclass
class BestCheckpoint:
    metric: str
    mode: str  # max or min
    value: float
    step: int
    checkpoint: str  # the step folder's URL


def selected_metric(cfg: Config, dev_set_name: str | None, retrieval_set_name: str | None = None) -> str | None:
    """The metric eval.select names, as the evaluation logs it (the dev STS set's is ``<name>_spearman``, the
    retrieval dev set's ``<name>_ndcg@10``); None when selection is off."""
    if cfg.eval.select == RETRIEVAL_DEV:  # the config check makes sure eval.retrieval_dev is set
        return f"{retrieval_set_name}_ndcg@10"
    if cfg.eval.select != STS_DEV:
        return cfg.eval.select or None
    return f"{dev_set_name}_spearman" if dev_set_name else None


def read_best(run_url: str) -> BestCheckpoint | None:
    record = storage.join(run_url, BEST_RECORD)
    return BestCheckpoint(**storage.read_json(record)) if storage.exists(record) else None


def best_weights(run_url: str) -> dict[str, torch.Tensor]:
    """The fp32 weights (buffers included) of the objective in the run's best checkpoint."""
    best = read_best(run_url)
    if best is None:
        raise FileNotFoundError(f"{run_url}: no best checkpoint recorded ({BEST_RECORD})")
    with tempfile.TemporaryDirectory(prefix="clsys-best-") as local:
        storage.download_dir(best.checkpoint, local)
        return checkpoint.checkpoint_weights(local, best.checkpoint)


class BestTracker:
    """Collective where noted: every rank holds one and makes the same decisions (rank 0's)."""

    def __init__(self, run_url: str, metric: str, mode: str, keep: int):
        self.run_url, self.metric, self.mode, self.keep = run_url, metric, mode, keep
        best = read_best(run_url)
        # A record for another metric (the config changed between restarts) is not comparable: start over.
        self.best = best if best is not None and (best.metric, best.mode) == (metric, mode) else None

    @property
    def protected(self) -> str | None:
        """The step folder keep-last-k must not delete."""
        return self.best.checkpoint if self.best else None

    def improves(self, scores: dict[str, float], step: int) -> bool:
        """Collective: whether this evaluation beats the best so far (rank 0 decides, all ranks follow)."""
        if step == 0:
            return False
        if self.metric not in scores:
            raise ConfigError(f"eval.select: {self.metric} is not a metric this run evaluates "
                              f"({', '.join(sorted(scores)) or 'none'}; or set eval.select: '' to keep the "
                              f"last checkpoint)")
        value = scores[self.metric]
        better = not math.isnan(value) and (self.best is None or (value > self.best.value if self.mode == "max"
                                                                   else value < self.best.value))
        decision = [better]
        dist.broadcast_object_list(decision, src=0)
        return decision[0]

    def record(self, step: int, value: float, url: str) -> BestCheckpoint:
        """The checkpoint at ``url``, being written now, is the best from here on (every rank tracks it);
        ``write`` records it once the checkpoint is complete."""
        self.best = BestCheckpoint(self.metric, self.mode, value, step, url)
        return self.best

    def write(self, best: BestCheckpoint) -> None:
        """Rank 0, once ``best``'s checkpoint is complete: name it in best.json; the superseded best,
        unprotected now, goes by the keep-last-k rule like any other."""
        storage.write_json(storage.join(self.run_url, BEST_RECORD), asdict(best))
        checkpoint.prune(self.run_url, self.keep, protect=best.checkpoint)
