"""``data_prep align``: aligned Wikipedia sections across languages, for cross-lingual QLM/RR pretraining.

Inputs: one MediaWiki dump per language (read with ``dumps.DumpReader`` and cleaned with
``wiki_tasks.process_page``, exactly as ``data_prep wiki`` does) and Wikipedia's interlanguage-link dumps
(``langlinks.py``). Output: one stream per language pair, ``OUT/clir/<A>-<B>/``, one sample per
aligned section pair (docs/training/objectives.md#clir-data: the query is a sentence of one side, the document the
other side's section; the direction is drawn at training time, so records are symmetric).

Steps:
1. Read every langlinks file. Rows that point at languages outside ``--dumps`` are counted and
   dropped. The links of a pair A-B are the union of A's rows to B and B's rows to A.
2. Index pass over each dump: which link sources (page ids) are articles, which link targets
   (titles) are articles or redirects. Only main-namespace pages count; titles are compared in
   MediaWiki's canonical form (underscores as spaces, first letter upper case).
3. Text pass over each dump: the pages that links need, including the targets of targeted redirects
   (followed one hop; a redirect to a redirect is dropped), are cleaned and split into sections.
4. Per linked article pair (an article linked to two partners keeps the first link read), sections
   are aligned by ``sectionalign.SectionAligner``, whose docstring documents the method.
5. Each aligned pair becomes one record holding both sides, each with its hard negatives: other
   sections of the same article, then sections of related articles (the held articles that its
   wikilinks name), each group shuffled by a RNG seeded with ``--seed`` and the pair id.

Memory: the langlinks rows between the aligned languages (tens of bytes each), the titles they name,
and the sentences of every *linked* article, about three times their plain text: it grows linearly
with the number of linked articles, roughly 1 GB per 100,000 articles of typical length. Pages
without a link are streamed past and never held. Each dump is read twice (index pass, text pass).
"""
from __future__ import annotations

import argparse
import itertools
import logging
import os
import random
import re
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import mwparserfromhell

from clsys import storage
from clsys.storage import StorageError
from data_prep import __version__, cli
from data_prep.langlinks import Langlink, LanglinksError, LanglinksFile
from data_prep.sectionalign import DEFAULT_THRESHOLD, Article, Match, Section, SectionAligner
from clsys.shards.manifest import previous_shas
from clsys.shards.writer import ShardWriter
from data_prep.bz2_streams import DumpError, TruncatedDump
from data_prep.dumps import DumpReader
from data_prep.process_pool import ProcessPool, WorkerDied
from data_prep.wiki_tasks import PageTask, ordered_map, process_page

log = logging.getLogger(__name__)

DROP_REASONS = ("no_langlink", "source_missing", "target_missing", "redirect", "conflicting_link", "empty_article",
                "section_too_short", "below_threshold", "unmatched_section", "malformed_langlinks_line")
METHODS = ("lead", "anchors", "encoder")
_LANG = re.compile(r"^[a-z][a-z0-9]*(?:-[a-z0-9]+)*$")
_REDIRECT_LINK = re.compile(r"\[\[([^\]|]+)")


def normalize_title(title: str) -> str:
    """MediaWiki's canonical title: no fragment, underscores as spaces, single spaces, first letter upper."""
    title = " ".join(title.split("#", 1)[0].replace("_", " ").split())
    return title[:1].upper() + title[1:]


@dataclass
class DumpReport:
    """One dump, as the manifest's ``sources.dumps`` lists it."""

    file: str
    lang: str
    dbname: str | None
    pages_read: int = 0
    articles: int = 0  # main-namespace pages that are not redirects


@dataclass
class DumpIndex:
    """One dump: what the index pass learned about the pages that links name, then the held articles."""

    lang: str
    reader: DumpReader
    report: DumpReport
    titles: dict[str, int] = field(default_factory=dict)  # link target (or a targeted redirect's target) → id
    redirects: dict[str, str] = field(default_factory=dict)  # link target that is a redirect → its target
    sources: dict[int, bool] = field(default_factory=dict)  # link source id → is an article (not a redirect)
    articles: dict[int, Article] = field(default_factory=dict)  # filled by the text pass

    def resolve(self, title: str) -> tuple[int | None, str]:
        """(article id, "" or "redirect_followed"), or (None, the drop reason)."""
        title = normalize_title(title)
        if title in self.titles:
            return self.titles[title], ""
        if title in self.redirects:
            target = self.titles.get(self.redirects[title])
            # None: the redirect leads to a missing page or to another redirect (never followed twice)
            return (target, "redirect_followed") if target is not None else (None, "redirect")
        return None, "target_missing"

    def pages(self, count: bool = False):
        """Main-namespace pages; a truncated or corrupt dump is an error (no partial alignment)."""
        try:
            for page in self.reader.pages():
                if count:
                    self.report.pages_read += 1
                if page.ns == 0:
                    yield page
        except TruncatedDump as err:
            raise DumpError(f"{self.reader.path}: {err.message} (reading stopped at byte {err.byte_offset})") from None


