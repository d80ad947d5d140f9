"""What the tests (and the benchmarks, bench/common.py) share, in one place: the services as real processes on
free localhost ports, greedy generation, memory readers, an in-process engine. The fixtures are in conftest.py."""
from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import subprocess
import sys
import time

import grpc

TESTS = pathlib.Path(__file__).resolve().parent  # the helpers beside this file, on sys.path (conftest.py)
ROOT = TESTS.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from protos import generate_pb2, generate_pb2_grpc  # noqa: E402

# the GPU service's --device in every test that starts it (e.g. MOE_TEST_DEVICE=cuda on a GPU machine:
# scripts/gpu_check.sh); unset, its default (auto)
DEVICE_ARGS = ("--device", os.environ["MOE_TEST_DEVICE"]) if os.environ.get("MOE_TEST_DEVICE") else ()


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


FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                  ("grpc.max_reconnect_backoff_ms", 200)]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 90, channel=None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    # gRPC waits about a second before reconnecting after a refused connect: polled every 0.1 s, it must not
    with channel or grpc.insecure_channel(f"127.0.0.1:{port}", options=FAST_RECONNECT) as ch:
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
                 gpu: bool = True, gpu_env: dict | None = None):
        self.expert_port, self.gpu_port = free_port(), free_port()
        self.gpu_env = gpu_env
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
                     log=self._log("gpu"), env=self.gpu_env, prefix=self.gpu_prefix)

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


class Sharded:
    """N expert services (one per shard) and a GPU service over all of them."""

    def __init__(self, model, tmp, n: int, gpu_args=(), shards: list[str] | None = None, models=None):
        self.model, self.tmp, self.n = str(model), tmp, n
        self.shards = list(shards or [f"{i}/{n}" for i in range(n)])
        self.models = [str(m) for m in (models or [model] * len(self.shards))]
        self.ports = [free_port() for _ in self.shards]
        self.gpu_port, self.starts = free_port(), 0
        self.experts = [self.start_expert(i) for i in range(len(self.shards))]
        for p, proc in zip(self.ports, self.experts):
            wait_healthy(p, proc)
        self.gpu = start("gpu_service", "--model", self.model, "--experts",
                         ",".join(f"127.0.0.1:{p}" for p in self.ports), "--listen", f"127.0.0.1:{self.gpu_port}",
                         "--threads", "1", "--connect-timeout", "10", *DEVICE_ARGS, *gpu_args, log=self.log("gpu"))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.gpu_port}")
        self.stub = generate_pb2_grpc.GenerateServiceStub(self.channel)

    def log(self, name):
        self.starts += 1
        return self.tmp / f"{name}.{self.starts}.log"

    def start_expert(self, i: int) -> subprocess.Popen:
        return start("expert_service", "--model", self.models[i], "--listen", f"127.0.0.1:{self.ports[i]}",
                     "--threads", "1", "--shard", self.shards[i], log=self.log(f"expert{i}"))

    def logs(self) -> str:
        return "".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(self.tmp.glob("*.log")))

    def stop(self):
        with contextlib.suppress(Exception):
            self.channel.close()
        terminate_all([self.gpu, *self.experts])


# -- generation ---------------------------------------------------------------------------------------------
def refused_at_start(module: str, *args: str, timeout: float = 120) -> str:
    """Start `python -m module args...`, expect it to stop with a failure before serving -> its stderr."""
    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode != 0, f"{module} {' '.join(args)} started:\n{r.stderr[-2000:]}"
    return r.stderr


def greedy_request(prompt: str | list[int], n: int, **kw) -> generate_pb2.GenerateRequest:
    """n tokens at temperature 0, EOS ignored; prompt text or token ids."""
    kw.setdefault("sampling", generate_pb2.SamplingParams(temperature=0))
    given = {"prompt": prompt} if isinstance(prompt, str) else {"token_ids": generate_pb2.TokenIds(ids=list(prompt))}
    return generate_pb2.GenerateRequest(**given, max_tokens=n, ignore_eos=True, **kw)


def greedy(stub, prompt: str | list[int], n: int = 16, timeout: float = 300, **kw) -> list[int]:
    """The token ids a greedy Generate streams back."""
    return [t for c in stub.Generate(greedy_request(prompt, n, **kw), timeout=timeout) for t in c.token_ids]


# -- memory ---------------------------------------------------------------------------------------------------
def status_mib(pid: int | str, field: str = "VmRSS") -> float:
    """A memory figure of /proc/PID/status in MiB (VmRSS: resident now; VmHWM: its peak); pid "self" for this one."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


# -- an engine in this process ------------------------------------------------------------------------------
def local_engine(model_dir, fmt: str = "fp32", max_batch: int = 8, max_context: int = 512, dense: str | None = None,
                 **kw):
    """An Engine (started) on model_dir's checkpoint in fp32, its routed experts in this process; dense: the dense
    layers' native weight format (and so the native decode attention), None for torch's."""
    import torch

    from moe_experts.store import load_expert_layers
    from gpu_service.engine.scheduler import Engine
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import Model
    from gpu_service.api.text import TextCodec
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config

    cfg, ckpt = load_config(model_dir), Checkpoint(model_dir)
    model = Model(cfg, ckpt, torch.device("cpu"), torch.float32, dense_format=dense)
    e = Engine(model, LocalExperts(load_expert_layers(cfg, ckpt, fmt, 1)), TextCodec(model_dir), max_batch=max_batch,
               max_context=max_context, **kw)
    e.start()
    return e


def health(port):
    """The service's grpc.health.v1 status, or None when it does not answer."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return None


def wait_for(cond, timeout=30, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise TimeoutError(what)


def scrape(port):
    """The Prometheus metrics on port, by family name."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}
