"""Best-checkpoint selection (eval.select) with a real DeepSpeed engine writing real checkpoints (CPU,
gloo, one rank): which checkpoint best.json names, which ones keep-last-k leaves, what a restart reads
back. The scores are scripted, so every case is reached; tests/test_pretrain.py checks the same
choice end to end on the dev scores of a real run."""
from __future__ import annotations

import math
import os

import pytest
import torch.multiprocessing as mp

from tests.conftest import free_port

METRIC = "stsb-en-dev_spearman"


def _scripted_run(rank: int, port: int, tiny: str, run: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1", DS_ACCELERATOR="cpu")
    from clsys.config import ConfigError
    from clsys.recipes import OBJECTIVES, load_config
    from clsys.engine import checkpoint
    from clsys.engine.checkpoint_writer import CheckpointWriter
    from clsys.engine.deepspeed import build_engine, init_distributed
    from clsys.engine.selection import BestTracker, read_best
    from clsys.model.encoder import load_tokenizer

    init_distributed()
    cfg = load_config(None, ["objective.name=simcse", f"model.name={tiny}", "model.init=scratch",
                             "model.tokenizer=all-MiniLM-L6-v2", "cluster.num_workers=1", "train.batch_size=8",
                             "train.zero_stage=2"])
    engine = build_engine(OBJECTIVES["simcse"](cfg, load_tokenizer(cfg.model.tokenizer)), cfg)
    writer = CheckpointWriter(engine, run, keep=1)

    def steps(tracker: BestTracker, scores: dict[int, float]) -> list[list[int]]:
        """The loop's order: evaluate, checkpoint in the background (every step here, keep 1), with a new best
        tracked at once and written to best.json once its checkpoint is complete."""
        kept = []
        for step, value in scores.items():
            protect = tracker.protected
            record = tracker.record(step, value, checkpoint.step_url(run, step)) \
                if tracker.improves({METRIC: value}, step) else None
            writer.save(step, {}, {"world_size": 1}, lambda folder: None, protect,
                        on_complete=(lambda url, record=record: tracker.write(record)) if record else None)
            writer.wait()
            kept.append([s for s, _ in checkpoint.complete_checkpoints(run)])
        return kept

    tracker = BestTracker(run, METRIC, "max", keep=1)
    out["step0"] = tracker.improves({METRIC: 99.0}, 0)  # the starting model is never a candidate
    out["kept"] = steps(tracker, {1: 50.0, 2: 60.0, 3: 55.0, 4: math.nan, 5: 60.0})
    out["best"] = vars(read_best(run))
    # A restart reads the record back and goes on comparing with it.
    restarted = BestTracker(run, METRIC, "max", keep=1)
    out["restarted_best_step"] = restarted.best.step
    out["kept_after_restart"] = steps(restarted, {6: 59.0, 7: 61.5})
    out["final_best"] = vars(read_best(run))
    # Another metric or mode is not comparable with the record: it starts over.
    out["other_mode_best"] = BestTracker(run, METRIC, "min", keep=1).best
    try:
        tracker.improves({"xquad_en-de_mrr@10": 1.0}, 8)
    except ConfigError as err:
        out["missing"] = str(err)


def test_best_checkpoint_survives_keep_last_and_restarts(tiny, tmp_path):
    out = mp.Manager().dict()
    run = f"file://{tmp_path}/run"
    mp.spawn(_scripted_run, args=(free_port(), tiny, run, out), nprocs=1, join=True)
    assert out["step0"] is False
    # keep 1: only the newest, plus the best (step 2) while it is the best; a NaN and a tie do not replace it.
    assert out["kept"] == [[1], [2], [2, 3], [2, 4], [2, 5]]
    assert (out["best"]["step"], out["best"]["value"], out["best"]["metric"], out["best"]["mode"]) == (2, 60.0, METRIC, "max")
    assert out["best"]["checkpoint"] == f"{run}/checkpoints/step-00000002"
    assert out["restarted_best_step"] == 2
    # Step 7 beats it: the superseded best (step 2) is deleted once the new record is written.
    assert out["kept_after_restart"] == [[2, 6], [7]]
    assert (out["final_best"]["step"], out["final_best"]["value"]) == (7, 61.5)
    assert out["other_mode_best"] is None
    assert f"eval.select: {METRIC} is not a metric this run evaluates (xquad_en-de_mrr@10;" in out["missing"]


@pytest.mark.parametrize("overrides, message", [
    (["eval.select_mode=biggest"], "eval.select_mode: expected max or min"),
    (["eval.sts_dev=", "eval.select=xquad_en-de_mrr@10"], "eval.select: expected '' or sts_dev when nothing"),
    (["eval.select=retrieval_dev"], "eval.select: expected retrieval_dev only with eval.retrieval_dev set"),
])
def test_selection_config_errors(overrides, message):
    from clsys.config import ConfigError
    from clsys.recipes import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
