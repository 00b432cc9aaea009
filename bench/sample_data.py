"""What the benchmarks share: the bundled Wikipedia sample as data_prep shards (written once), its
sentences, and a free port on 127.0.0.1 for a gloo group."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SAMPLE_SHARDS = REPO / "runs" / "shards" / "enwiki-sample"


def sample_shards(out: Path = SAMPLE_SHARDS) -> Path:
    """``out`` holding ``python -m data_prep wiki`` output of data_prep/samples (4 MB shards); made if missing."""
    manifest = out / "sentences" / "manifest.json"
    if not manifest.exists() or json.loads(manifest.read_text())["format"] != "clsys-shards/2":  # or written before
        subprocess.run([sys.executable, "-m", "data_prep", "wiki", "--input",
                        *map(str, sorted((REPO / "data_prep" / "samples").glob("*.bz2"))), "--out", str(out),
                        "--shard-size-mb", "0.25"], cwd=REPO, check=True)
    return out


def sentences(n: int) -> list[str]:
    """The first ``n`` sentences of the sample's shards (repeated when it has fewer)."""
    from clsys import storage
    from clsys.shards.reader import load_shards, read_shard

    found = []
    for shard in load_shards(storage.join(str(sample_shards()), "sentences")):
        found += [s["txt"] for s in read_shard(shard)]
        if len(found) >= n:
            return found[:n]
    return (found * (n // len(found) + 1))[:n]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
