"""A model folder is data (docs/operations/untrusted-input.md#model-folders): clsys never runs code that comes with
it. Every ``from_pretrained`` passes ``trust_remote_code=False`` (before, transformers asked on the terminal, and
a folder whose ``auto_map`` named its own .py ran it once the user typed "y"), a folder that asks for its own code
is refused in one line, and pickled weights that hold more than tensors are refused in one line naming the file
(before, a 20-line traceback whose last words advised ``weights_only=False``), by ``clsys.evaluate`` (``--model``,
``--rerank``) and ``clsys.mine --model`` alike. The folders are crafted copies of the packaged MiniLM; the code
and the pickle each create a marker file if they ever run.
"""
from __future__ import annotations

import ast
import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clsys.evaluate import main as evaluate
from clsys.mine import main as mine
from clsys.model.loading import resolve_model_path
from faults import RunsCodeWhenUnpickled

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("clsys", "data_prep", "bench")  # every package of ours that loads models


def calls_trusting_remote_code(path: Path) -> list[str]:
    """``file:line`` of each ``from_pretrained`` call in ``path`` that does not pass ``trust_remote_code=False``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "from_pretrained":
            if not any(k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False
                       for k in node.keywords):
                found.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{node.lineno}")
    return found


def test_every_from_pretrained_call_passes_trust_remote_code_false(tmp_path):
    calls = [c for package in SCANNED for path in sorted((REPO / package).rglob("*.py"))
             for c in calls_trusting_remote_code(path)]
    assert calls == []
    # The scan itself, on calls it must report (the bare name, None, True, a variable) and one it must not.
    module = tmp_path / "m.py"
    module.write_text("AutoModel.from_pretrained(p)\nfrom_pretrained(p, trust_remote_code=None)\n"
                      "X.from_pretrained(p, trust_remote_code=True)\nX.from_pretrained(p, trust_remote_code=t)\n"
                      "X.from_pretrained(p, trust_remote_code=False)\n")
    assert calls_trusting_remote_code(module) == ["m.py:1", "m.py:2", "m.py:3", "m.py:4"]


def minilm_copy(folder: Path) -> Path:
    shutil.copytree(resolve_model_path("all-MiniLM-L6-v2"), folder)
    return folder


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, Path]:
    """Two MiniLM folders: "code" whose config.json's ``auto_map`` names a .py of its own (an architecture
    transformers does not ship, ``evilbert``), "pickle" whose weights are a ``pytorch_model.bin`` holding a
    pickle that runs code; and the "marker" each of them creates if its code ever runs."""
    root = tmp_path_factory.mktemp("hostile-models")
    marker = root / "RAN"
    code = minilm_copy(root / "code")
    config = json.loads((code / "config.json").read_text())
    config.update(model_type="evilbert", architectures=["EvilModel"],
                  auto_map={"AutoConfig": "evil.EvilConfig", "AutoModel": "evil.EvilModel"})
    (code / "config.json").write_text(json.dumps(config))
    (code / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                  "from transformers import BertConfig as EvilConfig, BertModel as EvilModel\n"
                                  "EvilConfig.model_type = 'evilbert'\n")
    pickled = minilm_copy(root / "pickle")
    (pickled / "model.safetensors").unlink()
    torch.save({"embeddings.word_embeddings.weight": RunsCodeWhenUnpickled(str(marker))},
               pickled / "pytorch_model.bin")
    return {"code": code, "pickle": pickled, "marker": marker}


def test_a_folder_asking_to_run_its_own_code_is_refused_in_one_line_though_the_user_would_say_yes(hostile):
    """The real command on a terminal whose user has already typed "y" to transformers' question."""
    user, terminal = pty.openpty()
    os.write(user, b"y\ny\n")
    try:
        proc = subprocess.run([sys.executable, "-m", "clsys.evaluate", "--model", str(hostile["code"]),
                               "--pooling", "mean"], cwd=REPO, stdin=terminal, capture_output=True, text=True,
                              timeout=120)
    finally:
        os.close(user), os.close(terminal)
    assert not hostile["marker"].exists(), "the folder's code ran"
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "custom code" not in proc.stdout and "[y/N]" not in proc.stdout, proc.stdout  # no question asked
    assert proc.stderr.splitlines() == [
        f"python -m clsys.evaluate: error: cannot load model '{hostile['code']}': {hostile['code']}/config.json: its "
        "auto_map names code of the model folder's own (evil.EvilConfig, evil.EvilModel), which clsys does not run: "
        "use a model of an architecture transformers ships"], proc.stderr[-3000:]


def test_pickled_weights_holding_code_and_a_folder_asking_for_code_are_refused_naming_the_file(
        hostile, tmp_path, capsys):
    weights = hostile["pickle"] / "pytorch_model.bin"
    refusal = (f"{weights}: refused: it holds more than tensors and plain containers, which "
               "torch.load(weights_only=True) does not unpickle (that could run code from the file)")

    def refused(command, *args: str) -> str:
        try:
            code = command(list(args))
        except SystemExit as exit_info:
            code = exit_info.code
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1 and "weights_only=False" not in err, err
        return err

    assert refused(evaluate, "--model", str(hostile["pickle"]), "--pooling", "mean") == \
        f"python -m clsys.evaluate: error: cannot load model '{hostile['pickle']}': {refusal}\n"
    assert refused(evaluate, "--model", "all-MiniLM-L6-v2", "--xling", "en-de", "--articles", "0:1",
                   "--rerank", str(hostile["pickle"])) == \
        f"python -m clsys.evaluate: error: cannot load reranker '{hostile['pickle']}': {refusal}\n"
    pairs = ("--data", str(tmp_path / "pairs"), "--out", str(tmp_path / "mined"), "--pooling", "mean")
    assert refused(mine, "--model", str(hostile["pickle"]), *pairs) == \
        f"clsys.mine: error: --model {hostile['pickle']}: {refusal}\n"
    assert "config.json: its auto_map names code of the model folder's own" in \
        refused(mine, "--model", str(hostile["code"]), *pairs)
    assert not hostile["marker"].exists(), "the folder's code ran"
