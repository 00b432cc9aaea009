"""The CSS-LM recipe end to end (``python -m clsys.pretrain --config css_lm``): epoch batching, the
stage configs, the bank's corpus slices, driver errors; then real runs through Ray Train and
DeepSpeed on a tiny BERT, each stage a run of the step loop's Trainer: 2 workers at ZeRO-2 with 2 seeds
on S3, 1 worker at ZeRO stage 0 resuming by stage and within one, and the plain fine-tuning baseline;
the exported classifier reproduces the reported accuracy."""
from __future__ import annotations

import itertools
import json
import math
import os
import re

import pytest

from clsys import storage
from clsys.recipes import load_config
from clsys.recipes.css_lm.corpus import bank_sentences, corpus_texts, resolve_corpus_stream
from clsys.recipes.css_lm.pipeline import stage_config
from clsys.recipes.css_lm.stage import FewShotBatches, epoch_rows
from clsys.data.labeled import LabeledSet
from clsys.model.encoder import load_tokenizer
from clsys.pretrain import main as pretrain_main
from clsys.recipes.css_lm.bank import load_all
from tensorboard_events import tensorboard_scalars
from test_pretrain import REPO, SAMPLE, run

SST5 = REPO / "clsys" / "assets" / "labeled" / "sst5"


# ---- pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize("examples,batch", [(10, 4), (12, 4), (3, 8)])
def test_epoch_rows_are_a_seeded_permutation_cycled_to_whole_batches(examples, batch):
    rows = epoch_rows(examples, batch, seed=1, epoch=0)
    assert len(rows) == math.ceil(examples / batch) * batch
    assert sorted(rows[:examples]) == list(range(examples))  # every example once per epoch …
    assert rows[examples:] == [rows[i % examples] for i in range(examples, len(rows))]  # … then the start again
    assert rows == epoch_rows(examples, batch, seed=1, epoch=0)
    if examples > 3:
        assert rows != epoch_rows(examples, batch, seed=1, epoch=1)
        assert rows != epoch_rows(examples, batch, seed=2, epoch=0)


def test_few_shot_batches_deal_each_global_batch_over_ranks_and_resume_where_they_stopped():
    """Every optimizer step's micro-batches, over ranks and accumulation steps, are one global batch of the epoch's
    rows, in order; a loader built from a saved position hands out what the first would have next."""
    train = LabeledSet([f"text {i}" for i in range(10)], [i % 3 for i in range(10)], ["a", "b", "c"], "train.tsv")
    cfg = load_config("css_lm", ["train.batch_size=4", "cluster.num_workers=2", "train.grad_accum=2", "train.seed=7"])

    def collate(texts, labels, corpus):
        assert corpus is None
        return {"texts": texts, "labels": labels}

    ranks = [iter(FewShotBatches(train, collate, cfg, rank, 2, None)) for rank in range(2)]
    for epoch in range(2):  # 3 steps an epoch (10 rows → 12, cycled), each 2 micro-batches × 2 ranks of 1 row
        rows = epoch_rows(10, 4, seed=7, epoch=epoch)
        for step in range(3):
            dealt = [next(ranks[rank])["keys"] for a in range(2) for rank in range(2)]  # (a·world + rank) order
            assert dealt == [[f"train.tsv#{i}"] for i in rows[4 * step:4 * step + 4]]
    first = FewShotBatches(train, collate, cfg, 1, 2, None)
    batches = iter(first)
    for _ in range(5):
        next(batches)
    again = FewShotBatches(train, collate, cfg, 1, 2, None)
    again.load_state_dict(first.state_dict())
    assert [b["keys"] for b in itertools.islice(again, 8)] == [next(batches)["keys"] for _ in range(8)]


