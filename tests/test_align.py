"""data_prep align: the real CLI on real Wikipedia text (XQuAD fixtures), real langlinks SQL, real moto S3."""
from __future__ import annotations

import bz2
import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from clsys import storage
from data_prep.langlinks import LanglinksError, LanglinksFile
from clsys.shards.manifest import read_manifest
from data_prep.dumps import DumpReader
from data_prep.wiki_tasks import PageTask, process_page

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "clir"
LANGS = ("en", "de", "es")
DUMPS = {lang: DATA / f"{lang}wiki-20261101-pages-articles.xml.bz2" for lang in LANGS}
LANGLINKS = {lang: DATA / f"{lang}wiki-20261101-langlinks.sql.gz" for lang in ("en", "de")}
PAIRS = ("en-de", "en-es", "de-es")
EXPECTED = json.loads((DATA / "expected.json").read_text(encoding="utf-8"))


def run_align(*args, dumps=LANGS, links=("en", "de"), timeout: float = 120) -> subprocess.CompletedProcess:
    inputs = ["--dumps", *(f"{lang}={DUMPS[lang]}" for lang in dumps),
              "--langlinks", *(f"{lang}={LANGLINKS[lang]}" for lang in links)]
    return subprocess.run([sys.executable, "-m", "data_prep", "align", *inputs, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def read_records(stream_url: str) -> dict[tuple[int, int, int, int], dict]:
    """(A page id, A section, B page id, B section) → record, checking keys and txt on the way."""
    records = {}
    manifest = read_manifest(stream_url)
    for shard in manifest["shards"]:
        data = storage.read_bytes(storage.join(stream_url, shard["name"]))
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        for name, raw in members.items():
            if name.endswith(".json"):
                rec = json.loads(raw)
                (a, b), (i, j) = (map(int, part.split("-")) for part in rec["pair_id"].split("/")[1:])
                assert name == f"{rec['pair_id'].split('/')[0]}-{a}-{b}-{i}-{j}.json"
                assert "⇄" in members[name[:-5] + ".txt"].decode()
                records[(a, i, b, j)] = rec
    assert len(records) == manifest["samples"]
    return records


@pytest.fixture(scope="module")
def sections() -> dict[str, dict[tuple[int, int], list[str]]]:
    """lang → (page id, section index) → the section's sentences, straight from the fixture dumps."""
    out = {}
    for lang, path in DUMPS.items():
        reader = DumpReader(str(path))
        out[lang] = {}
        for page in reader.pages():
            if not page.redirect:
                result = process_page(PageTask(lang, page.page_id, page.title, page.text, frozenset(), frozenset(), 200))
                for n, (_, sentences, _) in enumerate(result.sections):
                    out[lang][(page.page_id, n)] = sentences
    return out


def check_alignment(pair: str, records: dict, sections: dict, min_recall: float = 0.9) -> None:
    """Recall over the parallel pairs both of whose sections have >= 2 sentences; no false pair at all."""
    a_lang, b_lang = pair.split("-")
    truth = EXPECTED["pairs"][pair]
    parallel = {tuple(p) for p in truth["parallel"]}
    eligible = {p for p in parallel if len(sections[a_lang][p[:2]]) >= 2 and len(sections[b_lang][p[2:]]) >= 2}
    found = eligible & set(records)
    assert not set(records) - parallel, f"{pair}: non-parallel sections aligned: {sorted(set(records) - parallel)}"
    assert not {tuple(p) for p in truth["must_not"]} & set(records)
    assert not {tuple(u) for u in truth["unlinked"]} & {(a, b) for a, _, b, _ in records}
    recall = len(found) / len(eligible)
    assert recall >= min_recall, f"{pair}: recall {recall:.3f}, missed {sorted(eligible - found)}"


def test_fixtures_hold_no_evaluation_article(sections):
    """XQuAD articles 24-47 evaluate the trained models: none of their text may be in the training fixtures."""
    for lang in LANGS:
        xquad = json.loads((ROOT / "clsys" / "assets" / "xquad" / f"xquad.{lang}.json").read_text(encoding="utf-8"))
        fixture_text = " ".join(" ".join(s) for s in sections[lang].values())
        starts = [[" ".join(p["context"].replace("\ufeff", "").split())[:40] for p in a["paragraphs"]]
                  for a in xquad["data"]]
        assert all(start in fixture_text for start in starts[0])  # the check can see text that is there
        assert not [s for article in starts[24:] for s in article if s in fixture_text]


def test_langlinks_parser(tmp_path):
    sql = "\n".join([
        "-- Host: db1    Database: enwiki",
        "CREATE TABLE `langlinks` (",
        "  `ll_from` int(8) unsigned NOT NULL DEFAULT 0,",
        "  `ll_lang` varbinary(35) NOT NULL DEFAULT '',",
        "  `ll_title` varbinary(255) NOT NULL DEFAULT '',",
        "  PRIMARY KEY (`ll_from`,`ll_lang`)",
        ") ENGINE=InnoDB DEFAULT CHARSET=binary;",
        "INSERT INTO `langlinks` VALUES (1,'de','Fresno (Kalifornien)'),(1,'fr','Droit de l\\'Union'),"
        "(2,'es','Coma, paréntesis) y (más'),(3,'ja','\\\"quoted\\\" back\\\\slash\\nline');",
        "INSERT INTO `langlinks` VALUES (4,'de','fine'),(5,'de','unterminated);",
        "INSERT INTO `langlinks` VALUES (6,'de','Ünïcödé ✓');",
        "INSERT INTO `langlinks` VALUES (7,'de');",
        "/*!40000 ALTER TABLE `langlinks` ENABLE KEYS */;",
    ]) + "\n"
    path = tmp_path / "enwiki-langlinks.sql.gz"
    path.write_bytes(gzip.compress(sql.encode()))
    f = LanglinksFile(str(path))
    rows = [(r.page_id, r.lang, r.title) for r in f.links()]
    assert rows == [(1, "de", "Fresno (Kalifornien)"), (1, "fr", "Droit de l'Union"), (2, "es", "Coma, paréntesis) y (más"),
                    (3, "ja", '"quoted" back\\slash\nline'), (6, "de", "Ünïcödé ✓")]
    assert (f.dbname, f.lang, f.rows, f.malformed_lines) == ("enwiki", "en", 5, 2)
    assert f.messages[0].startswith(f"{path}:9: column ") and "expected" in f.messages[0]
    assert f.messages[1] == f"{path}:11: a row has 2 values, the table 3 columns"
    plain = tmp_path / "plain.sql"  # uncompressed SQL is read too
    plain.write_text(sql, encoding="utf-8")
    assert len(list(LanglinksFile(str(plain)).links())) == 5
    other = tmp_path / "pagelinks.sql"
    other.write_text(sql.replace("CREATE TABLE `langlinks`", "CREATE TABLE `pagelinks`"), encoding="utf-8")
    with pytest.raises(LanglinksError, match=r"pagelinks.sql:2: a dump of table `pagelinks`"):
        list(LanglinksFile(str(other)).links())
    cut = tmp_path / "cut.sql.gz"
    cut.write_bytes(gzip.compress(sql.encode() * 50)[:300])
    with pytest.raises(LanglinksError, match=r"cut.sql.gz:\d+: corrupt or truncated gzip"):
        list(LanglinksFile(str(cut)).links())


@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("align") / "out"
    result = run_align("--out", out, "--shard-size-mb", "0.1")
    assert result.returncode == 0, result.stderr
    return out, result


def test_alignment_on_fixtures(fixture_run, sections):
    out, result = fixture_run
    assert sorted(os.listdir(out / "clir")) == sorted(PAIRS)
    for pair in PAIRS:
        a_lang, b_lang = pair.split("-")
        url = f"file://{out / 'clir' / pair}"
        records = read_records(url)
        check_alignment(pair, records, sections)
        manifest = read_manifest(url)
        counts, dropped = manifest["counts"], manifest["dropped"]
        assert manifest["pair"] == pair and manifest["langs"] == [a_lang, b_lang]
        assert manifest["samples"] == sum(counts["aligned"].values()) == sum(s["samples"] for s in manifest["shards"])
        assert counts["aligned"]["encoder"] == 0 and counts["aligned"]["lead"] == counts["linked_articles"]
        assert counts["articles"] == {a_lang: 24, b_lang: 24}
        assert dropped["section_too_short"] > 0 and dropped["malformed_langlinks_line"] == 0
        assert f"{pair:<8}{counts['linked_articles']:>8}" in result.stdout
        texts = {lang: {" ".join(s) for s in sections[lang].values()} for lang in (a_lang, b_lang)}
        for rec in records.values():
            assert rec["langs"] == [a_lang, b_lang] and rec["method"] in ("lead", "anchors")
            for side, lang in zip(rec["sides"], rec["langs"]):
                assert side["lang"] == lang and len(side["sentences"]) >= 2
                assert 0 < len(side["hard_negatives"]) <= 8
                assert set(side["hard_negatives"]) <= texts[lang]  # real sections of the same language
                assert " ".join(side["sentences"]) not in side["hard_negatives"]
    en_de = read_manifest(f"file://{out / 'clir' / 'en-de'}")
    # Warszawa and Normanne redirect once; "British Sky Broadcasting" twice (dropped), but the de file links Sky.
    assert en_de["counts"]["redirects_followed"] == 2 and en_de["dropped"]["redirect"] == 1
    assert en_de["counts"]["linked_articles"] == 24 and en_de["dropped"]["no_langlink"] == 0
    en_es = read_manifest(f"file://{out / 'clir' / 'en-es'}")
    assert en_es["counts"]["linked_articles"] == 22 and en_es["dropped"]["target_missing"] == 1
    assert en_es["dropped"]["no_langlink"] == 3  # Peste negra and Black Death; Geología (the link misses it)
    assert {s["file"]: s["other_languages"] for s in en_de["sources"]["langlinks"]} == {
        LANGLINKS["en"].name: 4, LANGLINKS["de"].name: 2}


def test_swapped_and_inserted_sections(fixture_run, sections):
    out, _ = fixture_run
    records = read_records(f"file://{out / 'clir' / 'en-de'}")
    # Computational complexity theory: de has paragraphs 1 and 3 in swapped order.
    assert {(1104, 1, 2208, 3), (1104, 3, 2208, 1)} <= set(records)
    # Normannen: paragraph 3 dropped and a Warschau paragraph inserted as section 2.
    normans = {(i, j) for a, i, b, j in records if (a, b) == (1102, 2204)}
    assert normans == {(0, 0), (1, 1), (2, 3), (4, 4)}
    lead = records[(1102, 0, 2204, 0)]
    assert lead["method"] == "lead" and lead["sides"][0]["title"] == "Normans" and lead["sides"][1]["title"] == "Normannen"
    # Martin Luther's own other sections come first, then those of the article its "See also" links (Huguenot).
    def texts(page_id: int) -> set[str]:
        return {" ".join(s) for (p, n), s in sections["en"].items() if p == page_id and len(s) >= 2}

    negatives = records[(1106, 0, 2212, 0)]["sides"][0]["hard_negatives"]
    own = texts(1106) - {" ".join(sections["en"][(1106, 0)])}
    assert len(negatives) == 8 and set(negatives[:len(own)]) == own
    assert set(negatives[len(own):]) <= texts(1110)


def test_deterministic_across_workers(fixture_run, tmp_path):
    out, _ = fixture_run
    again = tmp_path / "again"
    result = run_align("--out", again, "--shard-size-mb", "0.1", "--workers", "2")
    assert result.returncode == 0, result.stderr
    for pair in PAIRS:
        first, second = out / "clir" / pair, again / "clir" / pair
        assert sorted(os.listdir(first)) == sorted(os.listdir(second))
        assert all((first / n).read_bytes() == (second / n).read_bytes() for n in os.listdir(first))


def test_s3_output(s3_bucket):
    out = f"{s3_bucket}/clir-data/v1"
    result = run_align("--out", out, "--pairs", "de-es", dumps=("de", "es"), links=("de",))
    assert result.returncode == 0, result.stderr
    assert list(storage.list_prefix(out)) == [f"{out}/clir/de-es/manifest.json", f"{out}/clir/de-es/shard-000000.tar"]
    records = read_records(f"{out}/clir/de-es")
    assert len(records) == read_manifest(f"{out}/clir/de-es")["samples"] > 50


def test_encoder_scores(tmp_path, sections):
    out = tmp_path / "out"
    result = run_align("--out", out, "--encoder", "all-MiniLM-L6-v2", dumps=("en", "de"), timeout=300)
    assert result.returncode == 0, result.stderr
    records = read_records(f"file://{out / 'clir' / 'en-de'}")
    assert {r["method"] for r in records.values()} == {"lead", "encoder"}
    check_alignment("en-de", records, sections)
    assert read_manifest(f"file://{out / 'clir' / 'en-de'}")["method"]["encoder"] == "all-MiniLM-L6-v2"


@pytest.mark.parametrize("kind", ["lang_mismatch", "missing_dump", "not_xml", "broken_xml", "missing_langlinks",
                                  "not_langlinks", "langlinks_lang_mismatch"])
def test_bad_inputs_exit_2(kind, tmp_path):
    dumps = {lang: str(path) for lang, path in DUMPS.items()}
    links = {lang: str(path) for lang, path in LANGLINKS.items()}
    bad = tmp_path / "bad.xml.bz2"
    if kind == "lang_mismatch":
        bad = DUMPS["es"]
        dumps["de"] = str(bad)
    elif kind == "missing_dump":
        dumps["de"] = str(bad)
    elif kind == "not_xml":
        bad.write_bytes(bz2.compress(b"\x00\x01 not xml at all"))
        dumps["de"] = str(bad)
    elif kind == "broken_xml":  # a real dump cut in the middle of a page
        bad.write_bytes(bz2.compress(bz2.decompress(DUMPS["de"].read_bytes())[:20000]))
        dumps["de"] = str(bad)
    elif kind == "missing_langlinks":
        bad = tmp_path / "dewiki-langlinks.sql.gz"
        links["de"] = str(bad)
    elif kind == "not_langlinks":
        bad = DUMPS["de"]
        links["de"] = str(bad)
    elif kind == "langlinks_lang_mismatch":
        bad = LANGLINKS["en"]
        links["de"] = str(bad)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "data_prep", "align", "--out", str(out),
                             "--dumps", *(f"{k}={v}" for k, v in dumps.items()),
                             "--langlinks", *(f"{k}={v}" for k, v in links.items())],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert str(bad) in result.stderr and "data_prep align: error:" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()
    if kind == "lang_mismatch":
        assert "given as 'de=' but the dump's <siteinfo> is for language 'es'" in result.stderr
