"""The classifier a CSS-LM run exports (``<run>/export/``): its encoder, ``task_head.safetensors`` over the two
views [u; v] and ``classifier.json`` (class names, max length), as ``python -m clsys.classify`` uses it."""
from __future__ import annotations

import json
import os

import safetensors.torch
import torch

from clsys.data.labeled import LabeledSet
from clsys.model.encoder import load_encoder, load_tokenizer
from clsys.recipes.css_lm.bank import two_views
from clsys.recipes.css_lm.objective import task_head


class Classifier:
    def __init__(self, folder: str):
        """``folder``: a local export folder."""
        with open(os.path.join(folder, "classifier.json")) as f:
            meta = json.load(f)
        self.labels: list[str] = meta["labels"]
        self.max_length: int = meta["max_length"]
        self.encoder = load_encoder(folder).eval()
        self.tokenizer = load_tokenizer(folder)
        self.head = task_head(self.encoder.config.hidden_size, len(self.labels), 0.0).eval()
        self.head.load_state_dict(safetensors.torch.load_file(os.path.join(folder, "task_head.safetensors")))

    @torch.no_grad()
    def logits(self, texts: list[str], batch_size: int = 64) -> torch.Tensor:
        out = []
        for start in range(0, len(texts), batch_size):
            batch = self.tokenizer(texts[start:start + batch_size], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt", return_token_type_ids=False)
            hidden = self.encoder(**batch).last_hidden_state
            out.append(self.head(torch.cat(two_views(hidden, batch["attention_mask"]), -1)))
        return torch.cat(out) if out else torch.empty(0, len(self.labels))

    def predict(self, texts: list[str], batch_size: int = 64) -> list[str]:
        return [self.labels[i] for i in self.logits(texts, batch_size).argmax(-1).tolist()]

    def accuracy(self, data: LabeledSet, batch_size: int = 64) -> float:
        """``data`` must be read with this classifier's class names (``load_labeled(path, classifier.labels)``)."""
        predicted = self.logits(data.texts, batch_size).argmax(-1)
        return float((predicted == torch.tensor(data.labels)).float().mean())
