"""The loader's collate at accelerator rate (issue 40): ``BatchTokenizer`` and ``SentenceBatcher`` give exactly
the tensors of ``tokenizer(texts, padding=True, truncation=True, max_length=L, return_tensors="pt")``, on
random hostile texts, for every kind of tokenizer clsys meets, from text and from pre-tokenized ids alike."""
from __future__ import annotations

import copy
import csv
import functools
import itertools
import pickle
import random
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
from tokenizers import AddedToken, Tokenizer
from tokenizers.normalizers import BertNormalizer
from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

from clsys.config import Config, ModelConfig
from clsys.recipes import load_config
from clsys.data.batch_tokenizer import BatchTokenizer
from clsys.data import chunk_tokenizer
from clsys.data.chunk_tokenizer import ChunkTokenizer
from clsys.data.pretokenized import SentenceBatcher
from clsys.model.encoder import load_tokenizer
from clsys.model.loading import resolve_model_path
from clsys.objectives.clir import CLIR
from clsys.recipes.css_lm.objective import CSSLM, CSSLMConfig
from clsys.objectives.simcse import SimCSE
from clsys.objectives.tacl import TaCL
from data_prep.tokenizer import SPECIALS, hf_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import e5_model  # noqa: E402

MINILM = "all-MiniLM-L6-v2"
GERMAN = ROOT / "clsys" / "assets" / "sts" / "stsb-de-test.csv"
KINDS = ("minilm", "minilm_left", "xlmr_e5", "spm_unigram", "spm_bpe", "slow_bert")
# 1 is below BERT's two special tokens: the backend then does not truncate at all; 2 leaves no text token.
MAX_LENGTHS = (1, 2, 3, 8, 32, 128)
BATCH_SIZES = (1, 2, 7, 64)

ALPHABETS = ("abcdefghijklmnopqrstuvwxyz", "ÄÖÜäöüßéèêçñ", "абвгдежзийклмнопрстуфхцчшщыэюя", "北京是中华人民共和国的首都",
             "القاهرةهيعاصمة", "여성은하루에단백질을", "🙂🚀👍🏽", "0123456789", ".,;:!?'\"()[]-/&",
             "e\u0301o\u0308", "\u200b\u00a0\u3000ﬁＦｕｌ")
LITERAL_SPECIALS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "<s>", "</s>", "<mask>", "<pad>")
# Format characters BERT's normalizer drops (right-to-left mark, zero-width joiner, soft hyphen, byte order mark):
# where they follow whitespace, the backend's offsets give them to the whitespace's side.
DROPPED = "\u200f\u200d\u00ad\ufeff"


def max_lengths(kind: str, main_case: bool = True) -> tuple[int, ...]:
    # Seconds each: a BatchTokenizer copies XLM-R's 250k-piece backend in ~1 s, and the slow tokenizer is Python
    # per character. Fewer there (the other kinds test the same code), one for the options of other objectives.
    if kind in ("xlmr_e5", "slow_bert"):
        return (2, 32) if main_case else (32,)
    return MAX_LENGTHS


def random_text(rng: random.Random) -> str:
    """Empty, blank, or words of mixed scripts, literal special tokens and very long words; some texts far
    over every max_length."""
    roll = rng.random()
    if roll < 0.05:
        return ""
    if roll < 0.1:
        return rng.choice((" ", "\t\n  ", "\u3000", "\r\n"))
    words = []
    for _ in range(rng.choice((1, 3, 10, 40, 120))):
        roll = rng.random()
        if roll < 0.05:
            words.append(rng.choice(LITERAL_SPECIALS))
        elif roll < 0.08:
            words.append(rng.choice(ALPHABETS[0] + ALPHABETS[3]) * rng.randint(50, 300))
        else:
            words.append("".join(rng.choice(rng.choice(ALPHABETS)) for _ in range(rng.randint(1, 12))))
    return rng.choice((" ", "  ", "", "\t")).join(words)


