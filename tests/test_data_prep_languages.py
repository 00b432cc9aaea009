"""data_prep wiki over several languages in one run: per-language streams and manifests, the summary table,
sentence splitting without spaces (Chinese, Japanese) and right to left (Arabic, Hebrew).

The dumps are written here: small MediaWiki exports whose wikitext (templates, links, refs, a table, files,
headings, categories, interlanguage links, tail sections) was written for these tests. Each tells its language
another way: ``<dbname>`` (zh, ja), a Wikimedia ``<base>`` (ar), the file name alone (he).
"""
from __future__ import annotations

import bz2
import json
import re
import shutil
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

from clsys import storage
from clsys.data.sentences import SplitStats, count_words, split_sentences
from clsys.shards.manifest import read_manifest
from test_data_prep import SAMPLE, STREAMS, read_stream, run_cli
from test_data_prep_multistream import write_multistream

ZH_ARTICLES = {
    "长江": """{{Infobox river|name=长江|length=6300}}
'''长江'''是[[中国]]最长的[[河流]]，全长约六千三百公里。<ref>{{cite book|title=中国地理}}</ref>它发源于青藏高原，向东流入[[东海]]。
长江流域是中国人口最稠密的地区之一！你知道它有多长吗？当然。

== 地理 ==
长江上游穿过许多高山峡谷，水流十分湍急。[[File:Yangtze.jpg|thumb|长江三峡的风景]]中游的[[湖北省|湖北]]和[[湖南省|湖南]]有很多湖泊。
{| class="wikitable"
|-
! 城市 !! 人口
|-
| 上海 || 两千万
|}
下游地区地势平坦，是重要的农业区。

== 参考文献 ==
{{reflist}}
[[Category:中国河流]]
[[en:Yangtze]]
""",
    "茶": """'''茶'''是一种用茶树叶子制作的饮料。<ref name="a">某书，第三页。</ref>中国人饮茶已经有几千年的历史。

=== 种类 ===
常见的茶有绿茶、红茶和乌龙茶等多种类型。{{citation needed}}不同地区的人喜欢不同的茶。
""",
}
JA_ARTICLES = {
    "富士山": """{{基礎情報 山|名称=富士山|標高=3776}}
'''富士山'''（ふじさん）は、[[静岡県]]と[[山梨県]]にまたがる活火山である。<ref>国土地理院の資料。</ref>標高は三千七百七十六メートルで、日本で最も高い山だ。
毎年夏になると、多くの登山者が山頂を目指して登っている！

== 歴史 ==
古くから信仰の対象とされ、多くの和歌や絵画に描かれてきた。[[ファイル:Fuji.jpg|thumb|冬の富士山の写真]]
二〇一三年には世界文化遺産に登録された。

== 脚注 ==
<references />

== 関連項目 ==
* [[日本の山一覧]]
[[カテゴリ:日本の山]]
[[zh:富士山]]
""",
}
AR_ARTICLES = {
    "القاهرة": """{{صندوق معلومات مدينة|الاسم=القاهرة}}
'''القاهرة''' هي عاصمة [[مصر|جمهورية مصر العربية]] وأكبر مدنها من حيث عدد السكان.<ref>{{استشهاد بكتاب|عنوان=مدن مصر}}</ref> تقع المدينة على ضفاف [[نهر النيل]] قرب رأس الدلتا.
هل تعلم أن القاهرة تضم آلاف المساجد القديمة؟ نعم، ولهذا تسمى مدينة الألف مئذنة!

== التاريخ ==
تأسست المدينة في القرن العاشر الميلادي على يد الفاطميين.[[ملف:Cairo.jpg|تصغير|منظر عام للمدينة القديمة]] ثم أصبحت مركزا مهما للعلم والتجارة في العالم الإسلامي.
{| class="wikitable"
|-
| الحي || السكان
|-
| الزمالك || كثير
|}

== المراجع ==
{{مراجع}}
[[تصنيف:عواصم أفريقيا]]
[[en:Cairo]]
""",
    "الشاي": """'''الشاي''' مشروب ساخن يحضر من أوراق نبات الشاي المجففة. يشرب الناس الشاي في كثير من البلدان العربية بعد الطعام.
""",
}
HE_ARTICLES = {
    "ירושלים": """{{עיר|שם=ירושלים}}
'''ירושלים''' היא אחת הערים העתיקות ביותר ב[[המזרח התיכון|מזרח התיכון]].<ref>ספר על תולדות העיר.</ref> העיר שוכנת בהרי יהודה בגובה של כשמונה מאות מטרים.
האם ביקרתם פעם בעיר העתיקה? רבים מגיעים אליה מכל העולם!

== היסטוריה ==
במשך אלפי שנים נשלטה העיר בידי ממלכות ואימפריות רבות.[[קובץ:Jerusalem.jpg|ממוזער|מראה כללי של העיר]] החומות של העיר העתיקה נבנו במאה השש עשרה.

== הערות שוליים ==
{{הערות שוליים}}
[[קטגוריה:ערים]]
[[en:Jerusalem]]
""",
}
# What the cleaned, split and filtered text must be: the filters keep every sentence below and nothing else
# (so none is lost to whitespace word counts, and no markup, table, caption or tail section gets through).
EXPECTED = {
    "zh": {"长江是中国最长的河流，全长约六千三百公里。", "它发源于青藏高原，向东流入东海。",
           "长江流域是中国人口最稠密的地区之一！", "你知道它有多长吗？", "长江上游穿过许多高山峡谷，水流十分湍急。",
           "中游的湖北和湖南有很多湖泊。", "下游地区地势平坦，是重要的农业区。",
           "茶是一种用茶树叶子制作的饮料。", "中国人饮茶已经有几千年的历史。",
           "常见的茶有绿茶、红茶和乌龙茶等多种类型。", "不同地区的人喜欢不同的茶。"},
    "ja": {"富士山（ふじさん）は、静岡県と山梨県にまたがる活火山である。",
           "標高は三千七百七十六メートルで、日本で最も高い山だ。", "毎年夏になると、多くの登山者が山頂を目指して登っている！",
           "古くから信仰の対象とされ、多くの和歌や絵画に描かれてきた。", "二〇一三年には世界文化遺産に登録された。"},
    "ar": {"القاهرة هي عاصمة جمهورية مصر العربية وأكبر مدنها من حيث عدد السكان.",
           "تقع المدينة على ضفاف نهر النيل قرب رأس الدلتا.", "هل تعلم أن القاهرة تضم آلاف المساجد القديمة؟",
           "نعم، ولهذا تسمى مدينة الألف مئذنة!", "تأسست المدينة في القرن العاشر الميلادي على يد الفاطميين.",
           "ثم أصبحت مركزا مهما للعلم والتجارة في العالم الإسلامي.",
           "الشاي مشروب ساخن يحضر من أوراق نبات الشاي المجففة.",
           "يشرب الناس الشاي في كثير من البلدان العربية بعد الطعام."},
    "he": {"ירושלים היא אחת הערים העתיקות ביותר במזרח התיכון.", "העיר שוכנת בהרי יהודה בגובה של כשמונה מאות מטרים.",
           "האם ביקרתם פעם בעיר העתיקה?", "רבים מגיעים אליה מכל העולם!",
           "במשך אלפי שנים נשלטה העיר בידי ממלכות ואימפריות רבות.", "החומות של העיר העתיקה נבנו במאה השש עשרה."},
}
# Each dump also holds a redirect and a talk page (counted as skipped, never written); "当然。" (of course)
# is the one sentence too short to keep.
SKIPPED_PAGES = {"redirect": 1, "non_article": 1}
SCRIPTS = {"zh": r"[\u4e00-\u9fff]", "ja": r"[\u3040-\u30ff]", "ar": r"[\u0600-\u06ff]", "he": r"[\u0590-\u05ff]"}
BIDI_CONTROLS = re.compile("[\u200e\u200f\u202a-\u202e\u2066-\u2069\u061c]")


