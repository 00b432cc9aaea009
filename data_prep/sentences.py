"""Language-aware sentence splitting (Wikimedia's sentencex) and sentence → passage packing."""
from __future__ import annotations

from dataclasses import dataclass

from sentencex import segment

# Shorter sentences are mostly debris (list fragments, captions, "See below."); longer ones are
# usually run-together lists or tables that escaped cleaning. Both are counted, not silently lost.
MIN_WORDS = 3
MIN_CHARS = 15
MAX_CHARS = 1000
# Wiki markup that survived cleaning (mwparserfromhell gives up on some malformed constructs):
# such a sentence is debris, not prose.
MARKUP = ("[[", "]]", "{{", "}}", "|")  # a pipe in prose is nearly always table/template debris
# sentencex falls back through its own language chains; "und" (unknown) uses English rules.
FALLBACK_LANG = "en"


@dataclass
class SplitStats:
    too_short: int = 0
    too_long: int = 0
    markup: int = 0


@dataclass
class Passage:
    text: str
    n_words: int


def split_sentences(lang: str, text: str, stats: SplitStats) -> list[str]:
    """Sentences of one paragraph that pass the length filters; rejects are counted in ``stats``."""
    out = []
    for sentence in segment(lang if lang != "und" else FALLBACK_LANG, text):
        sentence = sentence.strip()
        if not sentence:
            continue
        if len(sentence) > MAX_CHARS:
            stats.too_long += 1
        elif len(sentence) < MIN_CHARS or len(sentence.split()) < MIN_WORDS:
            stats.too_short += 1
        elif any(m in sentence for m in MARKUP):
            stats.markup += 1
        else:
            out.append(sentence)
    return out


def pack_passages(sentences: list[str], max_words: int) -> list[Passage]:
    """Greedily pack consecutive whole sentences into passages of at most ``max_words`` words.

    A sentence is never cut: one longer than the budget becomes a passage on its own.
    """
    passages: list[Passage] = []
    current: list[str] = []
    words = 0
    for sentence in sentences:
        n = len(sentence.split())
        if current and words + n > max_words:
            passages.append(Passage(" ".join(current), words))
            current, words = [], 0
        current.append(sentence)
        words += n
    if current:
        passages.append(Passage(" ".join(current), words))
    return passages
