"""Evaluation of a text encoder: semantic textual similarity (STS), cross-lingual retrieval and BEIR retrieval.

An STS set is a list of sentence pairs with human similarity scores (0-5). The encoder's
score for a pair is the cosine similarity of the two sentence embeddings; the result is
the Spearman (and Pearson) correlation with the human scores, x 100, as papers report it.

The scoring itself lives in the evaluation package, ``clsys/eval/``: STS in ``clsys.eval.sts`` (the trainer calls
it on rank 0 for dev evaluation), cross-lingual retrieval (XQuAD, Tatoeba) in ``clsys.eval.retrieval``, retrieval
over a BEIR / MTEB folder (nDCG@10, MRR@10, Recall@100) in ``clsys.eval.beir``; this CLI runs every kind. STS
files come in several layouts, and a folder is a SentEval year or a suite of sets whose average is reported as
SimCSE does (``clsys.eval.sts_data``).

CLI:
    python -m clsys.evaluate --model all-MiniLM-L6-v2 --sts stsb-en-test,korsts-test --pooling cls,mean
    python -m clsys.evaluate --model runs/quickstart/export --sts path/to/senteval/downstream  # its own pooling
    python -m clsys.evaluate --model all-MiniLM-L6-v2 --xling en-de de-en --articles 24:48 \
        --tatoeba deu-eng --pooling mean
    python -m clsys.evaluate --model runs/quickstart/export --retrieval xquad-en path/to/scifact
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from clsys import logs
from clsys.eval.beir import BeirSet, CorpusChanged, bundled_beir, evaluate_beir, load_beir, resolve_beir
from clsys.eval.sts import evaluate_sts
from clsys.model.declared import default_max_length, folder_pooling, folder_prompts
from clsys.model.encoder import POOLINGS, load_encoder, load_tokenizer
from clsys.model.loading import resolve_model_path
from clsys.eval.retrieval import (XquadSet, bundled_xquad, evaluate_bitext, evaluate_retrieval, hf_reranker,
                             load_tatoeba, parse_articles, xquad_pair)
from clsys.eval.sts_data import StsSet, bundled_sts, read_sts

log = logs.module_logger(__name__, __spec__)


def _xling_pair(spec: str) -> tuple[str, str]:
    query_lang, _, doc_lang = spec.partition("-")
    if not query_lang or not doc_lang or "-" in doc_lang:
        raise ValueError(f"bad --xling pair '{spec}' (expected QUESTIONLANG-PARAGRAPHLANG, e.g. en-de; "
                         f"bundled languages: {', '.join(bundled_xquad())})")
    return query_lang, doc_lang


def _load_xling(spec: str, args: argparse.Namespace) -> XquadSet:
    articles = parse_articles(args.articles) if args.articles else None
    return xquad_pair(*_xling_pair(spec), articles, args.xquad_dir)


def _read_sts(spec: str, args: argparse.Namespace) -> list[StsSet]:
    suite = read_sts(spec)
    for path in suite.left_out:
        log.info(f"{spec}: passed over {path}")
    for sts in suite.sets:
        if sts.note:
            log.info(f"{spec}: {sts.name}: {sts.note}")
    return suite.sets


def _read_beir(spec: str, args: argparse.Namespace) -> list[BeirSet]:
    data = load_beir(resolve_beir(spec), args.retrieval_split or "test")
    if data.note:
        log.info(f"{spec}: {data.note}")
    return [data]


# Evaluation kinds: CLI option -> (read the data sets one value names, score one set). The reader
# also gets the parsed arguments, for options that qualify every set of its kind (--articles, --retrieval-split). A
# value naming several sets (an STS folder) also gets their average. Another kind adds an entry
# here and its option in parse_args.
EVALUATIONS: dict[str, tuple[Callable[[str, argparse.Namespace], list[Any]], Callable[..., dict[str, Any]]]] = {
    "sts": (_read_sts, evaluate_sts),
    "xling": (lambda spec, args: [_load_xling(spec, args)], evaluate_retrieval),
    "tatoeba": (lambda spec, args: [load_tatoeba(spec)], evaluate_bitext),
    "retrieval": (_read_beir, evaluate_beir),
}


LABELS = {"spearman_mean": "Spearman-mean", "spearman_wmean": "Spearman-wmean", "mrr@10": "MRR@10",
          "recall@1": "R@1", "recall@10": "R@10", "xxx->eng": "xxx->eng", "eng->xxx": "eng->xxx",
          "ndcg@10": "nDCG@10", "recall@100": "R@100"}


def _label(metric: str) -> str:
    if metric.startswith("rerank_"):
        return "rerank-" + _label(metric.removeprefix("rerank_"))
    return LABELS.get(metric, metric.capitalize())


def average_row(group: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The plain mean of the metrics every set has (SimCSE's "Avg." over STS12-16, STS-B, SICK-R)."""
    shared = [m for m in group[0] if m not in ("kind", "set", "pooling", "n") and all(m in r for r in group)]
    return {"kind": group[0]["kind"], "set": name, "pooling": group[0]["pooling"], "n": sum(r["n"] for r in group),
            **{m: sum(r[m] for r in group) / len(group) for m in shared}}


