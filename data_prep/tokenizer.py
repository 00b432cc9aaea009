"""``data_prep tokenizer``: language-balanced SentencePiece training → spm model + Hugging Face folder.

Languages are balanced as in XLM / XLM-R: with p_l = n_l / N the share of language l in the corpus,
sentences are drawn with probability q_l = p_l^α / Σ_k p_k^α. α < 1 flattens the distribution, so
low-resource languages are up-sampled (repeated) and high-resource ones down-sampled; α = 1 keeps
the corpus shares, α = 0 gives every language the same share.

Memory is bounded by ``--max-sentences``: each language keeps a seeded reservoir of at most its
target count, and a language with fewer sentences than its target is repeated when the training
file is written, not held twice. One sentence in ``HELD_OUT_EVERY`` (chosen by a hash of its key,
so independent of order and seed) never reaches training and measures the UNK rate afterwards.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING

from clsys import storage
from clsys.storage import StorageError
from data_prep import cli
from clsys.shards.manifest import MANIFEST, read_manifest

if TYPE_CHECKING:  # imported where used: transformers is slow to import
    from transformers import PreTrainedTokenizerFast

# BERT-style specials with fixed ids. [PAD]/[UNK] are spm's own meta pieces; [CLS]/[SEP]/[MASK]
# are control symbols: they own ids 2-4 but spm never produces them from text (the HF tokenizer
# still maps a literal "[MASK]" to its id, as an added special token).
SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
HELD_OUT_EVERY = 50  # 2 % of the sentences, by key hash
HELD_OUT_MAX = 1000  # per language: enough for a stable UNK rate


def language_shares(counts: dict[str, int], alpha: float) -> dict[str, float]:
    """q_l = (n_l/N)^α / Σ_k (n_k/N)^α over the languages with at least one sentence."""
    total = sum(counts.values())
    weights = {lang: (n / total) ** alpha for lang, n in sorted(counts.items()) if n > 0}
    norm = sum(weights.values())
    return {lang: w / norm for lang, w in weights.items()}


def language_targets(shares: dict[str, float], budget: int) -> dict[str, int]:
    """Integer sentence counts in proportion to ``shares`` that sum to ``budget`` (largest remainder)."""
    exact = {lang: q * budget for lang, q in shares.items()}
    targets = {lang: int(x) for lang, x in exact.items()}
    by_remainder = sorted(exact, key=lambda lang: (targets[lang] - exact[lang], lang))
    for lang in by_remainder[: budget - sum(targets.values())]:
        targets[lang] += 1
    return targets


@dataclass
class Reservoir:
    """Uniform sample of at most ``size`` items from a stream of unknown length (Algorithm R)."""

    size: int
    rng: random.Random
    items: list[str] = field(default_factory=list)
    seen: int = 0

    def add(self, item: str) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(item)
        elif (j := self.rng.randrange(self.seen)) < self.size:
            self.items[j] = item


@dataclass
class LanguageReport:
    available: int  # sentences in the input
    share: float  # q_l
    sampled: int  # lines in the training file (with repeats when up-sampled)
    distinct: int  # distinct sentences among them
    held_out: int = 0
    unk_rate: float = 0.0  # [UNK] tokens / tokens on the held-out sentences


def resolve_stream(url: str) -> str:
    """A ``sentences`` stream URL, or a ``data_prep wiki --out`` root holding one."""
    for candidate in (url, storage.join(url, "sentences")):
        if storage.exists(storage.join(candidate, MANIFEST)):
            return candidate
    raise StorageError(f"{url}: no {MANIFEST} here or under sentences/ (expected the output of data_prep wiki)")


def samples(streams: list[str]):
    from clsys.shards.reader import load_shards, read_shard

    for url in streams:
        for shard in load_shards(url):
            for sample in read_shard(shard):
                yield sample["__key__"], sample["json"]["lang"], sample["txt"].replace("\n", " ")


def count_languages(streams: list[str]) -> dict[str, int]:
    """Sentences per language: from the manifest for one-language streams, else by reading the samples."""
    counts: dict[str, int] = {}
    for url in streams:
        manifest = read_manifest(url)
        langs = manifest.get("languages", [])
        if len(langs) == 1:
            counts[langs[0]] = counts.get(langs[0], 0) + manifest["samples"]
        else:
            for _, lang, _ in samples([url]):
                counts[lang] = counts.get(lang, 0) + 1
    return counts


def sample_sentences(items, targets: dict[str, int], seed: int) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(training reservoirs, held-out reservoirs) per language from ``(key, lang, text)`` items."""
    # One RNG per language, seeded by (seed, lang): a language's sample does not depend on the others.
    train = {lang: Reservoir(n, random.Random(f"{seed}-{lang}")) for lang, n in targets.items()}
    held = {lang: Reservoir(HELD_OUT_MAX, random.Random(f"{seed}-{lang}-held")) for lang in targets}
    for key, lang, text in items:
        if zlib.crc32(key.encode()) % HELD_OUT_EVERY == 0:
            held[lang].add(text)
        else:
            train[lang].add(text)
    return {lang: r.items for lang, r in train.items()}, {lang: r.items for lang, r in held.items()}


