"""The exported folder's model card (clsys/model/card.py) and clsys.evaluate's pooling taken from a folder."""
from __future__ import annotations

import json

import pytest
import yaml

from clsys.recipes import load_config
from clsys.evaluate import folder_pooling
from clsys.model.card import add_evaluation, write_card


def test_card_says_what_was_trained_and_carries_the_evaluation(tmp_path):
    # As checkpoints hold it: train.zero_stage auto made the stage the run used.
    config = json.loads(json.dumps(load_config("quickstart", ["train.steps=200", "train.zero_stage=0"]).to_dict()))
    record = {"checkpoint": "file:///runs/quickstart/checkpoints/step-00000100", "step": 100,
              "chosen": "best stsb-en-dev_spearman 85.21 at step 100", "objective": "simcse", "pooling": "cls",
              "pooler": "all-MiniLM-L6-v2's, untrained"}
    write_card(str(tmp_path), record, config)
    card = (tmp_path / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "all-MiniLM-L6-v2" and front["library_name"] == "sentence-transformers"
    for row in ("| objective | `simcse` |", "| steps | 100 of 200, global batch 32, max length 32 |",
                "| optimizer | AdamW, lr 6e-05 (linear, 0 warm-up steps), weight decay 0 |",
                "| run | 2 worker(s), DeepSpeed ZeRO-0, precision auto, seed 42 |", "| pooling | `cls` |"):
        assert row in card, row
    assert "Chosen on the development set during training: best stsb-en-dev_spearman 85.21 at step 100." in card
    # The config block is the run's config, a recipe that loads back.
    block = card.split("```yaml\n")[1].split("```")[0]
    (tmp_path / "config.yaml").write_text(block)
    assert load_config(str(tmp_path / "config.yaml")) == load_config("quickstart", ["train.steps=200", "train.zero_stage=0"])

    rows = [{"model": "before", "pooling": "cls", "spearman": 73.5, "pearson": 73.37},
            {"model": "after", "pooling": "cls", "spearman": 79.34, "pearson": 80.19}]
    add_evaluation(f"file://{tmp_path}", "STS test: stsb-en-test (1379 pairs), cosine, ×100", rows)
    card = (tmp_path / "README.md").read_text()
    evaluation = card.split("## Evaluation\n\n")[1].split("## Configuration")[0]
    assert evaluation.startswith("STS test: stsb-en-test (1379 pairs), cosine, ×100:\n")
    assert "| after | cls | 79.34 | 80.19 |" in evaluation and "Chosen on the development set" in evaluation


def test_card_of_a_model_from_scratch_names_no_base(tmp_path):
    config = json.loads(json.dumps(load_config("quickstart", ["model.init=scratch", "model.tokenizer=tok"]).to_dict()))
    record = {"checkpoint": "s3://b/r/checkpoints/step-00000008", "step": 8, "chosen": "latest",
              "objective": "simcse", "pooling": "cls", "pooler": "initialised (seed 0), untrained"}
    write_card(str(tmp_path), record, config)
    card = (tmp_path / "README.md").read_text()
    assert "base_model" not in yaml.safe_load(card.split("---")[1])
    assert "all-MiniLM-L6-v2 (architecture only, from scratch)" in card and "the run's latest one" in card
    (tmp_path / "README.md").write_text("# edited by hand\n")
    with pytest.raises(ValueError, match="no '## Evaluation' section"):
        add_evaluation(str(tmp_path), "t", [])


def test_pooling_is_read_from_a_sentence_transformers_folder(tmp_path):
    def folder(name: str, modes: dict, after: list[str]) -> str:
        path = tmp_path / name
        (path / "1_Pooling").mkdir(parents=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **modes}))
        modules = [{"type": f"sentence_transformers.models.{t}"} for t in ("Transformer", "Pooling", *after)]
        (path / "modules.json").write_text(json.dumps(modules))
        return str(path)

    assert folder_pooling(folder("cls", {"pooling_mode_cls_token": True}, [])) == "cls"
    assert folder_pooling(folder("mean", {"pooling_mode_mean_tokens": True}, ["Normalize"])) == "mean"
    # A Dense head after the pooling (supervised SimCSE's cls_mlp) or two modes at once: no plain pooling.
    assert folder_pooling(folder("dense", {"pooling_mode_cls_token": True}, ["Dense"])) is None
    assert folder_pooling(folder("two", {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, [])) is None
    assert folder_pooling(str(tmp_path / "missing")) is None