def _load_article(task: PageTask) -> Article:
    """Sections and wikilinks of one page; runs in the worker processes."""
    result = process_page(task)
    sections = [Section(n, heading, sentences) for n, (heading, sentences, _) in enumerate(result.sections)]
    targets = (normalize_title(str(link.title)) for link in mwparserfromhell.parse(task.text).filter_wikilinks())
    return Article(task.lang, task.page_id, task.title, sections, [t for t in dict.fromkeys(targets) if t])


class AlignJob:
    """State of one ``data_prep align`` run: dumps and langlinks in, aligned section pairs out."""

    def __init__(self, args: argparse.Namespace, dumps: dict[str, DumpIndex], langlinks: dict[str, LanglinksFile]):
        self.args, self.dumps, self.langlinks = args, dumps, langlinks
        self.links: dict[str, list[Langlink]] = {}  # file language → its rows to the other dump languages
        self.other_languages: dict[str, int] = {}  # file language → rows to languages not aligned

    def read(self) -> None:
        """Langlinks, then the index pass and the text pass over every dump."""
        for lang, f in self.langlinks.items():
            rows = list(f.links())
            self.links[lang] = [r for r in rows if r.lang in self.dumps and r.lang != lang]
            self.other_languages[lang] = len(rows) - len(self.links[lang])
            for message in f.messages:
                log.warning(f"data_prep align: warning: skipped malformed line {message}")
        for dump in self.dumps.values():
            self._index_pass(dump)
        pool = ProcessPool(self.args.workers) if self.args.workers > 1 else None
        try:
            for dump in self.dumps.values():
                self._text_pass(dump, pool)
        finally:
            if pool is not None:
                pool.terminate()

    def _index_pass(self, dump: DumpIndex) -> None:
        wanted_ids = {r.page_id for r in self.links.get(dump.lang, [])}
        wanted_titles = {normalize_title(r.title) for rows in self.links.values() for r in rows if r.lang == dump.lang}
        for page in dump.pages(count=True):
            title = normalize_title(page.title)
            if page.redirect:
                if title in wanted_titles:
                    target = page.redirect_target or next(iter(_REDIRECT_LINK.findall(page.text)), "")
                    dump.redirects[title] = normalize_title(target)
                if page.page_id in wanted_ids:
                    dump.sources[page.page_id] = False
                continue
            dump.report.articles += 1
            if title in wanted_titles:
                dump.titles[title] = page.page_id
            if page.page_id in wanted_ids:
                dump.sources[page.page_id] = True

    def _text_pass(self, dump: DumpIndex, pool) -> None:
        hops = set(dump.redirects.values()) - set(dump.titles)
        needed = {i for i, is_article in dump.sources.items() if is_article} | set(dump.titles.values())
        info = dump.reader.siteinfo
        media, category = frozenset(info.media_prefixes), frozenset(info.category_prefixes)

        def tasks():
            for page in dump.pages():
                title = normalize_title(page.title)
                if not page.redirect and (page.page_id in needed or title in hops):
                    if title in hops:
                        dump.titles[title] = page.page_id
                    # passage_words=1: the passages process_page packs are not used here
                    yield PageTask(dump.lang, page.page_id, page.title, page.text, media, category, 1)

        for article in ordered_map(pool, _load_article, tasks(), window=32 * self.args.workers):
            dump.articles[article.page_id] = article

    def link_pair(self, a_lang: str, b_lang: str, counts: Counter, dropped: Counter) -> list[tuple[int, int]]:
        """Linked (A article id, B article id) pairs, sorted: both files' rows resolved, conflicts dropped."""
        a, b = self.dumps[a_lang], self.dumps[b_lang]
        records = []  # (A id | None, B id | None, reason): A's file first, then B's, in file order
        for src, dst in ((a, b), (b, a)):
            for row in self.links.get(src.lang, []):
                if row.lang != dst.lang:
                    continue
                target, how = dst.resolve(row.title)
                is_article = src.sources.get(row.page_id)
                source = row.page_id if is_article else None
                reason = "source_missing" if is_article is None else how if is_article else "redirect"
                counts["redirects_followed"] += is_article is True and how == "redirect_followed"
                records.append((source, target, reason) if src is a else (target, source, reason))
        pairs: dict[tuple[int, int], None] = {}
        used_a, used_b = set(), set()
        for a_id, b_id, reason in records:
            if a_id is None or b_id is None:
                dropped[reason] += 1
            elif (a_id, b_id) in pairs:
                counts["links_in_both_files"] += 1
            elif a_id in used_a or b_id in used_b:
                dropped["conflicting_link"] += 1
            else:
                pairs[(a_id, b_id)] = None
                used_a.add(a_id)
                used_b.add(b_id)
        # Articles without any row for this pair (a row that failed still means "has a langlink").
        involved_a, involved_b = {r[0] for r in records} - {None}, {r[1] for r in records} - {None}
        dropped["no_langlink"] += a.report.articles - len(involved_a) + b.report.articles - len(involved_b)
        return sorted(pairs)

    def align_pair(self, a_lang: str, b_lang: str, aligner: SectionAligner) -> tuple:
        counts, dropped = Counter(), Counter(dict.fromkeys(DROP_REASONS, 0))
        # A malformed line's rows are unknown: it counts for every pair its file could have linked.
        dropped["malformed_langlinks_line"] = sum(f.malformed_lines for lang, f in self.langlinks.items()
                                                  if lang in (a_lang, b_lang))
        aligned = []
        for a_id, b_id in self.link_pair(a_lang, b_lang, counts, dropped):
            a, b = self.dumps[a_lang].articles[a_id], self.dumps[b_lang].articles[b_id]
            counts["linked_articles"] += 1
            dropped["empty_article"] += (not a.sections) + (not b.sections)
            aligned += [(a, b, m) for m in aligner.align(a, b, dropped)]
        return a_lang, b_lang, counts, dropped, aligned


