"""What training hands the loader's worker processes: each objective's data spec (``Objective.data``), pickled to
them, with no training state in it; and the forkserver's imports that let a worker unpickle its collate without
importing anything. The loader itself: test_streaming.py."""
from __future__ import annotations

import collections
import json
import pickle
import subprocess
import sys

import pytest
import torch


def training_state_in(value, seen=None) -> list[str]:
    """Where in ``value`` (attributes, mappings, sequences, followed all the way) a module, parameter or tensor is."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
        return []
    seen.add(id(value))
    if isinstance(value, (torch.nn.Module, torch.Tensor)):
        return [type(value).__name__]
    if isinstance(value, dict):
        children = list(value.items())
    elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        children = list(enumerate(value))
    else:
        children = list(getattr(value, "__dict__", {}).items())
    return [f"{name}.{inner}" for name, child in children for inner in training_state_in(child, seen)]


def test_loader_workers_get_the_objectives_data_spec_only(tiny):
    """What training hands the loader's worker processes (``Objective.data``, its data spec): the objective's
    collate as it is, without its parameters and submodules (here the encoder, the MLP and the MLM head)."""
    from clsys.recipes import OBJECTIVES, load_config
    from clsys.model.encoder import load_tokenizer

    cfg = load_config(None, [f"model.name={tiny}", "model.init=scratch", "model.tokenizer=all-MiniLM-L6-v2",
                             "objective.mlm_weight=0.1"])
    objective = OBJECTIVES["simcse"](cfg, load_tokenizer(cfg.model.tokenizer))
    data_side = pickle.loads(pickle.dumps(objective.data))
    assert list(objective.parameters()) and training_state_in(objective) and not training_state_in(data_side)
    samples = [{"txt": f"sentence number {i} of the batch"} for i in range(6)]
    torch.manual_seed(3)
    full = objective.collate(samples)
    torch.manual_seed(3)
    light = data_side.collate(samples)
    assert full.keys() == light.keys() and "masked_input_ids" in full
    assert all(torch.equal(full[k], light[k]) for k in full)


RECIPES = ["quickstart", "simcse_unsup", "simcse_sup", "sg_opt", "tacl", "clir", "pairs", "css_lm"]


@pytest.fixture(scope="module")
def pairs_shards(tmp_path_factory) -> str:
    """The bundled pairs sample as ``data_prep pairs`` writes it: the pairs objective lists its streams when built."""
    from pathlib import Path

    from data_prep.__main__ import main

    out = tmp_path_factory.mktemp("pairs")
    sample = Path(__file__).resolve().parents[1] / "data_prep" / "samples" / "xquad-en-train.parquet"
    assert main(["pairs", "--input", str(sample), "--out", str(out)]) == 0
    return str(out)


def recipe_objective(recipe: str, tiny: str, pairs_shards: str):
    """A bundled recipe's objective on the tiny BERT with MiniLM's tokenizer."""
    from clsys.recipes import OBJECTIVES, load_config
    from clsys.model.encoder import load_tokenizer

    extra = {"css_lm": ["objective.num_labels=2"],  # set by its pipeline from the task's data
             "pairs": [f"data.url={pairs_shards}", "objective.matryoshka_dims=[32]"]}.get(recipe, [])
    cfg = load_config(recipe, [f"model.name={tiny}", "model.init=scratch", "model.tokenizer=all-MiniLM-L6-v2", *extra])
    return OBJECTIVES[cfg.objective.name](cfg, load_tokenizer(cfg.model.tokenizer))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_objectives_data_spec_reaches_the_loader_workers(recipe, tiny, pairs_shards):
    """Each bundled recipe's objective: its data spec pickles (the forkserver's workers get it so; a lambda
    in it, say, would stop training at the first batch) and carries no modules, parameters or tensors."""
    objective = recipe_objective(recipe, tiny, pairs_shards)
    assert list(objective.parameters())
    data_side = pickle.loads(pickle.dumps(objective.data))
    assert training_state_in(data_side) == []


def test_loader_workers_start_with_what_their_collate_needs_imported(tiny, pairs_shards, tmp_path):
    """A loader worker is forked from the forkserver and then unpickles its collate. Whatever that pickle names and
    the forkserver had not imported, every worker imported again at every epoch: MiniLM's tokenizer class pulled in
    ``transformers.models`` (its import structure scanned from the source files), 0.3 s of CPU per worker start.
    With the forkserver's imports for each recipe's collate (``forkserver_preload``), unpickling it imports nothing;
    and none of them is transformers' modelling code (2 s of CPU a rank before every run's first batch)."""
    from clsys.data.loader_workers import forkserver_preload

    checks = []
    for recipe in RECIPES:
        collate = recipe_objective(recipe, tiny, pairs_shards).data.collate
        path = tmp_path / f"{recipe}.pkl"
        path.write_bytes(pickle.dumps(collate))
        checks.append((recipe, [m for m in forkserver_preload(collate) if m != "__main__"], str(path)))
    # One interpreter for all (each takes seconds to import torch): each recipe's preload, then its collate.
    script = "import importlib, json, pickle, sys\n" \
             f"for recipe, preload, path in {checks!r}:\n" \
             "    for name in preload: importlib.import_module(name)\n" \
             "    before = set(sys.modules)\n" \
             "    pickle.loads(open(path, 'rb').read())\n" \
             "    print(json.dumps([recipe, sorted(set(sys.modules) - before)]))\n" \
             "print(json.dumps(sorted(m for m in sys.modules if '.modeling_' in m or m.endswith('.modeling'))))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    *per_recipe, modelling = [json.loads(line) for line in proc.stdout.splitlines()]
    assert per_recipe == [[recipe, []] for recipe in RECIPES]
    assert modelling == []
