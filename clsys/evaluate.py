"""Evaluation of a text encoder on semantic textual similarity (STS).

An STS set is a list of sentence pairs with human similarity scores (0-5). The encoder's
score for a pair is the cosine similarity of the two sentence embeddings; the result is
the Spearman (and Pearson) correlation with the human scores, x 100, as papers report it.

Library use (the trainer calls this on rank 0 for dev evaluation):
    sts = load_sts(resolve_sts("stsb-en-dev"))
    evaluate_sts(hf_encoder, tokenizer, sts, pooling="cls")  # {"spearman", "pearson", "n"}

CLI:
    python -m clsys.evaluate --model all-MiniLM-L6-v2 --sts stsb-en-test,korsts-test --pooling cls,mean
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from scipy.stats import pearsonr, spearmanr
from torch import nn

from clsys.model.encoder import POOLINGS, embed, load_encoder, load_tokenizer, resolve_model_path

# Bundled dev/test splits of stsb-multi-mt (en, de) and KorSTS; origin and licences in LICENSE.md there.
STS_ASSETS = Path(__file__).parent / "assets" / "sts"


@dataclass
class StsSet:
    name: str
    sent1: list[str]
    sent2: list[str]
    scores: list[float]


def bundled_sts() -> list[str]:
    return sorted(p.stem for p in STS_ASSETS.iterdir() if p.suffix in (".csv", ".tsv"))


def resolve_sts(name_or_path: str) -> Path:
    """A file path as is, or a bundled set name (``stsb-en-test``, ``korsts-dev``, ...) -> its asset file."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    for suffix in (".csv", ".tsv"):
        if (STS_ASSETS / f"{name_or_path}{suffix}").is_file():
            return STS_ASSETS / f"{name_or_path}{suffix}"
    raise FileNotFoundError(f"STS set '{name_or_path}' is neither a file nor a bundled set "
                            f"({', '.join(bundled_sts())})")


def load_sts(path: str | Path) -> StsSet:
    """Read an STS file; the format is detected from the first line.

    - TSV with a header naming ``sentence1``, ``sentence2`` and ``score`` (KorSTS: genre, filename,
      year, id, score, sentence1, sentence2). Read with QUOTE_NONE: quotes in KorSTS are sentence text.
    - otherwise headerless CSV ``sentence1,sentence2,score`` (stsb-multi-mt), quoted where needed.
    """
    path = Path(path)
    sent1, sent2, scores = [], [], []
    with open(path, newline="", encoding="utf-8") as f:
        header = f.readline().rstrip("\r\n").split("\t")
        if {"sentence1", "sentence2", "score"} <= set(header):
            rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            first_line = 2  # the reader starts after the header
            i1, i2, iscore = header.index("sentence1"), header.index("sentence2"), header.index("score")
        else:
            f.seek(0)
            rows = csv.reader(f)
            first_line = 1
            header, i1, i2, iscore = ["sentence1", "sentence2", "score"], 0, 1, 2
        try:
            for row in rows:
                if len(row) != len(header):
                    raise ValueError(f"expected {len(header)} fields, found {len(row)}")
                scores.append(float(row[iscore]))
                sent1.append(row[i1])
                sent2.append(row[i2])
        except (ValueError, csv.Error) as e:
            # line_num counts the lines this reader consumed, i.e. the record's (last) line.
            raise ValueError(f"{path}:{first_line - 1 + rows.line_num}: malformed STS line: {e}") from None
    if not scores:
        raise ValueError(f"{path}: no sentence pairs")
    return StsSet(path.stem, sent1, sent2, scores)


def correlations(pred: list[float], gold: list[float]) -> tuple[float, float]:
    """(Spearman, Pearson) x 100; scipy ranks ties by their average rank."""
    return 100 * float(spearmanr(pred, gold).statistic), 100 * float(pearsonr(pred, gold).statistic)


