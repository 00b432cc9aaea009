"""data_prep wiki on the alphabets written without spaces between words: Thai, Lao, Khmer, Burmese, Tibetan.

Their sentences are split at each script's own marks (Khmer ។ ៕, Burmese ။, Tibetan ། ༎; Thai and Lao, which
have no full stop, at a space between two of their letters) and measured in graphemes (a letter with its
combining vowel signs, tone marks and subscripts), words estimated from them. The articles below were written
for these tests, each with a short paragraph that is 15 code points or more but fewer than 15 graphemes: the one
sentence of each language to drop. The per-language kept ratio of the summary table is checked here too.
"""
from __future__ import annotations

import bz2
import math

import pytest

from clsys.data.sentences import GRAPHEMES_PER_WORD, MIN_CHARS, MIN_WORDS, SplitStats, count_words, split_sentences
from clsys.shards.manifest import read_manifest
from test_data_prep import run_cli
from test_data_prep_languages import dump_xml, sentences, summary_rows

ARTICLES = {
    "th": {"กรุงเทพมหานคร": """{{กล่องข้อมูล เมือง|ชื่อ=กรุงเทพมหานคร}}
'''กรุงเทพมหานคร''' เป็นเมืองหลวงและนครที่มีประชากรมากที่สุดของ[[ประเทศไทย]]<ref>{{cite web|title=ประชากร}}</ref> ตั้งอยู่บนฝั่งแม่น้ำเจ้าพระยาใกล้กับอ่าวไทย
เมืองนี้ก่อตั้งขึ้นในปี พ.ศ. 2325

ที่นี่มีวัดที่สวยงาม

== ประวัติ ==
รัชกาลที่ 1 ทรงย้ายราชธานีมาที่ฝั่งตะวันออกของแม่น้ำ[[ไฟล์:Bangkok.jpg|thumb|ภาพเมืองในยามค่ำคืน]] กรุงเทพฯ เติบโตอย่างรวดเร็วในคริสต์ศตวรรษที่ 20
{| class="wikitable"
|-
| เขต || ประชากร
|}

== อ้างอิง ==
{{รายการอ้างอิง}}
[[หมวดหมู่:เมืองหลวงในทวีปเอเชีย]]
[[en:Bangkok]]
"""},
    "lo": {"ວຽງຈັນ": """'''ວຽງຈັນ''' ແມ່ນນະຄອນຫຼວງຂອງ[[ປະເທດລາວ]]<ref>ປຶ້ມ.</ref> ຕັ້ງຢູ່ແຄມຝັ່ງຊ້າຍຂອງແມ່ນ້ຳຂອງ
ວຽງຈັນເປັນເມືອງທີ່ໃຫຍ່ທີ່ສຸດຂອງປະເທດ

ທີ່ນີ້ມີວັດທີ່ສວຍງາມ

== ປະຫວັດ ==
ໃນປີ 1563 ພະເຈົ້າໄຊເສດຖາທິລາດໄດ້ຍ້າຍນະຄອນຫຼວງມາຢູ່ວຽງຈັນ
[[en:Vientiane]]
"""},
    "km": {"ភ្នំពេញ": """'''ភ្នំពេញ''' គឺជារាជធានីនៃ[[ប្រទេសកម្ពុជា]]។<ref>សៀវភៅ។</ref> ទីក្រុងនេះស្ថិតនៅលើច្រាំងទន្លេមេគង្គ។ ផ្សារមានផ្លែឈើច្រើនដូចជា ចេក ស្វាយ ។ល។ ដែលលក់រាល់ថ្ងៃ។ អរគុណច្រើនណាស់។

== ប្រវត្តិ ==
ទីក្រុងនេះត្រូវបានបង្កើតឡើងនៅសតវត្សរ៍ទីដប់បួន៕
[[en:Phnom Penh]]
"""},
    "my": {"ရန်ကုန်": """'''ရန်ကုန်မြို့'''သည် [[မြန်မာနိုင်ငံ]]၏ အကြီးဆုံးမြို့ ဖြစ်သည်။<ref>စာအုပ်။</ref> ရန်ကုန်မြို့သည်ရန်ကုန်မြစ်၏ကမ်းနားတွင်တည်ရှိသည်။ ကျေးဇူးတင်ပါသည်။

== သမိုင်း ==
ရွှေတိဂုံစေတီသည်မြို့၏အထင်ရှားဆုံးအဆောက်အအုံဖြစ်သည်။
[[en:Yangon]]
"""},
    "bo": {"ལྷ་ས": """'''ལྷ་ས'''་ནི་བོད་ཀྱི་རྒྱལ་ས་ཡིན།<ref>དཔེ་ཆ།</ref> ལྷ་ས་ནི་སྐྱིད་ཆུའི་འགྲམ་དུ་ཡོད། དེང་སང་། ལྷ་སར་མི་མང་པོ་སྡོད་ཀྱི་ཡོད།

ཐུགས་རྗེ་ཆེ་ལགས།

== ལོ་རྒྱུས ==
པོ་ཏ་ལ་ནི་ལྷ་སའི་ཕོ་བྲང་ཆེན་པོ་ཞིག་ཡིན། །
[[en:Lhasa]]
"""},
}
NAMESPACES = {"th": ("ไฟล์", "หมวดหมู่")}
# The sentences each article must give, in order. Thai and Lao: split at a space between two of their letters
# (not next to a digit: "ที่ 1", "ປີ 1563"), a piece under MIN_CHARS graphemes kept with the next one (the bold
# title, "กรุงเทพฯ") or, last of its paragraph, the one before ("พ.ศ. 2325"). Tibetan likewise at ། (a clause
# or a sentence: "དེང་སང་།" "nowadays," stays with its sentence), Khmer at ។ ៕ but not inside ។ល។ ("etc."),
# Burmese at ။.
EXPECTED = {
    "th": ["กรุงเทพมหานคร เป็นเมืองหลวงและนครที่มีประชากรมากที่สุดของประเทศไทย",
           "ตั้งอยู่บนฝั่งแม่น้ำเจ้าพระยาใกล้กับอ่าวไทย", "เมืองนี้ก่อตั้งขึ้นในปี พ.ศ. 2325",
           "รัชกาลที่ 1 ทรงย้ายราชธานีมาที่ฝั่งตะวันออกของแม่น้ำ", "กรุงเทพฯ เติบโตอย่างรวดเร็วในคริสต์ศตวรรษที่ 20"],
    "lo": ["ວຽງຈັນ ແມ່ນນະຄອນຫຼວງຂອງປະເທດລາວ", "ຕັ້ງຢູ່ແຄມຝັ່ງຊ້າຍຂອງແມ່ນ້ຳຂອງ", "ວຽງຈັນເປັນເມືອງທີ່ໃຫຍ່ທີ່ສຸດຂອງປະເທດ",
           "ໃນປີ 1563 ພະເຈົ້າໄຊເສດຖາທິລາດໄດ້ຍ້າຍນະຄອນຫຼວງມາຢູ່ວຽງຈັນ"],
    "km": ["ភ្នំពេញ គឺជារាជធានីនៃប្រទេសកម្ពុជា។", "ទីក្រុងនេះស្ថិតនៅលើច្រាំងទន្លេមេគង្គ។",
           "ផ្សារមានផ្លែឈើច្រើនដូចជា ចេក ស្វាយ ។ល។ ដែលលក់រាល់ថ្ងៃ។", "ទីក្រុងនេះត្រូវបានបង្កើតឡើងនៅសតវត្សរ៍ទីដប់បួន៕"],
    "my": ["ရန်ကုန်မြို့သည် မြန်မာနိုင်ငံ၏ အကြီးဆုံးမြို့ ဖြစ်သည်။", "ရန်ကုန်မြို့သည်ရန်ကုန်မြစ်၏ကမ်းနားတွင်တည်ရှိသည်။",
           "ရွှေတိဂုံစေတီသည်မြို့၏အထင်ရှားဆုံးအဆောက်အအုံဖြစ်သည်။"],
    "bo": ["ལྷ་ས་ནི་བོད་ཀྱི་རྒྱལ་ས་ཡིན།", "ལྷ་ས་ནི་སྐྱིད་ཆུའི་འགྲམ་དུ་ཡོད།", "དེང་སང་། ལྷ་སར་མི་མང་པོ་སྡོད་ཀྱི་ཡོད།",
           "པོ་ཏ་ལ་ནི་ལྷ་སའི་ཕོ་བྲང་ཆེན་པོ་ཞིག་ཡིན། །"],
}
# Each article's one sentence too short: 15 code points or more, under 15 graphemes (vowel signs, tone marks,
# subscript consonants are combining characters: they take no room of their own).
SHORT = {"th": "ที่นี่มีวัดที่สวยงาม", "lo": "ທີ່ນີ້ມີວັດທີ່ສວຍງາມ", "km": "អរគុណច្រើនណាស់។", "my": "ကျေးဇူးတင်ပါသည်။",
         "bo": "ཐུགས་རྗེ་ཆེ་ལགས།"}