def dump_xml(articles: dict[str, str], dbname: str | None = None, base: str | None = None,
             namespaces: tuple[str, str] = ("File", "Category")) -> bytes:
    """A MediaWiki export-0.11 dump of ``articles`` (page ids from 10), one redirect and one talk page."""
    site = "".join(f"    <{tag}>{value}</{tag}>\n" for tag, value in (("dbname", dbname), ("base", base)) if value)
    pages = [(title, 0, text) for title, text in articles.items()]
    first = next(iter(articles))
    pages += [("Redirect " + first, 0, f"#REDIRECT [[{first}]]"), ("Talk:" + first, 1, "'''Talk''' text here. " * 5)]
    body = "".join(
        f"  <page>\n    <title>{escape(title)}</title>\n    <ns>{ns}</ns>\n    <id>{10 + i}</id>\n"
        f"    <revision>\n      <id>{100 + i}</id>\n      <text xml:space=\"preserve\">{escape(text)}</text>\n"
        f"    </revision>\n  </page>\n" for i, (title, ns, text) in enumerate(pages))
    return (f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="x">\n'
            f"  <siteinfo>\n{site}    <namespaces>\n      <namespace key=\"0\" />\n"
            f"      <namespace key=\"6\">{namespaces[0]}</namespace>\n"
            f"      <namespace key=\"14\">{namespaces[1]}</namespace>\n    </namespaces>\n  </siteinfo>\n"
            f"{body}</mediawiki>\n").encode()


