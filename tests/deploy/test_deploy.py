"""The sharded deployments: deploy/k8s (validated offline against Kubernetes 1.34's schemas with
kubernetes-validate) and docker-compose.shards.yml (compose_spec), wired consistently, and every
command they run parses: the containers' scripts are run with `exec` replaced by printing their
arguments, for a pod of each kind, with and without the TLS Secret mounted."""
from __future__ import annotations

import pathlib
import shlex
import subprocess

import kubernetes_validate
import pytest
import yaml

from moe_core.shards import Shard, check_coverage
from harness import ROOT
from test_compose import merged, parse

K8S = ROOT / "deploy" / "k8s"
SHARDS_COMPOSE = ROOT / "docker-compose.shards.yml"
K8S_VERSION = "1.34.0"


def manifests() -> list[dict]:
    return [d for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text()) if d]


def kind(name: str) -> dict:
    return next(d for d in manifests() if d["kind"] == name)


def container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifests_validate_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_refuses_a_broken_manifest():
    bad = kind("StatefulSet")
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")


def test_shards_names_and_gpu_wiring_agree():
    sts, svc, gpu = kind("StatefulSet"), next(d for d in manifests() if d["kind"] == "Service"
                                              and d["spec"].get("clusterIP") == "None"), kind("Deployment")
    n = sts["spec"]["replicas"]
    assert int(env(container(sts))["SHARDS"]) == n
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert env(container(gpu))["EXPERTS"] == ",".join(f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}:50061"
                                                      for i in range(n))
    assert container(gpu)["resources"]["limits"]["nvidia.com/gpu"] == 1
    for w in (sts, gpu):
        assert env(container(w))["MOE_AUTH_TOKEN"] == {"secretKeyRef": {"name": "moe-auth", "key": "token"}}
        tls = next(v for v in w["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
        assert tls["secret"] == {"secretName": "moe-tls", "optional": True}


def run_printing(script: str, variables: dict, tls_dir: pathlib.Path | None) -> list[list[str]]:
    """The script as the container's shell runs it, each `exec CMD` / probe command printed as argv."""
    script = script.replace("/tls/", f"{tls_dir}/" if tls_dir else "/nonexistent-tls/")
    script = script.replace("exec ", "printf '%s\\n' ").replace("moe-client ", "printf '%s\\n' moe-client ")
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=variables, timeout=10, check=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize("tls", [False, True])
@pytest.mark.parametrize("workload, pod", [("StatefulSet", "expert-1"), ("Deployment", "gpu-service-7d9f-x2")])
def test_container_scripts_and_probes_parse(workload, pod, tls, tmp_path):
    from expert_service.cli import parse_args as expert_args
    from gpu_service.cli import parse_args as gpu_args
    from moe_client.cli import parse_args as client_args

    if tls:
        for f in ("tls.crt", "tls.key", "ca.crt"):
            (tmp_path / f).write_text("x")
    c = container(kind(workload))
    variables = {"HOSTNAME": pod, **{k: v for k, v in env(c).items() if isinstance(v, str)}, "PATH": "/usr/bin:/bin"}
    argv = run_printing(c["args"][0], variables, tmp_path if tls else None)
    if workload == "StatefulSet":
        a = expert_args(argv[1:])
        assert argv[0] == "expert-service" and Shard.parse(a.shard) == Shard(1, 2)
    else:
        a = gpu_args(argv[1:])
        assert argv[0] == "gpu-service" and a.experts == variables["EXPERTS"] and a.device == "cuda"
    assert bool(a.tls_cert) == tls
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        argv = run_printing(c[probe]["exec"]["command"][2], variables, tmp_path if tls else None)
        a = client_args(argv[1:])
        assert argv[0] == "moe-client" and a.cmd == "health" and bool(a.tls_ca) == tls
        assert a.server.endswith(":50061" if workload == "StatefulSet" else ":50051")
        assert a.alive == (probe != "readinessProbe")  # liveness: answering, SERVING or not


def test_sharded_compose_file_is_valid_and_covers_every_shard():
    spec = merged(SHARDS_COMPOSE)
    assert sorted(parse(spec).service_names()) == ["expert-0", "expert-1", "gpu-service"]
    s = spec["services"]
    shards = {name: Shard.parse(svc["command"][svc["command"].index("--shard") + 1])
              for name, svc in s.items() if name.startswith("expert")}
    check_coverage(shards)
    g = s["gpu-service"]["command"]
    assert g[g.index("--experts") + 1] == "expert-0:50061,expert-1:50061"
    assert all(s["gpu-service"]["depends_on"][e]["condition"] == "service_healthy" for e in shards)
    from expert_service.cli import parse_args as expert_args
    from gpu_service.cli import parse_args as gpu_args
    for name, svc in s.items():
        (gpu_args if name == "gpu-service" else expert_args)(svc["command"][1:])
        assert shlex.join(svc["healthcheck"]["test"][1:]).startswith("moe-client health")
