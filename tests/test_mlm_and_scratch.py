"""SimCSE's MLM auxiliary (a separate masked forward, weight × MLM added) and training from scratch
with a SentencePiece tokenizer from `data_prep tokenizer` (model.init: scratch)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from clsys.recipes import OBJECTIVES, load_config
from clsys.model.encoder import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
MINI = str(REPO / "clsys" / "configs" / "models" / "bert-mini.json")
TEXTS = [{"txt": t} for t in ["The cat sat on the mat in the warm sun.", "Stocks fell sharply on Monday.",
                               "Rivers flow into the sea after rain.", "A quiet evening in the old town."]]


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    """A 600-piece SentencePiece tokenizer trained on the bundled Wikipedia sample."""
    root = tmp_path_factory.mktemp("scratch")
    sample = sorted((REPO / "data_prep" / "samples").glob("*.bz2"))
    subprocess.run([sys.executable, "-m", "data_prep", "wiki", "--input", *map(str, sample), "--out", str(root / "shards")],
                   check=True, timeout=300, capture_output=True)
    subprocess.run([sys.executable, "-m", "data_prep", "tokenizer", "--input", str(root / "shards"),
                    "--vocab-size", "600", "--out", str(root / "tok")], check=True, timeout=300, capture_output=True)
    return str(root / "tok")


def test_mlm_auxiliary_adds_weighted_masked_lm_loss():
    torch.manual_seed(0)
    cfg = load_config("quickstart", ["objective.mlm_weight=0.1", "model.dropout=0.0"])
    tokenizer = load_tokenizer(cfg.model.name)
    objective = OBJECTIVES["simcse"](cfg, tokenizer)
    batch = objective.collate(TEXTS)
    assert batch["chosen"].any() and not torch.equal(batch["masked_input_ids"], batch["input_ids"])
    out = objective(batch)

    # Reference: the contrastive loss on clean inputs plus 0.1 × CE at the chosen positions of a
    # second forward over the masked copies.
    inputs = {k: v for k, v in batch.items() if k not in ("masked_input_ids", "chosen")}
    from clsys.objectives.contrastive import info_nce

    z = objective.mlp(objective.model(**inputs).last_hidden_state[:, 0])
    contrastive = info_nce(*z.chunk(2), 0.05)
    masked = objective.model(**{**inputs, "input_ids": batch["masked_input_ids"]}).last_hidden_state
    logits = objective.mlm_head(masked)[batch["chosen"]]
    mlm = F.cross_entropy(logits, batch["input_ids"][batch["chosen"]])
    torch.testing.assert_close(out.loss, contrastive + 0.1 * mlm)
    out.loss.backward()
    assert objective.mlm_head.predictions.transform.dense.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name,extra", [("simcse", []), ("tacl", ["data.max_length=64"])])
def test_objectives_train_from_scratch_with_a_sentencepiece_tokenizer(spm_tokenizer, name, extra):
    cfg = load_config("tacl" if name == "tacl" else "quickstart",
                      ["model.init=scratch", f"model.name={MINI}", f"model.tokenizer={spm_tokenizer}", *extra])
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    objective = OBJECTIVES[name](cfg, tokenizer)
    assert objective.encoder().config.vocab_size == len(tokenizer) == 600
    objective.train()
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=1e-3)
    samples = TEXTS * 2
    losses = []
    for _ in range(4):
        out = objective(objective.collate(samples))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))


def test_scratch_needs_a_tokenizer():
    from clsys.config import ConfigError

    with pytest.raises(ConfigError, match="model.tokenizer"):
        load_config("quickstart", ["model.init=scratch", f"model.name={MINI}"])