def test_stage_configs():
    cfg = load_config("css_lm", ["objective.task.warmup_epochs=3", "objective.task.epochs=2", "train.batch_size=4",
                                 "cluster.num_workers=2", "train.grad_accum=2", "objective.task.warmup_fraction=0.1"])
    warmup, css = stage_config(cfg, "warmup", 10), stage_config(cfg, "css", 10)
    assert (warmup.objective.stage, warmup.train.steps, warmup.optim.warmup_steps) == ("warmup", 9, 0)
    assert warmup.objective.detach_after_micro_steps == 3 * 2  # one epoch of micro-steps: 3 steps × 2
    assert (css.objective.stage, css.train.steps, css.optim.warmup_steps) == ("css", 6, 0)
    assert stage_config(load_config("css_lm", ["objective.task.warmup_epochs=14"]), "warmup", 96).optim.warmup_steps == 33
    assert cfg.objective.stage == "warmup" and cfg.train.steps != 9  # the recipe's config is left as it was


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("corpus")
    assert run("-m", "data_prep", "wiki", "--input", str(SAMPLE[0]), "--out", str(out),
               "--shard-size-mb", "0.5").returncode == 0
    return str(out)


def test_bank_slices_of_any_worker_count_make_the_one_process_bank(corpus):
    stream, tokenizer = resolve_corpus_stream(corpus), load_tokenizer("all-MiniLM-L6-v2")
    whole, seen = bank_sentences(corpus_texts(stream), tokenizer, 15, 0, 500)
    assert seen == 500 and len(whole) == 500 and len(set(whole)) > 400
    lengths = [len(ids) for ids in tokenizer(whole, add_special_tokens=False)["input_ids"]]
    assert min(lengths) >= 15
    first_texts = list(corpus_texts(stream))[:2000]
    assert [t for t in first_texts if t in set(whole)][:50] == whole[:50]  # corpus order kept
    for world in (2, 3):
        slices = [bank_sentences(corpus_texts(stream), tokenizer, 15, r * 500 // world, (r + 1) * 500 // world)[0]
                  for r in range(world)]
        assert sum(slices, []) == whole
    everything, total = bank_sentences(corpus_texts(stream), tokenizer, 15, 0, 10**9)
    assert total == len(everything) < 10**9  # a corpus that runs out says how many it had


def test_corpus_url_is_the_stream_or_its_root(corpus, tmp_path):
    assert resolve_corpus_stream(corpus) == storage.join(corpus, "sentences")
    assert resolve_corpus_stream(os.path.join(corpus, "sentences")) == os.path.join(corpus, "sentences")
    with pytest.raises(FileNotFoundError, match="no manifest.json in .*sentences"):
        resolve_corpus_stream(str(tmp_path))
    with pytest.raises(ValueError, match="objective.corpus.url"):
        resolve_corpus_stream("")


@pytest.mark.parametrize("overrides,message", [
    (["objective.task.train="], "objective.task.train: set it to a labelled file"),
    (["task.test="], "objective.task.test: set it to a labelled file"),  # the spelling from before: the key now
    (["objective.task.dev=clsys/assets/labeled/acl-arc/dev.txt"], "acl-arc/dev.txt:1: unknown label 'Background'"),
    (["objective.num_labels=3"], "objective.num_labels: 3, but .* has 5 classes"),
    (["objective.corpus.url=/nonexistent/corpus"], "objective.corpus.url: no manifest.json in /nonexistent/corpus"),
    (["train.resume=file:///x/checkpoints/step-00000001"], "train.resume: css_lm resumes whole stages"),
    (["train.name=other", "train.steps=5", "objective.task.shots=-1"], "shots must be >= 0"),
])
def test_driver_errors_name_the_key_or_file(overrides, message, corpus, tmp_path, capsys):
    code = pretrain_main(["--config", "css_lm", f"objective.corpus.url={corpus}", f"train.run_root={tmp_path}",
                          *overrides])
    assert code == 2
    assert re.search(message, capsys.readouterr().err)


def test_repeats_is_only_for_css_lm(capsys):
    assert pretrain_main(["--config", "quickstart", "--repeats", "3"]) == 2
    assert "--repeats" in capsys.readouterr().err


# ---- end to end --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_task(tmp_path_factory) -> dict[str, str]:
    """SST-5's training file as it ships, dev and test cut to 40 and 60 rows and written as JSONL."""
    out = tmp_path_factory.mktemp("task")
    files = {"train": str(SST5 / "stsa.fine.train")}
    for split, source, rows in (("dev", "stsa.fine.dev", 40), ("test", "stsa.fine.test", 60)):
        lines = (SST5 / source).read_text().splitlines()[:rows]
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps({"text": line[2:], "label": line[0]}) + "\n" for line in lines))
        files[split] = str(path)
    return files