def evaluate_sts(model: nn.Module, tokenizer, sts: StsSet, pooling: str, batch_size: int = 64,
                 max_length: int = 128) -> dict[str, Any]:
    """Spearman/Pearson x 100 of cosine(embedding(sent1), embedding(sent2)) against the gold scores."""
    # STS sets repeat sentences across pairs, so each distinct sentence is embedded once; longest
    # first so that every batch pads to a similar length (``embed`` pads to the batch's longest).
    unique = sorted(dict.fromkeys(sts.sent1 + sts.sent2), key=len, reverse=True)
    index = {s: i for i, s in enumerate(unique)}
    emb = embed(model, tokenizer, unique, pooling, batch_size, max_length).double()
    a = emb[[index[s] for s in sts.sent1]]
    b = emb[[index[s] for s in sts.sent2]]
    # A NaN embedding (e.g. a diverged checkpoint) counts as "unrelated" instead of poisoning the ranks.
    cosine = F.cosine_similarity(a, b, dim=-1).nan_to_num(0.0)
    spearman, pearson = correlations(cosine.tolist(), sts.scores)
    return {"spearman": spearman, "pearson": pearson, "n": len(sts.scores)}


# Evaluation kinds: CLI option -> (read one data set given by name or path, score it).
# Another kind (e.g. cross-lingual retrieval) adds an entry here and its option in parse_args.
EVALUATIONS: dict[str, tuple[Callable[[str], Any], Callable[..., dict[str, Any]]]] = {
    "sts": (lambda spec: load_sts(resolve_sts(spec)), evaluate_sts),
}


def default_max_length(model_dir: str, model: nn.Module) -> int:
    """The model's own sentence-transformers ``max_seq_length`` if it has one, else its position limit."""
    st_config = Path(model_dir) / "sentence_bert_config.json"
    if st_config.is_file():
        return int(json.loads(st_config.read_text())["max_seq_length"])
    return min(512, model.config.max_position_embeddings)


def format_table(rows: list[dict[str, Any]]) -> str:
    metrics = list(dict.fromkeys(k for row in rows for k in row if k not in ("kind", "set", "pooling", "n")))
    header = ["set", "pooling", "n"] + [m.capitalize() for m in metrics]
    lines = [[row["set"], row["pooling"], str(row["n"])] + [f"{row[m]:.2f}" if m in row else "" for m in metrics]
             for row in rows]
    widths = [max(len(r[c]) for r in [header] + lines) for c in range(len(header))]
    # Names left-aligned, numbers right-aligned.
    return "\n".join("  ".join(v.ljust(w) if c < 2 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths)))
                     for r in [header] + lines)


def _split(csv_list: str) -> list[str]:
    return [x.strip() for x in csv_list.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m clsys.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="exported clsys folder, any HF model folder, or a packaged alias")
    p.add_argument("--sts", default="stsb-en-test",
                   help=f"comma list of STS files or bundled sets ({', '.join(bundled_sts())})")
    p.add_argument("--pooling", required=True, help=f"comma list of {', '.join(POOLINGS)}")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per sentence; default: the model's sentence_bert_config.json, else 512")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    return p, p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    poolings = _split(args.pooling)
    bad = [x for x in poolings if x not in POOLINGS]
    if bad or not poolings:
        parser.error(f"bad --pooling '{args.pooling}' (choose from {', '.join(POOLINGS)})")
    # Read all data before loading the model, so that a typo fails in a second, not after a minute.
    try:
        jobs = [(kind, load(spec)) for kind, (load, _) in EVALUATIONS.items() for spec in _split(getattr(args, kind))]
    except (OSError, ValueError) as e:
        parser.error(str(e))

    try:
        path = resolve_model_path(args.model)
        # Only hub-id-shaped names ("org/name") may be meant for the hub; anything else is a missing
        # folder, which the hub client would report as a confusing "bad repo id".
        if not os.path.exists(path) and (os.path.isabs(path) or path.startswith(".") or path.count("/") > 1):
            raise FileNotFoundError("no such folder")
        model, tokenizer = load_encoder(args.model), load_tokenizer(args.model)
    except (OSError, ValueError) as e:
        parser.error(f"cannot load model '{args.model}': {str(e).splitlines()[0]}")
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    max_length = args.max_length or default_max_length(path, model)

    rows = []
    for kind, data in jobs:
        for pooling in poolings:
            metrics = EVALUATIONS[kind][1](model, tokenizer, data, pooling, args.batch_size, max_length)
            rows.append({"kind": kind, "set": data.name, "pooling": pooling, **metrics})
    print(f"model {args.model}, max_length {max_length}")
    print(format_table(rows))
    if args.json is not None:
        result = {"model": args.model, "max_length": max_length, "results": rows}
        try:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        except OSError as e:
            parser.error(f"cannot write --json: {e}")


if __name__ == "__main__":
    main()
