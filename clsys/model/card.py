"""The model card (README.md) of an exported model folder: what was trained, from what, on which data,
with which recipe, which checkpoint was exported and why, how it scored, and how to load it.

``write_card`` writes it at export from the checkpoint's record and the run's config; the driver of a
run then adds the STS test comparison it prints (``add_evaluation``), so the figures travel with the
model. The front matter is the Hugging Face hub's model-card metadata.
"""
from __future__ import annotations

import json
import os

import yaml

from clsys import storage

EVALUATION_HEADING = "## Evaluation"


def write_card(folder: str, record: dict, config: dict) -> None:
    """README.md in the local export ``folder``; ``record`` is clsys_export.json's content, ``config``
    the run's resolved config (``Config.to_dict()``). The card is published with the model: a URL in either
    (the checkpoint's, the shards') is written without its secrets, also from a checkpoint that recorded them."""
    record, config = storage.redact_values(record), storage.redact_values(config)
    model, train, data, optim = config["model"], config["train"], config["data"], config["optim"]
    base = model["name"] if model["init"] == "pretrained" else f"{model['name']} (architecture only, from scratch)"
    front = {"library_name": "sentence-transformers", "pipeline_tag": "sentence-similarity",
             "tags": ["sentence-transformers", "feature-extraction", "sentence-similarity", "clsys",
                      record["objective"]]}
    if model["init"] == "pretrained" and not os.path.isabs(model["name"]) and "://" not in model["name"]:
        front["base_model"] = model["name"]  # a name others can look up, not a path on the training machine
    workers = config["cluster"]["num_workers"]
    lines = [
        "---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
        f"# {train['name']}", "",
        f"A text encoder trained with clsys ({record['objective']} objective) from {base}.", "",
        "| | |", "|---|---|",
        f"| objective | `{record['objective']}` |",
        f"| base model | `{base}` |",
        f"| training data | `{data['url']}` |",
        f"| steps | {record['step']} of {train['steps']}, global batch {train['batch_size']}, "
        f"max length {data['max_length']} |",
        f"| optimizer | AdamW, lr {optim['lr']:g} ({optim['schedule']}, {optim['warmup_steps']} warm-up steps), "
        f"weight decay {optim['weight_decay']:g} |",
        f"| run | {workers} worker(s), DeepSpeed ZeRO-{train['zero_stage']}, precision {train['precision']}, "
        f"seed {train['seed']} |",
        f"| exported checkpoint | `{record['checkpoint']}` ({record['chosen']}) |",
        f"| pooling | `{record['pooling']}` |",
        f"| pooler weights | {record['pooler']} |",
    ]
    # Records of exports before prompts and Matryoshka dimensions were recorded have neither.
    prompts, dims = record.get("prompts") or {}, record.get("matryoshka_dims") or []
    if prompts:
        lines.append(f"| prompts | {', '.join(f'`{name}`' for name in prompts)} (in "
                     "`config_sentence_transformers.json`) |")
    if dims:
        lines.append(f"| Matryoshka dimensions | {', '.join(map(str, dims))} (trained to be used truncated to each) |")
    lines += ["", "## Usage", "", "```python", "from sentence_transformers import SentenceTransformer", "",
              "model = SentenceTransformer(\"path/to/this/folder\")"]
    passage = _passage_prompt(prompts)
    if "query" in prompts:
        lines.append("queries = model.encode([\"how long do cats sleep?\"], prompt_name=\"query\")")
        lines.append("passages = model.encode([\"Cats sleep 16 hours a day.\"]"
                     + (f", prompt_name=\"{passage}\")" if passage else ")"))
    else:
        lines.append("embeddings = model.encode([\"A cat sits on the mat.\", \"Stocks fell sharply.\"])")
    if dims:
        lines += ["", f"small = SentenceTransformer(\"path/to/this/folder\", truncate_dim={min(dims)})"]
    lines += ["```", ""]
    if prompts:
        lines += ["The prompts, each put before its inputs as it was in training:", "", "```json",
                  json.dumps(prompts, indent=2, ensure_ascii=False), "```", ""]
    lines += [
        "Or with `transformers.AutoModel` and the pooling above; "
        "`python -m clsys.evaluate --model path/to/this/folder` reads the pooling from `1_Pooling/config.json` "
        "and the query and passage prompts from `config_sentence_transformers.json`.",
        "", EVALUATION_HEADING, "",
    ]
    if record["chosen"].startswith("best "):
        lines.append(f"Chosen on the development set during training: {record['chosen']}.")
    else:
        lines.append("No evaluation during training chose this checkpoint: it is the run's "
                     f"{record['chosen']} one.")
    lines += ["", "## Configuration", "", "The run's resolved config (`python -m clsys.pretrain --config` takes it):",
              "", "```yaml", yaml.safe_dump(config, sort_keys=False, allow_unicode=True).rstrip(), "```", ""]
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("\n".join(lines))


def _passage_prompt(prompts: dict[str, str]) -> str | None:
    """The prompt name sentence-transformers' ``encode_document`` picks for documents, as ``clsys.evaluate`` does."""
    return next((name for name in ("document", "passage", "corpus") if name in prompts), None)


def add_evaluation(export_url: str, title: str, rows: list[dict]) -> None:
    """Add a table of ``rows`` ({model, pooling, spearman, pearson}) under the card's Evaluation heading."""
    card_url = storage.join(export_url, "README.md")
    card = storage.read_bytes(card_url).decode()
    table = [f"{title}:", "", "| model | pooling | Spearman | Pearson |", "|---|---|---|---|"]
    table += [f"| {r['model']} | {r['pooling']} | {r['spearman']:.2f} | {r['pearson']:.2f} |" for r in rows]
    head, found, tail = card.partition(f"{EVALUATION_HEADING}\n\n")
    if not found:
        raise ValueError(f"{card_url}: no '{EVALUATION_HEADING}' section")
    storage.write_bytes(card_url, (head + found + "\n".join(table) + "\n\n" + tail).encode())