def random_batches(seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [[random_text(rng) for _ in range(size)] for size in BATCH_SIZES]


def _spm_tokenizer(folder: Path, model_type: str):
    """data_prep's SentencePiece tokenizer (its own [CLS]/[SEP] template), trained in a second on German STS."""
    with open(GERMAN, newline="", encoding="utf-8") as f:
        (folder / "train.txt").write_text("\n".join(row[0] for row in csv.reader(f)), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(folder / "train.txt"), model_prefix=str(folder / model_type), vocab_size=400, model_type=model_type,
        pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece=SPECIALS["pad"], unk_piece=SPECIALS["unk"],
        control_symbols=[SPECIALS["cls"], SPECIALS["sep"], SPECIALS["mask"]], num_threads=1, minloglevel=2)
    return hf_tokenizer(str(folder / f"{model_type}.model"))


def build_tokenizer(kind: str, folder: Path):
    if kind.startswith("minilm"):
        tokenizer = load_tokenizer(MINILM)
        if kind == "minilm_left":
            tokenizer.padding_side = tokenizer.truncation_side = "left"
    elif kind == "xlmr_e5":
        tokenizer = e5_model.build_tokenizer()  # multilingual-e5-small's XLM-R SentencePiece tokenizer.json
    elif kind.startswith("spm"):
        tokenizer = _spm_tokenizer(folder, kind.removeprefix("spm_"))
    else:  # a pure-Python tokenizer, no Rust backend
        tokenizer = BertTokenizerLegacy(str(Path(resolve_model_path(MINILM)) / "vocab.txt"))
    assert tokenizer.is_fast == (kind != "slow_bert")
    return tokenizer


@pytest.fixture(scope="module", params=KINDS)
def kind_and_tokenizer(request, tmp_path_factory):
    return request.param, build_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


def hf_call(tokenizer, texts: list[str], max_length: int, padding: bool | str = True,
            **options) -> dict[str, torch.Tensor]:
    """The call the collates made before issue 40 (and still make for a slow tokenizer)."""
    return dict(tokenizer(texts, padding=padding, truncation=True, max_length=max_length, return_tensors="pt",
                          **options))


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)  # the same keys in the same order
    for key in expected:
        assert got[key].dtype == expected[key].dtype == torch.int64, key
        assert torch.equal(got[key], expected[key]), key


# (BatchTokenizer's options, the HF call's arguments that mean the same)
OPTIONS = [({}, {}), ({"pad_to_max_length": True}, {"padding": "max_length"}),
           ({"token_type_ids": False}, {"return_token_type_ids": False}),
           ({"token_type_ids": True}, {"return_token_type_ids": True})]


@pytest.mark.parametrize("options, hf_options", OPTIONS)
def test_batch_tokenizer_equals_the_hf_call(kind_and_tokenizer, options, hf_options):
    kind, tokenizer = kind_and_tokenizer
    for max_length in max_lengths(kind, main_case=not options):
        encode = BatchTokenizer(tokenizer, max_length, **options)
        assert isinstance(encode.backend, Tokenizer) == (kind != "slow_bert")  # the fast path where there is one
        for texts in random_batches(max_length):
            try:
                expected = hf_call(tokenizer, texts, max_length, **hf_options)
            except ValueError:  # padding="max_length" on rows that max_length 1 left longer: refused alike
                with pytest.raises(ValueError):
                    encode(texts)
                continue
            assert_same(encode(texts), expected)
            if kind == "minilm_left" and max_length == 32 and len(texts) > 1:
                assert (expected["attention_mask"][:, 0] == 0).any()  # padded on the left, indeed


def test_sentence_batcher_equals_the_hf_call_from_text_and_from_ids(kind_and_tokenizer):
    kind, tokenizer = kind_and_tokenizer
    rng = random.Random(0)
    for max_length in [m for m in max_lengths(kind) if m > 1]:  # not 1: the backend leaves rows whole there
        batcher = SentenceBatcher(tokenizer, max_length)
        for copies, texts in zip((1, 2, 1, 2), random_batches(100 + max_length)):
            expected = {k: v.repeat(copies, 1) for k, v in hf_call(tokenizer, texts, max_length).items()}
            # As data_prep tokenize writes them: cut at --max-tokens, no less than what max_length keeps.
            max_tokens = max_length - tokenizer.num_special_tokens_to_add() + rng.choice((0, 1, 5, 1000))
            ids = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_tokens)["input_ids"]
            with_ids = [{"txt": t, "ids": i} for t, i in zip(texts, ids)]
            assert_same(batcher(with_ids, copies), expected)
            as_arrays = [{**s, "ids": np.asarray(s["ids"], np.int32)} for s in with_ids]  # should a reader decode so
            assert_same(batcher(as_arrays, copies), expected)
            assert_same(batcher([{"txt": t} for t in texts], copies), expected)
            with_ids[0] = {"txt": texts[0]}  # one sample without ids: the batch is tokenized
            assert_same(batcher(with_ids, copies), expected)