LANGS = list(ARTICLES)


def paragraphs(lang: str) -> list[str]:
    """The article's text as the cleaner gives it to the splitter: the lead's two paragraphs, the section's one."""
    text = {"th": ["กรุงเทพมหานคร เป็นเมืองหลวงและนครที่มีประชากรมากที่สุดของประเทศไทย ตั้งอยู่บนฝั่งแม่น้ำเจ้าพระยาใกล้กับอ่าวไทย "
                   "เมืองนี้ก่อตั้งขึ้นในปี พ.ศ. 2325", SHORT["th"],
                   "รัชกาลที่ 1 ทรงย้ายราชธานีมาที่ฝั่งตะวันออกของแม่น้ำ กรุงเทพฯ เติบโตอย่างรวดเร็วในคริสต์ศตวรรษที่ 20"],
            "lo": ["ວຽງຈັນ ແມ່ນນະຄອນຫຼວງຂອງປະເທດລາວ ຕັ້ງຢູ່ແຄມຝັ່ງຊ້າຍຂອງແມ່ນ້ຳຂອງ ວຽງຈັນເປັນເມືອງທີ່ໃຫຍ່ທີ່ສຸດຂອງປະເທດ", SHORT["lo"],
                   EXPECTED["lo"][-1]],
            "km": [" ".join(EXPECTED["km"][:3] + [SHORT["km"]]), EXPECTED["km"][3]],
            "my": [" ".join(EXPECTED["my"][:2] + [SHORT["my"]]), EXPECTED["my"][2]],
            "bo": [" ".join(EXPECTED["bo"][:3]), SHORT["bo"], EXPECTED["bo"][3]]}
    return text[lang]


