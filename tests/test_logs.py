"""clsys.logs: one configuration for every command and Ray worker; importing clsys.pretrain sets nothing."""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from clsys import logs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_importing_pretrain_leaves_the_environment_as_it_was():
    """The driver's environment defaults (Ray on loopback, tokenizers, Ray's log de-duplication) are set by main,
    before Ray starts: a program that imports clsys.pretrain keeps its own environment."""
    code = ("import json, os; before = dict(os.environ); import clsys.pretrain; "
            "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "TOKENIZERS_PARALLELISM", "RAY_DEDUP_LOGS_ALLOW_REGEX")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_the_option_wins_over_the_environment_and_info_is_the_default(monkeypatch):
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    assert logs.resolve_level() == "INFO"
    monkeypatch.setenv(logs.LEVEL_ENV, "debug")
    assert logs.resolve_level() == "DEBUG" and logs.resolve_level("WARNING") == "WARNING"
    monkeypatch.setenv(logs.LEVEL_ENV, "chatty")
    with pytest.raises(ValueError, match="CLSYS_LOG_LEVEL=CHATTY: one of DEBUG, INFO, WARNING, ERROR"):
        logs.resolve_level()


def test_progress_goes_to_its_stream_warnings_to_stderr_each_line_once(capsys):
    """Configured twice (a driver that also runs a worker function), a record is still written once; the
    message is the line as it reads (its own prefix); DEBUG shows only at DEBUG."""
    logs.configure("INFO")
    logs.configure("INFO")
    engine, prep = logging.getLogger("clsys.engine.loop"), logging.getLogger("data_prep.pairs")
    engine.debug("[clsys] not shown")
    engine.info("[clsys] step 1/2 loss 0.5")
    engine.warning("[clsys] warning: collapsing")
    prep.info("data_prep pairs: 2 tasks at a time")
    out, err = capsys.readouterr()
    assert out == "[clsys] step 1/2 loss 0.5\ndata_prep pairs: 2 tasks at a time\n"
    assert err == "[clsys] warning: collapsing\n"

    logs.configure("DEBUG", progress_stream="stderr")
    engine.debug("[clsys] train.zero_stage auto: 0")
    out, err = capsys.readouterr()
    assert out == "" and err == "[clsys] train.zero_stage auto: 0\n"


@pytest.fixture(scope="module")
def wiki_shards(tmp_path_factory) -> str:
    """sentences/ from the bundled dump, as the quickstart reads them."""
    out = tmp_path_factory.mktemp("shards")
    dumps = sorted(glob.glob(os.path.join(REPO, "data_prep", "samples", "*.bz2")))
    subprocess.run([sys.executable, "-m", "data_prep", "wiki", "--input", *dumps, "--out", str(out)], cwd=REPO,
                   capture_output=True, check=True)
    return str(out)


# What only a Ray Train worker logs, at DEBUG: what the quickstart's train.precision and train.zero_stage auto
# became on its device, and how its loader was set up. Ray forwards the worker's stdout behind its prefix.
WORKER_DEBUG = (r"\(RayTrainWorker pid=\d+[^)]*\) \[clsys\] train\.precision auto: ",
                r"\(RayTrainWorker pid=\d+[^)]*\) \[clsys\] train\.zero_stage auto: ",
                r"\(RayTrainWorker pid=\d+[^)]*\) \[clsys\] rank 0 loader: ")


@pytest.mark.slow
@pytest.mark.usefixtures("shared_ray")
def test_the_drivers_debug_level_reaches_the_ray_train_workers(wiki_shards, tiny_bert_with_heads, tmp_path):
    """`python -m clsys.pretrain --log-level DEBUG`: the workers log their decisions to the driver's console. One
    step of the small random BERT on one worker (~30 s on 2 cores, on the module's shared Ray cluster). That INFO,
    the default, leaves DEBUG records out is configure's, tested above without a run."""
    env = {k: v for k, v in os.environ.items() if k != logs.LEVEL_ENV}  # the option alone sets the level
    proc = subprocess.run([sys.executable, "-m", "clsys.pretrain", "--log-level", "DEBUG", f"data.url={wiki_shards}",
                           f"model.name={tiny_bert_with_heads}", f"train.run_root={tmp_path}", "train.name=debug",
                           "train.steps=1", "train.batch_size=8", "train.ckpt_every=1", "cluster.num_workers=1",
                           "cluster.cpus_per_worker=1", "eval.sts_dev=", "eval.sts_test=", "eval.heatmap_text="],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    debug = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # Ray colours its worker prefix
    assert [line for line in WORKER_DEBUG if not re.search(line, debug)] == [], debug[-3000:]
    # The driver's own line, from clsys.pretrain's logger: its name is the module's under `python -m` too.
    assert "[clsys] run " in debug
