"""Language-aware sentence splitting (Wikimedia's sentencex) and sentence → passage packing."""
from __future__ import annotations

import re
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
_MARKUP = re.compile("|".join(map(re.escape, MARKUP)))  # one search: half the time of five substring tests
# Chinese and Japanese put no spaces between words, so whitespace would see one "word" a sentence and
# drop them all as too short. Each Han or kana character counts as a word instead (as BERT-style
# tokenizers split them; a passage budget of 200 words is then ~200 characters) and as two characters
# against MIN_CHARS, as in display columns (a CJK sentence needs 8 characters, ~4-5 English words).
# Korean (Hangul) is written with spaces and needs nothing of this.
_CJK = re.compile(r"[\u3005\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f]")


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
    return [sentence for sentence, _ in counted_sentences(lang, text, stats)]


def counted_sentences(lang: str, text: str, stats: SplitStats) -> list[tuple[str, int]]:
    """``split_sentences`` with each sentence's ``count_words``, which the length filter needs anyway and
    ``pack_passages`` takes: counted once per sentence, not twice."""
    out = []
    for sentence in segment(lang, text):
        sentence = sentence.strip()
        if not sentence:
            continue
        if len(sentence) > MAX_CHARS:
            stats.too_long += 1
            continue
        cjk = _cjk_chars(sentence)
        words = _words(sentence, cjk)
        if len(sentence) + cjk < MIN_CHARS or words < MIN_WORDS:
            stats.too_short += 1
        elif _MARKUP.search(sentence):
            stats.markup += 1
        else:
            out.append((sentence, words))
    return out


def count_words(text: str) -> int:
    """Whitespace-separated words, each Chinese or Japanese character counted as one (``_CJK``)."""
    return _words(text, _cjk_chars(text))


def _words(text: str, cjk: int) -> int:
    return len(_CJK.sub(" ", text).split()) + cjk if cjk else len(text.split())


def _cjk_chars(text: str) -> int:
    # Most sentences have none: ASCII is checked in C without the regex, and a search stops at the first.
    return 0 if text.isascii() or not _CJK.search(text) else len(_CJK.findall(text))


def pack_passages(sentences: list[tuple[str, int]], max_words: int) -> list[Passage]:
    """Greedily pack consecutive whole sentences (each with its ``count_words``, as ``counted_sentences``
    gives them) into passages of at most ``max_words`` words.

    A sentence is never cut: one longer than the budget becomes a passage on its own.
    """
    passages: list[Passage] = []
    current: list[str] = []
    words = 0
    for sentence, n in sentences:
        if current and words + n > max_words:
            passages.append(Passage(" ".join(current), words))
            current, words = [], 0
        current.append(sentence)
        words += n
    if current:
        passages.append(Passage(" ".join(current), words))
    return passages
