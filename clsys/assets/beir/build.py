"""Build the bundled BEIR folders ``xquad-en`` and ``xquad-de`` from the bundled XQuAD files (``clsys/assets/xquad``).

    python clsys/assets/beir/build.py             # rewrites xquad-en/ and xquad-de/ beside this file
    python clsys/assets/beir/build.py --out DIR   # elsewhere (tests/test_beir.py compares the two)

Each folder, from ``xquad.<lang>.json`` (48 Wikipedia articles, 5 paragraphs each, 1190 questions):
  corpus.jsonl    the 240 paragraphs; ``_id`` "<article>-<paragraph>" (article 00-47 in file order, paragraph
                  0-4), ``title`` the article's title with "_" as spaces (XQuAD keeps the English titles in
                  every language), ``text`` the paragraph, unchanged
  queries.jsonl   the 1190 questions; ``_id`` XQuAD's question id (the same in every language), ``text`` unchanged
  qrels/test.tsv  each question of articles 24-47 -> the paragraph it was asked about, score 1 (558 rows): the
                  held-out half, which no bundled training data holds
  qrels/dev.tsv   the same for articles 0-23 (632 rows): disjoint from test, but the bundled CLIR fixtures
                  (tests/data/clir) are built from these articles' text
One corpus for both splits, as in BEIR: a test question retrieves among all 240 paragraphs.
The output is byte-identical on every run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
XQUAD = HERE.parent / "xquad"
LANGUAGES = ("en", "de")
SPLITS = {"dev": range(0, 24), "test": range(24, 48)}


def build(lang: str, out: Path) -> None:
    articles = json.loads((XQUAD / f"xquad.{lang}.json").read_text(encoding="utf-8"))["data"]
    corpus, queries, qrels = [], [], {split: [] for split in SPLITS}
    for a, article in enumerate(articles):
        split = next(name for name, selected in SPLITS.items() if a in selected)
        for p, paragraph in enumerate(article["paragraphs"]):
            doc_id = f"{a:02d}-{p}"
            corpus.append({"_id": doc_id, "title": article["title"].replace("_", " "), "text": paragraph["context"]})
            for qa in paragraph["qas"]:
                queries.append({"_id": qa["id"], "text": qa["question"]})
                qrels[split].append(f"{qa['id']}\t{doc_id}\t1")
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    for name, records in (("corpus.jsonl", corpus), ("queries.jsonl", queries)):
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    for split, rows in qrels.items():
        (out / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(r + "\n" for r in rows),
                                                    encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="where the xquad-<lang> folders go (default: here)")
    args = parser.parse_args(argv)
    for lang in LANGUAGES:
        build(lang, args.out / f"xquad-{lang}")


if __name__ == "__main__":
    main()
