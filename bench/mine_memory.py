"""A mining worker's peak memory against the texts of its slice: ``python -m clsys.mine`` with one Ray worker.

    python bench/mine_memory.py [--texts 10000 50000 200000] [--words 10] [--max-length 32] [--layers 6]

The data: ``--queries`` XQuAD questions with their paragraphs (``data_prep pairs``) and, as ``--corpus``, a
``sentences`` stream of N distinct texts of ``--words`` random common words and a number (10 words: ~14 tokens
for all-MiniLM-L6-v2, as MS MARCO's shortest passages); the packaged all-MiniLM-L6-v2 (384 dimensions: 1.5 KB of
vector a text), or its first ``--layers`` layers (the same vectors' size and tokens, for a machine where the
whole model takes too long: what is measured is the slice's memory, not the model's). One run per N, each on its own local Ray cluster, and first one of ``--base`` texts: the worker's
peak with next to no slice, what the model, torch and Ray take.

Printed per N, from the worker's line of the command's output: its texts, MiB of embeddings and of text (UTF-8),
peak RSS, and ``ratio peak_over_base_per_slice_<N> <value>``: (peak − the base run's peak) / (embeddings + text),
the memory the slice costs over what it holds (the target: at most 1.5). Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mine_throughput import mine  # noqa: E402  (bench/: the command run and its worker lines parsed)

from clsys.eval.retrieval import load_xquad  # noqa: E402
from clsys.shards.blocks import Record  # noqa: E402
from clsys.shards.writer import ShardWriter  # noqa: E402
from data_prep.__main__ import main as data_prep  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health "
         "person art war history party result change morning reason research girl guy moment air teacher force "
         "education").split()


def write_corpus(folder: Path, texts: int, words: int) -> str:
    """A ``sentences`` stream of ``texts`` distinct texts of ``words`` words and their number."""
    rng = random.Random(texts)
    url = str(folder / f"corpus-{texts}" / "sentences")
    writer = ShardWriter(url, str(folder), 64 << 20, block_records=256)
    for start in range(0, texts, 10_000):
        writer.write_records([Record(f"{' '.join(rng.choices(WORDS, k=words))} {i}", {})
                              for i in range(start, min(start + 10_000, texts))])
    writer.close()
    writer.write_manifest({})
    return url


def first_layers(folder: Path, layers: int) -> str:
    """all-MiniLM-L6-v2's folder (tokenizer, pooling) with only its first ``layers`` transformer layers."""
    from transformers import AutoModel

    from clsys.model.loading import resolve_model_path

    source = resolve_model_path("all-MiniLM-L6-v2")
    model = AutoModel.from_pretrained(source, trust_remote_code=False)
    if layers >= model.config.num_hidden_layers:
        return "all-MiniLM-L6-v2"
    target = folder / f"all-MiniLM-L{layers}"
    shutil.copytree(source, target)
    model.encoder.layer = model.encoder.layer[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(target)
    return str(target)


def write_pairs(folder: Path, queries: int) -> str:
    xs = load_xquad("en")
    rows = [{"query": q, "pos": [xs.paragraphs[g]]} for q, g in zip(xs.questions[:queries], xs.gold)]
    (folder / "q.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert data_prep(["pairs", "--input", str(folder / "q.jsonl"), "--out", str(folder / "data")]) == 0
    return str(folder / "data")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, nargs="+", default=[10_000, 50_000, 200_000])
    p.add_argument("--base", type=int, default=100, help="the texts of the run that measures the model alone")
    p.add_argument("--words", type=int, default=10)
    p.add_argument("--queries", type=int, default=64)
    p.add_argument("--max-length", type=int, default=32)
    p.add_argument("--layers", type=int, default=6, help="of all-MiniLM-L6-v2's 6 (default: all)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mine-memory-") as tmp:
        folder = Path(tmp)
        data, model = write_pairs(folder, args.queries), first_layers(folder, args.layers)
        base = None
        for n in [args.base, *args.texts]:
            run = mine(data, write_corpus(folder, n, args.words), str(folder / f"out-{n}"), 1, args.max_length,
                       model)
            w = run["per_worker"][0]
            base = base or w
            held = w["embedding_mib"] + w["text_mib"]
            print(f"{n} texts: worker holds {w['texts']} texts, {w['embedding_mib']:.1f} MiB of embeddings, "
                  f"{w['text_mib']:.1f} MiB of text; peak RSS {w['rss_mib']} MiB, {w['rss_mib'] - base['rss_mib']} "
                  f"over the {base['texts']}-text run's (run {run['wall']:.0f} s)", flush=True)
            if n != args.base:
                print(f"ratio peak_over_base_per_slice_{n} {(w['rss_mib'] - base['rss_mib']) / held:.2f}", flush=True)


if __name__ == "__main__":
    main()
