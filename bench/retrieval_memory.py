"""Peak memory of ``python -m clsys.evaluate --retrieval`` against the corpus' size and one document's length.

    python bench/retrieval_memory.py [--docs 100000 1000000] [--lengths 1000 1048576 33554432] [--max-length 4]
                                     [--batch-size 1024]

Each run is its own process; its peak resident memory is the kernel's (``bench/process_runs.py``'s
``peak_rss_mib``). Two series over BEIR folders written here:

  corpus size      --docs documents of 330 characters of words (about MS MARCO's passages), 8-character ids
  document length  one document of each --lengths characters, among 999 of 330

Two queries, graded on the first two documents. The model: a random 1-layer BERT (hidden 32) with the packaged
tokenizer and mean pooling, reading --max-length tokens in batches of --batch-size, so that embedding costs
little beside reading the corpus: what is measured is what a run holds. Printed: one line a run (its peak RSS),
and ``ratio <name> <value>`` lines: the bytes a document adds between the smallest and the largest corpus (the
text itself is 330 bytes a document), and the MiB the longest document adds over the shortest. Not part of the
test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from process_runs import peak_rss_mib  # noqa: E402 (bench/, beside this script)

DOC_CHARS = 330
VOCABULARY = [f"{stem}{n}" for stem in ("passage", "query", "model", "search", "rank", "text") for n in range(50)]


def words(chars: int, rng: random.Random) -> str:
    text = " ".join(rng.choices(VOCABULARY, k=chars // 6 + 1))
    return text[:chars]


def write_folder(folder: Path, lengths: list[int]) -> Path:
    """A BEIR folder of one document a length (characters), written a line at a time."""
    rng = random.Random(0)
    (folder / "qrels").mkdir(parents=True)
    with open(folder / "corpus.jsonl", "w") as corpus:
        for i, chars in enumerate(lengths):
            corpus.write(json.dumps({"_id": f"{i:08d}", "title": "", "text": words(chars, rng)}) + "\n")
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": words(40, rng)}) + "\n"
                                                  for i in range(2)))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq0\t00000000\t1\nq1\t00000001\t1\n")
    return folder


def tiny_model(folder: Path) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    from clsys.model.encoder import load_tokenizer

    tokenizer = load_tokenizer("all-MiniLM-L6-v2")
    tokenizer.save_pretrained(folder)
    # memory, not quality, is measured: the smallest BERT that reads the packaged tokenizer's ids
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    return folder


def peak_mib(model: Path, folder: Path, args: argparse.Namespace) -> float:
    return peak_rss_mib([sys.executable, "-m", "clsys.evaluate", "--model", str(model), "--pooling", "mean",
                         "--retrieval", str(folder), "--max-length", str(args.max_length), "--batch-size",
                         str(args.batch_size)], folder.parent / f"{folder.name}.log",
                        {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}, timeout_s=3600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, nargs="*", default=[100_000, 1_000_000])
    p.add_argument("--lengths", type=int, nargs="*", default=[1000, 1 << 20, 32 << 20])
    p.add_argument("--max-length", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=1024)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="retrieval-memory-") as tmp:
        tmp = Path(tmp)
        model = tiny_model(tmp / "model")
        by_docs = {}
        for n in args.docs:
            by_docs[n] = peak_mib(model, write_folder(tmp / f"docs-{n}", [DOC_CHARS] * n), args)
            print(f"corpus {n} documents of {DOC_CHARS} characters: peak RSS {by_docs[n]:.0f} MiB", flush=True)
            (tmp / f"docs-{n}" / "corpus.jsonl").unlink()
        by_length = {}
        for chars in args.lengths:
            by_length[chars] = peak_mib(model, write_folder(tmp / f"long-{chars}", [chars] + [DOC_CHARS] * 999), args)
            print(f"one document of {chars} characters among 999 of {DOC_CHARS}: peak RSS {by_length[chars]:.0f} MiB",
                  flush=True)
    if len(by_docs) > 1:
        small, large = min(by_docs), max(by_docs)
        print(f"ratio bytes_per_document {(by_docs[large] - by_docs[small]) * 2**20 / (large - small):.0f}")
    if len(by_length) > 1:
        print(f"ratio longest_document_adds_mib {by_length[max(by_length)] - by_length[min(by_length)]:.0f}")


if __name__ == "__main__":
    main()
