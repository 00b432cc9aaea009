"""Token-by-token cosine-similarity heatmaps of an encoder's last layer (TaCL's analysis).

A well-trained token-aware encoder shows a sharp diagonal (each token most similar to itself and
distinct from its neighbours); an anisotropic one shows a uniformly bright square. Panels for
several models side by side compare, e.g., the encoder before and after training.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Panel:
    title: str
    tokens: list[str]
    similarity: torch.Tensor  # [n_tokens, n_tokens] cosine similarities


@torch.no_grad()
def token_similarity(model: nn.Module, tokenizer, text: str, max_length: int = 64) -> tuple[list[str], torch.Tensor]:
    """Tokens of ``text`` (special tokens included) and the cosine similarity of their last-layer vectors."""
    was_training = model.training
    model.eval()
    batch = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
    batch = batch.to(next(model.parameters()).device)
    hidden = F.normalize(model(**batch).last_hidden_state[0].float(), dim=-1)
    model.train(was_training)
    return tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist()), (hidden @ hidden.T).cpu()


def render(panels: list[Panel]) -> bytes:
    """The panels side by side as one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display; safe in workers and CI
    import matplotlib.pyplot as plt

    n = max(len(p.tokens) for p in panels)
    size = max(4.0, 0.28 * n)
    fig, axes = plt.subplots(1, len(panels), figsize=(size * len(panels) + 1.5, size), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        image = ax.imshow(panel.similarity.numpy(), vmin=-1, vmax=1, cmap="viridis")
        ax.set_title(panel.title, fontsize=10)
        ax.set_xticks(range(len(panel.tokens)), panel.tokens, rotation=90, fontsize=7)
        ax.set_yticks(range(len(panel.tokens)), panel.tokens, fontsize=7)
    fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="cosine similarity")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()