def related_articles(dump: DumpIndex) -> dict[int, list[Article]]:
    """Page id → the held articles of the same dump that its wikilinks name (itself excluded)."""
    by_title = {normalize_title(a.title): a for a in dump.articles.values()}
    return {a.page_id: [by_title[t] for t in a.links if t in by_title and by_title[t] is not a]
            for a in dump.articles.values()}


def hard_negatives(article: Article, aligned: int, related: list[Article], min_sentences: int, k: int,
                   rng: random.Random) -> list[str]:
    """Other sections of the same article first, then sections of related articles; ``k`` at most."""
    def texts(a: Article) -> list[str]:
        return [s.text for s in a.sections
                if len(s.sentences) >= min_sentences and not (a is article and s.index == aligned)]

    same, others = texts(article), [t for r in related for t in texts(r)]
    rng.shuffle(same)
    rng.shuffle(others)
    return (same + others)[:k]


def record(pair: str, a: Article, b: Article, m: Match, related: dict[str, dict[int, list[Article]]], args) -> dict:
    """The symmetric sample of one aligned section pair (see docs/data-prep.md, "align")."""
    pair_id = f"{pair}/{a.page_id}-{b.page_id}/{m.i}-{m.j}"
    sides = []
    for article, index in ((a, m.i), (b, m.j)):
        rng = random.Random(f"{args.seed}/{pair_id}/{article.lang}")  # str seeds are hashed stably (sha512)
        negatives = hard_negatives(article, index, related[article.lang][article.page_id], args.min_sentences,
                                   args.max_hard_negatives, rng)
        section = article.sections[index]
        sides.append({"lang": article.lang, "page_id": article.page_id, "title": article.title,
                      "heading": section.heading, "sentences": section.sentences, "hard_negatives": negatives})
    return {"pair_id": pair_id, "langs": [a.lang, b.lang], "method": m.method, "score": round(m.score, 4),
            "sides": sides}


def embed_sections(model_name: str, dumps: dict[str, DumpIndex], min_sentences: int) -> dict:
    """(lang, page_id, section index) → unit-length mean-pooled embedding, for every section that can align."""
    from clsys.model.encoder import embed, load_encoder, load_tokenizer  # torch only when asked for

    try:
        model, tokenizer = load_encoder(model_name), load_tokenizer(model_name)
    except (OSError, ValueError) as err:  # transformers reports a missing or broken model folder so
        raise ValueError(f"--encoder {model_name}: cannot load the model ({err})") from None
    keys = [(d.lang, a.page_id, s.index) for d in dumps.values() for a in d.articles.values()
            for s in a.sections if len(s.sentences) >= min_sentences]
    vectors = embed(model, tokenizer, [dumps[lang].articles[pid].sections[i].text for lang, pid, i in keys], "mean")
    return dict(zip(keys, vectors / vectors.norm(dim=1, keepdim=True).clamp(min=1e-12)))


