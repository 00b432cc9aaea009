"""The collate alone, on one core: sentences/s of SimCSE's ``SentenceBatcher`` from text and from pre-tokenized ids.

    python bench/collate_rate.py [--batch 64] [--max-length 32] [--batches 200] [--repeats 5]

One DataLoader worker process runs the collate on one core; the target is >= 15,000 sentences/s from
text and >= 40,000 from ids (all-MiniLM-L6-v2, max length 32, batches of 64). The reference row is the
Hugging Face tokenizer call the collate made before (``tokenizer(texts, padding=True, truncation=True, ...)``);
then the collate with the Rust backend encoding every text (no chunk tokenizer, ``clsys.data.chunk_tokenizer``),
with a chunk tokenizer that has met no chunk yet (a new loader worker's: it learns the chunks as it goes), and with
one that has met every chunk of the batches (a worker well into a large corpus answers nearly every chunk).
Sentences: the bundled Wikipedia sample's (bench/sample_data.py) in a shuffled order; ids: the tokenizer's, without
special tokens, as ``data_prep tokenize`` writes them. One torch thread, no tokenizers parallelism; the best of --repeats
passes, the ways taking turns, in wall time and in this process's CPU time (on a machine shared with other work
the second is the steadier). Not part of the test suite.
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import torch  # noqa: E402

from clsys.data.pretokenized import SentenceBatcher  # noqa: E402
from clsys.model.encoder import load_tokenizer  # noqa: E402
from sample_data import sentences  # noqa: E402


def best_rates(ways: dict[str, tuple[Callable[[], Callable[[list], object]], list[list]]],
               repeats: int) -> dict[str, tuple]:
    """Per way, (sentences/s of wall time, sentences per CPU second) of its fastest pass over its batches, each pass
    with the collate its factory makes. The ways take turns pass by pass, so that other work on the machine slows
    them alike."""
    best = {name: (float("inf"), float("inf")) for name in ways}
    for _ in range(repeats):
        for name, (make, batches) in ways.items():
            collate = make()
            wall, cpu = time.perf_counter(), time.process_time()
            for batch in batches:
                collate(batch)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return {name: tuple(sum(map(len, ways[name][1])) / t for t in best[name]) for name in ways}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-length", type=int, default=32)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer("all-MiniLM-L6-v2")
    texts = sentences(args.batch * args.batches)
    random.Random(0).shuffle(texts)  # as the loader's shuffle buffer mixes them
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    cut = range(0, len(texts), args.batch)
    text_batches = [[{"txt": t} for t in texts[i:i + args.batch]] for i in cut]
    id_batches = [[{"txt": t, "ids": x} for t, x in zip(texts[i:i + args.batch], ids[i:i + args.batch])] for i in cut]
    batcher = SentenceBatcher(tokenizer, args.max_length)
    backend_alone = SentenceBatcher(tokenizer, args.max_length)
    backend_alone.encode.chunks = None  # no chunk tokenizer: the Rust backend encodes every text
    warm = copy.deepcopy(batcher)
    for batch in text_batches:
        warm(batch)  # its chunk tokenizer has met every chunk of the batches

    def hf_call(samples: list[dict]) -> object:
        return tokenizer([s["txt"] for s in samples], padding=True, truncation=True, max_length=args.max_length,
                         return_tensors="pt")

    def fresh() -> SentenceBatcher:
        return copy.deepcopy(batcher)  # a chunk tokenizer that has met no chunk yet, as a new loader worker's

    ways = {"HF tokenizer call (before)": (lambda: hf_call, text_batches),
            "backend alone, no chunks": (lambda: backend_alone, text_batches),
            "from text, new worker": (fresh, text_batches), "from text, chunks met": (lambda: warm, text_batches),
            "from ids": (lambda: batcher, id_batches)}
    print(f"collate of {len(texts)} sentences, batches of {args.batch}, max length {args.max_length}, 1 thread, "
          f"best of {args.repeats}")
    print(f"{'':28s} {'sentences/s':>12s} {'per CPU s':>12s}")
    for name, (wall, cpu) in best_rates(ways, args.repeats).items():
        print(f"{name:28s} {wall:12,.0f} {cpu:12,.0f}")

if __name__ == "__main__":
    main()
