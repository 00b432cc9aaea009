"""Recipes and overrides: every bundled recipe loads; a bad key or value is an error naming it."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from clsys.config import Config, ConfigError
from clsys.recipes import CONFIG_DIR, config_from_dict, load_config


@pytest.mark.parametrize("recipe", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_bundled_recipes_load_and_round_trip(recipe, tmp_path):
    cfg = load_config(recipe)
    again = config_from_dict(cfg.to_dict())
    assert again == cfg and again.fingerprint() == cfg.fingerprint()
    # As YAML (what --print-config prints and <run>/config.yaml holds): a recipe that loads back equal.
    saved = tmp_path / "config.yaml"
    saved.write_text(cfg.to_yaml())
    assert load_config(str(saved)) == cfg


def test_deepspeed_section_merges_and_refuses_what_clsys_derives(tmp_path):
    from clsys.config import DEEPSPEED_DERIVED
    from clsys.engine.deepspeed import ds_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("deepspeed:\n  zero_optimization:\n    offload_optimizer: {device: cpu}\n"
                      "    reduce_bucket_size: 1000000\n    allgather_bucket_size: 5e8\n")
    cfg = load_config(str(recipe), ["deepspeed.zero_optimization.reduce_bucket_size=2e6",
                                    "deepspeed.wall_clock_breakdown=true", "train.zero_stage=3"])
    generated = ds_config(cfg)
    # Merged key by key: the recipe's offload, the override's bucket size (read as YAML: a number), clsys's stage.
    assert generated["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                              "reduce_bucket_size": 2e6, "allgather_bucket_size": 5e8}
    assert generated["wall_clock_breakdown"] is True and generated["train_batch_size"] == cfg.train.batch_size
    assert config_from_dict(cfg.to_dict()) == cfg  # what the workers and checkpoints receive
    (tmp_path / "saved.yaml").write_text(cfg.to_yaml())
    assert load_config(str(tmp_path / "saved.yaml")) == cfg
    for derived, owner in DEEPSPEED_DERIVED.items():
        with pytest.raises(ConfigError, match=re.escape(f"deepspeed.{derived}: clsys sets it from {owner}")):
            load_config(None, [f"deepspeed.{derived}=1"])
    with pytest.raises(ConfigError, match="deepspeed.zero_optimization.stage: clsys sets it from train.zero_stage"):
        load_config(None, ["deepspeed.zero_optimization={stage: 3}"])
    with pytest.raises(ConfigError, match=r"deepspeed.torch_autocast: expected a mapping \(clsys sets its enabled"):
        load_config(None, ["deepspeed.torch_autocast=1"])
    # What clsys does not derive in a section it fills is the recipe's: which gradients DeepSpeed reduces in bf16.
    cfg = load_config(None, ["deepspeed.torch_autocast.lower_precision_safe_modules=[]", "train.precision=bf16",
                             "train.zero_stage=0"])
    assert ds_config(cfg)["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}


def test_help_lists_the_recipes_and_every_key_with_default_and_meaning(capsys):
    from clsys.driver.keys import known_keys
    from clsys.pretrain import main

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for recipe in (p.stem for p in CONFIG_DIR.glob("*.yaml")):
        assert re.search(rf"^  {recipe} +\S", out, re.M), recipe
    assert "quickstart    The quickstart: unsupervised SimCSE on all-MiniLM-L6-v2" in out
    # default, the quickstart's value where it differs, type, meaning (the field's comment)
    assert "    optim.lr = 3e-5 [6e-5]  (float) AdamW learning rate" in out
    # a closed set of two types: both named, the values after the meaning
    assert "    train.zero_stage = auto  (int or str) DeepSpeed ZeRO stage 0-3; auto: 0 (plain" in out
    assert "a resumed run keeps its checkpoint's stage (one of 0 | 1 | 2 | 3 | auto)" in out
    assert "    train.precision = auto  (str) fp32; bf16: autocast" in out
    assert "    cluster.group_shutdown_timeout_s = 5  (int) A failed worker group's time" in out
    assert "  objective.* of objective.name: clir" in out
    missing = [key for key in known_keys() if f"    {key} = " not in out]
    assert not missing, missing


def test_dotted_options_and_print_config(capsys, tmp_path):
    from clsys.pretrain import main

    # --key=value and --key value beside key=value; the printed config is a recipe that loads back.
    assert main(["--config", "quickstart", "--print-config", "--train.steps=5", "--cluster.num_workers", "1",
                 "train.batch_size=8", "--objective.grad_cache.chunk_size=4", f"--train.run_root={tmp_path}"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(printed)
    cfg = load_config(str(tmp_path / "printed.yaml"))
    assert (cfg.train.steps, cfg.cluster.num_workers, cfg.train.batch_size) == (5, 1, 8)
    assert cfg.objective.grad_cache.chunk_size == 4 and cfg.train.run_root == str(tmp_path)
    assert cfg.optim.lr == load_config("quickstart").optim.lr  # the recipe's own values under the overrides
    assert not list(tmp_path.glob("quickstart*")), "--print-config must not start a run"

    assert main(["--print-config", "--train.stepz=5"]) == 2
    assert "unknown config key 'train.stepz'" in capsys.readouterr().err
    assert main(["--print-config", "--train.steps"]) == 2
    assert "--train.steps: no value (write --train.steps=VALUE)" in capsys.readouterr().err


def test_overrides_are_typed():
    cfg = load_config(None, ["train.steps=5", "optim.betas=[0.8, 0.9]", "model.dropout=0.1", "objective.gather=false",
                             "model.dropout=null", "train.run_root=s3://b/p"])
    assert (cfg.train.steps, cfg.optim.betas, cfg.model.dropout, cfg.objective.gather) == (5, (0.8, 0.9), None, False)
    assert cfg.train.run_root == "s3://b/p"
    assert cfg.micro_batch == cfg.train.batch_size // cfg.cluster.num_workers


def test_nested_groups_from_overrides_and_yaml(tmp_path):
    cfg = load_config(None, ["objective.grad_cache.chunk_size=64"])
    assert cfg.objective.grad_cache.chunk_size == 64
    assert config_from_dict(cfg.to_dict()) == cfg  # a saved run config (checkpoint, Ray payload) loads back
    recipe = tmp_path / "r.yaml"
    recipe.write_text("objective:\n  name: self_guided\n  grad_cache:\n    chunk_size: 16\n")
    assert load_config(str(recipe)).objective.grad_cache.chunk_size == 16


def test_css_lm_task_and_corpus_are_objective_groups_in_either_spelling(tmp_path):
    """CSS-LM's task and corpus are groups of its objective config (objective.task, objective.corpus: the spelling
    to_yaml writes); top-level sections and overrides, the spelling from before, fill the same keys, objective.name
    coming before or after them."""
    nested = tmp_path / "nested.yaml"
    nested.write_text("objective:\n  name: css_lm\n  task:\n    train: a.tsv\n    shots: 4\n  corpus:\n    url: c\n")
    cfg = load_config(str(nested))
    assert (cfg.objective.task.train, cfg.objective.task.shots, cfg.objective.corpus.url) == ("a.tsv", 4, "c")
    top_level = tmp_path / "top_level.yaml"
    top_level.write_text("task:\n  train: a.tsv\n  shots: 4\ncorpus:\n  url: c\nobjective:\n  name: css_lm\n")
    assert load_config(str(top_level)) == cfg
    assert load_config(None, ["task.train=a.tsv", "task.shots=4", "corpus.url=c", "objective.name=css_lm"]) == cfg
    assert load_config(None, ["objective.name=css_lm", "objective.task.train=a.tsv", "objective.task.shots=4",
                              "objective.corpus.url=c"]) == cfg
    assert load_config("css_lm", ["task.shots=8"]).objective.task.shots == 8
    written = yaml.safe_load(cfg.to_yaml())
    assert "task" not in written and "corpus" not in written
    assert (written["objective"]["task"]["train"], written["objective"]["corpus"]["url"]) == ("a.tsv", "c")
    (tmp_path / "saved.yaml").write_text(cfg.to_yaml())
    assert load_config(str(tmp_path / "saved.yaml")) == cfg and config_from_dict(cfg.to_dict()) == cfg
    assert not hasattr(Config(), "task") and not hasattr(Config(), "corpus")


# What every run saved before task and corpus moved under objective holds, whatever its objective.
SAVED_TASK = {"train": "", "dev": "", "test": "", "shots": 16, "text_field": "", "label_field": "", "warmup_epochs": 14,
              "epochs": 14, "warmup_fraction": 0.1, "detach_after_epochs": 1}
SAVED_CORPUS = {"url": "", "bank_size": 40000, "min_tokens": 15}


@pytest.mark.parametrize("recipe", ["css_lm", "quickstart"])
def test_a_config_saved_before_the_move_reads_back(recipe, tmp_path):
    """A run saved before (its to_dict, its config.yaml) with top-level task and corpus: CSS-LM's read into
    objective.task and objective.corpus, another objective's (at their defaults) left out."""
    expected = load_config(recipe)
    saved = expected.to_dict()
    if recipe == "css_lm":
        task, corpus = saved["objective"].pop("task"), saved["objective"].pop("corpus")
        assert task != SAVED_TASK and corpus != SAVED_CORPUS  # the recipe's own values, not the defaults
    else:
        task, corpus = SAVED_TASK, SAVED_CORPUS
    saved = {**saved, "task": task, "corpus": corpus}
    assert config_from_dict(saved) == expected
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(saved)), sort_keys=False))
    assert load_config(str(tmp_path / "config.yaml")) == expected


