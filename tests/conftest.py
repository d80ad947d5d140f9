"""Shared fixtures: tiny checkpoints (built once per session) and both services as real
processes on free localhost ports."""
from __future__ import annotations

import atexit
import contextlib
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import tiny_models  # noqa: E402

from protos import generate_pb2_grpc  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the GPU service's --device in every test that starts it (e.g. MOE_TEST_DEVICE=cuda on a GPU machine:
# scripts/gpu_check.sh); unset, its default (auto)
DEVICE_ARGS = ("--device", os.environ["MOE_TEST_DEVICE"]) if os.environ.get("MOE_TEST_DEVICE") else ()
# the services' packed-weight cache: one per test session, never the user's ~/.cache
if "MOE_CACHE_DIR" not in os.environ:
    os.environ["MOE_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MOE_CACHE_DIR"], True)


_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now and never handed out before in this run: the kernel can give the same free
    port to two calls in a row, and the first may be bound only after the second call (CI once had the GPU
    service on its own expert service's port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> fp32 checkpoint dir; deepseek_v3 is split into 3 shards with an index."""
    base = tmp_path_factory.mktemp("ckpt")
    return {f: tiny_models.build(f, base / f, shards=3 if f == "deepseek_v3" else 1) for f in tiny_models.FAMILIES}


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 90, channel=None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with channel or grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"service on {port} exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"service on {port} not healthy after {timeout}s")


def start(module: str, *args: str, log: pathlib.Path, env: dict | None = None, prefix=()) -> subprocess.Popen:
    f = open(log, "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([*prefix, sys.executable, "-m", module, *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=env)


class Services:
    def __init__(self, model_dir, tmp: pathlib.Path, gpu_args=(), expert_args=(), gpu_prefix=(), expert_prefix=(),
                 gpu: bool = True):
        self.expert_port, self.gpu_port = free_port(), free_port()
        self.model_dir, self.tmp = str(model_dir), tmp
        self.gpu_args, self.expert_args = gpu_args, expert_args
        self.gpu_prefix, self.expert_prefix = gpu_prefix, expert_prefix
        self.starts = 0
        self.expert = self.start_expert()
        self.gpu = self.start_gpu() if gpu else None  # None: the expert service alone
        try:
            wait_healthy(self.expert_port, self.expert)
            if self.gpu is not None:
                wait_healthy(self.gpu_port, self.gpu)
        except Exception:
            self.stop()
            raise RuntimeError(f"services failed to start:\n{self.logs()}")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.gpu_port}",
                                             options=[("grpc.max_receive_message_length", -1)])  # Score logits
        self.stub = generate_pb2_grpc.GenerateServiceStub(self.channel)

    def _log(self, name: str) -> pathlib.Path:
        self.starts += 1
        return self.tmp / f"{name}.{self.starts}.log"

    def start_expert(self) -> subprocess.Popen:
        return start("expert_service", "--model", self.model_dir, "--listen", f"127.0.0.1:{self.expert_port}",
                     "--threads", "1", *self.expert_args, log=self._log("expert"), prefix=self.expert_prefix)

    def start_gpu(self) -> subprocess.Popen:
        return start("gpu_service", "--model", self.model_dir, "--experts", f"127.0.0.1:{self.expert_port}",
                     "--listen", f"127.0.0.1:{self.gpu_port}", "--threads", "1", *DEVICE_ARGS, *self.gpu_args,
                     log=self._log("gpu"),
                     prefix=self.gpu_prefix)

    def logs(self) -> str:
        return "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(self.tmp.glob("*.log")))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.channel.close()
        terminate_all([p for p in (self.gpu, self.expert) if p is not None])


def terminate_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each (they drain and exit), then SIGKILL whatever is still up after 10 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture
def services_factory(tmp_path):
    started = []

    def make(model_dir, **kw):
        d = tmp_path / f"svc{len(started)}"
        d.mkdir()
        s = Services(model_dir, d, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
