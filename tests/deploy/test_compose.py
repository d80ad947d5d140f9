"""docker-compose.yml (CPU, what runs anywhere) and docker-compose.gpu.yml (the opt-in GPU override):
valid Compose files, wired together, and every command they run exists and parses its flags.
Validated offline with compose_spec (a spec-complete Compose parser), and with the Docker Compose
CLI as well where one is installed."""
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest
import yaml
from compose_spec import PyCompose

from harness import ROOT

BASE, GPU = ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml"


def interpolate(text: str) -> str:
    """Compose's ${VAR:-default} / ${VAR-default} / ${VAR} substitution (compose_spec parses, it does not substitute)."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: os.environ.get(m.group(1), m.group(2) or ""), text)


def merged(*files: pathlib.Path) -> dict:
    """Compose's merge of several -f files: mappings merge, everything else is replaced."""
    def merge(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: merge(a[k], v) if k in a else v for k, v in b.items()} | {k: v for k, v in a.items() if k not in b}
        return b
    out: dict = {}
    for f in files:
        out = merge(out, yaml.safe_load(interpolate(f.read_text())))
    return out


def parse(spec: dict) -> PyCompose:
    return PyCompose.from_json(json.dumps(spec))


def services(*files) -> dict:
    return merged(*(files or (BASE,)))["services"]


@pytest.mark.parametrize("files", [(BASE,), (BASE, GPU)], ids=["cpu", "cpu+gpu-override"])
def test_compose_files_are_valid(files):
    spec = parse(merged(*files))
    assert sorted(spec.service_names()) == ["expert-service", "gpu-service"]


def test_validator_refuses_a_broken_file():
    """The check above can fail: a wrong value is refused."""
    bad = merged(BASE)
    bad["services"]["gpu-service"]["depends_on"]["expert-service"]["condition"] = "healthy_maybe"
    with pytest.raises(ValueError, match="healthy_maybe"):
        parse(bad)


def test_cpu_by_default_gpu_opt_in():
    """Plain `docker compose up` asks for no GPU (it must run where there is no NVIDIA runtime); the
    override asks for one and runs the GPU service on CUDA."""
    base, gpu = services(), services(BASE, GPU)
    assert "deploy" not in base["gpu-service"] and "--device" not in base["gpu-service"]["command"]
    devices = gpu["gpu-service"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("capabilities") == ["gpu"] and d.get("driver") == "nvidia" for d in devices)
    cmd = gpu["gpu-service"]["command"]
    assert cmd[cmd.index("--device") + 1] == "cuda"
    assert "docker-compose.gpu.yml" in BASE.read_text() and "docker-compose.gpu.yml" in (ROOT / "README.md").read_text()


def test_services_and_wiring():
    for files in [(BASE,), (BASE, GPU)]:
        s = services(*files)
        g, e = s["gpu-service"], s["expert-service"]
        assert g["depends_on"]["expert-service"]["condition"] == "service_healthy"
        assert "expert-service:50061" in g["command"]
        for svc in s.values():
            assert svc["healthcheck"]["test"][0] == "CMD"
            assert any(v.endswith(":/model:ro") for v in svc["volumes"])
        assert (ROOT / e["build"]["dockerfile"]).exists()


@pytest.mark.slow
def test_commands_exist_and_parse():
    for svc in [*services().values(), services(BASE, GPU)["gpu-service"]]:
        for cmd in (svc["command"], svc["healthcheck"]["test"][1:]):
            exe = shutil.which(cmd[0])
            assert exe, f"{cmd[0]} is not installed"
            p = subprocess.run([exe, *cmd[1:2], "--help"] if cmd[0] == "moe-client" else [exe, "--help"],
                               capture_output=True, text=True, timeout=60)
            assert p.returncode == 0, p.stderr
            for flag in (a for a in cmd[1:] if a.startswith("--")):
                assert flag in p.stdout, f"{shlex.join(cmd)}: {flag} not among its flags"


def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.skipif(compose_cli() is None, reason="no Docker Compose CLI here (the compose_spec checks above ran)")
@pytest.mark.parametrize("files", [(BASE,), (BASE, GPU)], ids=["cpu", "cpu+gpu-override"])
def test_docker_compose_config(files):
    args = [a for f in files for a in ("-f", str(f))]
    p = subprocess.run([*compose_cli(), *args, "config", "-q"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
