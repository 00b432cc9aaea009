"""DeepSpeed set-up: the process group, the engine config derived from ours, and initialisation."""
from __future__ import annotations

import dataclasses
import logging
import os
import platform
import sys
import warnings

import torch
import torch.distributed as dist

from clsys.config import Config
from clsys.engine.ranks import ProcessGroupRanks

log = logging.getLogger(__name__)


def init_distributed() -> None:
    """Adopt the process group Ray Train created (gloo on CPU, nccl on GPU) for DeepSpeed."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed calls collectives under names torch deprecated (ZeRO-3 reduce-scatters at every step); the
    # warnings are for DeepSpeed.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning)
    if get_accelerator().device_name() == "cpu":
        # On the CPU accelerator DeepSpeed JIT-compiles a shared-memory all-reduce op (about a
        # minute of gcc on a cold cache). Plain gloo collectives give identical results, so skip it.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        _grad_norms_in_fp32()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


def _grad_norms_in_fp32() -> None:
    """CPU only: ZeRO sums its gradient norms in fp32 instead of fp64.

    DeepSpeed's ZeRO optimizers copy every gradient to float64 before taking its norm (for clipping and
    the logged grad_norm). On a GPU that copy is cheap; on a CPU it streams twice the gradients' size
    through memory each step: 52 of the 126 ms of MiniLM's ZeRO-2 optimizer step. fp32 is what
    ``torch.nn.utils.clip_grad_norm_`` uses, and a clip threshold does not need 16 digits.
    """
    import deepspeed.runtime.zero.stage3 as zero_3
    import deepspeed.runtime.zero.stage_1_and_2 as zero_1_2

    for module in (zero_1_2, zero_3):
        if hasattr(module, "get_norm_dtype"):  # where each ZeRO optimizer looks the dtype up
            module.get_norm_dtype = lambda: torch.float32


def bf16_matmul_units(use_gpu: bool) -> bool:
    """Whether this process's device multiplies bf16 matrices natively: a GPU with bf16 support, or a CPU
    with AVX512-BF16 / AMX. Elsewhere bf16 is emulated and slower than fp32."""
    if use_gpu:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if platform.machine().lower() in ("x86_64", "amd64"):
        # Not oneDNN's own check: it says yes on any AVX512 core, where bf16 is emulated. Measured on an Intel
        # Xeon with AVX512 but without AVX512-BF16: a MiniLM forward and backward 2.4 s in bf16, 0.64 s in fp32.
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def step_precision(cfg: Config) -> str:
    """``train.precision`` with ``auto`` resolved on this worker: ``bf16`` (autocast) where the device has
    bf16 matrix units, else ``fp32``. On a CPU with them (e.g. AVX512-BF16), MiniLM's SimCSE step ran 1.9×
    as fast as in fp32 (docs/benchmarks.md, "Throughput and scale")."""
    if cfg.train.precision != "auto":
        return cfg.train.precision
    units = bf16_matmul_units(cfg.cluster.use_gpu)
    log.debug(f"[clsys] train.precision auto: {'bf16' if units else 'fp32'} (bf16 matrix units on this "
              f"{'GPU' if cfg.cluster.use_gpu else 'CPU'}: {'yes' if units else 'no'})")
    return "bf16" if units else "fp32"


# Of a device's memory (on CPU: a rank's share of the node's), what the whole training state may take for
# ``train.zero_stage: auto`` to choose stage 0: the rest is for activations, the allocator's cache and the loader.
STATE_SHARE = 0.5
STATE_BYTES_PER_PARAMETER = 16  # fp32 weight and gradient, AdamW's two fp32 moments (bf16_weights: 2 + 2 + 12)


def resolve_zero_stage(cfg: Config, model: torch.nn.Module, resumed_stage: int | None) -> Config:
    """``cfg`` with ``train.zero_stage: auto`` made a stage; collective where it measures (every rank gets the
    same stage). A resumed run keeps the stage of its checkpoint (``resumed_stage``), whose files are laid out for
    it. Otherwise 0 while every rank can hold the whole state (``STATE_BYTES_PER_PARAMETER`` per trainable
    parameter, frozen ones at their size) in ``STATE_SHARE`` of its memory, else 2. Stage 0 is plain data
    parallelism: nothing to partition on one rank, and for a model whose state fits, partitioning only adds
    copies (ZeRO-2's step 0.91x stage 0's for BERT-base on an H100, 0.82x for MiniLM on 2 CPU workers:
    docs/benchmarks.md). A model too large for that (several billion parameters on an 80 GB GPU) gets ZeRO-2."""
    if cfg.train.zero_stage != "auto":
        return cfg
    if resumed_stage is not None:
        stage = resumed_stage
        log.debug(f"[clsys] train.zero_stage auto: {stage}, the stage of the checkpoint resumed from")
    else:
        need = sum(p.numel() * (STATE_BYTES_PER_PARAMETER if p.requires_grad else p.element_size())
                   for p in model.parameters())
        memory = rank_memory_bytes(cfg.cluster.use_gpu)
        stage = 0 if need <= STATE_SHARE * memory else 2
        if dist.is_initialized():  # ranks on different hardware: the largest stage any of them needs
            from deepspeed.accelerator import get_accelerator

            agreed = torch.tensor([stage], device=get_accelerator().current_device_name())
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            stage = int(agreed.item())
        log.debug(f"[clsys] train.zero_stage auto: {stage} (the largest any rank needs; on this one the training state "
                  f"takes {need / 2**30:.2f} GiB, {STATE_SHARE:g} of its memory is "
                  f"{STATE_SHARE * memory / 2**30:.2f} GiB)")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, zero_stage=stage))


def rank_memory_bytes(use_gpu: bool) -> int:
    """The memory this rank has: its GPU's, or on CPU the node's (its cgroup's limit, where lower) shared by the
    node's ranks (``LOCAL_WORLD_SIZE``, which Ray Train and torchrun set)."""
    if use_gpu:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    node = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:  # cgroup v2: a number, or "max" for none
            limit = f.read().strip()
        node = min(node, int(limit)) if limit.isdigit() else node
    except OSError:
        pass
    return node // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def merged(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` merged in, mappings key by key at every depth."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def ds_config(cfg: Config, load_universal: bool = False) -> dict:
    """The DeepSpeed config for ``cfg``, with the user's ``deepspeed:`` section merged over it (the keys
    clsys derives itself, ``clsys.config.DEEPSPEED_DERIVED``, were refused when the config was read)."""
    t, precision = cfg.train, step_precision(cfg)
    if t.zero_stage == "auto":
        raise ValueError("train.zero_stage: auto is made a stage (resolve_zero_stage) before the engine is built")
    return merged({
        # Resuming on another rank count reads a universal checkpoint (clsys.engine.checkpoint).
        "checkpoint": {"load_universal": load_universal},
        "train_batch_size": t.batch_size,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        # bf16: the engine runs forward under torch.autocast; weights, gradients and AdamW stay fp32, but
        # DeepSpeed reduces the gradients of nn.Linear layers across ranks in bf16 (its torch_autocast
        # lower_precision_safe_modules; `deepspeed: {torch_autocast: {lower_precision_safe_modules: []}}`
        # reduces every gradient in fp32).
        "torch_autocast": {"enabled": precision == "bf16", "dtype": "bfloat16"},
        "bf16": {"enabled": precision == "bf16_weights"},
        # Our optimizer is torch's fused AdamW (DeepSpeed's fused Adam needs a CUDA build).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }, cfg.deepspeed)


def lr_lambda(cfg: Config):
    warmup, total, schedule = cfg.optim.warmup_steps, cfg.train.steps, cfg.optim.schedule

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


def compile_models(objective: torch.nn.Module) -> None:
    """torch.compile the objective's Hugging Face models (encoder, frozen teacher) in place.

    In place (``Module.compile``), so parameter names, checkpoints and export are unchanged; the
    objective's own glue (pooling, loss, gathers) stays eager, where collectives and data-dependent
    shapes would break the graph anyway."""
    from transformers import PreTrainedModel

    for module in objective.modules():
        if isinstance(module, PreTrainedModel):
            module.compile()


def parameter_groups(model: torch.nn.Module, cfg: Config) -> list[dict]:
    """AdamW's parameter groups: with and without weight decay (as in BERT and the HF Trainer, none on
    biases and LayerNorm weights), then, with ``optim.head_lr``, the objective's heads at their own rate
    (a new classifier learns little at an encoder's fine-tuning rate: CLIR's RR head stayed at chance at
    1e-5). Frozen parts (teacher, BERT_F, frozen embeddings) stay out of the optimizer."""
    heads = {id(p) for p in model.head_parameters()} if cfg.optim.head_lr else set()
    split = {(head, decay): [] for head in (False, True) for decay in (True, False)}
    for param in model.parameters():
        if param.requires_grad:
            split[id(param) in heads, param.ndim >= 2].append(param)
    return [{"params": params, "lr": cfg.optim.head_lr if head else cfg.optim.lr,
             "weight_decay": cfg.optim.weight_decay if decay else 0.0}
            for (head, decay), params in split.items() if params or not head]


def build_engine(model: torch.nn.Module, cfg: Config, load_universal: bool = False):
    """A DeepSpeed engine over the objective's trainable parameters (frozen ones stay out); the objective gets the
    process group's collectives (``objective.ranks``, ``clsys.engine.ranks``).

    ``load_universal``: the checkpoint it will restore was written by another number of ranks."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # On the device before the optimizer exists, so that a fused optimizer sees device tensors.
    device = torch.device(get_accelerator().current_device_name())
    model.to(device)
    if dist.is_initialized():
        model.ranks = ProcessGroupRanks()  # the objective's collectives, over the engine's process group
    if cfg.train.compile:
        compile_models(model)
    optimizer = torch.optim.AdamW(parameter_groups(model, cfg), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                  eps=cfg.optim.eps, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # torch's fused AdamW, on GPU and CPU alike: one pass over each tensor instead of ~10. On CPU, ZeRO's
    # optimizer holds one flat fp32 partition far larger than the caches, which the unfused update streams
    # through memory once per operation: MiniLM's ZeRO-2 step took 0.24 s unfused, 0.08 s fused (docs/benchmarks.md, "Throughput and scale").
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_config(cfg, load_universal))
    if plain_data_parallel(cfg.train.zero_stage, step_precision(cfg)):
        _torch_step(engine)
    return engine


def plain_data_parallel(zero_stage: int, precision: str) -> bool:
    """Whether DeepSpeed runs plain data parallelism: ZeRO stage 0 with fp32 weights, every rank holding the
    whole model and AdamW state (in bf16_weights mode DeepSpeed's bf16 optimizer partitions it even at stage 0)."""
    return zero_stage == 0 and precision != "bf16_weights"


def _torch_step(engine) -> None:
    """Plain data parallelism (``plain_data_parallel``): the step torch itself would take.

    DeepSpeed clips stage 0's gradients one parameter at a time (for BERT-base ~200 small norm kernels, a
    copy each and host syncs: 8.5 ms of a 148 ms SimCSE step on an H100, where the bare loop's whole
    optimizer step takes 6 ms) and keeps no norm for ``grad_norm`` to log. torch's ``clip_grad_norm_``
    does the same math in a few multi-tensor kernels and returns the norm. The gradients are already
    averaged across ranks when it runs (in ``engine.backward``), so every rank gets the same norm, as
    with DeepSpeed's. With one rank there is nothing to average: DeepSpeed would still copy every
    gradient into buckets, all-reduce them with itself and copy them back."""
    def clip_gradients() -> None:
        engine._global_grad_norm = torch.nn.utils.clip_grad_norm_(engine.module.parameters(),
                                                                  engine.gradient_clipping())

    engine.clip_fp32_gradients = clip_gradients
    if engine.dp_world_size == 1:
        engine.enable_backward_allreduce = False
