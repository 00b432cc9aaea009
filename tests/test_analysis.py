"""Token-similarity heatmaps: the matrix against a loop reference, and the CLI's PNG."""
from __future__ import annotations

import subprocess
import sys

import torch
from PIL import Image

from clsys.analysis.heatmap import token_similarity
from clsys.model.encoder import load_encoder, load_tokenizer


def test_similarity_matrix_matches_pairwise_cosine():
    model, tokenizer = load_encoder("all-MiniLM-L6-v2"), load_tokenizer("all-MiniLM-L6-v2")
    tokens, sim = token_similarity(model, tokenizer, "A small cat naps.")
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and sim.shape == (len(tokens), len(tokens))
    with torch.no_grad():
        hidden = model(**tokenizer(["A small cat naps."], return_tensors="pt")).last_hidden_state[0]
    for i in range(len(tokens)):
        for j in range(len(tokens)):
            want = torch.cosine_similarity(hidden[i], hidden[j], dim=0)
            assert abs(sim[i, j].item() - want.item()) < 1e-5


def test_cli_draws_one_panel_per_model(tmp_path):
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    base = [sys.executable, "-m", "clsys.analyze", "heatmap", "--text", "The cat sat on the mat."]
    assert subprocess.run(base + ["--model", "all-MiniLM-L6-v2", "--out", str(one)], timeout=120).returncode == 0
    assert subprocess.run(base + ["--model", "all-MiniLM-L6-v2"] * 2 + ["--out", str(two)], timeout=120).returncode == 0
    assert Image.open(two).size[0] > 1.5 * Image.open(one).size[0]
    missing = subprocess.run(base + ["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "error:" in missing.stderr
