"""The bundled Wikipedia sample as data_prep shards, written once and shared by the benchmarks."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE_SHARDS = REPO / "runs" / "shards" / "enwiki-sample"


def sample_shards(out: Path = SAMPLE_SHARDS) -> Path:
    """``out`` holding ``python -m data_prep wiki`` output of data_prep/samples (4 MB shards); made if missing."""
    if not (out / "sentences" / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "data_prep", "wiki", "--input",
                        *map(str, sorted((REPO / "data_prep" / "samples").glob("*.bz2"))), "--out", str(out),
                        "--shard-size-mb", "4"], cwd=REPO, check=True)
    return out
