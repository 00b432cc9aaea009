"""Recipes and overrides: every bundled recipe loads; a bad key or value is an error naming it."""
from __future__ import annotations

import re

import pytest

from clsys.config import CONFIG_DIR, ConfigError, config_from_dict, load_config


@pytest.mark.parametrize("recipe", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_bundled_recipes_load_and_round_trip(recipe):
    cfg = load_config(recipe)
    again = config_from_dict(cfg.to_dict())
    assert again == cfg and again.fingerprint() == cfg.fingerprint()


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


@pytest.mark.parametrize("override,message", [
    ("train.stepz=1", "unknown config key 'train.stepz'"),
    ("trainn.steps=1", "unknown config key 'trainn.steps'"),
    ("objective.temprature=1", "unknown config key 'objective.temprature'"),
    ("objective.name=nope", "objective.name: unknown objective 'nope'"),
    ("objective.grad_cache.chunk=8", "unknown config key 'objective.grad_cache.chunk' (keys of objective.grad_cache: "
                                     "chunk_size)"),
    ("objective.temperature.x=1", "unknown config key 'objective.temperature.x' (keys of objective: "),
    ("objective.grad_cache=8", "objective.grad_cache: expected a mapping of chunk_size"),
    ("objective.grad_cache.chunk_size=-1", "objective.grad_cache.chunk_size: expected >= 0"),
    ("train.steps=1.5", "train.steps: expected an integer"),
    ("train.steps=true", "train.steps: expected an integer"),
    ("objective.gather=maybe", "objective.gather: expected true or false"),
    ("optim.betas=[0.9]", "optim.betas: expected a list of 2 values"),
    ("train.precision=fp8", "train.precision: expected fp32, bf16, bf16_weights or auto"),
    ("train.batch_size=31", "train.batch_size=31 is not divisible"),
    ("train.steps", "is not of the form key=value"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


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