def test_another_objectives_section_names_its_objective(tmp_path):
    message = ("unknown config key 'task.train' (sections: data, model, objective, optim, train, cluster, eval, "
               "deepspeed; task is a section of objective css_lm: objective.name: css_lm)")
    with pytest.raises(ConfigError, match=re.escape(f"override: {message}")):
        load_config(None, ["task.train=x"])
    with pytest.raises(ConfigError, match=re.escape("'corpus.url' (sections: ")):
        load_config("quickstart", ["corpus.url=shards"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("objective:\n  name: simcse\ntask:\n  train: x\n")
    with pytest.raises(ConfigError, match=re.escape(f"{recipe}: {message}")):
        load_config(str(recipe))
    with pytest.raises(ConfigError, match=re.escape("'task.shots' (sections: ")):
        load_config(None, ["task.shots=8"])
    assert load_config(None, ["task.shots=16"]) == load_config(None)  # css_lm's default: it sets nothing


@pytest.mark.parametrize("override,message", [
    ("train.stepz=1", "unknown config key 'train.stepz'"),
    ("trainn.steps=1", "unknown config key 'trainn.steps'"),
    ("objective.temprature=1", "unknown config key 'objective.temprature'"),
    ("objective.name=nope", "objective.name: unknown objective 'nope'"),
    ("objective.grad_cache.chunk=8", "unknown config key 'objective.grad_cache.chunk' (keys of objective.grad_cache: "
                                     "chunk_size)"),
    ("objective.temperature.x=1", "unknown config key 'objective.temperature.x' (keys of objective: "),
    ("objective.grad_cache=8", "objective.grad_cache: expected a mapping of chunk_size"),
    ("objective.own_sections=[a]", "unknown config key 'objective.own_sections'"),  # a ClassVar is no key
    ("objective.grad_cache.chunk_size=-1", "objective.grad_cache.chunk_size: expected >= 0"),
    ("cluster.health_check_timeout_s=0", "cluster.health_check_timeout_s: expected > 0"),
    ("eval.every=0", "eval.every: expected > 0"),  # a modulo by zero at the first step, once the cluster was up
    ("train.log_every=0", "train.log_every: expected > 0"),
    ("cluster.lease_ttl_s=-1", "cluster.lease_ttl_s: expected 0 (no lease) or a time-to-live in seconds"),
    ("train.steps=1.5", "train.steps: expected an integer"),
    ("train.steps=true", "train.steps: expected an integer"),
    ("objective.gather=maybe", "objective.gather: expected true or false"),
    ("optim.betas=[0.9]", "optim.betas: expected a list of 2 values"),
    ("train.precision=fp8", "train.precision: expected fp32, bf16, bf16_weights or auto"),
    ("train.batch_size=31", "train.batch_size=31 is not divisible"),
    ("model.packed_attention=auto", "model.packed_attention: expected padded or nested"),
    ("train.steps", "is not of the form key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


@pytest.mark.parametrize("recipe, key, bad, good, message", [
    (None, "train.zero_stage", "4", "3", "expected 0, 1, 2, 3 or auto, got '4'"),
    (None, "data.on_bad_sample", "ignore", "skip", "expected error or skip, got 'ignore'"),
    (None, "train.precision", "16", "bf16", "expected fp32, bf16, bf16_weights or auto, got '16'"),
    ("sg_opt", "objective.loss", "sg_plus", "opt1", "expected sg, opt1, opt2 or sg_opt, got 'sg_plus'"),
    ("quickstart", "objective.pooler", "first", "mean", "expected cls_mlp, cls, mean or max, got 'first'"),
    ("clir", "objective.tasks", "[qlm, mlm]", "[rr]", "expected qlm or rr, got 'mlm'"),
    ("css_lm", "objective.stage", "both", "css", "expected warmup or css, got 'both'"),
])
def test_closed_sets_refuse_any_other_value_naming_the_key_and_the_set(recipe, key, bad, good, message):
    """A closed set (a Literal-typed key) is checked as the config is read, in the driver: the key, every value it
    takes and the one given; not in a worker, once the objective is built. A value of the set passes."""
    with pytest.raises(ConfigError, match=re.escape(f"{key}: {message}")):
        load_config(recipe, [f"{key}={bad}"])
    assert load_config(recipe, [f"{key}={good}"])


def test_a_closed_set_in_a_recipe_file_names_the_file(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("train:\n  precision: fp16\n")
    with pytest.raises(ConfigError, match=re.escape(f"{recipe}: train.precision: expected fp32, bf16, bf16_weights "
                                                    "or auto, got 'fp16'")):
        load_config(str(recipe))


def test_compile_refuses_the_nested_packed_attention():
    with pytest.raises(ConfigError, match=re.escape("model.packed_attention: expected padded with train.compile")):
        load_config(None, ["train.compile=true", "model.packed_attention=nested"])
    assert load_config(None, ["train.compile=true", "model.packed=false", "model.packed_attention=nested"]).train.compile


def test_bad_recipe_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=f"{bad}: unknown config key 'train.stepz'"):
        load_config(str(bad))
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "missing.yaml"))
