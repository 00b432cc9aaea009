"""Language-aware sentence splitting (Wikimedia's sentencex) and sentence → passage packing."""
from __future__ import annotations

import re
import unicodedata
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
_CJK_CHARS = "\u3005\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
_CJK = re.compile(f"[{_CJK_CHARS}]")
# Thai, Lao, Tibetan, Burmese and Khmer put no spaces between words either, but they are alphabets: a
# syllable takes a few letters, and the vowel signs, tone marks and stacked consonants written on and
# around them are combining characters. Their text is measured in graphemes (a letter with its combining
# marks, which take no room of their own): a sentence needs MIN_CHARS of them, and a run of them counts
# as one word per GRAPHEMES_PER_WORD graphemes, rounded up, about a word's length in these scripts
# (Thai ประเทศ "country" 6, เมือง "city" 4, ที่ "that" 1; Tibetan syllables are ~3 with their ་).
_SPACELESS_CHARS = "\u0e00-\u0fff\u1000-\u109f\u1780-\u17ff"  # Thai, Lao, Tibetan; Myanmar; Khmer
_SPACELESS_RUN = re.compile(f"[{_SPACELESS_CHARS}]+")
_COMBINING = re.compile("[%s]" % "".join(c for c in map(chr, range(0x0E00, 0x1800))
                                          if _SPACELESS_RUN.match(c) and unicodedata.category(c).startswith("M")))
_NO_SPACES = re.compile(f"[{_CJK_CHARS}]|[{_SPACELESS_CHARS}]+")  # what whitespace cannot count
GRAPHEMES_PER_WORD = 3
# Sentence ends of these scripts, where sentencex knows none. Khmer ends a sentence with ។ (not inside
# ។ល។, "etc.") or a text with ៕, Burmese with ။, Tibetan with ། or ༎ (a run of them, as "། །"); all three
# with ? or ! too. Thai and Lao have no full stop: a space between two of their letters ends a sentence or
# a clause (a space next to a digit, theirs included, or a Latin word is word spacing, as is one before the
# repetition mark ๆ / ໆ or the abbreviation mark ฯ / ຯ).
_THAI_LAO_LETTER = r"[\u0e01-\u0e4f\u0e5a\u0e5b\u0e81-\u0ecf\u0edc-\u0edf]"  # not their digits
_THAI_LAO_SPACE = rf"(?<={_THAI_LAO_LETTER})\s+(?![\u0e2f\u0e46\u0eaf\u0ec6])(?={_THAI_LAO_LETTER})"
_KHMER_END = r"(?:៕|(?<!។ល)។(?!ល។))\s*"
_QUESTION_END = r"[?!](?:\s+|$)"
_SENTENCE_ENDS = {"th": _THAI_LAO_SPACE, "lo": _THAI_LAO_SPACE, "km": f"{_KHMER_END}|{_QUESTION_END}",
                  "my": f"။\\s*|{_QUESTION_END}", "bo": f"[།༎](?:\\s*[།༎])*\\s*|{_QUESTION_END}"}
_SENTENCE_END = {lang: re.compile(pattern) for lang, pattern in _SENTENCE_ENDS.items()}
# A space in Thai and Lao and a shad in Tibetan end clauses as often as sentences: a piece shorter than
# MIN_CHARS is kept with the next one (the last of a paragraph with the one before), not dropped.
_CLAUSE_ENDS = {"th", "lo", "bo"}


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
    for sentence, length, words in _segment(lang, text):
        if len(sentence) > MAX_CHARS:
            stats.too_long += 1
        elif length < MIN_CHARS or words < MIN_WORDS:
            stats.too_short += 1
        elif _MARKUP.search(sentence):
            stats.markup += 1
        else:
            out.append((sentence, words))
    return out


def _segment(lang: str, text: str) -> list[tuple[str, int, int]]:
    """The sentences of ``text``, each with its ``_measure``: by sentencex, or at ``_SENTENCE_END`` for the
    scripts it does not know, clauses joined where ``_CLAUSE_ENDS`` says."""
    ends = _SENTENCE_END.get(lang)
    pieces = segment(lang, text) if ends is None else _split_after(ends, text)
    measured = [_measured(piece) for piece in map(str.strip, pieces) if piece]
    return _join_clauses(measured) if lang in _CLAUSE_ENDS else measured


def _split_after(ends: re.Pattern, text: str) -> list[str]:
    """``text`` cut after each match of ``ends`` (which keeps its terminator, ``strip`` drops its spaces)."""
    cuts = [0, *(end.end() for end in ends.finditer(text)), len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def _join_clauses(pieces: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """A piece shorter than MIN_CHARS joined to the next one; the last of the paragraph to the one before."""
    joined: list[tuple[str, int, int]] = []
    for piece in pieces:
        if joined and joined[-1][1] < MIN_CHARS:
            piece = _measured(f"{joined.pop()[0]} {piece[0]}")
        joined.append(piece)
    if len(joined) > 1 and joined[-1][1] < MIN_CHARS:
        last = joined.pop()
        joined.append(_measured(f"{joined.pop()[0]} {last[0]}"))
    return joined


def _measured(sentence: str) -> tuple[str, int, int]:
    return (sentence, *_measure(sentence))


def count_words(text: str) -> int:
    """Whitespace-separated words, each Chinese or Japanese character counted as one and runs of the
    alphabets without spaces (Thai, Lao, Tibetan, Burmese, Khmer) by their graphemes (``_measure``)."""
    return _measure(text)[1]


def _measure(text: str) -> tuple[int, int]:
    """(length against MIN_CHARS, words): characters and whitespace-separated words, but a Chinese or
    Japanese character counts as two characters and one word, and a run of Thai, Lao, Tibetan, Burmese or
    Khmer as its graphemes and one word per GRAPHEMES_PER_WORD of them."""
    # Most sentences have none: ASCII is checked in C without the regex, and a search stops at the first.
    if text.isascii() or not _NO_SPACES.search(text):
        return len(text), len(text.split())
    cjk = len(_CJK.findall(text))
    length, words = len(text) + cjk, cjk + len(_NO_SPACES.sub(" ", text).split())
    for run in _SPACELESS_RUN.findall(text):
        graphemes = len(run) - len(_COMBINING.findall(run))
        length -= len(run) - graphemes
        words += -(-graphemes // GRAPHEMES_PER_WORD)  # rounded up: every run is at least one word
    return length, words


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
