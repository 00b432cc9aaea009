"""Typed configuration: what a run's config holds (a dataclass per section) and the checks a whole config passes.

``clsys.config.parsing`` fills these dataclasses from a YAML recipe plus dotted ``key=value`` overrides. The closed
sets (a field annotated ``Literal``) are checked here, not only where text is parsed, so that a config built in
Python (an objective's, a test's) is held to them as well; this module imports no objective.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import typing
from typing import ClassVar, Literal
from dataclasses import dataclass, field

import yaml

from clsys.storage.lease import MAX_TTL_S, is_ttl


class ConfigError(ValueError):
    """A bad recipe or override; the message names the key (and the file)."""


@dataclass
class DataConfig:
    # root written by `data_prep wiki --out`; streams are sub-folders. Local folder, file://, s3://, or another
    # scheme fsspec knows (gs://, az://, hf://, …; its package installed: docs/operations/storage.md)
    url: str = "runs/quickstart/shards"
    max_length: int = 32  # tokens per sentence after truncation (SimCSE: 32)
    shuffle_buffer: int = 2048  # samples held per loader worker for shuffling
    loader_workers: int = 1  # DataLoader worker processes per training rank
    # how batches cross from the loader workers to the trainer: plain (a stock DataLoader, the tokenizer's own call)
    # or fast (the same batches: packed in bundles, forkserver workers, the next epoch read ahead, the tokenizer's
    # backend called directly)
    transport: Literal["plain", "fast"] = "fast"
    verify_checksums: bool = True  # compare each shard's sha256 with the manifest before using any of its samples
    # error: stop, naming shard, sample and reason; skip: leave bad shards/samples out
    on_bad_sample: Literal["error", "skip"] = "error"
    max_shard_mb: int = 1024  # the most MiB a shard's tar may take in a loader worker (a .tar.gz's decompressed)
    length_group_batches: int = 0  # K > 0: sort each window of K micro-batches by text length (less padding)
    # The streams an objective that reads many sources mixes (pairs/<source> of data_prep pairs), with weights
    # ({pairs/msmarco: 2, pairs/nq: 1}: sampling probabilities 2/3 and 1/3) or without ([pairs/msmarco, pairs/nq]:
    # weighed by data.source_alpha); empty: every stream it finds under data.url
    sources: dict[str, float | None] = field(default_factory=dict)
    # sources without weights are drawn with p ∝ n^α, n a source's samples (its manifest's): 1 by size, 0 uniform
    source_alpha: float = 0.5
    # same: every micro-batch of an optimizer step, on every rank, from one source; mixed: a source per micro-batch
    source_batches: Literal["same", "mixed"] = "same"


@dataclass
class ModelConfig:
    name: str = "all-MiniLM-L6-v2"  # packaged alias, local folder, or a hub id the user has cached
    # pretrained weights of model.name, or scratch: model.name is just the architecture
    init: Literal["pretrained", "scratch"] = "pretrained"
    tokenizer: str = ""  # tokenizer folder/URL (e.g. from data_prep tokenizer); "" = model.name's own
    dropout: float | None = None  # overrides hidden and attention dropout when set (SimCSE needs > 0)
    packed: bool = True  # encoder forwards without pad tokens (clsys/model/packing.py); false: padded batches
    # packed rows' attention product: padded (one masked SDPA call) or nested
    packed_attention: Literal["padded", "nested"] = "padded"


@dataclass
class GradCacheConfig:
    chunk_size: int = 0  # > 0: GradCache, encoder rows per chunk (clsys/engine/grad_cache.py); 0 = off


@dataclass
class ObjectiveConfig:
    """Base of every objective's own config dataclass (see ``clsys/objectives``).

    The ``objective`` section of a recipe is checked against the dataclass of the objective
    that ``objective.name`` selects, so each objective declares exactly the keys it accepts.
    """

    name: str = "simcse"  # the objective (clsys.recipes.OBJECTIVES); the other objective.* keys are its own
    grad_cache: GradCacheConfig = field(default_factory=GradCacheConfig)

    # Groups of this config that a recipe may also write as top-level sections (``task:``, ``task.shots=8``): the
    # spelling of recipes and saved runs from before they moved under ``objective`` (clsys.config.parsing).
    own_sections: ClassVar[tuple[str, ...]] = ()
    # Keys (dotted, below ``objective``) the driver resolves before any worker starts, as workers do not run in its
    # folder (clsys.driver.paths): files the run reads (against its folder, else the checkout; one that names
    # nothing is an error naming its key) and data locations (made absolute, as data.url is).
    local_files: ClassVar[tuple[str, ...]] = ()
    locations: ClassVar[tuple[str, ...]] = ()


@dataclass
class OptimConfig:
    lr: float = 3e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay, not applied to biases and LayerNorm weights
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    warmup_steps: int = 0  # linear warm-up steps
    schedule: Literal["linear", "constant"] = "linear"  # linear (decay to 0 at the last step) or constant
    grad_clip: float = 1.0  # gradient-norm clipping
    head_lr: float = 0.0  # > 0: learning rate of the objective's task heads (e.g. CLIR's new RR classifier); 0: lr


@dataclass
class TrainConfig:
    name: str = "quickstart"  # run name: the run lives at <run_root>/<name>
    # local folder, file:// or s3:// URL, or another scheme fsspec knows (gs://: pip install gcsfs, az://: adlfs,
    # hf://: huggingface_hub), which has no run lease (set cluster.lease_ttl_s=0) and is atomic per object only
    # where the store is (docs/operations/storage.md)
    run_root: str = "runs"
    steps: int = 200  # optimizer steps
    batch_size: int = 32  # global batch (all ranks, all accumulation steps)
    grad_accum: int = 1  # micro-batches per optimizer step (in-batch negatives are per micro-batch × ranks)
    seed: int = 42  # model init and data order are the same on all ranks; dropout is seeded per rank
    # fp32; bf16: autocast (bf16 matmuls, fp32 weights, gradients and optimizer state; Linear gradients
    # reduced across ranks in bf16, see deepspeed.torch_autocast); bf16_weights:
    # DeepSpeed's bf16 mode (weights and gradients in bf16, an fp32 master copy in the optimizer: less memory);
    # auto: bf16 where the worker's device has bf16 matrix units, else fp32 (clsys.engine.deepspeed.step_precision):
    # the default, so that a GPU (or a CPU with AVX512-BF16/AMX) steps in bf16 without being asked
    precision: Literal["fp32", "bf16", "bf16_weights", "auto"] = "auto"
    compile: bool = False  # torch.compile the objective's Hugging Face models (fuses the step's small kernels on GPU)
    # DeepSpeed ZeRO stage 0-3; auto: 0 (plain data parallelism) while every rank can hold the whole model, its
    # gradients and AdamW state in half its device's memory, else 2; a resumed run keeps its checkpoint's stage
    zero_stage: Literal[0, 1, 2, 3, "auto"] = "auto"
    log_every: int = 10  # TensorBoard/console logging interval (steps)
    # Collapse alarm: train/uniformity above this (toward 0, where every embedding is the same point) logs
    # health/collapse 1 and warns on the console; 0 turns it off.
    collapse_uniformity: float = -0.2
    ckpt_every: int = 100  # checkpoint interval (steps; and always at the last step)
    async_checkpoint: bool = True  # write checkpoints in the background (training stops for a host-memory snapshot)
    keep_checkpoints: int = 2  # complete checkpoints kept (the best one, eval.select, is kept besides)
    resume: str = ""  # "" (fresh run; refuses to overwrite), "latest", or a checkpoint URL
    tensorboard_sync_s: float = 60.0  # remote runs: copy the event files to <run>/tensorboard this often
    log_sample_keys: bool = False  # write every consumed sample key to <run>/sample_keys/ at checkpoints
    profile: bool = False  # log perf/time_<phase>_s: where the step's time goes (syncs the GPU at each phase)
    # perf/mfu's divisor: the device's peak TFLOP/s at the step's precision; 0: the data-sheet bf16 peak of
    # a known GPU (H100, H200, A100, L40S, L4, A10G) under bf16, else no perf/mfu
    peak_tflops: float = 0.0


@dataclass
class ClusterConfig:
    num_workers: int = 2  # Ray Train workers (data-parallel ranks)
    use_gpu: bool = False  # one GPU per worker, NCCL
    cpus_per_worker: int = 1  # CPUs reserved per worker
    max_restarts: int = 0  # worker-group restarts after a failure (Ray FailureConfig)
    collective_timeout_s: int = 1800  # a collective waiting longer (a stuck or lost rank) fails the step
    # A failed worker group's time to close its process group before its workers are killed and the
    # restart begins (Ray's TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, whose own default of 30 s a stuck
    # rank always uses up: it never answers).
    group_shutdown_timeout_s: int = 5
    # A rank that has not answered Ray Train's health check (asked every 2 s) for this long is declared
    # dead and the group fails: the watchdog for a stuck rank whose peers' collectives do not time out.
    health_check_timeout_s: int = 600
    stop_poll_s: float = 5.0  # how often rank 0 looks for a stop request (<run>/STOP, written on SIGUSR1/SIGTERM)
    # The driver holds <run>/LEASE while it runs, renewed every third of this; a second driver on the
    # run exits, and one left unrenewed this long (its driver died) is taken over. 0: no lease.
    lease_ttl_s: float = 60.0


@dataclass
class EvalConfig:
    sts_dev: str = "stsb-en-dev"  # bundled name or path; "" disables evaluation during training
    every: int = 100  # evaluation interval (also at step 0 and the last step)
    pooling: str = "cls"  # pooling for the evaluation during training: cls, mean or max
    max_pairs: int = 0  # 0 = all pairs of the dev set
    batch_size: int = 64  # sentences per evaluation forward
    sts_test: str = ""  # after training: compare the base model and the exported one on this set
    test_poolings: str = "cls,mean"  # comma list of poolings for that comparison
    heatmap_text: str = ""  # when set: a token-similarity heatmap of this sentence in TensorBoard at each evaluation
    xling: list[str] = field(default_factory=list)  # XQuAD question→paragraph directions, e.g. [en-de, de-en]
    xling_articles: str = "24:48"  # XQuAD articles evaluated (0:24 build the bundled CLIR fixtures)
    tatoeba: list[str] = field(default_factory=list)  # bitext retrieval sets, e.g. [deu-eng]
    rerank_top: int = 10  # re-rank this many bi-encoder candidates with the objective's scorer (0 = off)
    # a BEIR/MTEB folder (corpus.jsonl, queries.jsonl, qrels/) or a bundled one (xquad-en, xquad-de): nDCG@10,
    # MRR@10, Recall@100 logged as <folder name>_ndcg@10, ...; "" = off
    retrieval_dev: str = ""
    retrieval_split: str = "dev"  # eval.retrieval_dev's qrels split (qrels/<split>.tsv); dev: selection never sees test
    # Best checkpoint: the evaluation metric that picks it (sts_dev = the sts_dev set's Spearman, retrieval_dev =
    # the retrieval_dev set's nDCG@10, or a logged eval metric such as xquad_en-de_mrr@10; "" = export the last
    # checkpoint), and its direction.
    select: str = "sts_dev"  # the best checkpoint's eval metric: sts_dev, retrieval_dev or a logged one; "" = the last
    select_mode: Literal["max", "min"] = "max"  # max or min: which direction of eval.select is better


# DeepSpeed config keys that clsys derives from its own settings, and the setting that decides each. A
# `deepspeed:` section may set anything else: offload, communication, activation checkpointing, ...
DEEPSPEED_DERIVED = {
    "train_batch_size": "train.batch_size",
    "train_micro_batch_size_per_gpu": "train.batch_size (divided by cluster.num_workers × train.grad_accum)",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "optim.grad_clip",
    "zero_optimization.stage": "train.zero_stage",
    "torch_autocast.enabled": "train.precision",
    "torch_autocast.dtype": "train.precision",
    "bf16": "train.precision",
    "fp16": "train.precision",
    "optimizer": "optim.* (clsys builds torch's AdamW with its parameter groups)",
    "scheduler": "optim.schedule and optim.warmup_steps",
    "checkpoint.load_universal": "clsys itself (a resume on another number of ranks)",
}
# Top-level sections that are free-form mappings (no dataclass, so no types to coerce an override to:
# its value is read as YAML).
FREE_FORM = ("deepspeed",)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Merged over the DeepSpeed config clsys generates (clsys.engine.deepspeed.ds_config), e.g.
    # zero_optimization.offload_optimizer or communication_data_type; keys clsys derives are refused.
    deepspeed: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The config as a recipe: ``load_config`` reads it back to an equal config."""
        plain = json.loads(json.dumps(self.to_dict()))  # tuples as lists: YAML's safe dumper has no tuples
        return yaml.safe_dump(plain, sort_keys=False, allow_unicode=True)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def validate(self) -> None:
        t = self.train
        weights = list(self.data.sources.values())
        per_step = self.cluster.num_workers * t.grad_accum
        if t.batch_size % per_step:
            raise ConfigError(
                f"train.batch_size={t.batch_size} is not divisible by cluster.num_workers × train.grad_accum "
                f"= {self.cluster.num_workers} × {t.grad_accum}")
        checks = [
            ("train.steps", t.steps > 0, "> 0"),
            ("train.ckpt_every", t.ckpt_every > 0, "> 0"),
            ("train.log_every", t.log_every > 0, "> 0"),
            ("eval.every", self.eval.every > 0, "> 0 (an evaluation also runs at step 0 and the last step)"),
            ("train.keep_checkpoints", t.keep_checkpoints > 0, "> 0"),
            ("train.collapse_uniformity", t.collapse_uniformity <= 0, "<= 0 (0 = off; uniformity is at most 0)"),
            ("train.peak_tflops", t.peak_tflops >= 0, ">= 0 (0 = the data-sheet peak of a known GPU)"),
            ("model.packed_attention", not (t.compile and self.model.packed and self.model.packed_attention == "nested"),
             "padded with train.compile (torch.compile fails on the nested kernel's backward)"),
            ("model.tokenizer", self.model.init == "pretrained" or bool(self.model.tokenizer),
             "a tokenizer folder when model.init is scratch"),
            ("optim.head_lr", self.optim.head_lr >= 0, ">= 0 (0 = optim.lr)"),
            ("objective.grad_cache.chunk_size", self.objective.grad_cache.chunk_size >= 0, ">= 0 (0 = off)"),
            ("cluster.num_workers", self.cluster.num_workers > 0, "> 0"),
            ("cluster.collective_timeout_s", self.cluster.collective_timeout_s > 0, "> 0"),
            ("cluster.group_shutdown_timeout_s", self.cluster.group_shutdown_timeout_s > 0, "> 0"),
            ("cluster.health_check_timeout_s", self.cluster.health_check_timeout_s > 0, "> 0"),
            ("cluster.lease_ttl_s", self.cluster.lease_ttl_s == 0 or is_ttl(self.cluster.lease_ttl_s),
             f"0 (no lease) or a time-to-live in seconds, > 0 and <= {MAX_TTL_S:g} (not NaN or infinite)"),
            ("data.loader_workers", self.data.loader_workers > 0, "> 0"),
            ("data.length_group_batches", self.data.length_group_batches >= 0, ">= 0 (0 = off)"),
            ("data.sources", weights.count(None) in (0, len(weights))
             and all(0 < w < math.inf for w in weights if w is not None),
             "a weight > 0 for every source, or none (then data.source_alpha weighs them by size)"),
            ("data.source_alpha", 0 <= self.data.source_alpha < math.inf,
             ">= 0 (1: in proportion to size, 0: uniform)"),
            ("data.source_batches", self.data.source_batches == "same" or t.grad_accum > 1,
             "same when train.grad_accum is 1 (mixed draws a source per micro-batch, and a micro-batch holds one "
             "source)"),
            ("eval.select", self.eval.select in ("", "sts_dev") or bool(self.eval.sts_dev or self.eval.xling
                                                                         or self.eval.tatoeba or self.eval.retrieval_dev),
             "'' or sts_dev when nothing is evaluated during training (eval.sts_dev, eval.xling, eval.tatoeba, "
             "eval.retrieval_dev)"),
            ("eval.select", self.eval.select != "retrieval_dev" or bool(self.eval.retrieval_dev),
             "retrieval_dev only with eval.retrieval_dev set"),
            ("eval.xling_articles", re.fullmatch(r"\d*:\d*", self.eval.xling_articles) is not None,
             'an article range START:STOP, quoted in YAML ("24:48")'),
        ]
        for key, ok, expected in checks:
            if not ok:
                raise ConfigError(f"{key}: expected {expected}")
        for derived, owner in DEEPSPEED_DERIVED.items():
            node, parts = self.deepspeed, derived.split(".")
            for depth, part in enumerate(parts):
                node = node.get(part, dataclasses.MISSING) if isinstance(node, dict) else dataclasses.MISSING
                if depth < len(parts) - 1 and node is not dataclasses.MISSING and not isinstance(node, dict):
                    # e.g. torch_autocast: 1, which would replace the section holding a derived key
                    raise ConfigError(f"deepspeed.{'.'.join(parts[:depth + 1])}: expected a mapping "
                                      f"(clsys sets its {parts[-1]} from {owner})")
            if node is not dataclasses.MISSING:
                raise ConfigError(f"deepspeed.{derived}: clsys sets it from {owner}; set that instead")

    @property
    def micro_batch(self) -> int:
        return self.train.batch_size // (self.cluster.num_workers * self.train.grad_accum)


