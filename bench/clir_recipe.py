"""Cross-lingual retrieval pretraining (QLM + RR) before/after, on held-out XQuAD articles and Tatoeba.

    python bench/clir_recipe.py [--steps 300] [--out runs/bench-clir]

1. `data_prep align` on the bundled fixtures (tests/data/clir: Wikipedia text of XQuAD articles 0-23
   in en/de/es as MediaWiki dumps + langlinks SQL) → clir/en-de and clir/en-es streams;
2. the clir recipe (2 Ray workers, ZeRO-2, QLM and RR alternating per pair) from all-MiniLM-L6-v2;
3. XQuAD question→paragraph retrieval on the held-out articles 24-47 (en↔de, en↔es: bi-encoder with
   mean pooling, and the trained RR head re-ranking the bi-encoder's top 10) and Tatoeba deu-eng,
   spa-eng bitext accuracy, for the base model and the trained one.
Wall times are measured in this one run on this machine. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from clsys.model.encoder import load_encoder, load_tokenizer  # noqa: E402
from clsys.retrieval import evaluate_tatoeba, evaluate_xquad, hf_reranker, parse_articles  # noqa: E402

MODEL = "all-MiniLM-L6-v2"
FIXTURES = REPO / "tests" / "data" / "clir"
DIRECTIONS = ("en-de", "de-en", "en-es", "es-en")
TATOEBA = ("deu-eng", "spa-eng")
HELD_OUT = "24:48"


def run(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=REPO, check=True)
    return time.perf_counter() - start


def measure(model_dir: str, reranker_dir: str | None) -> dict[str, float]:
    encoder, tokenizer = load_encoder(model_dir), load_tokenizer(model_dir)
    reranker = hf_reranker(reranker_dir, max_length=256) if reranker_dir else None
    scores = {}
    for direction in DIRECTIONS:
        q, _, d = direction.partition("-")
        result = evaluate_xquad(encoder, tokenizer, q, d, "mean", parse_articles(HELD_OUT), reranker, 10)
        scores[f"{direction} MRR@10"] = result["mrr@10"]
        scores[f"{direction} R@1"] = result["recall@1"]
        if reranker:
            scores[f"{direction} MRR@10 (RR re-rank)"] = result["rerank_mrr@10"]
            scores[f"{direction} R@1 (RR re-rank)"] = result["rerank_recall@1"]
    for pair in TATOEBA:
        result = evaluate_tatoeba(encoder, tokenizer, pair, "mean")
        scores[f"tatoeba {pair} (both directions, mean)"] = (result["xxx->eng"] + result["eng->xxx"]) / 2
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/bench-clir")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    shards = os.path.join(out, "shards")

    dumps = [f"{lang}={FIXTURES / f'{lang}wiki-20261101-pages-articles.xml.bz2'}" for lang in ("en", "de", "es")]
    links = [f"{lang}={FIXTURES / f'{lang}wiki-20261101-langlinks.sql.gz'}" for lang in ("en", "de")]
    run("-m", "data_prep", "align", "--dumps", *dumps, "--langlinks", *links, "--out", shards,
        "--pairs", "en-de", "en-es", "--shard-size-mb", "0.1")

    train_s = run("-m", "clsys.pretrain", "--config", "clir", f"data.url={shards}", f"train.run_root={out}",
                  "train.name=clir", f"train.steps={args.steps}", f"train.ckpt_every={args.steps}",
                  "eval.xling=[]", "eval.tatoeba=[]", "train.log_every=20")
    export = os.path.join(out, "clir", "export")

    before = measure(MODEL, None)
    after = measure(export, os.path.join(export, "reranker"))
    print(f"\nclir recipe: {args.steps} optimizer steps (QLM/RR alternating over en-de, en-es), "
          f"training job {train_s / 60:.1f} min wall\n")
    print(f"| metric (held-out XQuAD articles {HELD_OUT}; Tatoeba) | {MODEL} | + QLM/RR |")
    print("|---|---|---|")
    for key, value in after.items():
        base = f"{before[key]:.2f}" if key in before else "— (no RR head)"
        print(f"| {key} | {base} | {value:.2f} |")


if __name__ == "__main__":
    main()