def format_table(rows: list[dict[str, Any]]) -> str:
    metrics = list(dict.fromkeys(k for row in rows for k in row if k not in ("kind", "set", "pooling", "n")))
    header = ["set", "pooling", "n"] + [_label(m) for m in metrics]
    lines = [[row["set"], row["pooling"], str(row["n"])] + [f"{row[m]:.2f}" if m in row else "" for m in metrics]
             for row in rows]
    widths = [max(len(r[c]) for r in [header] + lines) for c in range(len(header))]
    # Names left-aligned, numbers right-aligned.
    return "\n".join("  ".join(v.ljust(w) if c < 2 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths)))
                     for r in [header] + lines)


def _split(csv_list: str) -> list[str]:
    return [x.strip() for x in csv_list.split(",") if x.strip()]


def _missing_folder(path: str) -> bool:
    # Only hub-id-shaped names ("org/name") may be meant for the hub; anything else is a missing
    # folder, which the hub client would report as a confusing "bad repo id".
    return not os.path.exists(path) and (os.path.isabs(path) or path.startswith(".") or path.count("/") > 1)


def refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """Exit 2 with one line: what is wrong with a model folder, without the usage of options given right."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m clsys.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="exported clsys folder, any HF model folder, or a packaged alias")
    # Each set option takes one or more values, each a comma list.
    p.add_argument("--sts", nargs="+", default=[], metavar="SET",
                   help=f"STS files, folders (a SentEval year, or a suite: each set and their average) or "
                        f"bundled sets ({', '.join(bundled_sts())}); "
                        "default stsb-en-test unless --xling, --tatoeba or --retrieval is given")
    p.add_argument("--xling", nargs="+", default=[], metavar="Q-P",
                   help="XQuAD retrieval of paragraphs in language P for questions in language Q, e.g. en-de "
                        f"(bundled: {', '.join(bundled_xquad())})")
    p.add_argument("--xquad-dir", type=Path, default=None,
                   help="folder of xquad.<lang>.json files (any SQuAD-format JSON) instead of the bundled ones")
    p.add_argument("--articles", default=None, metavar="START:STOP",
                   help="XQuAD articles to retrieve over, e.g. 24:48, the held-out half (default: all 48)")
    p.add_argument("--rerank", nargs="?", const="", default=None, metavar="FOLDER",
                   help="also re-rank each question's top --xling paragraphs with this cross-encoder folder "
                        "(FOLDER left out: <model>/reranker)")
    p.add_argument("--rerank-top", type=int, default=20, help="bi-encoder top paragraphs to re-rank (default 20)")
    p.add_argument("--tatoeba", nargs="+", default=[], metavar="XXX-eng",
                   help="Tatoeba bitext retrieval: bundled pairs (deu-eng, ...) or path prefixes DIR/tatoeba.xxx-eng")
    p.add_argument("--retrieval", nargs="+", default=[], metavar="FOLDER",
                   help="retrieval over BEIR / MTEB folders (corpus.jsonl, queries.jsonl, qrels/<split>.tsv) or "
                        f"bundled ones ({', '.join(bundled_beir())}): nDCG@10, MRR@10, Recall@100")
    p.add_argument("--retrieval-split", default=None, metavar="SPLIT",
                   help="the --retrieval qrels split, qrels/SPLIT.tsv (default test)")
    p.add_argument("--query-prefix", default=None,
                   help="text put before each --retrieval query (default: the model folder's "
                        "config_sentence_transformers.json prompt for queries, else none)")
    p.add_argument("--passage-prefix", default=None,
                   help="text put before each --retrieval document (default: the model folder's prompt for "
                        "documents, else none)")
    p.add_argument("--ignore-identical-ids", action="store_true", default=None,
                   help="leave each --retrieval query's own id out of its ranking, as BEIR does by default "
                        "and MTEB for ArguAna, Quora, ... (default: keep it, as MTEB does by default)")
    p.add_argument("--pooling", default=None,
                   help=f"comma list of {', '.join(POOLINGS)} (default: the pooling the model folder's "
                        "1_Pooling/config.json declares, as a clsys export's does)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per sentence; default: the model's sentence_bert_config.json, else 512")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    logs.add_level_option(p)
    return p, p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    logs.configure(args.log_level, progress_stream="stderr")  # stdout is the results, which users pipe
    if args.pooling is None:
        args.pooling = folder_pooling(resolve_model_path(args.model))
        if args.pooling is None:
            parser.error(f"--pooling: '{args.model}' declares no pooling to take (1_Pooling/config.json with "
                         f"one of {', '.join(POOLINGS)}, only Normalize after it): give --pooling")
        print(f"pooling {args.pooling} (the model's 1_Pooling/config.json)")  # the results' heading: which pooling
    poolings = _split(args.pooling)
    bad = [x for x in poolings if x not in POOLINGS]
    if bad or not poolings:
        parser.error(f"bad --pooling '{args.pooling}' (choose from {', '.join(POOLINGS)})")
    specs = {kind: [s for value in getattr(args, kind) for s in _split(value)] for kind in EVALUATIONS}
    if not any(specs.values()):
        specs["sts"] = ["stsb-en-test"]
    qualifiers = {"xling": ("--xquad-dir", "--articles", "--rerank"),
                  "retrieval": ("--retrieval-split", "--query-prefix", "--passage-prefix", "--ignore-identical-ids")}
    for kind, options in qualifiers.items():
        for option in options:
            if getattr(args, option[2:].replace("-", "_")) is not None and not specs[kind]:
                parser.error(f"{option} qualifies --{kind}: give --{kind} as well")
    if args.rerank_top < 1:
        parser.error(f"--rerank-top must be at least 1, not {args.rerank_top}")
    # Read all data before loading the model, so that a typo fails in a second, not after a minute.
    try:
        jobs = [(kind, spec, EVALUATIONS[kind][0](spec, args)) for kind, kind_specs in specs.items()
                for spec in kind_specs]
    except (OSError, ValueError) as e:
        parser.error(str(e))

    try:
        path = resolve_model_path(args.model)
        if _missing_folder(path):
            raise FileNotFoundError("no such folder")
        model, tokenizer = load_encoder(args.model), load_tokenizer(args.model)
    except (OSError, ValueError) as e:
        refuse(parser, f"cannot load model '{args.model}': {str(e).splitlines()[0]}")
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    max_length = args.max_length or default_max_length(path, model.config)
    reranker, reranker_path = None, None
    if args.rerank is not None:
        reranker_path = args.rerank or os.path.join(path, "reranker")
        try:
            if _missing_folder(reranker_path):
                raise FileNotFoundError("no such folder")
            reranker = hf_reranker(reranker_path)
        except (OSError, ValueError) as e:
            refuse(parser, f"cannot load reranker '{reranker_path}': {str(e).splitlines()[0]}")
    query_prefix, passage_prefix = folder_prompts(path)
    query_prefix = query_prefix if args.query_prefix is None else args.query_prefix
    passage_prefix = passage_prefix if args.passage_prefix is None else args.passage_prefix
    options = {"xling": {"reranker": reranker, "rerank_top": args.rerank_top},
               "retrieval": {"query_prefix": query_prefix, "passage_prefix": passage_prefix,
                             "ignore_identical_ids": bool(args.ignore_identical_ids)}}

    rows = []
    for kind, spec, data_sets in jobs:
        for pooling in poolings:
            group = []
            for data in data_sets:
                try:
                    metrics = EVALUATIONS[kind][1](model, tokenizer, data, pooling, args.batch_size, max_length,
                                                   **options.get(kind, {}))
                except CorpusChanged as e:  # a retrieval corpus is read again when it is embedded
                    parser.error(str(e))
                group.append({"kind": kind, "set": data.name, "pooling": pooling, **metrics})
            rows += group
            if len(group) > 1:
                rows.append(average_row(group, f"{Path(spec).name} avg"))
    settings = {"model": args.model, "max_length": max_length}
    if specs["xling"]:
        settings["xquad_articles"] = args.articles or "all"
    if reranker is not None:
        settings |= {"reranker": reranker_path, "rerank_top": args.rerank_top}
    if specs["retrieval"]:
        settings |= {"retrieval_split": args.retrieval_split or "test", "query_prefix": query_prefix,
                     "passage_prefix": passage_prefix, "ignore_identical_ids": bool(args.ignore_identical_ids)}
    # Prefixes quoted: their spaces matter.
    print(", ".join(f"{k} {json.dumps(v) if k.endswith('_prefix') else v}" for k, v in settings.items()))
    # One table per kind: their metrics differ.
    kinds = dict.fromkeys(row["kind"] for row in rows)
    print("\n\n".join(format_table([row for row in rows if row["kind"] == kind]) for kind in kinds))
    if args.json is not None:
        result = {**settings, "results": rows}
        try:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        except OSError as e:
            parser.error(f"cannot write --json: {e}")


if __name__ == "__main__":
    main()