def choices(values: tuple) -> str:
    """A closed set as the errors and the reference write it: ``a, b or c``."""
    names = [str(v) for v in values]
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def closed_set(tp) -> tuple:
    """The values of a closed set (a ``Literal``, or a list of one), else ()."""
    if typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ()


def closed_set_problem(key: str, value, tp) -> str | None:
    """Why ``value`` (or, for a list, one of its items) is not in the closed set ``tp``, or None."""
    allowed = closed_set(tp)
    for item in value if typing.get_origin(tp) is list else [value]:
        if allowed and not any(type(item) is type(a) and item == a for a in allowed):  # True is not 1 here
            return f"{key}: expected {choices(allowed)}, got {item!r}"
    return None


def check_closed_sets(section, prefix: str) -> None:
    """ConfigError naming the first key of the dataclass ``section`` (nested groups included) whose value is not
    in its closed set: for configs built in Python, which no parsing checked (an objective checks its own)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value):
            check_closed_sets(value, key)
        elif problem := closed_set_problem(key, value, hints[f.name]):
            raise ConfigError(problem)


def run_url(cfg: Config) -> str:
    """Where this run's checkpoints, logs and exported model live (local path or URL)."""
    from clsys import storage

    root = cfg.train.run_root
    if "://" not in root:
        root = os.path.abspath(root)
    return storage.join(root, cfg.train.name)
