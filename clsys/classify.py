"""``python -m clsys.classify --model DIR FILE``: a trained CSS-LM / fine-tuned classifier on a file of texts.

DIR is a CSS-LM run's ``export/`` folder (local, file:// or s3://): the encoder, ``task_head.safetensors``
and ``classifier.json`` (class names, max length). FILE is a labelled file in any format
``clsys.data.labeled`` reads (then the accuracy is printed) or ``--texts`` a plain file, one text a
line (then one predicted class a line).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import safetensors.torch
import torch

from clsys import storage
from clsys.data.labeled import LabeledSet, load_labeled
from clsys.model.encoder import load_encoder, load_tokenizer
from clsys.objectives.css_lm import task_head
from clsys.retrieval_bank import two_views


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


def load(url: str) -> Classifier:
    if storage.is_local(url):
        return Classifier(storage.parse(url).path)
    with tempfile.TemporaryDirectory() as local:
        storage.download_dir(url, local)
        return Classifier(local)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clsys.classify", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="a CSS-LM run's export folder (local path or storage URL: file://, s3://, gs://, …)")
    parser.add_argument("--texts", action="store_true", help="FILE is plain text, one example a line: print predictions")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("file")
    args = parser.parse_args(argv)
    try:
        classifier = load(args.model)
        if args.texts:
            with open(args.file, encoding="utf-8") as f:
                texts = [line.rstrip("\n") for line in f if line.strip()]
            print("\n".join(classifier.predict(texts, args.batch_size)))
            return 0
        data = load_labeled(args.file, classifier.labels)
        accuracy = classifier.accuracy(data, args.batch_size)
        print(storage.redact(f"{args.file}: accuracy {accuracy:.4f} on {len(data)} examples"))
    except (FileNotFoundError, ValueError, storage.StorageError) as err:
        print(f"error: {storage.redact(str(err))}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