DUMPS = {  # file name → dump; the language is told by dbname (zh, ja), base (ar), file name (he)
    "zhwiki-20261101-pages-articles.xml.bz2": dump_xml(ZH_ARTICLES, dbname="zhwiki"),
    "jawiki-20261101-pages-articles.xml.bz2": dump_xml(JA_ARTICLES, dbname="jawiki", namespaces=("ファイル", "カテゴリ")),
    "arabic-export.xml.bz2": dump_xml(AR_ARTICLES, base="https://ar.wikipedia.org/wiki/الصفحة_الرئيسية",
                                      namespaces=("ملف", "تصنيف")),
    "hewiki-20261101-pages-articles.xml.bz2": dump_xml(HE_ARTICLES, namespaces=("קובץ", "קטגוריה")),
}
LANGS = {"zh": "zhwiki-20261101-pages-articles.xml.bz2", "ja": "jawiki-20261101-pages-articles.xml.bz2",
         "ar": "arabic-export.xml.bz2", "he": "hewiki-20261101-pages-articles.xml.bz2"}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dumps")
    for name, xml in DUMPS.items():
        (folder / name).write_bytes(bz2.compress(xml))
    return folder


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def summary_rows(stdout: str) -> dict[str, dict[str, str]]:
    """The summary table: language → column → cell."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("lang "))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = (re.split(r"\s{2,}", line.strip()) for line in lines[start + 1:])
    return {cells[0]: dict(zip(header, cells)) for cells in rows}


@pytest.fixture(scope="module")
def multi_run(dumps, tmp_path_factory):
    out = tmp_path_factory.mktemp("multi") / "out"
    result = run_cli("--input", SAMPLE, *(dumps / name for name in DUMPS), "--out", f"file://{out}", "--workers", "2")
    assert result.returncode == 0, result.stderr
    return out, result


def test_split_without_spaces():
    stats = SplitStats()
    text = "北京是中华人民共和国的首都。它有三千多年的历史！你去过吗？东京是日本的首都です。"
    assert split_sentences("zh", text, stats) == ["北京是中华人民共和国的首都。", "它有三千多年的历史！",
                                                  "东京是日本的首都です。"]
    assert stats.too_short == 1  # "你去过吗？": 5 characters, 9 columns of MIN_CHARS' 15
    assert count_words("它有三千多年的历史！") == 10 and count_words("GDP 为 1.5 万亿") == 5
    assert count_words("Dr. Smith went home.") == 4
    stats = SplitStats()
    assert split_sentences("ar", "القاهرة هي عاصمة مصر. هل زرتها يوما ما؟ نعم! إنها مدينة كبيرة جدا.", stats) == [
        "القاهرة هي عاصمة مصر.", "هل زرتها يوما ما؟", "إنها مدينة كبيرة جدا."]
    assert stats.too_short == 1


def test_per_language_streams(multi_run):
    out, _ = multi_run
    assert sorted(p.name for p in out.iterdir()) == ["ar", "en", "he", "ja", "zh"]  # no top-level sentences/
    for lang in ("en", *LANGS):
        for stream in STREAMS:
            manifest = read_manifest(f"file://{out / lang / stream}")
            assert manifest["stream"] == stream and manifest["languages"] == [lang]
            (source,) = manifest["sources"]
            assert source["lang"] == lang and source["file"] == LANGS.get(lang, SAMPLE.name)
            assert list(manifest["counts"]) == [lang]
            assert manifest["counts"][lang][stream if stream == "sentences" else "passages"] == manifest["samples"]
            assert manifest["skipped"] == manifest["counts"][lang]["skipped"]
            for sample in read_stream(out / lang / stream, manifest):
                meta = json.loads(sample["json"])
                assert meta["lang"] == lang and isinstance(meta["page_id"], int)
    assert read_manifest(str(out / "en" / "sentences"))["counts"]["en"]["pages"] == 206


def sentences(out: Path, lang: str) -> list[str]:
    folder = out / lang / "sentences"
    return [s["txt"].decode() for s in read_stream(folder, read_manifest(str(folder)))]


def test_sentences_in_each_script(multi_run):
    out, _ = multi_run
    for lang, expected in EXPECTED.items():
        texts = sentences(out, lang)
        assert sorted(texts) == sorted(expected), lang
        assert all(re.search(SCRIPTS[lang], t) for t in texts)
        manifest = read_manifest(str(out / lang / "sentences"))
        assert manifest["skipped"] == {**dict.fromkeys(manifest["skipped"], 0), **SKIPPED_PAGES,
                                       "too_short": int(lang == "zh")}
        assert manifest["counts"][lang]["articles"] == len(DUMPS[LANGS[lang]].split(b"<ns>0</ns>")) - 2
    for lang in ("zh", "ja"):  # split at 。！？, each sentence ends at one and holds no other
        assert all(t[-1] in "。！？" and not re.search("[。！？]", t[:-1]) for t in sentences(out, lang))
    for lang in ("ar", "he"):  # right to left: EXPECTED above is in logical order, as written; no bidi controls added
        assert not any(BIDI_CONTROLS.search(t) for t in sentences(out, lang))
    assert any(t.endswith("؟") for t in sentences(out, "ar"))


NOT_COUNTS = ("lang", "kept %")  # kept %: tests/test_data_prep_scripts.py


def test_summary_table_matches_manifests(multi_run):
    out, result = multi_run
    rows = summary_rows(result.stdout)
    assert list(rows) == ["en", "zh", "ja", "ar", "he", "total"]  # input order
    total = dict.fromkeys(rows["total"], 0)
    for lang in ("en", *LANGS):
        counts = read_manifest(str(out / lang / "sentences"))["counts"][lang]
        assert counts["passages"] == read_manifest(str(out / lang / "documents"))["samples"]
        expected = {"files": 1, **{k: counts[k] for k in ("pages", "articles", "sentences", "passages")},
                    **counts["skipped"], "MB read": round(counts["bytes_read"] / 1e6, 1)}
        assert {k: float(v) if k == "MB read" else int(v) for k, v in rows[lang].items()
                if k not in NOT_COUNTS} == expected
        for k, v in expected.items():
            total[k] += v
    assert {k: float(v) for k, v in rows["total"].items() if k not in NOT_COUNTS} == pytest.approx(
        {k: v for k, v in total.items() if k not in NOT_COUNTS}, abs=0.11)
    assert rows["en"]["pages"] == "206" and rows["en"]["redirect"] == "100"


def test_english_stream_as_in_a_single_language_run(multi_run, tmp_path):
    """A language's streams are those a run over its dumps alone writes (the layout aside)."""
    out, _ = multi_run
    alone = tmp_path / "en"
    result = run_cli("--input", SAMPLE, "--out", alone)
    assert result.returncode == 0, result.stderr
    assert (alone / "sentences" / "manifest.json").exists()  # one language: the flat layout
    for stream in STREAMS:
        assert read_manifest(str(alone / stream))["shards"] == read_manifest(str(out / "en" / stream))["shards"]


