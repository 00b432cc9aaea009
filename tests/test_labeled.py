"""Labelled task files (clsys.data.labeled): every format on real files, label mapping, errors, few-shot sampling."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest

from clsys import storage
from clsys.data.labeled import LabeledSet, few_shot, load_labeled

ASSETS = Path(__file__).resolve().parents[1] / "clsys" / "assets" / "labeled"
SHARED = Path("/work/shared/data/labeled")  # the unmodified originals, where this checkout has them
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="no shared/data/labeled on this machine")


def _write(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def test_sst5_line_format_and_shared_label_mapping():
    train = load_labeled(str(ASSETS / "sst5" / "stsa.fine.train"))
    assert len(train) == 8544 and train.label_names == ["0", "1", "2", "3", "4"]
    assert train.texts[0].startswith("a stirring , funny and finally transporting re-imagining")
    assert train.labels[:3] == [4, 1, 1]
    assert [collections.Counter(train.labels)[i] for i in range(5)] == [1092, 2218, 1624, 2322, 1288]
    dev = load_labeled(str(ASSETS / "sst5" / "stsa.fine.dev"), label_names=train.label_names)
    assert len(dev) == 1101 and dev.label_names == train.label_names
    assert [collections.Counter(dev.labels)[i] for i in range(5)] == [139, 289, 229, 279, 165]
    assert len(load_labeled(f"file://{ASSETS / 'sst5' / 'stsa.fine.test'}", train.label_names)) == 2210


def test_acl_arc_json_lines():
    train = load_labeled(str(ASSETS / "acl-arc" / "train.txt"))
    assert len(train) == 1688
    assert train.label_names == ["Background", "CompareOrContrast", "Extends", "Future", "Motivation", "Uses"]
    assert train.texts[0].startswith("Thus , over the past few years , along with advances")
    assert train.label_names[train.labels[0]] == "Background"
    assert collections.Counter(train.labels)[train.label_names.index("Future")] == 60
    dev = load_labeled(str(ASSETS / "acl-arc" / "dev.txt"), train.label_names)
    test = load_labeled(str(ASSETS / "acl-arc" / "test.txt"), train.label_names)
    assert (len(dev), len(test)) == (114, 139)
    assert collections.Counter(dev.labels)[train.label_names.index("Background")] == 59


@needs_shared
def test_shared_scicite_snli_korean_tsv_and_trec():
    scicite = load_labeled(str(SHARED / "scibert" / "sci-cite" / "train.txt"))
    assert len(scicite) == 7320 and scicite.label_names == ["background", "method", "result"]
    assert scicite.texts[0].startswith("However, how frataxin interacts with the Fe-S cluster")
    # The second text has embedded newlines: kept inside the text, not split into lines.
    assert "\n" in scicite.texts[1]

    snli = load_labeled(str(SHARED / "nli" / "snli_dev.csv"))  # gold_label, sentence1, sentence2, SET
    assert len(snli) == 9842 and snli.label_names == ["contradiction", "entailment", "neutral"]
    assert snli.texts[0] == "Two women are embracing while holding to go packages."
    assert snli.label_names[snli.labels[0]] == "neutral"

    # Line 900 starts with a literal '"': with CSV quoting it would swallow the lines after it.
    korean = load_labeled(str(SHARED / "nli" / "xnli.dev.ko.tsv"))
    assert len(korean) == 2490 and korean.texts[898].startswith('"')

    trec_path = str(SHARED / "sst-trec" / "data" / "TREC.train.all")
    with pytest.raises(ValueError, match=r"TREC\.train\.all:66: not utf-8 text \(byte 0xf0\)"):
        load_labeled(trec_path)
    trec = load_labeled(trec_path, encoding="latin-1")
    assert len(trec) == 5452 and trec.label_names == ["0", "1", "2", "3", "4", "5"]
    assert trec.texts[0] == "How did serfdom develop in and then leave Russia ?"


def test_word_labels_and_numeric_sorting(tmp_path):
    # Raw TREC: the label is a word (COARSE:fine); names sort as strings.
    trec = load_labeled(_write(tmp_path, "TREC.train", "DESC:manner How did serfdom develop ?\n"
                                                       "ENTY:cremat What films featured Popeye Doyle ?\n\n"
                                                       "ABBR:exp What is the full form of .com ?\n"))
    assert trec.label_names == ["ABBR:exp", "DESC:manner", "ENTY:cremat"]
    assert trec.labels == [1, 2, 0] and trec.texts[2] == "What is the full form of .com ?"
    # Integer labels sort by value, not as strings ("10" after "9").
    numeric = load_labeled(_write(tmp_path, "n.train", "10 ten\n9 nine\n-1 minus one\n"))
    assert numeric.label_names == ["-1", "9", "10"] and numeric.labels == [2, 1, 0]


def test_csv_and_tsv_fields(tmp_path):
    csv_path = _write(tmp_path, "d.csv", 'id,sentence,gold_label\n1,"a, quoted\ntext",pos\n\n2,plain,neg\n')
    data = load_labeled(csv_path)
    assert data.texts == ["a, quoted\ntext", "plain"] and data.label_names == ["neg", "pos"]
    assert data.labels == [1, 0]
    named = load_labeled(csv_path, text_field="id", label_field="sentence")
    assert named.texts == ["1", "2"] and named.label_names == ["a, quoted\ntext", "plain"]
    with pytest.raises(ValueError, match=r"d\.csv:1: no text field 'body'"):
        load_labeled(csv_path, text_field="body")
    tsv = load_labeled(_write(tmp_path, "d.tsv", 'Review\tY\n"quoted at start\tx\n'))
    assert tsv.texts == ['"quoted at start'] and tsv.label_names == ["x"]
    with pytest.raises(ValueError, match=r"e\.csv:3: 2 fields, the header has 3"):
        load_labeled(_write(tmp_path, "e.csv", "text,label,extra\nok,a,1\nbad,a\n"))
    with pytest.raises(ValueError, match=r"f\.csv:1: no label field among"):
        load_labeled(_write(tmp_path, "f.csv", "text,tag\nok,a\n"))


def test_unknown_dev_label_names_file_and_line(tmp_path):
    train = load_labeled(_write(tmp_path, "train.jsonl", '{"text": "x", "label": "b"}\n{"text": "y", "label": "a"}\n'
                                                         '{"text": "z", "label": "c"}\n'))
    assert train.label_names == ["a", "b", "c"] and train.labels == [1, 0, 2]
    # dev has a subset in another order: ids still follow train's names.
    dev = load_labeled(_write(tmp_path, "dev.jsonl", '{"text": "p", "label": "c"}\n{"text": "q", "label": "a"}\n'),
                       train.label_names)
    assert dev.labels == [2, 0]
    bad = _write(tmp_path, "test.jsonl", '{"text": "p", "label": "a"}\n\n{"text": "q", "label": "d"}\n')
    with pytest.raises(ValueError, match=r"test\.jsonl:3: unknown label 'd'"):
        load_labeled(bad, train.label_names)


@pytest.mark.parametrize("content,error", [
    ('{"text": "ok", "label": 1}\n{"text": "broken", "label": \n', r"x\.jsonl:2: bad JSON"),
    ('{"text": "ok", "label": 1}\n["a", 1]\n', r"x\.jsonl:2: expected a JSON object, got list"),
    ('{"text": "ok", "label": 1}\n{"label": 1}\n', r"x\.jsonl:2: missing field 'text'"),
    ('{"text": "ok", "label": 1}\n{"text": "  ", "label": 1}\n', r"x\.jsonl:2: empty text"),
    ('{"text": "ok", "label": true}\n', r"x\.jsonl:1: the label True is not a string or an integer"),
    ('{"sentence": "ok", "label": 1}\n{"text": "no sentence", "label": 1}\n', r"x\.jsonl:2: missing field 'sentence'"),
    ("", r"x\.jsonl: no examples \(empty file\)"),
])
def test_malformed_json_lines(tmp_path, content, error):
    with pytest.raises(ValueError, match=error):
        load_labeled(_write(tmp_path, "x.jsonl", content))


def test_malformed_line_format_and_encoding(tmp_path):
    with pytest.raises(ValueError, match=r"s\.train:2: expected 'LABEL sentence', found no text after the label '3'"):
        load_labeled(_write(tmp_path, "s.train", "1 fine\n3\n"))
    with pytest.raises(ValueError, match=r"s\.dev: no examples"):
        load_labeled(_write(tmp_path, "s.dev", "\n  \n"))
    with pytest.raises(ValueError, match=r"l1\.train:2: not utf-8 text \(byte 0xe9\)"):
        load_labeled(_write(tmp_path, "l1.train", b"0 ok\n1 caf\xe9\n"))
    assert load_labeled(_write(tmp_path, "l1.train", b"0 ok\n1 caf\xe9\n"), encoding="latin-1").texts[1] == "café"
    with pytest.raises(ValueError, match="apply to CSV, TSV and JSON lines"):
        load_labeled(_write(tmp_path, "s.test", "1 fine\n"), text_field="text")


def test_reads_s3(s3_bucket):
    url = f"{s3_bucket}/tasks/acl-arc/dev.txt"
    storage.upload_file(str(ASSETS / "acl-arc" / "dev.txt"), url)
    from_s3 = load_labeled(url)
    local = load_labeled(str(ASSETS / "acl-arc" / "dev.txt"))
    assert (from_s3.texts, from_s3.labels, from_s3.label_names) == (local.texts, local.labels, local.label_names)
    assert from_s3.source == url


def _toy(sizes: list[int]) -> LabeledSet:
    texts, labels = [], []
    for label, size in enumerate(sizes):
        texts += [f"class{label}-{i}" for i in range(size)]
        labels += [label] * size
    return LabeledSet(texts, labels, [f"c{i}" for i in range(len(sizes))], "toy")


def test_few_shot_counts_determinism_and_replacement():
    sst = load_labeled(str(ASSETS / "sst5" / "stsa.fine.train"))
    shots = few_shot(sst, 16, seed=1)
    assert len(shots) == 80 and collections.Counter(shots.labels) == {i: 16 for i in range(5)}
    # Every sampled row is a real (text, label) pair of the source.
    source = set(zip(sst.texts, sst.labels))
    assert all(pair in source for pair in zip(shots.texts, shots.labels))
    again = few_shot(sst, 16, seed=1)
    assert (again.texts, again.labels) == (shots.texts, shots.labels)
    assert few_shot(sst, 16, seed=2).texts != shots.texts
    assert shots.labels != sorted(shots.labels)  # shuffled, not in class blocks

    toy = _toy([40, 3, 10])
    small = few_shot(toy, 10, seed=0)
    per_class = collections.defaultdict(list)
    for text, label in zip(small.texts, small.labels):
        per_class[label].append(text)
    assert {label: len(texts) for label, texts in per_class.items()} == {0: 10, 1: 10, 2: 10}
    # Enough examples: without replacement, so ten of ten is all of them (with replacement that
    # would repeat one with probability 1 − 10!/10¹⁰). Three examples for ten shots: with replacement.
    assert len(set(per_class[0])) == 10 and set(per_class[2]) == {f"class2-{i}" for i in range(10)}
    assert set(per_class[1]) == {"class1-0", "class1-1", "class1-2"}

    everything = few_shot(toy, 0, seed=3)
    assert sorted(everything.texts) == sorted(toy.texts) and everything.texts != toy.texts
    assert all(t.startswith(f"class{label}-") for t, label in zip(everything.texts, everything.labels))


def test_few_shot_errors():
    with pytest.raises(ValueError, match="shots must be >= 0"):
        few_shot(_toy([2]), -1, 0)
    empty_class = LabeledSet(["a"], [0], ["c0", "c1"], "dev.txt")
    with pytest.raises(ValueError, match="dev.txt: no example of class 'c1'"):
        few_shot(empty_class, 1, 0)

