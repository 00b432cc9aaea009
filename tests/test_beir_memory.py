"""``python -m clsys.evaluate --retrieval``'s memory, through the real command: the corpus text is not held (it
is read again, a chunk at a time, when it is embedded), and a long document is cut before the tokenizer reads
it, so that neither the corpus' text nor one document's length sets the peak. Each run's peak resident memory
is the kernel's (``bench/process_runs.py``'s ``peak_rss_mib``), compared with a run over a corpus of short
documents."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clsys import evaluate
from clsys.eval.beir import CorpusChanged, load_beir, rank_corpus
from clsys.model.encoder import CHARS_PER_TOKEN, cut_for_tokens, load_encoder, load_tokenizer
import test_beir
from test_beir import write_beir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from process_runs import peak_rss_mib  # noqa: E402 (bench/process_runs.py)

tiny_folder = test_beir.tiny_folder  # the fixture: a random 1-layer sentence-transformers folder
MIB = 1 << 20
MAX_LENGTH = 32  # tokens a document is read to: cut at CHARS_PER_TOKEN * 32 characters
# ~5,000 characters of numbered words, which each document reads from a different place
PROSE = " ".join(f"{word}{i % 97}" for i, word in enumerate(
    "the encoder reads each passage as far as its tokens allow and no further; a retrieval corpus may hold "
    "documents of any length".split() * 25))


def text(chars: int, seed: int) -> str:
    """``chars`` characters of prose, starting at a place set by ``seed``."""
    start = seed * 37 % len(PROSE)
    return (PROSE * (chars // len(PROSE) + 2))[start:start + chars]


def folder_of(tmp_path: Path, name: str, lengths: list[int]) -> Path:
    """A BEIR folder whose documents have these lengths (characters); two queries graded on the first two."""
    corpus = [{"_id": f"d{i}", "title": f"title {i}", "text": text(n, i)} for i, n in enumerate(lengths)]
    queries = [{"_id": "q0", "text": text(40, 1)}, {"_id": "q1", "text": text(40, 2)}]
    return write_beir(tmp_path / name, corpus, queries, {"test": [("q0", "d0", 1), ("q1", "d1", 1)]})


def evaluate_peak_mib(model: Path, folder: Path, log: Path) -> float:
    """The peak resident memory (MiB) of ``python -m clsys.evaluate --retrieval folder``, which must succeed."""
    cmd = [sys.executable, "-m", "clsys.evaluate", "--model", str(model), "--retrieval", str(folder),
           "--max-length", str(MAX_LENGTH)]
    try:
        peak = peak_rss_mib(cmd, log, {**os.environ, "PYTHONPATH": str(REPO)}, timeout_s=300)
    except subprocess.CalledProcessError:
        pytest.fail(log.read_text()[-3000:])
    assert "nDCG@10" in log.read_text()
    return peak


def test_memory_follows_neither_the_corpus_text_nor_one_documents_length(tiny_folder, tmp_path):
    """400 documents of 100,000 characters (40 MB of text, which held would be 100 MiB) and one of 4 MiB (which
    the tokenizer would read whole: ~700 MiB): the run peaks within 25 MiB of one over 401 documents of 100
    characters. The 4 MiB line is parsed whole (a few copies of it, one line at a time); the tokenizer reads
    each document's first CHARS_PER_TOKEN * max_length characters."""
    short = evaluate_peak_mib(tiny_folder, folder_of(tmp_path, "short", [100] * 401), tmp_path / "short.log")
    folder = folder_of(tmp_path, "long", [100_000] * 400 + [4 * MIB])
    peak = evaluate_peak_mib(tiny_folder, folder, tmp_path / "long.log")
    assert peak - short < 25, (peak, short)


def test_the_cut_keeps_the_tokens_max_length_reads(tiny_folder):
    """Cut at CHARS_PER_TOKEN characters a token, prose tokenizes to the same first max_length tokens as uncut;
    short texts are unchanged."""
    tokenizer = load_tokenizer(str(tiny_folder))
    long = text(20_000, 3)
    for max_length in (8, 32, 128, 512):
        assert len(cut_for_tokens(long, max_length)) == CHARS_PER_TOKEN * max_length
        cut, whole = (tokenizer(t, truncation=True, max_length=max_length)["input_ids"]
                      for t in (cut_for_tokens(long, max_length), long))
        assert cut == whole and len(cut) == max_length
    assert cut_for_tokens("short", 8) == "short"


def test_a_corpus_that_changes_after_it_was_read_is_named(tiny_folder, tmp_path, monkeypatch, capsys):
    """The corpus is read again when it is embedded: a file rewritten in between is an error naming it and the
    line (the CLI: one line, exit 2), not documents scored under other documents' ids."""
    folder = folder_of(tmp_path, "set", [100] * 5)
    corpus = folder / "corpus.jsonl"
    lines = corpus.read_text().splitlines()
    data = load_beir(folder)
    corpus.write_text("\n".join(lines[:4]) + "\n")
    model, tokenizer = load_encoder(str(tiny_folder)), load_tokenizer(str(tiny_folder))
    with pytest.raises(CorpusChanged, match=rf"{corpus}: changed since it was read: 4 documents, not 5"):
        rank_corpus(model, tokenizer, data, "mean", max_length=MAX_LENGTH)

    def load_then_swap(*args):  # the CLI's load, then lines 2 and 3 swapped
        loaded = load_beir(*args)
        corpus.write_text("\n".join([lines[0], lines[2], lines[1], *lines[3:]]) + "\n")
        return loaded

    corpus.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(evaluate, "load_beir", load_then_swap)
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--model", str(tiny_folder), "--retrieval", str(folder), "--max-length", str(MAX_LENGTH)])
    assert exit_info.value.code == 2
    assert f"error: {corpus}:2: changed since it was read: document 'd2' where 'd1' was\n" in capsys.readouterr().err