def test_folder_input_and_workers_identical(dumps, tmp_path):
    """A folder finds every dump under it (sub-folders too, indexes and other files left out); the output is
    byte-identical to listing the dumps, with 1 or 2 workers (with 2, the four languages are prepared at the
    same time)."""
    folder = tmp_path / "dumps"
    shutil.copytree(dumps, folder)
    (folder / "sub").mkdir()
    shutil.move(folder / LANGS["he"], folder / "sub" / LANGS["he"])
    (folder / "README.txt").write_text("not a dump")
    (folder / "zhwiki-20261101-pages-articles-multistream-index.txt.bz2").write_bytes(bz2.compress(b"1:10:x\n"))
    by_folder = run_cli("--input", f"file://{folder}", "--out", tmp_path / "a", "--workers", "2")
    assert by_folder.returncode == 0, by_folder.stderr
    listed = sorted(p for p in folder.rglob("*.xml.bz2"))
    by_list = run_cli("--input", *listed, "--out", tmp_path / "b", "--workers", "1")
    assert by_list.returncode == 0, by_list.stderr
    a, b = files(tmp_path / "a"), files(tmp_path / "b")
    assert a == b and len(a) == 4 * 2 * 2  # 4 languages × 2 streams × (shard + manifest)
    assert "README" not in by_folder.stdout and list(summary_rows(by_folder.stdout))[:-1] == ["ar", "ja", "he", "zh"]


