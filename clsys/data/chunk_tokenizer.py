"""A BERT WordPiece tokenizer at the loader's rate: the Rust backend's own ids, remembered chunk by chunk.

The backend spends ~50 µs on a 130-character sentence (all-MiniLM-L6-v2, one core of the CI machine), most of it
on what the loader never reads: every character's alignment through normalization and pre-tokenization, and an
``Encoding`` per text with tokens, offsets and word ids. BERT's pipeline, though, never looks across whitespace:
its normalizer (BertNormalizer) changes one character at a time (control characters dropped, whitespace made a
space, CJK characters spaced out, accents stripped after an NFD decomposition that whitespace bounds, lowercase),
its pre-tokenizer (BertPreTokenizer) splits at whitespace and punctuation, and WordPiece cuts each word alone. So
a text's ids are its whitespace-separated chunks' ids, one after the other, and a chunk's ids are what the backend
gives for the chunk alone: a dictionary of the chunks met so far ("the", "Paris,", "(1999).") answers nearly
every chunk of natural text after a few batches (words follow Zipf's law), and the chunks it has not met go to
the backend, all of a batch in one call.

The chunks are cut where the backend separates words: at whitespace, but not at the control characters that
Python's ``str.split`` also takes for whitespace (``\\x0b``, ``\\x0c``, ``\\x1c``-``\\x1f``, ``\\x85``): the
normalizer drops those, joining what is around them. An added token ([CLS], [MASK], a user's added word) is found
within a chunk exactly as within the text, as long as its own content holds no whitespace, and its ids go to its
chunk as long as it does not take the whitespace after it (``rstrip``): the backend's offsets give such a token the
characters the normalizer drops after that whitespace (a right-to-left mark, a zero-width joiner, a soft hyphen, a
byte order mark), and a next chunk made only of them would take the token (131 of 2,000 random texts of such a
token, spaces and those characters got other ids). A tokenizer with either kind of added token gets no chunk
tokenizer (``ChunkTokenizer.of`` is None), nor does one whose pipeline is not BERT's.
tests/test_fast_collate.py holds the ids equal to the backend's on every whitespace and control character, on
fuzzed mixed-script text and on the bundled corpus.
"""
from __future__ import annotations

import copy
import itertools
import re
import unicodedata

import numpy as np
from tokenizers import Tokenizer
from tokenizers.models import WordPiece
from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer

# Where the backend separates words: whitespace (Unicode White_Space) that its normalizer keeps, the control
# characters among it (Cc) but tab, line feed and carriage return being dropped.
_SEPARATORS = re.compile("[%s]+" % "".join(chr(c) for c in range(0x3001) if chr(c).isspace()  # U+3000: the last
                                           and (unicodedata.category(chr(c)) != "Cc" or chr(c) in "\t\n\r")))
# Chunks whose ids are remembered, and the longest remembered. The frequent ones are met first, so a full
# dictionary keeps them and learns no more (~200 bytes a chunk: ~25 MB per loader worker).
MAX_CHUNKS = 1 << 17
MAX_CHUNK_CHARS = 64


class ChunkTokenizer:
    """``__call__(texts)``: the ids ``backend.encode_batch_fast(texts, add_special_tokens=False)`` gives each text,
    uncut (``backend``'s truncation does not apply)."""

    def __init__(self, backend: Tokenizer):
        self.backend = copy.deepcopy(backend)  # the chunks' ids whole: the texts are cut after they are joined
        self.backend.encode_special_tokens = backend.encode_special_tokens  # a setting a copy does not keep
        self.backend.no_truncation()
        self.backend.no_padding()
        self.known: dict[str, list[int]] = {}

    @classmethod
    def of(cls, backend: Tokenizer) -> ChunkTokenizer | None:
        """The chunk tokenizer for ``backend``, or None where its ids are not its chunks' (see the module)."""
        normalizer = backend.normalizer
        if not (type(normalizer) is BertNormalizer and normalizer.clean_text
                and type(backend.pre_tokenizer) is BertPreTokenizer and type(backend.model) is WordPiece):
            return None
        if any(len(token.content.split()) != 1 or token.content.strip() != token.content or token.rstrip
               for token in backend.get_added_tokens_decoder().values()):
            return None
        return cls(backend)

    def __call__(self, texts: list[str]) -> list[list[int]]:
        # A printable text's only whitespace is the space; any other goes through the backend's own separators.
        chunked = [text.split() if text.isprintable() else [c for c in _SEPARATORS.split(text) if c] for text in texts]
        found = [list(map(self.known.get, chunks)) for chunks in chunked]
        missing = list({chunk: None for chunks, ids in zip(chunked, found) if None in ids
                        for chunk, chunk_ids in zip(chunks, ids) if chunk_ids is None})
        if missing:
            learned = dict(zip(missing, self._encode(missing)))
            for chunk, ids in learned.items():
                if len(self.known) < MAX_CHUNKS and len(chunk) <= MAX_CHUNK_CHARS:
                    self.known[chunk] = ids
            found = [[learned[chunk] if chunk_ids is None else chunk_ids for chunk, chunk_ids in zip(chunks, ids)]
                     if None in ids else ids for chunks, ids in zip(chunked, found)]
        return [list(itertools.chain.from_iterable(ids)) for ids in found]

    def _encode(self, chunks: list[str]) -> list[list[int]]:
        """Each chunk's ids, from one backend call on the chunks joined by spaces (half the cost of a call on the
        list: one ``Encoding``, not one per chunk), each token given to the chunk its last character is in (an added
        token that strips the whitespace before it, ``lstrip``, spans the space before its chunk and what the
        normalizer drops there)."""
        encoding = self.backend.encode(" ".join(chunks), add_special_tokens=False)
        starts = np.cumsum([0] + [len(chunk) + 1 for chunk in chunks[:-1]])
        owners = np.searchsorted(starts, [end - 1 for _, end in encoding.offsets], side="right") - 1
        ends = np.cumsum(np.bincount(owners, minlength=len(chunks))).tolist()
        ids = encoding.ids
        return [ids[start:end] for start, end in zip([0] + ends[:-1], ends)]
