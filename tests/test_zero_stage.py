"""``train.zero_stage: auto`` (the default): stage 0 while every rank can hold the whole training state, else 2,
the same on every rank, and a resumed run keeps the stage its checkpoint was written with.

The elastic-resume test in tests/test_fault_tolerance.py resumes real ZeRO-2 and ZeRO-3 checkpoints with
``auto``; the quickstart's end-to-end run in tests/test_pretrain.py checks what its checkpoint records.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from clsys.config import ConfigError
from clsys.engine.deepspeed import STATE_BYTES_PER_PARAMETER, ds_config, rank_memory_bytes, resolve_zero_stage
from clsys.recipes import load_config
from tests.conftest import free_port


def _model(parameters: int) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(parameters // 2, 1, bias=False),
                                torch.nn.Linear(parameters // 2, 1, bias=False))
    model[1].weight.requires_grad_(False)  # frozen (a teacher): its own 4 bytes, no gradient or AdamW state
    return model


def _share_below(need_bytes: int) -> str:
    """A LOCAL_WORLD_SIZE that leaves each rank of this machine less than ``need_bytes`` in its share."""
    return str(int(rank_memory_bytes(use_gpu=False) * 0.5 / need_bytes) + 1)


def test_auto_is_stage_0_where_the_whole_state_fits_and_2_where_it_does_not(monkeypatch):
    model = _model(1000)  # 500 trainable (16 bytes each), 500 frozen (4 bytes each)
    need = 500 * STATE_BYTES_PER_PARAMETER + 500 * 4
    auto = load_config(None, ["train.zero_stage=auto"])
    assert load_config(None, []).train.zero_stage == "auto"  # the default; every recipe leaves it so
    assert load_config("simcse_unsup", []).train.zero_stage == "auto"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert resolve_zero_stage(auto, model, None).train.zero_stage == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", _share_below(need))
    assert resolve_zero_stage(auto, model, None).train.zero_stage == 2
    # Just enough: frozen parameters count at their own size, not at the trainable ones' 16 bytes.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", _share_below(need + 1))
    assert resolve_zero_stage(auto, model, None).train.zero_stage == 0
    assert auto.train.zero_stage == "auto"  # a resolved copy; the run's own config is untouched


def test_a_resumed_run_keeps_its_checkpoints_stage_and_a_stage_given_is_kept(monkeypatch):
    """A checkpoint's files are laid out for the stage that wrote it (ZeRO's optimizer partitions, or stage 0's
    whole state in one file): ``auto`` follows it whatever this machine would choose now."""
    model = _model(1000)
    auto = load_config(None, ["train.zero_stage=auto"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # stage 0 fits
    assert resolve_zero_stage(auto, model, 2).train.zero_stage == 2
    assert resolve_zero_stage(auto, model, 3).train.zero_stage == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", _share_below(100))  # nothing fits
    assert resolve_zero_stage(auto, model, 0).train.zero_stage == 0
    given = load_config(None, ["train.zero_stage=1"])
    assert resolve_zero_stage(given, model, None) is given and resolve_zero_stage(given, model, 3) is given


def test_the_engine_config_refuses_a_stage_left_auto():
    with pytest.raises(ValueError, match="train.zero_stage: auto is made a stage"):
        ds_config(load_config(None, []))
    assert ds_config(load_config(None, ["train.zero_stage=2"]))["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("value, message", [
    ("4", "train.zero_stage: expected 0, 1, 2, 3 or auto, got '4'"),
    ("Auto", "train.zero_stage: expected 0, 1, 2, 3 or auto, got 'Auto'"),
    ("2.5", "train.zero_stage: expected 0, 1, 2, 3 or auto, got '2.5'"),
    ("true", "train.zero_stage: expected 0, 1, 2, 3 or auto, got 'true'"),
])
def test_a_stage_outside_the_set_is_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"train.zero_stage={value}"])
    assert load_config(None, ["train.zero_stage=2"]).train.zero_stage == 2  # an int, as DeepSpeed wants it


def _agree(rank: int, port: int, small_share: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu",
                      LOCAL_WORLD_SIZE="1" if rank == 0 else small_share)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out[rank] = resolve_zero_stage(load_config(None, ["train.zero_stage=auto"]), _model(1000), None).train.zero_stage
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_on_different_hardware_agree_on_the_larger_stage():
    """Rank 0's share holds the whole state, rank 1's does not: both must build the same engine (ZeRO-2), or the
    first collective hangs."""
    out = mp.Manager().dict()
    mp.spawn(_agree, args=(free_port(), _share_below(100), out), nprocs=2, join=True)
    assert dict(out) == {0: 2, 1: 2}