@pytest.mark.parametrize("lang", LANGS)
def test_split_and_length_in_graphemes(lang):
    stats = SplitStats()
    assert [s for p in paragraphs(lang) for s in split_sentences(lang, p, stats)] == EXPECTED[lang]
    assert stats.too_short == 1
    short = SHORT[lang]
    # Long enough counted in code points, and in words; not in graphemes.
    assert len(short) >= MIN_CHARS and count_words(short) >= MIN_WORDS
    assert split_sentences(lang, short, stats) == [] and stats.too_short == 2
    # Kept without the three whitespace-separated words a spaced script needs.
    assert any(len(s.split()) < MIN_WORDS for s in EXPECTED[lang])


def test_words_estimated_from_graphemes():
    # A run of these scripts: one word per GRAPHEMES_PER_WORD graphemes, rounded up; anything else by whitespace.
    assert count_words("ที่นี่มีวัดที่สวยงาม") == math.ceil(12 / GRAPHEMES_PER_WORD)  # 20 code points, 12 graphemes
    # รัชกาลที่ (9 code points, 6 graphemes), 1, ทรงย้าย (7 code points, 6 graphemes)
    assert count_words("รัชกาลที่ 1 ทรงย้าย") == math.ceil(6 / GRAPHEMES_PER_WORD) + 1 + math.ceil(6 / GRAPHEMES_PER_WORD)
    assert count_words("ལྷ་ས་ནི་བོད་ཀྱི་རྒྱལ་ས་ཡིན།") == math.ceil(19 / GRAPHEMES_PER_WORD)  # 27 code points
    assert count_words("Bangkok กรุงเทพฯ is big.") == 3 + math.ceil(7 / GRAPHEMES_PER_WORD)


@pytest.fixture(scope="module")
def scripts_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scripts")
    for lang, articles in ARTICLES.items():
        xml = dump_xml(articles, dbname=f"{lang}wiki", namespaces=NAMESPACES.get(lang, ("File", "Category")))
        (folder / f"{lang}wiki-20261101-pages-articles.xml.bz2").write_bytes(bz2.compress(xml))
    out = folder / "out"
    result = run_cli("--input", f"file://{folder}", "--out", out)
    assert result.returncode == 0, result.stderr
    return out, result


@pytest.mark.parametrize("lang", LANGS)
def test_sentences_kept_through_the_cli(scripts_run, lang):
    out, _ = scripts_run
    assert sorted(sentences(out, lang)) == sorted(EXPECTED[lang])
    skipped = read_manifest(str(out / lang / "sentences"))["skipped"]
    assert (skipped["too_short"], skipped["too_long"], skipped["markup"]) == (1, 0, 0)


def test_summary_kept_ratio(scripts_run):
    """kept %: of the sentences split, the share kept (sentences / sentences + too_short + too_long + markup)."""
    out, result = scripts_run
    rows = summary_rows(result.stdout)
    assert sorted(rows) == sorted([*LANGS, "total"])
    for lang in LANGS:
        counts = read_manifest(str(out / lang / "sentences"))["counts"][lang]
        assert rows[lang]["kept %"] == f"{100 * len(EXPECTED[lang]) / (len(EXPECTED[lang]) + 1):.1f}"
        assert int(rows[lang]["sentences"]) == counts["sentences"] == len(EXPECTED[lang])
    kept = sum(map(len, EXPECTED.values()))
    assert rows["total"]["kept %"] == f"{100 * kept / (kept + len(LANGS)):.1f}"