def training_lines(reservoir: list[str], target: int, rng: random.Random) -> list[str]:
    """``target`` lines from the reservoir: whole copies, then a random part for the remainder."""
    if not reservoir:
        return []
    copies, rest = divmod(target, len(reservoir))
    return reservoir * copies + rng.sample(reservoir, rest)


def hf_tokenizer(model_file: str) -> PreTrainedTokenizerFast:
    """The spm model as a fast tokenizer, via transformers' own SentencePiece converter (same
    normalizer, Metaspace pre-tokenizer and Unigram/BPE model) plus BERT's [CLS]/[SEP] template."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter
    from transformers.tokenization_utils_base import generate_merges

    class MergesFromScores:
        """What SpmConverter's BPE branch calls, ``Extractor(model_file).extract(vocab_scores) -> (vocab, merges)``,
        merges in spm's order (by score): transformers 5's SentencePieceExtractor no longer has that signature.
        The scores carry everything, so the model file is not read again."""

        def __init__(self, model_file: str):
            del model_file

        def extract(self, vocab_scores: list[tuple[str, float]]):
            vocab = {piece: i for i, (piece, _) in enumerate(vocab_scores)}
            return vocab, generate_merges(vocab, dict(vocab_scores))

    class BertSpmConverter(SpmConverter):
        SpmExtractor = MergesFromScores

        def post_processor(self):
            return TemplateProcessing(single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
                                      special_tokens=[("[CLS]", 2), ("[SEP]", 3)])

    backend = BertSpmConverter(SimpleNamespace(vocab_file=model_file)).converted()
    # token_type_ids are not among a generic fast tokenizer's default outputs; BERT-style models take them.
    return PreTrainedTokenizerFast(tokenizer_object=backend, model_input_names=["input_ids", "token_type_ids", "attention_mask"],
                                   **{f"{k}_token": v for k, v in SPECIALS.items()})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="URL",
                   help="sentences stream(s) of data_prep wiki, or its --out root(s)")
    p.add_argument("--vocab-size", type=cli.positive(int), required=True, metavar="N", help="vocabulary size, specials included")
    p.add_argument("--out", required=True, metavar="URL", help="output folder: s3://bucket/prefix, file:///abs or a path")
    p.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram", help="SentencePiece model (default: unigram)")
    p.add_argument("--alpha", type=float, default=0.3, metavar="A",
                   help="language sampling exponent: q_l ∝ (n_l/N)^A; 1 = corpus shares, 0 = uniform (default: 0.3, as XLM-R)")
    p.add_argument("--max-sentences", type=cli.positive(int), default=2_000_000, metavar="M",
                   help="training sentences (and the most held in memory) (default: 2000000)")
    p.add_argument("--character-coverage", type=float, default=0.9995, metavar="C",
                   help="share of characters the vocabulary must cover; rarer ones become [UNK] (default: 0.9995)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; same seed and input give the same model (default: 0)")


def main(args: argparse.Namespace) -> int:
    """Run ``tokenizer``; returns the exit code (0 ok, 2 unusable input, training failure or storage error)."""
    # Imported here, not at module level: torch and transformers would add seconds to every data_prep command.
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    from clsys.shards.reader import ShardError

    inputs = ", ".join(args.input)
    if not 0 <= args.alpha <= 1 or not 0 < args.character_coverage <= 1:
        return cli.fail("tokenizer", "--alpha must be in [0, 1] and --character-coverage in (0, 1]")
    try:
        storage.check_bucket(args.out)
        streams = [resolve_stream(url) for url in args.input]
        if problem := cli.out_problem(args.out, [args.out], streams):
            return cli.fail("tokenizer", problem)
        counts = count_languages(streams)
        if not counts:
            return cli.fail("tokenizer", f"{inputs}: no sentences")
        shares = language_shares(counts, args.alpha)
        targets = language_targets(shares, min(args.max_sentences, sum(counts.values())))
        train, held = sample_sentences(samples(streams), targets, args.seed)
    except (StorageError, ShardError) as err:
        return cli.fail("tokenizer", str(err))

    report = {lang: LanguageReport(counts[lang], shares[lang], 0, len(train[lang]), len(held[lang])) for lang in shares}
    with tempfile.TemporaryDirectory(prefix="data_prep-") as tmp:
        text_file, out_dir = os.path.join(tmp, "train.txt"), os.path.join(tmp, "out")
        os.makedirs(out_dir)
        n_lines = 0
        with open(text_file, "w", encoding="utf-8") as f:
            for lang in sorted(train):
                lines = training_lines(train[lang], targets[lang], random.Random(f"{args.seed}-{lang}-repeat"))
                report[lang].sampled = len(lines)
                n_lines += len(lines)
                f.writelines(line + "\n" for line in lines)
        train.clear()  # the file is the only copy spm needs
        spm.set_random_generator_seed(args.seed)
        try:
            spm.SentencePieceTrainer.train(
                input=text_file, model_prefix=os.path.join(out_dir, "spm"), vocab_size=args.vocab_size,
                model_type=args.model_type, character_coverage=args.character_coverage,
                # spm loads at most input_sentence_size lines (shuffled): our file already is the sample.
                input_sentence_size=n_lines, shuffle_input_sentence=True,
                pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece=SPECIALS["pad"], unk_piece=SPECIALS["unk"],
                control_symbols=[SPECIALS["cls"], SPECIALS["sep"], SPECIALS["mask"]],
                num_threads=os.cpu_count() or 1, minloglevel=2)
        except RuntimeError as err:  # e.g. "Vocabulary size is too high (8000). Please set it to a value <= 2345."
            return cli.fail("tokenizer", f"{inputs}: sentencepiece training failed: {str(err).strip().splitlines()[-1]}")
        # spm records its (temporary) input and output paths in the model: drop them, so that the same
        # seed and input give byte-identical models.
        model_file, proto = os.path.join(out_dir, "spm.model"), sentencepiece_model_pb2.ModelProto()
        with open(model_file, "rb") as f:
            proto.ParseFromString(f.read())
        proto.trainer_spec.ClearField("input")
        proto.trainer_spec.ClearField("model_prefix")
        with open(model_file, "wb") as f:
            f.write(proto.SerializeToString())
        tokenizer = hf_tokenizer(model_file)
        tokenizer.save_pretrained(out_dir)
        unk_id = tokenizer.unk_token_id
        for lang, sentences in held.items():
            ids = [i for seq in tokenizer(sentences, add_special_tokens=False)["input_ids"] for i in seq] if sentences else []
            report[lang].unk_rate = sum(i == unk_id for i in ids) / max(len(ids), 1)
        summary = {"vocab_size": len(tokenizer), "model_type": args.model_type, "alpha": args.alpha,
                   "max_sentences": args.max_sentences, "character_coverage": args.character_coverage,
                   "seed": args.seed, "inputs": streams, "training_sentences": n_lines,
                   "languages": {lang: asdict(r) for lang, r in report.items()}}
        with open(os.path.join(out_dir, "tokenizer_report.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
        try:
            storage.upload_dir(out_dir, args.out)
        except StorageError as err:
            return cli.fail("tokenizer", str(err))
    print(storage.redact(f"vocab {len(tokenizer)} ({args.model_type}), {n_lines} training sentences, alpha "
                         f"{args.alpha} -> {args.out}"))
    for lang, r in sorted(report.items()):
        print(f"  {lang}: {r.available} available, share {r.share:.3f}, {r.sampled} sampled "
              f"({r.distinct} distinct), UNK rate {r.unk_rate:.4%} on {r.held_out} held out")
    return 0
