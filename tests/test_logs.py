"""clsys.logs: one configuration for every command and Ray worker; importing clsys.pretrain sets nothing."""
from __future__ import annotations

import json
import logging
import os
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