def _lang_path(value: str) -> tuple[str, str]:
    lang, sep, path = value.partition("=")
    if not sep or not path or not _LANG.match(lang):
        raise argparse.ArgumentTypeError(f"expected LANG=PATH (e.g. en=enwiki-latest-pages-articles.xml.bz2), "
                                         f"got {value!r}")
    return lang, path


def _fraction(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dumps", nargs="+", required=True, type=_lang_path, metavar="LANG=DUMP",
                   help="MediaWiki XML dumps (.xml or .bz2), one per language: en=enwiki-...-pages-articles.xml.bz2")
    p.add_argument("--langlinks", nargs="+", required=True, type=_lang_path, metavar="LANG=SQL",
                   help="interlanguage-link dumps: en=enwiki-...-langlinks.sql.gz (gzip or plain SQL)")
    p.add_argument("--out", required=True, metavar="URL",
                   help="output root: s3://bucket/prefix, file:///abs or a path; streams go to OUT/clir/<A>-<B>/")
    p.add_argument("--pairs", nargs="+", metavar="A-B",
                   help="language pairs (default: every pair of --dumps languages, in the order given)")
    p.add_argument("--shard-size-mb", type=cli.positive(float), default=64.0, metavar="N",
                   help="roll shards over at this size in MiB, fractions allowed (default: 64)")
    p.add_argument("--min-sentences", type=cli.positive(int), default=2, metavar="N",
                   help="sections with fewer sentences are not aligned (default: 2)")
    p.add_argument("--max-hard-negatives", type=cli.positive(int), default=8, metavar="N",
                   help="hard negatives per side (default: 8)")
    p.add_argument("--threshold", type=_fraction, default=DEFAULT_THRESHOLD, metavar="X",
                   help=f"minimum score of a non-lead section pair, in [0, 1] (default: {DEFAULT_THRESHOLD})")
    p.add_argument("--encoder", metavar="MODEL",
                   help="add the cosine of mean-pooled section embeddings to the score: a local Hugging Face "
                        "model folder or all-MiniLM-L6-v2")
    p.add_argument("--workers", type=cli.positive(int), default=1, metavar="N",
                   help="processes parsing wikitext; output is identical for any N (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the hard-negative shuffles (default: 0)")


def _pairs(names: list[str] | None, langs: list[str]) -> list[tuple[str, str]]:
    if not names:
        return list(itertools.combinations(langs, 2))
    pairs = []
    for name in names:
        # Language codes may contain '-' (zh-yue): split where both halves are dump languages.
        splits = [(name[:n], name[n + 1:]) for n, c in enumerate(name) if c == "-"]
        found = [(a, b) for a, b in splits if a in langs and b in langs and a != b]
        if len(found) != 1:
            raise ValueError(f"--pairs {name}: expected A-B, two different --dumps languages ({', '.join(langs)})")
        pairs.append(found[0])
    return pairs


def _open_inputs(args: argparse.Namespace) -> tuple[dict[str, DumpIndex], dict[str, LanglinksFile]]:
    """Check languages, files and dump headers before any input is read in full."""
    dumps: dict[str, DumpIndex] = {}
    for lang, path in args.dumps:
        if lang in dumps:
            raise ValueError(f"--dumps: language '{lang}' given twice")
        reader = DumpReader(path)
        try:
            info = reader.read_siteinfo()
        except DumpError as err:
            raise ValueError(f"{path}: {err}") from None
        if info.lang != lang:
            raise ValueError(f"{path}: given as '{lang}=' but the dump's <siteinfo> is for language "
                             f"'{info.lang}' (dbname {info.dbname})")
        dumps[lang] = DumpIndex(lang, reader, DumpReport(os.path.basename(path), lang, info.dbname))
    langlinks: dict[str, LanglinksFile] = {}
    for lang, path in args.langlinks:
        if lang in langlinks:
            raise ValueError(f"--langlinks: language '{lang}' given twice")
        if lang not in dumps:
            raise ValueError(f"--langlinks {lang}={path}: no --dumps for language '{lang}'")
        langlinks[lang] = LanglinksFile(path, expected_lang=lang)
    return dumps, langlinks


