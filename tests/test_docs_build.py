"""The docs check that `make test` runs first: the exact command of the Makefile's `test` target must fail
on a broken link. (`mkdocs build --strict --quiet` passed with two broken anchors: `--quiet` hid the
warnings that `--strict` counts.) Builds a copy of the manual with one link broken, ~10 s."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def docs_command() -> list[str]:
    """The mkdocs line of the Makefile's `test` recipe, with $(PY) as this interpreter."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, "Makefile: no `test:` target"
    lines = [line.strip() for line in recipe.group(1).splitlines() if "mkdocs" in line]
    assert len(lines) == 1, f"Makefile's test target: expected one mkdocs line, got {lines}"
    return [sys.executable if word == "$(PY)" else word for word in shlex.split(lines[0])]


def build(tree: Path, site: Path) -> subprocess.CompletedProcess:
    command = docs_command()
    command[command.index("--site-dir") + 1] = str(site)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_the_docs_check_fails_on_a_broken_anchor(tmp_path):
    tree = tmp_path / "repo"
    tree.mkdir()
    shutil.copytree(ROOT / "docs", tree / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "mkdocs.yml", tree / "mkdocs.yml")
    (tree / "clsys").symlink_to(ROOT / "clsys")  # the config-reference hook reads the config dataclasses
    page = tree / "docs" / "export.md"
    page.write_text(page.read_text() + "\nSee [nowhere](operations/storage.md#no-such-anchor).\n")
    result = build(tree, tmp_path / "site")
    assert result.returncode != 0, f"the docs check passed a broken anchor:\n{result.stdout}\n{result.stderr}"
    assert "no-such-anchor" in result.stdout + result.stderr  # the warning is shown, naming the link
