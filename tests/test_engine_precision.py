"""The step's precision modes and ``train.compile`` on real DeepSpeed engines (CPU, gloo, one rank).

- ``train.precision: bf16``: DeepSpeed's torch autocast: the encoder computes in bf16 while weights,
  gradients and AdamW stay fp32 (the bf16 mode meant for GPUs), the gradients of nn.Linear layers
  reduced across ranks in bf16 unless ``deepspeed.torch_autocast.lower_precision_safe_modules: []``;
- ``bf16_weights``: DeepSpeed's bf16 mode, the weights themselves in bf16;
- ``fp32``: everything fp32; ``auto``: bf16 where the CPU has bf16 matrix units (AVX512-BF16, AMX), else fp32;
- ``train.compile: true``: the Hugging Face encoder runs through torch.compile (inductor, CPU here) and
  gives the eager step's loss and weights.
Each case runs in a spawned process with its own process group, so nothing leaks into pytest's.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import free_port

SENTENCES = ["A cat sits on the mat.", "Stocks fell sharply on Monday.", "The river floods every spring.",
             "She plays the violin.", "Rain is expected tomorrow.", "He fixed the old bicycle.",
             "The museum opens at nine.", "Bread rises in a warm kitchen."]


def _step(rank: int, port: int, tiny: str, overrides: list[str], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1", DS_ACCELERATOR="cpu")
    from clsys.recipes import OBJECTIVES, load_config
    from clsys.engine.deepspeed import build_engine, init_distributed
    from clsys.model.encoder import load_tokenizer

    init_distributed()
    cfg = load_config(None, ["objective.name=simcse", f"model.name={tiny}", "model.init=scratch",
                             "model.tokenizer=all-MiniLM-L6-v2", "model.dropout=0", "cluster.num_workers=1",
                             "train.batch_size=8", "train.zero_stage=2", "optim.lr=1e-3", *overrides])
    torch.manual_seed(0)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    objective = OBJECTIVES["simcse"](cfg, tokenizer)
    before = {k: v.detach().float().clone() for k, v in objective.model.state_dict().items()}
    hidden_dtypes = []
    objective.model.encoder.layer[0].output.dense.register_forward_hook(
        lambda module, args, output: hidden_dtypes.append(output.dtype))
    engine = build_engine(objective, cfg)
    engine.train()
    batch = objective.collate([{"txt": s} for s in SENTENCES])
    losses = []
    for _ in range(2):
        loss = engine(batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    after = {k: v.detach().float() for k, v in objective.model.state_dict().items()}
    from deepspeed.runtime import torch_autocast
    from deepspeed.runtime.zero import stage_1_and_2

    grad_norm = engine.get_global_grad_norm()  # None where nothing clips (optim.grad_clip=0, stage 0)
    out.update(losses=losses, param_dtypes={str(p.dtype) for p in objective.model.parameters()},
               norm_dtype=str(stage_1_and_2.get_norm_dtype()), grad_norm=None if grad_norm is None else float(grad_norm),
               hidden_dtypes={str(d) for d in hidden_dtypes},
               changed=sum(not torch.equal(before[k], after[k]) for k in before),
               compiled=getattr(objective.model, "_compiled_call_impl", None) is not None,
               zero_stage=engine.zero_optimization_stage(), reduce_bucket_size=engine.zero_reduce_bucket_size(),
               allgather_bucket_size=engine.zero_allgather_bucket_size(),
               weights={k: v for k, v in after.items() if k.endswith("query.weight")},
               # The dtype each gradient is reduced across ranks in (DeepSpeed's autocast tags parameters).
               grad_reduce_dtypes={str(torch_autocast.get_comm_dtype(p)) for p in objective.model.parameters()})


def run_step(tiny: str, *overrides: str) -> dict:
    out = mp.Manager().dict()
    mp.spawn(_step, args=(free_port(), tiny, list(overrides), out), nprocs=1, join=True)
    return dict(out)


@pytest.fixture(scope="module")
def fp32_step(tiny) -> dict:
    return run_step(tiny, "train.precision=fp32")


def bf16_units() -> bool:
    from clsys.engine.deepspeed import bf16_matmul_units

    return bf16_matmul_units(use_gpu=False)


BF16_LINEAR = {"torch.bfloat16", "torch.float32"}  # nn.Linear gradients reduced in bf16, the rest in fp32


@pytest.mark.parametrize("precision, params, compute, reduce", [
    ("fp32", {"torch.float32"}, {"torch.float32"}, {"torch.float32"}),
    ("bf16", {"torch.float32"}, {"torch.bfloat16"}, BF16_LINEAR),
    ("bf16_weights", {"torch.bfloat16"}, {"torch.bfloat16"}, {"torch.bfloat16"}),
    ("auto", {"torch.float32"}, {"torch.bfloat16" if bf16_units() else "torch.float32"},
     BF16_LINEAR if bf16_units() else {"torch.float32"}),
])
def test_precision_modes(tiny, fp32_step, precision, params, compute, reduce):
    out = fp32_step if precision == "fp32" else run_step(tiny, f"train.precision={precision}")
    assert out["param_dtypes"] == params
    assert out["hidden_dtypes"] == compute
    assert out["grad_reduce_dtypes"] == reduce
    assert out["changed"] > 0  # the optimizer stepped every weight tensor it owns
    # ZeRO's gradient norm in fp32 on CPU (clsys.engine.deepspeed._grad_norms_in_fp32), still a real norm.
    assert out["norm_dtype"] == "torch.float32" and 0 < out["grad_norm"] < float("inf")
    # The same function in lower precision: the first loss within bf16's rounding of the fp32 one.
    torch.testing.assert_close(out["losses"][0], fp32_step["losses"][0], rtol=2e-2, atol=0)


def test_deepspeed_section_reaches_the_engine(tiny, fp32_step):
    # A recipe's `deepspeed:` keys, merged over clsys's own: the real engine runs with them, and with
    # clsys's stage; the step itself is the same function (its buckets only group the communication).
    out = run_step(tiny, "train.precision=fp32", "deepspeed.zero_optimization.reduce_bucket_size=12345",
                   "deepspeed.zero_optimization.allgather_bucket_size=23456")
    assert (out["zero_stage"], out["reduce_bucket_size"], out["allgather_bucket_size"]) == (2, 12345, 23456)
    assert (fp32_step["reduce_bucket_size"], fp32_step["allgather_bucket_size"]) != (12345, 23456)
    torch.testing.assert_close(out["losses"], fp32_step["losses"], rtol=1e-5, atol=1e-6)


def test_bf16_autocast_can_reduce_every_gradient_in_fp32(tiny):
    # DeepSpeed's default under autocast reduces nn.Linear gradients in bf16 (test_precision_modes); the
    # one torch_autocast key clsys leaves to a recipe makes every reduction fp32, the compute still bf16.
    out = run_step(tiny, "train.precision=bf16", "deepspeed.torch_autocast.lower_precision_safe_modules=[]")
    assert out["grad_reduce_dtypes"] == {"torch.float32"} and out["hidden_dtypes"] == {"torch.bfloat16"}


def test_compiled_step_matches_the_eager_step(tiny, fp32_step):
    eager = fp32_step
    compiled = run_step(tiny, "train.precision=fp32", "train.compile=true")
    assert compiled["compiled"] and not eager["compiled"]
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-4, atol=1e-5)
    for name, weight in eager["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], weight, rtol=1e-4, atol=1e-5)


def test_zero_stage_0_clips_and_logs_the_norm_as_zero_2_does(tiny):
    # Stage 0 clips with torch's clip_grad_norm_ instead of DeepSpeed's per-parameter loop
    # (clsys.engine.deepspeed._torch_step). With a threshold below the gradients' norm both steps
    # clip: AdamW is nearly blind to one constant scale, but not to the two steps' different clip factors,
    # so the weights agree with ZeRO-2's only if stage 0 clipped alike. grad_norm is the unclipped norm.
    zero_2 = run_step(tiny, "train.precision=fp32", "optim.grad_clip=0.01")
    zero_0 = run_step(tiny, "train.precision=fp32", "optim.grad_clip=0.01", "train.zero_stage=0")
    unclipped = run_step(tiny, "train.precision=fp32", "optim.grad_clip=0", "train.zero_stage=0")
    assert zero_0["zero_stage"] == 0 and zero_0["grad_norm"] > 0.01
    assert zero_0["grad_norm"] == pytest.approx(zero_2["grad_norm"], rel=1e-4)
    torch.testing.assert_close(zero_0["losses"], zero_2["losses"], rtol=1e-5, atol=1e-6)
    for name, weight in zero_2["weights"].items():
        torch.testing.assert_close(zero_0["weights"][name], weight, rtol=1e-4, atol=1e-6)
    assert any(not torch.allclose(unclipped["weights"][name], weight, rtol=1e-4, atol=1e-6)
               for name, weight in zero_2["weights"].items())


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not Path("/proc/cpuinfo").exists(),
                    reason="reads the x86 CPU flags of /proc/cpuinfo")
def test_auto_takes_bf16_only_where_the_cpu_has_bf16_units():
    """train.precision: auto chooses bf16 on a CPU with AVX512-BF16 or AMX, never on one that only emulates it
    (oneDNN's own check said yes on any AVX512 core: there bf16 ran 3.8x slower than fp32)."""
    from clsys.engine.deepspeed import bf16_matmul_units

    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split(":", 1)[1].split())
    assert bf16_matmul_units(use_gpu=False) == bool(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})