def test_collate_leaves_the_tokenizers_own_backend_alone():
    """The configured copy does the work: the HF call reconfigured the shared backend on every batch."""
    tokenizer = load_tokenizer(MINILM)
    backend = tokenizer.backend_tokenizer
    before = (backend.truncation, backend.padding)
    batcher = SentenceBatcher(tokenizer, 32)
    batcher([{"txt": t} for t in random_batches(0)[-1]])
    assert (backend.truncation, backend.padding) == before


def test_a_tokenizer_class_that_adds_to_the_call_keeps_the_hf_call():
    """LayoutLM, LUKE, mBART, … override steps of the HF call: the backend alone would miss what they add."""
    class Shifted(type(load_tokenizer(MINILM))):
        def _encode_plus(self, *args, **kwargs):
            encoding = super()._encode_plus(*args, **kwargs)
            encoding["input_ids"] = encoding["input_ids"] + 1
            return encoding

    tokenizer = Shifted.from_pretrained(resolve_model_path(MINILM))
    encode, texts = BatchTokenizer(tokenizer, 32), random_batches(1)[-1]
    assert encode.backend is None
    assert_same(encode(texts), hf_call(tokenizer, texts, 32))


@pytest.mark.parametrize("kind", ["minilm", "slow_bert"])
def test_pickled_and_copied_batchers_give_the_same_batches(kind, tmp_path):
    """The collate travels to the loader workers pickled (and may be deep-copied), before or after its
    configured backend copy and framing were built."""
    tokenizer = build_tokenizer(kind, tmp_path)
    texts = random_batches(7)[-1]
    text_samples = [{"txt": t} for t in texts]
    id_samples = [{"txt": t, "ids": i} for t, i in zip(texts, tokenizer(texts, add_special_tokens=False)["input_ids"])]
    batcher = SentenceBatcher(tokenizer, 32)
    fresh = pickle.loads(pickle.dumps(batcher))
    expected_text, expected_ids = batcher(text_samples, 2), batcher(id_samples, 2)
    used = pickle.loads(pickle.dumps(batcher))
    assert "backend" not in used.encode.__dict__  # the configured copy is rebuilt there, not pickled with it
    for other in (fresh, used, copy.deepcopy(batcher)):
        assert_same(other(text_samples, 2), expected_text)
        assert_same(other(id_samples, 2), expected_ids)


def test_objectives_collate_what_their_hf_calls_gave(tiny_bert_with_heads):
    """The drop-ins: supervised SimCSE's triplets, TaCL's passages (padded to max_length or not), CSS-LM's
    sentences (no token types) and CLIR's single texts for e₀ (token types) are the HF calls they replaced."""
    tokenizer = load_tokenizer(tiny_bert_with_heads)
    texts = [t for batch in random_batches(5) for t in batch][:24]
    model = [f"model.name={tiny_bert_with_heads}", "data.max_length=24"]

    simcse = SimCSE(load_config("simcse_sup", model), tokenizer)
    triplets = [{"json": {"anchor": a, "positive": p, "negative": n}} for a, p, n in zip(*[iter(texts)] * 3)]
    in_order = [s["json"][part] for part in ("anchor", "positive", "negative") for s in triplets]
    assert_same(simcse.collate(triplets), hf_call(tokenizer, in_order, 24))

    for pad_negatives in ("false", "true"):
        tacl = TaCL(load_config("tacl", [*model, f"objective.pad_negatives={pad_negatives}", "model.packed=false"]),
                    tokenizer)
        batch = tacl.collate([{"txt": t} for t in texts])
        expected = hf_call(tokenizer, texts, 24, padding="max_length" if pad_negatives == "true" else True)
        assert_same({k: batch[k] for k in expected}, expected)

    css = CSSLM(Config(model=ModelConfig(name=tiny_bert_with_heads),
                       objective=CSSLMConfig(name="css_lm", num_labels=2)), tokenizer)
    expected = hf_call(tokenizer, texts, css.cfg.data.max_length, return_token_type_ids=False)
    corpus = css.collate([{"txt": t} for t in texts])
    assert_same({"input_ids": corpus["corpus_input_ids"], "attention_mask": corpus["corpus_attention_mask"]}, expected)
    assert_same(css.collate_corpus(texts), expected)

    clir = CLIR(load_config("clir", [*model, "objective.keep_weight=1.0"]), tokenizer)
    assert_same(clir.data.keep_texts(texts), hf_call(tokenizer, texts, 24, return_token_type_ids=True))


