"""What a model folder declares about how it is used: its pooling (``1_Pooling/config.json``), its prompts
(``config_sentence_transformers.json``) and its sequence length (``sentence_bert_config.json``), as
sentence-transformers reads them; a clsys export declares all three (``clsys/model/folder.py``). What
``python -m clsys.evaluate`` and ``python -m clsys.mine`` take when their options do not say otherwise."""
from __future__ import annotations

import json
from pathlib import Path

from clsys.model.encoder import POOLINGS


def folder_pooling(model_dir: str) -> str | None:
    """The pooling a sentence-transformers folder (a clsys export among them) declares in
    ``1_Pooling/config.json``, when it is one of ``POOLINGS`` and nothing but Normalize follows it
    (cosine ignores the norm); else None."""
    path = Path(model_dir)
    try:
        config = json.loads((path / "1_Pooling" / "config.json").read_text())
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    after = [m["type"].rsplit(".", 1)[-1] for m in modules[2:]]
    modes = [mode for mode in POOLINGS if config.get(f"pooling_mode_{mode}_token" if mode == "cls"
                                                      else f"pooling_mode_{mode}_tokens")]
    return modes[0] if len(modes) == 1 and set(after) <= {"Normalize"} else None


def folder_prompts(model_dir: str) -> tuple[str, str]:
    """The (query, passage) prefixes a sentence-transformers folder declares in ``config_sentence_transformers.json``
    ``prompts``, chosen as sentence-transformers' ``encode_query`` and ``encode_document`` choose: ``query`` for
    queries, the first of ``document``, ``passage``, ``corpus`` for documents, else the ``default_prompt_name``'s
    prompt; "" where there is none (a clsys export declares none)."""
    try:
        config = json.loads((Path(model_dir) / "config_sentence_transformers.json").read_text())
        prompts = config.get("prompts") or {}
        default = prompts.get(config.get("default_prompt_name") or "", "")
        passage = next((prompts[name] for name in ("document", "passage", "corpus") if name in prompts), default)
        return str(prompts.get("query", default)), str(passage)
    except (OSError, ValueError, AttributeError):  # no such file, not JSON, not a mapping
        return "", ""


def default_max_length(model_dir: str, config) -> int:
    """The model's own sentence-transformers ``max_seq_length`` if it has one, else the position limit of its
    ``config`` (a transformers config: what the folder's config.json loads as, or a loaded model's)."""
    st_config = Path(model_dir) / "sentence_bert_config.json"
    if st_config.is_file():
        return int(json.loads(st_config.read_text())["max_seq_length"])
    return min(512, config.max_position_embeddings)
