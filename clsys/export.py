"""``python -m clsys.export --checkpoint URL --out DIR``: a training checkpoint → a model folder.

The folder loads with ``transformers.AutoModel.from_pretrained`` (BERT-like models with their pooler:
the trained head where the objective exports one into it, else the base model's, untouched by
training) and with ``sentence_transformers.SentenceTransformer`` (modules.json,
config_sentence_transformers.json, the pooling the objective uses at inference); its README.md is a
model card (``clsys.model.card``). Works from any ZeRO stage: DeepSpeed's own consolidation rebuilds
full fp32 weights from the per-rank shards. ``--checkpoint`` is ``best`` or ``latest`` of ``--run``, a step folder, or a
run folder (its best checkpoint when ``eval.select`` recorded one, else its newest complete one).
The choice is printed and recorded in the folder's ``clsys_export.json``.

``--out`` is replaced only when it is a clsys export as it was written, every file it holds its own (or an
empty folder, or nothing yet): the export is built in a temporary folder and published (``publish``) once
whole, its SHA256SUMS sealed in its COMPLETE.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from clsys import logs, storage
from clsys.storage import integrity
from clsys.storage.integrity import SUMS
from clsys.engine.checkpoint import (REQUIRED_FILES, checked_state, checkpoint_weights, latest_checkpoint,
                                     listed_apart, missing_rank_files)
from clsys.engine.selection import BEST_RECORD, read_best
from clsys.model.folder import (COUNT, INTEGER, NUMBER, POSITIVE, RECORD, TEXT, ExportSpec,
                                check_replaceable, checked_record, publish, source_max_seq_length, write_model,
                                write_reranker)
from clsys.model.card import write_card


def choose_checkpoint(checkpoint: str, run: str | None = None) -> tuple[str, str]:
    """(step folder URL, why it was chosen) for ``--checkpoint best|latest|PATH`` (``run`` for best/latest).

    A step folder is taken as is; a run folder gives its best checkpoint (``eval.select``, recorded in
    ``best.json``) when it has one, else its newest complete one.
    """
    if checkpoint in ("best", "latest"):
        if run is None:
            raise FileNotFoundError(f"--checkpoint {checkpoint} names one of a run's checkpoints: give --run RUN")
        base, explicit = run, checkpoint
    elif storage.exists(storage.join(checkpoint, "COMPLETE")):
        return checkpoint, "the given step folder"
    else:
        base, explicit = checkpoint, None
    if explicit != "latest":
        best = read_best(base)
        if best is not None:
            return best.checkpoint, f"best {best.metric} {best.value:.2f} at step {best.step}"
        if explicit == "best":
            raise FileNotFoundError(f"{base}: no best checkpoint recorded ({BEST_RECORD}; eval.select was off or "
                                    f"nothing was evaluated): use --checkpoint latest")
    latest = latest_checkpoint(base)
    if latest is None:
        raise FileNotFoundError(f"{base}: neither a complete checkpoint nor a run folder with one")
    return latest, "latest" if explicit else "latest (no best checkpoint recorded)"


# The fields of clsys_state.json that export reads beyond resume's (clsys.engine.checkpoint.checked_state;
# ExportSpec.from_meta checks its own): the record's, and those of the config the model card shows.
EXPORT_FIELDS = {
    "objective": TEXT, "config.model.name": TEXT, "config.model.init": TEXT, "config.train.name": TEXT,
    "config.train.steps": COUNT, "config.train.batch_size": POSITIVE, "config.train.precision": TEXT,
    "config.train.seed": INTEGER, "config.cluster.num_workers": POSITIVE, "config.data.url": TEXT,
    "config.data.max_length": POSITIVE, "config.optim.lr": NUMBER, "config.optim.schedule": TEXT,
    "config.optim.warmup_steps": COUNT, "config.optim.weight_decay": NUMBER,
}


def check_checkpoint(url: str, local: str, meta: dict) -> None:
    """Raise IntegrityError naming the checkpoint and its bad files when the checkpoint ``url``,
    downloaded whole to ``local``, fails the checks resume makes (``clsys.engine.checkpoint``;
    checkpoints written before clsys recorded checksums are not checked)."""
    try:
        if integrity.check_folder(local, name=url, recorded="sums" in meta, listed_apart=listed_apart,
                                  required=REQUIRED_FILES):
            sums = integrity.parse_sums(Path(local, SUMS).read_bytes(), f"{url}/{SUMS}")  # checked just now
            if missing := missing_rank_files(meta, sums):
                raise integrity.IntegrityError(f"{url}: files differ from {SUMS}: " + "; ".join(missing))
    except integrity.IntegrityError as err:
        raise integrity.IntegrityError(f"damaged checkpoint {err} (export another one: --checkpoint <step folder>)"
                                       ) from None


def export(checkpoint: str, out: str, run: str | None = None) -> tuple[str, str]:
    """Write the encoder of ``checkpoint`` (see ``choose_checkpoint``) to ``out`` (local folder or URL);
    returns the step folder used and why it was chosen."""
    from transformers import AutoConfig

    check_replaceable(out)  # before the work, not after it
    url, chosen = choose_checkpoint(checkpoint, run)
    work = tempfile.mkdtemp(prefix="clsys-export-")
    try:
        ckpt = os.path.join(work, "ckpt")
        storage.download_dir(url, ckpt)
        state_url = storage.join(url, "clsys_state.json")
        meta = checked_state(storage.parse_json(storage.read_bytes(os.path.join(ckpt, "clsys_state.json")), state_url),
                             state_url)
        check_checkpoint(url, ckpt, meta)  # what resume reads checked, the checksums next: a change is damage
        checked_record(meta, EXPORT_FIELDS, state_url)
        spec = ExportSpec.from_meta(meta, state_url)
        state = checkpoint_weights(ckpt, url)
        hf_dir = os.path.join(ckpt, "hf")
        config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=False)
        folder = os.path.join(work, "out")
        base_model = meta["config"]["model"]["name"]
        weights = spec.encoder_weights(state)
        pooler = write_model(folder, weights, config, hf_dir, spec.pooling,
                             source_max_seq_length(base_model, config), url,
                             base_model if meta["config"]["model"]["init"] == "pretrained" else "",
                             prompts=spec.prompts)
        if spec.reranker_map:
            write_reranker(os.path.join(folder, "reranker"), weights, state, spec.reranker_map, config, hf_dir)
        # The record is published with the model: the checkpoint's URL without its secrets.
        record = {"checkpoint": storage.redact(url), "chosen": chosen, "step": meta["step"],
                  "objective": meta["objective"], "pooling": spec.pooling, "pooler": pooler,
                  "prompts": spec.prompts, "matryoshka_dims": list(spec.matryoshka_dims)}
        with open(os.path.join(folder, RECORD), "w") as f:
            json.dump(record, f, indent=2)
        write_card(folder, record, meta["config"])
        publish(folder, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return url, chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clsys.export", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="best",
                        help="best or latest (of --run), or a step or run folder (local path, file:// or s3://); "
                             "a run folder gives its best checkpoint when one is recorded, else its latest "
                             "(default: best)")
    parser.add_argument("--run", default=None, help="the run folder, for --checkpoint best or latest")
    parser.add_argument("--out", required=True, help="output folder (local path, file:// or s3://)")
    logs.add_level_option(parser)
    args = parser.parse_args(argv)
    logs.configure(args.log_level)
    try:
        used, chosen = export(args.checkpoint, args.out, args.run)
    # ValueError: a refusal of the checkpoint's contents (CheckpointError, IntegrityError, transformers' own).
    except (OSError, RuntimeError, ValueError, storage.StorageError, KeyError) as err:
        print(f"error: {storage.redact(str(err))}", file=sys.stderr)
        return 2
    print(storage.redact(f"exported {used} ({chosen}) -> {args.out}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
