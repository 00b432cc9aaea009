"""Cross-lingual pretraining end to end on real parts: `data_prep align` on the multilingual fixture
dumps + langlinks SQL → 2 Ray Train workers running the clir recipe under DeepSpeed ZeRO-2 (QLM and RR
alternating per language pair) → TensorBoard → export (encoder + reranker) → `clsys.evaluate --xling`."""
from __future__ import annotations


import pytest

from tensorboard_events import tensorboard_scalars
from test_pretrain import REPO, run

FIXTURES = REPO / "tests" / "data" / "clir"
pytestmark = pytest.mark.slow


def test_clir_recipe_on_aligned_fixture_shards(tiny_bert_with_heads, tmp_path):
    shards = tmp_path / "shards"
    dumps = [f"{lang}={FIXTURES / f'{lang}wiki-20261101-pages-articles.xml.bz2'}" for lang in ("en", "de", "es")]
    links = [f"{lang}={FIXTURES / f'{lang}wiki-20261101-langlinks.sql.gz'}" for lang in ("en", "de")]
    assert run("-m", "data_prep", "align", "--dumps", *dumps, "--langlinks", *links, "--out", str(shards),
               "--pairs", "en-de", "en-es", "--shard-size-mb", "0.05").returncode == 0

    runs = tmp_path / "runs"
    proc = run("-m", "clsys.pretrain", "--config", "clir", f"data.url={shards}", f"train.run_root={runs}",
               f"model.name={tiny_bert_with_heads}", "train.steps=4", "train.log_every=1", "train.ckpt_every=4", "train.batch_size=4",
               "data.max_length=96", "eval.every=4", "eval.xling=[en-de]", "eval.xling_articles=44:48",
               "eval.tatoeba=[]", "eval.rerank_top=3")
    assert proc.returncode == 0
    # One round = QLM on each pair, then RR on each pair, each its own optimizer step.
    scalars = tensorboard_scalars(str(runs / "clir" / "tensorboard"))
    for tag in ("train/qlm_loss", "train/rr_loss", "train/qlm_loss_en-de", "train/rr_loss_en-es",
                "eval/xquad_en-de_mrr@10", "eval/xquad_en-de_rerank_mrr@10"):
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
    assert len(scalars["eval/xquad_en-de_mrr@10"]) == 2  # before training and at the last step

    export = runs / "clir" / "export"
    assert (export / "modules.json").exists() and (export / "reranker" / "config.json").exists()
    report = tmp_path / "xling.json"
    proc = run("-m", "clsys.evaluate", "--model", str(export), "--xling", "en-de", "--articles", "44:48",
               "--pooling", "mean", "--rerank", "--rerank-top", "3", "--json", str(report))
    assert proc.returncode == 0
    assert "rerank_mrr@10" in report.read_text(), "the exported reranker was not used"