def _backend_without_cuts(tokenizer) -> Tokenizer:
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.no_truncation()
    backend.no_padding()
    return backend


@functools.cache
def _edge_characters() -> tuple[str, ...]:
    """Every character that could move a chunk's edge: whitespace, control and format characters, combining marks."""
    return tuple(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000
                 and (chr(c).isspace() or unicodedata.category(chr(c)) in ("Cc", "Cf", "Zs", "Zl", "Zp", "Mn")))


def _texts_to_split(rng: random.Random) -> list[str]:
    """Real sentences (STS-B in English and German, KorSTS), the hostile random texts, and each edge character
    between words, inside a word, inside a literal special token and after an accent, and mixed at random."""
    real = []
    for name in ("stsb-en-test.csv", "stsb-de-test.csv"):
        with open(ROOT / "clsys" / "assets" / "sts" / name, newline="", encoding="utf-8") as f:
            real += [text for row in itertools.islice(csv.reader(f), 600) for text in row[:2]]
    with open(ROOT / "clsys" / "assets" / "sts" / "korsts-test.tsv", encoding="utf-8") as f:
        real += [text for line in list(f)[1:200] for text in line.rstrip("\n").split("\t")[5:7]]
    edges = _edge_characters()
    around = [f"ab{c}cd a {c} b [MA{c}SK] x{c}[SEP] e\u0301{c}\u0301x" for c in edges]
    pool = [*edges, *"aé[]MASKCLS#.,中", "[MASK]", "[CLS]", "[mask]", "hello", "Wörld", "  "]
    mixed = ["".join(rng.choice(pool) for _ in range(rng.randint(0, 30))) for _ in range(1000)]
    words = ["hello world", "x hello y", "ahello hellob hello, HELLO", " hello  Wörld wörld xWörldx abab cab"]
    # The added tokens of the tests ("hello", …) next to whitespace and to characters the normalizer drops.
    dropping = [*DROPPED, "hello", "Wörld", "ab", "x", "é", " ", "  ", "\t"]
    mixed_dropped = ["".join(rng.choice(dropping) for _ in range(rng.randint(1, 12))) for _ in range(1000)]
    return real + [random_text(rng) for _ in range(1000)] + around + mixed + words + mixed_dropped


@pytest.mark.parametrize("variant", ["minilm", "cased", "cased_no_accent_strip_no_cjk", "accents_stripped",
                                     "added_tokens", "added_tokens_split"])
