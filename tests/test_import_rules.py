"""What import-linter's contracts (pyproject.toml, `make test`) do not check: no module of clsys or data_prep
uses another module's private name (``_name``), by ``from m import _name`` or by ``m._name``. A private name is
free to change with its module; one used elsewhere made two modules one (storage's ``_s3_call`` in its S3
reader, encoder's ``_quiet_transformers`` in long.py)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("clsys", "data_prep")


def private_uses(path: Path) -> list[str]:
    """``module.name`` for each private name of another module of ours that ``path`` uses."""
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}  # local name -> our module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{node.module}.{alias.name}")
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    uses = {str(path.relative_to(REPO)): found for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))
            if (found := private_uses(path))}
    assert uses == {}


def test_the_check_finds_both_forms(tmp_path):
    """The check itself, on a module that does both."""
    module = tmp_path / "m.py"
    module.write_text("from clsys.model.loading import _hidden\nfrom clsys import storage\nstorage._s3_call()\n")
    assert private_uses(module) == ["clsys.model.loading._hidden", "clsys.storage._s3_call"]


def recipe_mentions(path: Path, name: str, objective: type) -> list[int]:
    """Lines of ``path`` that name the recipe ``name`` (as ``css_lm``, ``css-lm`` or ``csslm``, any case) or its
    objective class."""
    words = {name.lower(), name.lower().replace("_", "-"), name.lower().replace("_", ""), objective.__name__.lower()}
    return [number for number, line in enumerate(path.read_text().splitlines(), 1)
            if any(word in line.lower() for word in words)]


def test_no_file_outside_a_recipe_home_names_that_recipe():
    """A recipe with a driver of its own keeps everything of its own in ``clsys/recipes/<name>/``; the CLIs and the
    registry find it by looking there, so nothing else branches on its name or reaches into its modules."""
    from clsys.recipes import HOMES

    assert HOMES, "no recipe home found: the registry's discovery is broken"
    mentions = {}
    for name, home in HOMES.items():
        inside = REPO / "clsys" / "recipes" / name
        for package in PACKAGES:
            for path in sorted((REPO / package).rglob("*.py")):
                if inside not in path.parents and (lines := recipe_mentions(path, name, home.objective)):
                    mentions[f"{path.relative_to(REPO)} ({name})"] = lines
    assert mentions == {}


def test_the_recipe_check_finds_every_spelling(tmp_path):
    class CSSLM:
        pass

    module = tmp_path / "m.py"
    module.write_text("a = 'css_lm'\n# CSS-LM's bank\nb = 1\nfrom x import CSSLM\n")
    assert recipe_mentions(module, "css_lm", CSSLM) == [1, 2, 4]


def objective_modules() -> set[str]:
    """Every module an objective is made of: clsys.objectives, and each registered objective's module with the
    modules of its recipe home it imports (a recipe's driver, which runs the process group, is not among them)."""
    import importlib
    import sys

    from clsys.recipes import OBJECTIVES

    found = {path.relative_to(REPO).with_suffix("").as_posix().replace("/", ".")
             for path in (REPO / "clsys" / "objectives").glob("*.py")}
    pending = [cls.__module__ for cls in OBJECTIVES.values()]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        found.add(name)
        home = name.rsplit(".", 1)[0]
        tree = ast.parse(Path(importlib.import_module(name).__file__).read_text())
        pending += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith(home + ".") and node.module in sys.modules]
    return found


def imports_torch_distributed(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names)
               or isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed")
               or isinstance(node, ast.ImportFrom) and node.module == "torch" and
               any(a.name == "distributed" for a in node.names) for node in ast.walk(tree))


def test_objectives_call_no_collective_themselves():
    """docs/architecture.md: an objective reaches the other ranks only through the ``ranks`` the engine hands it
    (clsys/objectives/ranks.py), so no module an objective is made of imports torch.distributed."""
    modules = objective_modules()
    assert {"clsys.objectives.simcse", "clsys.recipes.css_lm.objective", "clsys.recipes.css_lm.bank"} <= modules
    assert "clsys.recipes.css_lm.pipeline" not in modules
    offenders = sorted(m for m in modules if imports_torch_distributed(REPO / (m.replace(".", "/") + ".py")))
    assert offenders == []


def test_the_collectives_check_finds_every_spelling(tmp_path):
    for line in ("import torch.distributed as dist", "from torch.distributed import all_reduce",
                 "from torch import distributed", "import torch.distributed"):
        (tmp_path / "m.py").write_text(line + "\n")
        assert imports_torch_distributed(tmp_path / "m.py"), line
    (tmp_path / "m.py").write_text("import torch\nfrom torch import nn\n")
    assert not imports_torch_distributed(tmp_path / "m.py")


def library_private_uses(path: Path, names: set[str]) -> set[str]:
    """Which of ``names`` (private names of torch, transformers and multiprocessing) ``path`` names in code: as an
    attribute, an imported name, or a string (``getattr(obj, "_name")``); its prose may mention them."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return found & names


def test_only_the_transport_touches_the_libraries_private_names():
    """Every private name of torch, transformers and multiprocessing the loader uses is in clsys/data/transport.py,
    which checks them at start-up and runs plain without them: nowhere else can one break the loader unchecked."""
    from clsys.data import transport

    names = {part for dotted in transport.private_names() for part in dotted.split(".")
             if part.startswith("_") and not part.startswith("__")} | {transport.SEQ2SEQ_MARK}
    assert {"_shutdown_workers", "_worker_result_queue", "_convert_encoding", "_forkserver_alive_fd"} <= names
    home = REPO / "clsys" / "data" / "transport.py"
    uses = {str(path.relative_to(REPO)): found for path in sorted((REPO / "clsys").rglob("*.py"))
            if path != home and (found := library_private_uses(path, names))}
    assert uses == {}
