"""clsys/driver/keys.py (every key with its type, default and meaning, from the config dataclasses) and
docs/hooks/config_reference.py, the configuration reference generated from it (the docs build itself,
`mkdocs build --strict`, runs first in `make test`)."""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from clsys.driver import keys as config_keys

HOOK = Path(__file__).resolve().parents[1] / "docs" / "hooks" / "config_reference.py"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("config_reference", HOOK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as MkDocs loads a hook (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@dataclass
class _Inner:
    size: int = 0  # rows per chunk


@dataclass
class _Documented:
    name: str = "x"  # the name
    # a meaning written
    # above the field
    ratio: float = 3e-5
    pairs: list[str] = field(default_factory=lambda: ["en-de"])  # language pairs
    group: _Inner = field(default_factory=_Inner)


@dataclass
class _Undocumented:
    fine: int = 1  # has one
    steps: int = 200


def test_every_key_with_type_default_and_meaning(gen):
    text = gen.render()
    assert "| `train.steps` | `int` | `200` | optimizer steps |" in text
    assert "| `objective.grad_cache.chunk_size` | `int` | `0` |" in text
    # the quickstart recipe's value beside the default, a YAML-quoted string, a per-objective table
    assert "| `optim.lr` | `float` | `3e-5` (quickstart: `6e-5`) | AdamW learning rate |" in text
    assert "| `train.zero_stage` | `int or str` | `auto` |" in text
    assert "| `train.precision` | `str` | `auto` |" in text
    assert '| `eval.xling_articles` | `str` | `"24:48"` |' in text
    assert "### `objective.name: clir` {#objective-clir}" in text
    assert "| `objective.pairs` | `list[str]` | `[en-de]` |" in text
    assert "sg \\| opt1 \\| opt2 \\| sg_opt" in text  # a pipe in a comment does not split the row
    # a closed set (Literal): its values' type, and the values after the meaning, whatever alias names the set
    assert "without being asked (one of fp32 \\| bf16 \\| bf16_weights \\| auto) |" in text
    assert ("| `objective.export_pooling` | `str` | `mean` | bi-encoder pooling of the exported encoder "
            "(one of cls \\| mean \\| max) |") in text
    assert "| `objective.tasks` | `list[str]` | `[qlm, rr]` |" in text and "(each one of qlm \\| rr) |" in text
    # an objective's nested groups, and the top-level sections it still reads (CSS-LM's task and corpus)
    assert "| `objective.task.train` | `str` | `\"\"` | labelled training file" in text
    assert "| `objective.corpus.bank_size` | `int` | `40000` |" in text
    assert "Its groups `task`, `corpus` are also read as top-level sections" in text


def test_meanings_from_trailing_and_leading_comments_nested_keys():
    rows = {r.key: r for r in config_keys.walk(_Documented(), "demo")}
    assert list(rows) == ["demo.name", "demo.ratio", "demo.pairs", "demo.group.size"]
    assert rows["demo.name"].meaning == "the name"
    assert rows["demo.ratio"].meaning == "a meaning written above the field"
    assert rows["demo.group.size"].meaning == "rows per chunk"
    assert config_keys.yaml_value(rows["demo.ratio"].default) == "3e-5"
    assert config_keys.yaml_value(rows["demo.pairs"].default) == "[en-de]"


def test_a_field_without_meaning_fails_naming_it():
    with pytest.raises(config_keys.ConfigKeyError,
                       match=r"'demo\.steps' \(_Undocumented\.steps, .*test_docs_config_reference\.py:\d+\)"):
        config_keys.walk(_Undocumented(), "demo")


def test_notes_and_key_tables_name_only_real_keys(gen):
    page = "# Reference\n\n<!-- config-notes\ntrain.steps: more on steps\n-->\n\n<!-- config-reference -->\n"
    out = gen.expand(page)
    assert "config-notes" not in out and "| optimizer steps<br>more on steps |" in out
    with pytest.raises(gen.ConfigKeyError, match="train.stepz"):
        gen.expand(page.replace("train.steps:", "train.stepz:"))
    table = "| key | default | meaning |\n|---|---|---|\n| `objective.pairs`, `objective.task.dev` | x | y |\n"
    gen.check_key_tables(table, "page.md")  # objective.* keys: of any objective
    with pytest.raises(gen.ConfigKeyError, match=r"page\.md:4: 'objective\.pair' "):
        gen.check_key_tables(table + "| `objective.pair` | x | y |\n", "page.md")


def test_every_config_field_is_documented(gen):
    from clsys.config import Config

    keys = gen.known_keys()
    for f in dataclasses.fields(Config):
        assert any(k.startswith(f.name + ".") for k in keys), f.name