def main(args: argparse.Namespace) -> int:
    """Run ``align``; returns the exit code (0 ok, 1 a worker died, 2 unusable input, nothing aligned, or storage
    error)."""
    start = time.time()
    try:
        storage.check_bucket(args.out)
        dumps, langlinks = _open_inputs(args)
        pairs = _pairs(args.pairs, list(dumps))
        inputs = [path for _, path in args.dumps + args.langlinks]
        if problem := cli.out_problem(args.out, [_pair_url(args.out, a, b) for a, b in pairs], inputs):
            raise ValueError(problem)
        for a, b in pairs:
            if a not in langlinks and b not in langlinks:
                raise ValueError(f"--pairs {a}-{b}: needs --langlinks for {a} or {b}")
        job = AlignJob(args, dumps, langlinks)
        job.read()  # every input is read in full before anything is written
        aligner = SectionAligner(args.min_sentences, args.threshold)
        if args.encoder:
            aligner.embeddings = embed_sections(args.encoder, dumps, args.min_sentences)
        results = [job.align_pair(a, b, aligner) for a, b in pairs]
        if not any(aligned for *_, aligned in results):
            linked = ", ".join(f"{a}-{b}: {counts['linked_articles']}" for a, b, counts, _, _ in results)
            raise ValueError(f"no section pair was aligned (linked articles {linked}); nothing written")
        related = {lang: related_articles(d) for lang, d in dumps.items()}
        with tempfile.TemporaryDirectory(prefix="data_prep-") as tmp:
            rows = [_write_pair(args, tmp, job, related, *result) for result in results]
    except (ValueError, DumpError, LanglinksError, StorageError) as err:
        return cli.fail("align", str(err))
    except WorkerDied as err:
        return cli.failed_run("align", err)
    _summary(rows, time.time() - start)
    return 0


def _pair_url(out: str, a_lang: str, b_lang: str) -> str:
    """The stream of the pair A-B."""
    return storage.join(out, "clir", f"{a_lang}-{b_lang}")


def _write_pair(args, tmp: str, job: AlignJob, related: dict, a_lang: str, b_lang: str, counts: Counter,
                dropped: Counter, aligned: list) -> tuple:
    pair = f"{a_lang}-{b_lang}"
    url = _pair_url(args.out, a_lang, b_lang)
    writer = ShardWriter(url, tmp, int(args.shard_size_mb * 2**20), previous_shas(url))
    methods = Counter(dict.fromkeys(METHODS, 0))
    for a, b, m in aligned:
        methods[m.method] += 1
        head_a, head_b = a.sections[m.i].heading or "(lead)", b.sections[m.j].heading or "(lead)"
        writer.write(f"{pair}-{a.page_id}-{b.page_id}-{m.i}-{m.j}", f"{a.title} § {head_a} ⇄ {b.title} § {head_b}",
                     record(pair, a, b, m, related, args))
    writer.close()
    links = [{"file": os.path.basename(f.path), "lang": lang, "rows": f.rows,
              "other_languages": job.other_languages[lang], "malformed_lines": f.malformed_lines}
             for lang, f in job.langlinks.items() if lang in (a_lang, b_lang)]
    extra = {"tool": f"data_prep {__version__}", "pair": pair, "langs": [a_lang, b_lang],
             "counts": {"articles": {lang: job.dumps[lang].report.articles for lang in (a_lang, b_lang)},
                        "linked_articles": counts["linked_articles"], "aligned": dict(methods),
                        "redirects_followed": counts["redirects_followed"],
                        "links_in_both_files": counts["links_in_both_files"]},
             "dropped": dict(dropped),
             "method": {"threshold": args.threshold, "min_sentences": args.min_sentences,
                        "max_hard_negatives": args.max_hard_negatives, "encoder": args.encoder, "seed": args.seed},
             "sources": {"dumps": [asdict(job.dumps[lang].report) for lang in (a_lang, b_lang)], "langlinks": links}}
    return pair, counts, methods, dropped, writer, writer.write_manifest(extra)


def _summary(rows: list[tuple], seconds: float) -> None:
    print(f"{'pair':<8}{'linked':>8}{'lead':>7}{'anchors':>9}{'encoder':>9}{'samples':>9}{'shards':>8}  manifest")
    for pair, counts, methods, _, writer, url in rows:
        print(f"{pair:<8}{counts['linked_articles']:>8}{methods['lead']:>7}{methods['anchors']:>9}"
              f"{methods['encoder']:>9}{writer.samples:>9}{len(writer.shards):>8}  {storage.redact(url)}")
    for pair, _, _, dropped, _, _ in rows:
        print(f"dropped {pair}: " + ", ".join(f"{k}={v}" for k, v in dropped.items()))
    print(f"done in {seconds:.1f}s")