def tiny_run(tiny: str, task: dict[str, str], corpus: str, run_root: str, *extra: str) -> list[str]:
    return ["-m", "clsys.pretrain", "--config", "css_lm", f"model.name={tiny}", "model.init=scratch",
            "model.tokenizer=all-MiniLM-L6-v2", f"objective.task.train={task['train']}",
            f"objective.task.dev={task['dev']}", f"objective.task.test={task['test']}", "objective.task.shots=2",
            "objective.task.warmup_epochs=2", "objective.task.epochs=2", "objective.k=4", "objective.domain_negatives=2",
            "objective.corpus.bank_size=120", f"objective.corpus.url={corpus}", "data.max_length=32",
            f"train.run_root={run_root}", "train.log_every=1", *extra]


def check_seed_run(run_url: str, test_file: str, stages: tuple[str, ...] = ("warmup", "css")) -> dict:
    """A finished seed: per-epoch results of each stage, the reported test accuracy at the best dev
    epoch, and an exported classifier that reproduces it."""
    result = storage.read_json(storage.join(run_url, "result.json"))
    for stage in stages:
        stage_result = storage.read_json(storage.join(run_url, stage, "result.json"))
        epochs = stage_result["epochs"]
        assert [e["epoch"] for e in epochs] == [1, 2]
        best = max(range(len(epochs)), key=lambda i: (epochs[i]["dev_accuracy"], -i))
        assert stage_result["best_epoch"] == best + 1
        assert stage_result["test_accuracy"] == epochs[best]["test_accuracy"]
    assert result["test_accuracy"] == storage.read_json(storage.join(run_url, stages[-1], "result.json"))["test_accuracy"]

    from clsys.classify import load
    from clsys.data.labeled import load_labeled

    classifier = load(storage.join(run_url, "export"))
    test = load_labeled(test_file, classifier.labels)
    # The same weights in eval mode; only batch padding differs from the in-training evaluation.
    assert classifier.accuracy(test) == pytest.approx(result["test_accuracy"], abs=1.01 / len(test))
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_workers_two_seeds_on_s3(s3_bucket, tiny, small_task, tmp_path):
    corpus = f"{s3_bucket}/corpus"
    assert run("-m", "data_prep", "wiki", "--input", str(SAMPLE[0]), "--out", corpus, "--shard-size-mb", "0.5").returncode == 0
    runs = f"{s3_bucket}/runs"
    proc = run(*tiny_run(tiny, small_task, corpus, runs, "cluster.num_workers=2", "train.name=two",
                         "train.zero_stage=2", "--repeats", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = storage.read_json(f"{runs}/two/summary.json")
    tests = [s["test_accuracy"] for s in summary["seeds"]]
    assert [s["seed"] for s in summary["seeds"]] == [42, 43]
    assert summary["test_accuracy_mean"] == pytest.approx(sum(tests) / 2)
    assert summary["test_accuracy_std"] == pytest.approx(abs(tests[0] - tests[1]) / math.sqrt(2))
    assert "test accuracy" in proc.stdout and "over 2 seed(s)" in proc.stdout
    for seed in (42, 43):
        run_url = f"{runs}/two/seed-{seed}"
        check_seed_run(run_url, small_task["test"])
        # The bank: one shard per worker, together the first 120 qualifying corpus sentences in corpus order.
        bank = load_all(f"{run_url}/bank")
        expected, _ = bank_sentences(corpus_texts(resolve_corpus_stream(corpus)), load_tokenizer("all-MiniLM-L6-v2"),
                                     15, 0, 120)
        assert bank.texts == expected and tuple(bank.u.shape) == (120, 32)
        assert [o for o in storage.list_prefix(f"{run_url}/bank") if o.endswith(".json")] == [
            f"{run_url}/bank/shard-00000-of-00002.json", f"{run_url}/bank/shard-00001-of-00002.json"]
    # TensorBoard events are written locally on rank 0 and synced to each stage's run on S3.
    for stage in ("warmup", "css"):
        assert any("tfevents" in o for o in storage.list_prefix(f"{runs}/two/seed-42/{stage}/tensorboard"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("shared_ray")
def test_one_worker_resumes_by_stage(tiny, small_task, corpus, tmp_path):
    common = tiny_run(tiny, small_task, corpus, str(tmp_path), "cluster.num_workers=1", "train.name=one",
                      "objective.bank_refresh_every=2")
    first = run(*common)
    assert first.returncode == 0, first.stderr[-3000:]
    # 10 examples, batch 4: 3 steps an epoch, 6 in stage C, the bank re-encoded after every 2nd.
    assert first.stdout.count("bank re-encoded with the current model") == 3
    run_dir = tmp_path / "one"
    result = check_seed_run(str(run_dir), small_task["test"])
    warmup, css = (tensorboard_scalars(str(run_dir / stage / "tensorboard")) for stage in ("warmup", "css"))
    # Each stage evaluates at step 0 and after each of its 2 epochs.
    assert len(warmup["eval/dev_accuracy"]) == len(css["eval/dev_accuracy"]) == 3
    assert "train/d_init" in warmup and "train/dc_out" in css
    # Only each stage's best checkpoint is kept once the stage is complete.
    for stage in ("warmup", "css"):
        best = storage.read_json(str(run_dir / stage / "best.json"))
        assert [p.name for p in (run_dir / stage / "checkpoints").iterdir()] == [best["checkpoint"].rpartition("/")[2]]

    again = run(*common)  # a fresh run must not overwrite a finished one
    assert again.returncode == 2 and "already exists: pass --resume latest" in again.stderr

    # Lose stage C's and the seed's outcome: --resume latest keeps stage A and the bank, and resumes stage C from
    # the checkpoint it kept, as the step loop resumes; the epochs before it come back from the checkpoint.
    for name in ("result.json", "css/result.json"):
        (run_dir / name).unlink()
    resumed = run(*common, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "stage A: complete" in resumed.stdout and "stage B: the bank" in resumed.stdout and "reused" in resumed.stdout
    assert re.search(r"resumed from \S+/css/checkpoints/step-\d+ at step \d+", resumed.stdout)
    assert check_seed_run(str(run_dir), small_task["test"])["warmup"] == result["warmup"]

    done = run(*common, "--resume", "latest")
    assert done.returncode == 0 and "complete in" in done.stdout and "skipped" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("shared_ray")
def test_plain_finetuning_baseline(tiny, small_task, corpus, tmp_path):
    common = tiny_run(tiny, small_task, corpus, str(tmp_path), "cluster.num_workers=1", "train.name=ft",
                      "objective.method=finetune", "objective.corpus.url=", "cluster.stop_poll_s=0.05")  # no corpus needed
    # A stop request in the stage's folder: the stage checkpoints and stops, and nothing is marked complete.
    stop = tmp_path / "ft" / "warmup" / "STOP"
    stop.parent.mkdir(parents=True)
    stop.write_text("operator")
    stopped = run(*common, "--resume", "latest")
    assert stopped.returncode == 75 and "stopped before its end" in stopped.stderr, stopped.stderr[-3000:]
    assert not (tmp_path / "ft" / "warmup" / "result.json").exists()
    stop.unlink()
    proc = run(*common, "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"resumed from \S+/warmup/checkpoints/step-\d+ at step [1-5]\b", proc.stdout)
    check_seed_run(str(tmp_path / "ft"), small_task["test"], stages=("warmup",))
    assert not (tmp_path / "ft" / "bank").exists() and not (tmp_path / "ft" / "css").exists()
    assert "train/d_init" not in tensorboard_scalars(str(tmp_path / "ft" / "warmup" / "tensorboard"))
