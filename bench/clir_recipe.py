"""Cross-lingual retrieval pretraining (QLM + RR) before/after, on held-out XQuAD articles and Tatoeba.

    python bench/clir_recipe.py [--model e5|all-MiniLM-L6-v2|DIR] [--steps 300] [--out runs/bench-clir] [KEY=VALUE ...] [--rerank DIR ...]

1. `data_prep align` on the bundled fixtures (tests/data/clir: Wikipedia text of XQuAD articles 0-23
   in en/de/es as MediaWiki dumps + langlinks SQL) → clir/en-de and clir/en-es streams;
2. the clir recipe (2 Ray workers, ZeRO-2, QLM and RR alternating per pair) from ``--model``: by default
   multilingual-e5-small (rebuilt by bench/e5_model.py into runs/models/ on first use), or the English
   all-MiniLM-L6-v2, or any BERT folder;
3. XQuAD question→paragraph retrieval on the held-out articles 24-47 (en↔de, en↔es: bi-encoder with
   mean pooling, and the trained RR head re-ranking the bi-encoder's top 10) and Tatoeba deu-eng,
   spa-eng bitext accuracy, for the base model and the trained one; and the base model's top 10
   re-ranked by the trained RR head (the base retriever kept, the QLM/RR model as its re-ranker).
KEY=VALUE arguments are passed on to the recipe as overrides (e.g. optim.lr=5e-6).
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
from clsys.eval.retrieval import evaluate_tatoeba, evaluate_xquad, hf_reranker, parse_articles  # noqa: E402

E5_DIR = REPO / "runs" / "models" / "multilingual-e5-small"
FIXTURES = REPO / "tests" / "data" / "clir"
DIRECTIONS = ("en-de", "de-en", "en-es", "es-en")
TATOEBA = ("deu-eng", "spa-eng")
HELD_OUT = "24:48"


def run(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=REPO, check=True)
    return time.perf_counter() - start


def measure(model_dir: str, reranker_dir: str | None, rerank: tuple[str, ...] = DIRECTIONS) -> dict[str, float]:
    """Bi-encoder (mean pooling) figures of ``model_dir``; with ``reranker_dir``, also its top 10
    re-ranked by that RR head in the directions ``rerank``."""
    encoder, tokenizer = load_encoder(model_dir), load_tokenizer(model_dir)
    reranker = hf_reranker(reranker_dir, max_length=256) if reranker_dir else None
    scores = {}
    for direction in DIRECTIONS:
        q, _, d = direction.partition("-")
        result = evaluate_xquad(encoder, tokenizer, q, d, "mean", parse_articles(HELD_OUT),
                                reranker if direction in rerank else None, 10)
        scores[direction] = (result["mrr@10"], result["recall@1"])
        if "rerank_mrr@10" in result:
            scores[f"{direction} re-ranked"] = (result["rerank_mrr@10"], result["rerank_recall@1"])
    for pair in TATOEBA:
        result = evaluate_tatoeba(encoder, tokenizer, pair, "mean")
        scores[pair] = ((result["xxx->eng"] + result["eng->xxx"]) / 2,)
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="e5", help="e5 (multilingual-e5-small), a packaged alias or a folder")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/bench-clir")
    parser.add_argument("--rerank", nargs="*", default=list(DIRECTIONS), choices=DIRECTIONS,
                        help="directions the RR head re-ranks, none when empty (a cross-encoder pass per question "
                             "× top 10: ~12 min a direction for e5-small on 2 CPU cores); put it after KEY=VALUE")
    parser.add_argument("--eval-only", action="store_true",
                        help="evaluate the run already in --out (exported from its checkpoint if need be)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, KEY=VALUE")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    shards = os.path.join(out, "shards")
    model = args.model
    if model == "e5":
        from e5_model import build_e5_small

        model = str(build_e5_small(E5_DIR))

    export = os.path.join(out, "clir", "export")
    train_s = 0.0
    if not args.eval_only:
        dumps = [f"{lang}={FIXTURES / f'{lang}wiki-20261101-pages-articles.xml.bz2'}" for lang in ("en", "de", "es")]
        links = [f"{lang}={FIXTURES / f'{lang}wiki-20261101-langlinks.sql.gz'}" for lang in ("en", "de")]
        run("-m", "data_prep", "align", "--dumps", *dumps, "--langlinks", *links, "--out", shards,
            "--pairs", "en-de", "en-es", "--shard-size-mb", "0.1")
        train_s = run("-m", "clsys.pretrain", "--config", "clir", f"data.url={shards}", f"train.run_root={out}",
                      "train.name=clir", f"model.name={model}", f"train.steps={args.steps}",
                      f"train.ckpt_every={args.steps}", "eval.xling=[]", "eval.tatoeba=[]", "train.log_every=20",
                      *args.overrides)
    elif not os.path.exists(export):
        run("-m", "clsys.export", "--checkpoint", "latest", "--run", os.path.join(out, "clir"), "--out", export)

    reranker = os.path.join(export, "reranker")
    rerank = tuple(args.rerank)
    before, after = measure(model, None), measure(export, reranker, rerank)
    base_reranked = measure(model, reranker, rerank)  # the base retriever kept, the trained RR head added
    print(f"\nclir recipe from {model}: {args.steps} optimizer steps (QLM/RR alternating over en-de, en-es), "
          f"training job {train_s / 60:.1f} min wall\n")
    print(f"Held-out XQuAD articles {HELD_OUT}, MRR@10 / R@1; Tatoeba: accuracy, mean of both directions.\n")
    print("| direction | base bi-encoder | + QLM/RR bi-encoder | + QLM/RR, RR re-rank of its top 10 "
          "| base bi-encoder, RR re-rank of its top 10 |")
    print("|---|---|---|---|---|")

    def cell(value: tuple) -> str:
        return " / ".join(f"{v:.2f}" for v in value)

    for key in DIRECTIONS:
        reranked = f"{key} re-ranked"
        own, base = (cell(after[reranked]), cell(base_reranked[reranked])) if key in rerank else ("–", "–")
        print(f"| {key} | {cell(before[key])} | {cell(after[key])} | {own} | {base} |")
    for key in TATOEBA:
        print(f"| Tatoeba {key} | {cell(before[key])} | {cell(after[key])} | – | – |")
    print("\n| change in bi-encoder MRR@10 (+ QLM/RR − base) | " +
          " | ".join(f"{key} {after[key][0] - before[key][0]:+.2f}" for key in DIRECTIONS) + " |")


if __name__ == "__main__":
    main()
