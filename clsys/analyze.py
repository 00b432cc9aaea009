"""``python -m clsys.analyze heatmap --model A [--model B ...] --text "..." --out file.png``

Draws token-by-token cosine-similarity heatmaps of each model's last layer, side by side (for
example the starting encoder and an exported run), as TaCL's analysis does.
"""
from __future__ import annotations

import argparse
import sys

from clsys.analysis.heatmap import Panel, render, token_similarity


def heatmap(models: list[str], text: str, out: str, max_length: int) -> None:
    from clsys.model.encoder import load_encoder, load_tokenizer

    panels = []
    for name in models:
        tokens, similarity = token_similarity(load_encoder(name), load_tokenizer(name), text, max_length)
        panels.append(Panel(name, tokens, similarity))
    with open(out, "wb") as f:
        f.write(render(panels))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clsys.analyze", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    hm = commands.add_parser("heatmap", help="token-similarity heatmaps, one panel per model")
    hm.add_argument("--model", action="append", required=True, help="model folder or packaged alias; repeat to compare")
    hm.add_argument("--text", required=True, help="the sentence to analyse")
    hm.add_argument("--out", required=True, help="PNG file to write")
    hm.add_argument("--max-length", type=int, default=64, help="tokens kept (default 64)")
    args = parser.parse_args(argv)
    try:
        heatmap(args.model, args.text, args.out, args.max_length)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