def test_chunk_tokenizer_gives_the_backends_ids(variant):
    """A text's ids are its whitespace-separated chunks' ids one after the other, each chunk's as the backend gives
    it alone: on real and hostile texts, on each BertNormalizer setting, with added tokens that strip the whitespace
    before them or match only whole words, matched or not (``split_special_tokens``); the first pass learns the
    chunks (one backend call on them joined), the second answers from what it learned."""
    backend = _backend_without_cuts(load_tokenizer(MINILM))
    options = {"cased": {"lowercase": False}, "accents_stripped": {"strip_accents": True},
               "cased_no_accent_strip_no_cjk": {"lowercase": False, "strip_accents": False,
                                                "handle_chinese_chars": False}}.get(variant)
    if options is not None:
        backend.normalizer = BertNormalizer(clean_text=True, **options)
    if variant.startswith("added_tokens"):
        backend.add_tokens([AddedToken("hello", single_word=True, lstrip=True, normalized=True),
                            AddedToken("Wörld", normalized=False), AddedToken("ab")])
        backend.encode_special_tokens = variant == "added_tokens_split"
    chunks = ChunkTokenizer.of(backend)
    assert chunks is not None
    texts = _texts_to_split(random.Random(variant))
    expected = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    for _ in range(2):
        assert [chunks(texts[i:i + 64]) for i in range(0, len(texts), 64)] == \
            [expected[i:i + 64] for i in range(0, len(texts), 64)]
    assert len(chunks.known) > 1000


def test_an_added_token_that_strips_the_whitespace_after_it_keeps_the_backends_ids():
    """An added token with ``rstrip`` takes the whitespace after it, and the backend's offsets give it the characters
    the normalizer drops that follow: cut into chunks, a chunk made only of them took the token, and the wrong ids
    were remembered for later batches. The loader's ids are still the backend's, batch after batch."""
    tokenizer = load_tokenizer(MINILM)
    tokenizer.add_tokens([AddedToken("hello", rstrip=True)])
    encode = BatchTokenizer(tokenizer, 1 << 20)  # no text is cut
    texts = _texts_to_split(random.Random(10))
    expected = [e.ids for e in encode.backend.encode_batch_fast(texts, add_special_tokens=False)]
    for _ in range(2):  # the second pass as later batches: from what the first learned, where chunks are remembered
        got = [ids for i in range(0, len(texts), 64) for ids in encode.text_ids(texts[i:i + 64])]
        wrong = [text for text, ids, right in zip(texts, got, expected) if ids != right]
        assert not wrong, f"{len(wrong)} of {len(texts)} texts, e.g. {wrong[:3]}"


def test_no_chunk_tokenizer_where_ids_are_not_the_chunks(tmp_path):
    """Other pipelines (SentencePiece's, XLM-R's), an added token that holds whitespace (it can span chunks) and one
    that strips the whitespace after it (it can take characters of the next chunk) keep the backend's own call."""
    for kind in ("xlmr_e5", "spm_unigram"):
        assert ChunkTokenizer.of(build_tokenizer(kind, tmp_path).backend_tokenizer) is None
    backend = _backend_without_cuts(load_tokenizer(MINILM))
    assert ChunkTokenizer.of(backend) is not None
    backend.add_tokens([AddedToken("new york")])
    assert ChunkTokenizer.of(backend) is None
    stripping = _backend_without_cuts(load_tokenizer(MINILM))
    stripping.add_tokens([AddedToken("hello", rstrip=True)])
    assert ChunkTokenizer.of(stripping) is None
    unclean = _backend_without_cuts(load_tokenizer(MINILM))
    unclean.normalizer = BertNormalizer(clean_text=False)  # control characters then stay inside words
    assert ChunkTokenizer.of(unclean) is None


def test_chunk_tokenizer_remembers_a_bounded_number_of_short_chunks(monkeypatch):
    """A loader worker's dictionary stops growing at MAX_CHUNKS chunks of at most MAX_CHUNK_CHARS characters; the
    chunks it no longer learns are encoded each time, with the same ids."""
    monkeypatch.setattr(chunk_tokenizer, "MAX_CHUNKS", 300)
    backend = _backend_without_cuts(load_tokenizer(MINILM))
    chunks = ChunkTokenizer.of(backend)
    texts = _texts_to_split(random.Random(3))[:2000] + ["x" * 65 + " " + "y" * 64]
    expected = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    for _ in range(2):
        assert chunks(texts) == expected
    assert len(chunks.known) == 300
    assert max(map(len, chunks.known)) <= chunk_tokenizer.MAX_CHUNK_CHARS == 64
    fresh = ChunkTokenizer.of(backend)
    fresh(texts[-1:])
    assert list(fresh.known) == ["y" * 64]
