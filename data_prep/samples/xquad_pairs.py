"""Build ``xquad-en-train.parquet`` here: question → paragraph pairs with hard negatives from XQuAD's English articles
0-23, the bundled data of the pairs walk-through (docs/training/pairs.md).

    python data_prep/samples/xquad_pairs.py             # rewrites xquad-en-train.parquet beside this file
    python data_prep/samples/xquad_pairs.py --out FILE  # elsewhere (tests/test_pairs_objective.py compares the two)

From ``clsys/assets/xquad/xquad.en.json`` (48 Wikipedia articles of 5 paragraphs, 1190 questions): a Parquet row per
question of articles 0-23 (632), in file order, in a layout ``python -m data_prep pairs`` reads (columns ``query``,
``positive`` and the list ``negatives``). Parquet, not JSON lines: its dictionary encoding stores each of the 120
paragraphs once, and the file takes 0.1 MB where the same rows as JSON lines take 2.6 MB.
  query      the question, unchanged
  positive   the paragraph it was asked about, as the bundled BEIR folder ``xquad-en`` holds it as a document (the
             article's title with "_" as spaces, a space, the paragraph): what evaluation embeds
  negatives  the NEGATIVES paragraphs of the other articles among 0-23 (in the same form) that share the most with
             the question: the sum of the inverse document frequency (among those 120 paragraphs) of the question's
             distinct words they hold, ties to the earlier paragraph. Lexical look-alikes, as BM25-mined negatives
             are; none of them was written about the question's article.
Articles 24-47 stay out: ``qrels/test.tsv`` of ``xquad-en`` asks their 558 questions, so a model trained on this file
is tested on questions it has never seen about paragraphs it has never read (among all 240 paragraphs).
The rows are the same on every run (the bytes, for one version of pyarrow).
"""
from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
XQUAD = HERE.parents[1] / "clsys" / "assets" / "xquad" / "xquad.en.json"
OUT = HERE / "xquad-en-train.parquet"
ARTICLES = range(0, 24)  # the dev split of the bundled BEIR folder xquad-en; 24-47 are its test split
NEGATIVES = 3


def words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def build() -> pa.Table:
    """The file's rows."""
    articles = json.loads(XQUAD.read_text(encoding="utf-8"))["data"]
    paragraphs = [(a, f"{articles[a]['title'].replace('_', ' ')} {p['context']}".strip(), p["qas"])
                  for a in ARTICLES for p in articles[a]["paragraphs"]]
    vocab = [words(text) for _, text, _ in paragraphs]
    frequency: dict[str, int] = {}
    for seen in vocab:
        for word in seen:
            frequency[word] = frequency.get(word, 0) + 1
    idf = {word: math.log(len(paragraphs) / n) for word, n in frequency.items()}
    rows: dict[str, list] = {"query": [], "positive": [], "negatives": []}
    for article, positive, questions in paragraphs:
        for qa in questions:
            asked = words(qa["question"])
            others = [i for i, (a, _, _) in enumerate(paragraphs) if a != article]
            scores = {i: sum(idf[w] for w in sorted(asked & vocab[i])) for i in others}  # one order: one float
            ranked = sorted(others, key=lambda i: (-scores[i], i))[:NEGATIVES]
            rows["query"].append(qa["question"])
            rows["positive"].append(positive)
            rows["negatives"].append([paragraphs[i][1] for i in ranked])
    return pa.table(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"the file to write (default: {OUT.name} here)")
    args = parser.parse_args(argv)
    pq.write_table(build(), args.out, compression="zstd")


if __name__ == "__main__":
    main()