def test_a_language_failing_stops_the_run(tmp_path):
    """English and Chinese prepared at the same time; Chinese's index lists a wrong page id (found while its
    first block is read, English still being read): the run stops with that error, exit 2, and no manifest
    is written for either language."""
    (tmp_path / "zh").mkdir()
    (tmp_path / "en").mkdir()
    en_dump, en_index, _ = write_multistream(bz2.decompress(SAMPLE.read_bytes()), tmp_path / "en")
    zh_dump, zh_index, _ = write_multistream(DUMPS[LANGS["zh"]], tmp_path / "zh", 2)
    lines = bz2.decompress(zh_index.read_bytes()).decode().splitlines(keepends=True)
    offset, page_id, title = lines[1].split(":", 2)
    lines[1] = f"{offset}:{int(page_id) + 1}:{title}"
    wrong = tmp_path / "wrong-index.txt"
    wrong.write_text("".join(lines))
    result = run_cli("--input", en_dump, zh_dump, "--index", en_index, wrong, "--out", tmp_path / "out",
                     "--workers", "2")
    assert result.returncode == 2, result.stderr
    assert f"error: {wrong}:2: " in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not list((tmp_path / "out").rglob("manifest.json"))


def test_layout_option(dumps, tmp_path):
    zh, ar = dumps / LANGS["zh"], dumps / LANGS["ar"]
    flat = run_cli("--input", zh, ar, "--out", tmp_path / "flat", "--layout", "flat")
    assert flat.returncode == 0, flat.stderr
    manifest = read_manifest(str(tmp_path / "flat" / "sentences"))
    assert manifest["languages"] == ["ar", "zh"] and sorted(manifest["counts"]) == ["ar", "zh"]
    assert manifest["samples"] == len(EXPECTED["zh"]) + len(EXPECTED["ar"])
    one = run_cli("--input", zh, "--out", tmp_path / "one", "--layout", "per-language")
    assert one.returncode == 0, one.stderr
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["zh"]
    assert read_manifest(str(tmp_path / "one" / "zh" / "sentences"))["samples"] == len(EXPECTED["zh"])


def test_unknown_language_refused(dumps, tmp_path):
    unknown = tmp_path / "export.xml"
    unknown.write_bytes(dump_xml(ZH_ARTICLES))  # no dbname, no base, a file name that names no wiki
    result = run_cli("--input", dumps / LANGS["zh"], unknown, "--out", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert f"error: {unknown}: cannot tell the dump's language" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    fandom = tmp_path / "fandom.xml"  # a wiki outside Wikimedia: its host is no language
    fandom.write_bytes(dump_xml(ZH_ARTICLES, dbname="muppet", base="https://muppet.fandom.com/wiki/Main_Page"))
    result = run_cli("--input", fandom, "--out", tmp_path / "out")
    assert result.returncode == 2 and f"{fandom}: cannot tell" in result.stderr


def test_empty_folder_refused(tmp_path):
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "notes.txt").write_text("x")
    result = run_cli("--input", tmp_path / "none", "--out", tmp_path / "out")
    assert result.returncode == 2 and f"{tmp_path / 'none'}: no MediaWiki dump" in result.stderr


def test_s3_prefix_input(s3_bucket, dumps):
    for name in (LANGS["zh"], LANGS["he"]):
        storage.upload_file(str(dumps / name), f"{s3_bucket}/dumps/{name}")
    storage.write_bytes(f"{s3_bucket}/dumps/README.txt", b"not a dump")
    result = run_cli("--input", f"{s3_bucket}/dumps", "--out", f"{s3_bucket}/out")
    assert result.returncode == 0, result.stderr
    for lang in ("he", "zh"):
        manifest = read_manifest(f"{s3_bucket}/out/{lang}/sentences")
        assert manifest["languages"] == [lang] and manifest["samples"] == len(EXPECTED[lang])
        assert manifest["sources"][0]["bytes_read"] == len(storage.read_bytes(f"{s3_bucket}/dumps/{LANGS[lang]}"))


def test_language_without_text_is_left_out(dumps, tmp_path):
    """A language whose dumps hold no article text gets no manifest (exit 2), the others are written."""
    redirects = tmp_path / "dewiki-20261101-pages-articles.xml"
    redirects.write_bytes(dump_xml({"Berlin": "#REDIRECT [[Hauptstadt]]"}, dbname="dewiki"))
    result = run_cli("--input", dumps / LANGS["zh"], redirects, "--out", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert f"error: {redirects}: no article text found" in result.stderr
    assert read_manifest(str(tmp_path / "out" / "zh" / "sentences"))["samples"] == len(EXPECTED["zh"])
    assert not list((tmp_path / "out" / "de").rglob("manifest.json"))
    assert summary_rows(result.stdout)["de"]["redirect"] == "2"
