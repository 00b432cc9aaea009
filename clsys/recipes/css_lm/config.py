"""CSS-LM's config: the ``objective`` section when ``objective.name`` is ``css_lm``, the task and the corpus as
its groups ``objective.task`` and ``objective.corpus`` (which a recipe may still write as top-level sections)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from clsys.config import ObjectiveConfig


@dataclass
class TaskConfig:
    """A few-shot text-classification task, for a recipe that trains a classifier: files in a format
    ``clsys.data.labeled`` reads."""

    train: str = ""  # labelled training file (CSV/TSV/JSONL/"LABEL text"); the class names come from it
    dev: str = ""  # selects the epoch (accuracy)
    test: str = ""  # reported at the best dev epoch
    shots: int = 16  # examples per class drawn from train with the repeat's seed (0 = all of train)
    text_field: str = ""  # CSV/TSV/JSONL field names; "" = guessed (text/sentence/…, label/…)
    label_field: str = ""  # the label column/field; "" = guessed (label/gold_label/class/y)
    warmup_epochs: int = 14  # stage A (or the plain fine-tuning baseline's only stage)
    epochs: int = 14  # stage C
    warmup_fraction: float = 0.1  # linear lr warm-up over this fraction of each stage's steps
    detach_after_epochs: int = 1  # stage A: C and D see detached views from this epoch on (0 = never)


@dataclass
class CorpusConfig:
    """The unlabeled corpus a retrieval recipe draws from: sentence shards written by ``data_prep wiki``."""

    url: str = ""  # the sentences stream (or the data_prep output root holding sentences/)
    bank_size: int = 40000  # bank rows: the first this many corpus sentences with >= min_tokens tokens
    min_tokens: int = 15  # tokens (without special tokens) a sentence needs to enter the bank


@dataclass
class CSSLMConfig(ObjectiveConfig):
    method: Literal["css_lm", "finetune"] = "css_lm"  # stages A, B, C; or finetune: CE on the task head (baseline)
    stage: Literal["warmup", "css"] = "warmup"  # stage A (CE + pairwise heads) or C (css: retrieval every step)
    num_labels: int = 0  # classes of the task; the pipeline sets it from the training data
    k: int = 16  # sentences retrieved per query (and rank positions drawn per step)
    domain_weight: float = 0.5  # w in s = s_C + w·s_D
    positives_with_replacement: bool = True  # rank positions drawn with replacement (original) or a permutation
    domain_negatives: int = 16  # random corpus sentences per query in stage A's domain loss
    detach_after_micro_steps: int = 0  # stage A: C and D get detached views after this many forwards; 0 = never
    classifier_dropout: float = 0.1  # both dropouts of the task head
    bank_chunk_rows: int = 65536  # bank rows scored at once during retrieval
    bank_refresh_every: int = 0  # stage C: re-encode the bank with the current model every N steps (0 = static, as the original)
    task: TaskConfig = field(default_factory=TaskConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)

    # task and corpus were top-level sections of every config before they became CSS-LM's: recipes and saved runs
    # may still write them so. The task files and the corpus are read in the workers, not in the driver's folder.
    own_sections: ClassVar[tuple[str, ...]] = ("task", "corpus")
    local_files: ClassVar[tuple[str, ...]] = ("task.train", "task.dev", "task.test")
    locations: ClassVar[tuple[str, ...]] = ("corpus.url",)
