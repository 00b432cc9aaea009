"""Build ``snli-dev-triplets.parquet`` here: (premise, entailment, contradiction) triplets of SNLI's development set,
the NLI source of ``bench/pairs_recipes.py`` (supervised SimCSE's kind of data: the entailed hypothesis is the
positive, the contradicted one the hard negative).

    python data_prep/samples/snli_triplets.py --csv snli_dev.csv   # rewrites snli-dev-triplets.parquet beside this file

From a CSV of SNLI 1.0's development set with the columns ``gold_label``, ``sentence1`` (the premise) and
``sentence2`` (the hypothesis), one row per labelled pair, as the Stanford NLP group distributes it: a Parquet row per
premise that has both an ``entailment`` and a ``contradiction`` hypothesis (2943 of them), in file order, the first
of each kind, in a layout ``python -m data_prep pairs`` reads (columns ``anchor``, ``positive``, ``negative``).
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
OUT = HERE / "snli-dev-triplets.parquet"


def build(csv_path: Path) -> pa.Table:
    """The file's rows: per premise, in order of first appearance, its first entailment and first contradiction."""
    hypotheses: dict[str, dict[str, str]] = {}
    with open(csv_path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            hypotheses.setdefault(row["sentence1"], {}).setdefault(row["gold_label"], row["sentence2"])
    kept = [(premise, by_label) for premise, by_label in hypotheses.items()
            if "entailment" in by_label and "contradiction" in by_label]
    return pa.table({"anchor": [premise for premise, _ in kept],
                     "positive": [by_label["entailment"] for _, by_label in kept],
                     "negative": [by_label["contradiction"] for _, by_label in kept]})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", type=Path, required=True, help="SNLI 1.0's development set as CSV")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the file to write (default: {OUT.name} here)")
    args = parser.parse_args(argv)
    pq.write_table(build(args.csv), args.out, compression="zstd")


if __name__ == "__main__":
    main()
