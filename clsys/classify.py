"""``python -m clsys.classify --model DIR FILE``: a trained classifier (a recipe's export) on a file of texts.

DIR is the ``export/`` folder (local, file:// or s3://) of a recipe that trains a classifier (few-shot
classification with retrieval, or its fine-tuning baseline): the encoder, the classifier's own weights and ``classifier.json`` (class
names, max length, the recipe). FILE is a labelled file in any format ``clsys.data.labeled`` reads (then the
accuracy is printed) or ``--texts`` a plain file, one text a line (then one predicted class a line).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from clsys import storage
from clsys.data.labeled import load_labeled
from clsys.recipes import HOMES


def load_local(folder: str):
    """The classifier in a local export folder, loaded by the recipe home that wrote it."""
    with open(os.path.join(folder, "classifier.json")) as f:
        recipe = json.load(f).get("recipe")  # absent in folders exported before it was recorded
    classifiers = {name: home.load_classifier for name, home in HOMES.items() if home.load_classifier is not None}
    if recipe is None and len(classifiers) == 1:
        recipe = next(iter(classifiers))
    if recipe not in classifiers:
        raise ValueError(f"{folder}/classifier.json: recipe {recipe!r} exports no classifier clsys knows "
                         f"(recipes that do: {', '.join(sorted(classifiers))})")
    return classifiers[recipe](folder)


def load(url: str):
    if storage.is_local(url):
        return load_local(storage.parse(url).path)
    with tempfile.TemporaryDirectory() as local:
        storage.download_dir(url, local)
        return load_local(local)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clsys.classify", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True,
                        help="a classifier recipe's export folder (local path or storage URL: file://, s3://, gs://, …)")
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
