"""Isolation: no request, peer or shared region can hurt another.

- the native pool: a task's exception reaches the Python caller, and the pool serves the next call;
  the scratch arena gives back what one large call took;
- a hostile shared-memory peer rewriting ids, weights, offsets and sizes while the expert side serves
  it (also under AddressSanitizer): every request answered or refused, no crash, no bad access;
- the engine: an error while stepping one request fails that request alone;
- hostile clients beside a good stream: each gets its status naming the field, the good stream keeps
  exactly its solo tokens;
- an expert service frozen mid-stream (SIGSTOP): requests end with UNAVAILABLE within --expert-timeout,
  SIGCONT brings serving back without restarting the GPU service;
- memory after a long prefill returns to the steady RSS.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

import tiny_models
from harness import ROOT, TESTS, Services, greedy_request, local_engine, status_mib
from moe_core.errors import Status
from moe_kernels import native as native
from moe_experts.kernels import MoELayer
from moe_experts.kernels.torch_moe import TorchMoELayer
from protos import generate_pb2

PEER = TESTS / "hostile_ring_peer.py"
IA, UNAVAILABLE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE


# -- the native thread pool ------------------------------------------------------------------------
@pytest.fixture
def two_pool_threads():
    """Workers besides the caller, so tasks really run on other threads."""
    before = native.init_pool(0)
    native.set_threads(2)
    yield
    native.set_threads(before)


def test_task_error_reaches_the_caller_and_the_pool_serves_the_next_call(two_pool_threads):
    assert native.pool_check(256) == 256
    for fail_from in (0, 1, 100, 255):  # 0: every task throws, the caller's own ones too
        with pytest.raises(RuntimeError, match=r"task \d+ failed"):
            native.pool_check(256, fail_from)
        assert native.pool_check(256) == 256
    # and the kernels still give the right answer afterwards
    torch.manual_seed(0)
    E, I, H, T, k = 8, 64, 128, 5, 2
    gate, up, down = torch.randn(E, I, H) * 0.1, torch.randn(E, I, H) * 0.1, torch.randn(E, H, I) * 0.1
    x, ids, w = torch.randn(T, H), torch.randint(0, E, (T, k), dtype=torch.int32), torch.rand(T, k)
    got = MoELayer(gate, up, down, "bf16", 2).forward(x, ids, w)
    want = TorchMoELayer(gate, up, down, fmt="bf16").forward(x, ids, w)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_scratch_memory_is_given_back_after_a_large_call(two_pool_threads):
    """A long prefill's scratch (here ~170 MB of gate/up and activation rows) is freed after the call,
    not kept for the life of the process."""
    torch.manual_seed(0)
    E, I, H, T, k = 4, 4096, 64, 1024, 4
    op = MoELayer(torch.randn(E, I, H) * 0.05, torch.randn(E, I, H) * 0.05, torch.randn(E, H, I) * 0.05, "bf16", 2)
    x, w = torch.randn(T, H), torch.rand(T, k)
    ids = torch.arange(T * k, dtype=torch.int32).view(T, k) % E
    op.forward(x[:2], ids[:2], w[:2])
    before = status_mib("self") * 2**20
    op.forward(x, ids, w)  # gate/up outputs alone: T*k * 2I * 4 bytes = 134 MB
    assert native.scratch_bytes() < 32 << 20
    assert status_mib("self") * 2**20 - before < 48 << 20


# -- a hostile shared-memory peer ------------------------------------------------------------------
def run_peer(seconds: float, native_path: str | None = None, env: dict | None = None):
    cmd = [sys.executable, str(PEER), "--seconds", str(seconds)]
    if native_path:
        cmd += ["--native", native_path]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stdout + p.stderr[-6000:]
    assert "AddressSanitizer" not in p.stderr, p.stderr[-6000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    # requests were served and refused, and every posted request was answered (deferred ones twice)
    assert out["posted"] >= 20 and out["responses"] >= out["posted"], out
    assert out["statuses"].get("0", 0) > 0 and out["statuses"].get("3", 0) > 0, out
    assert set(out["statuses"]) <= {"0", "3"}, out  # answers and INVALID_ARGUMENT, never INTERNAL
    return out


def test_hostile_ring_peer_cannot_crash_the_expert_side():
    run_peer(4)


@pytest.fixture(scope="session")
def asan_native(tmp_path_factory) -> str:
    """The native library built with AddressSanitizer (setup.py's MOE_ASAN=1 switch)."""
    out = tmp_path_factory.mktemp("asan")
    p = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(out / "lib"), "--build-temp",
                        str(out / "tmp")], cwd=ROOT, capture_output=True, text=True, timeout=2700,
                       env={**os.environ, "MOE_ASAN": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    (so,) = (out / "lib" / "moe_kernels").glob("_native*.so")
    return str(so)


def asan_env() -> dict:
    gcc = lambda name: subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True,  # noqa: E731
                                      text=True).stdout.strip()
    # libstdc++ too: a python binary does not link it, and ASan's __cxa_throw interceptor needs it
    preload = f"{gcc('libasan.so')} {gcc('libstdc++.so')}"
    assert all(os.path.exists(p) for p in preload.split()), preload
    return {"LD_PRELOAD": preload, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1"}


# the ASan build (its fixture) is part of the first test's time: 3 minutes on the 2-core AMX Xeon (was 12 with every
# row-blocked format in one file and GCC's variable tracking on; setup.py)
@pytest.mark.asan
@pytest.mark.timeout(3000)
def test_hostile_ring_peer_under_address_sanitizer(asan_native):
    run_peer(6, asan_native, asan_env())


@pytest.mark.asan
@pytest.mark.timeout(3000)
def test_damaged_exchange_messages_under_address_sanitizer(asan_native):
    """The native wire reader (native/exchange/wire.cpp) on cut, flipped and stretched messages, the ones it takes
    computed: no out-of-bounds access."""
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "hostile_wire_bytes.py"), "--native", asan_native,
                        "--n", "3000"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, **asan_env()})
    assert p.returncode == 0 and "AddressSanitizer" not in p.stderr, p.stderr[-6000:]
    assert int(p.stdout.split()[-1]) > 300, p.stdout  # messages taken and computed


# -- the engine: one request's failure is its own --------------------------------------------------
@pytest.fixture(scope="module")
def engine(checkpoints):
    e = local_engine(checkpoints["qwen3_moe"])
    yield e
    e.stop()


def submit(engine, prompt, n=12, **kw):
    from gpu_service.engine.scheduler import Request
    from gpu_service.engine.sampling import SamplingParams

    done, events = threading.Event(), []

    def emit(ev):
        events.append(ev)
        if not hasattr(ev, "finish_reason") or ev.finish_reason:
            done.set()

    r = Request(prompt_ids=list(prompt), emit=emit, max_tokens=n, sampling=SamplingParams(temperature=0),
                ignore_eos=True, **kw)
    return r, done, events


def outcome(done, events):
    assert done.wait(60)
    from gpu_service.engine.scheduler import Failure
    return events[-1] if isinstance(events[-1], Failure) else [t for ev in events for t in ev.token_ids]


def test_a_failing_request_does_not_fail_its_batch(engine, monkeypatch):
    from gpu_service.engine import scheduler as engine_mod

    prompts = [(5, 9, 17), (3, 4, 5, 6), (7, 8)]
    solo = []
    for p in prompts:
        r, done, ev = submit(engine, p)
        engine.submit(r)
        solo.append(outcome(done, ev))
    real_sample, real_forward = engine_mod.sample, engine.model.forward
    bad_sample, bad_forward = (1, 1, 1, 1), (2, 2, 2)

    def sample(logits, params, gen, *history):  # sampling fails for one request only
        if getattr(params, "poison", False):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_sample(logits, params, gen, *history)

    def forward(segs, *a, **kw):  # the forward pass fails whenever one request is in the batch
        if any(tuple(s.tokens.tolist()) == bad_forward for s in segs):
            raise RuntimeError("forward blew up on a bad input")
        return real_forward(segs, *a, **kw)

    monkeypatch.setattr(engine_mod, "sample", sample)
    monkeypatch.setattr(engine.model, "forward", forward)
    reqs = [submit(engine, p) for p in [*prompts, bad_sample, bad_forward]]
    reqs[3][0].sampling.poison = True
    for r, _, _ in reqs:  # all in one step: the engine admits everything waiting
        engine.submit(r)
    got = [outcome(done, ev) for _, done, ev in reqs]
    assert got[:3] == solo
    for bad in got[3:]:
        assert bad.status == Status.INTERNAL and "internal error" in bad.message


# -- hostile clients beside a good stream ----------------------------------------------------------
def tokens(stub, req, timeout=120):
    return [t for c in stub.Generate(req, timeout=timeout) for t in c.token_ids]


def negative_max_tokens() -> bytes:
    """GenerateRequest{prompt: "hi", max_tokens: -3} as a client with int fields would encode it: a
    10-byte varint, which a uint32 field reads as 4294967293."""
    varint, v = b"", (-3) % 2**64
    while v >= 0x80:
        varint += bytes([v & 0x7F | 0x80])
        v >>= 7
    return b"\x0a\x02hi" + b"\x20" + varint + bytes([v])


def test_hostile_requests_leave_a_concurrent_stream_alone(checkpoints, tmp_path):
    s = Services(checkpoints["deepseek_v3"], tmp_path)
    try:
        good = greedy_request((5, 9, 17, 33, 2, 8), 60)
        solo = tokens(s.stub, good)
        sp = generate_pb2.SamplingParams
        hostile = {  # name -> (request or raw bytes, expected code or None for OK, text in the message)
            "denormal temperature": (greedy_request((4, 5), 8, sampling=sp(temperature=1e-39)), None, ""),
            "temperature 1e-40, top-k 1": (greedy_request((4, 5), 8, sampling=sp(temperature=1e-40, top_k=1)), None, ""),
            "top-p 1e-45": (greedy_request((4, 5), 8, sampling=sp(temperature=1.0, top_p=1e-45, seed=1)), None, ""),
            "temperature inf": (greedy_request((4, 5), 8, sampling=sp(temperature=float("inf"))), IA, "sampling.temperature"),
            "prompt past the context": (greedy_request([7] * 600, 4), IA, "context limit"),
            "negative max-tokens": (negative_max_tokens(), IA, "max_tokens"),
            "deferral above k": (greedy_request((4, 5), 4, defer=99), IA, "defer"),
            "malformed bytes": (b"\xff\xff\xff\x01", IA, "could not be parsed"),
        }
        raw = s.channel.unary_stream("/moe.v1.GenerateService/Generate", request_serializer=None,
                                     response_deserializer=generate_pb2.GenerateChunk.FromString)

        def attack(name):
            req, code, text = hostile[name]
            for _ in range(3):
                try:
                    if isinstance(req, bytes):
                        list(raw(req, timeout=60))
                    else:
                        tokens(s.stub, req, timeout=60)
                    got = None
                except grpc.RpcError as e:
                    got = e
                if code is None:
                    assert got is None, f"{name}: {got}"
                else:
                    assert got is not None and got.code() == code and text in got.details(), f"{name}: {got}"

        def hang_up():  # a client that goes away mid-stream, three times
            for _ in range(3):
                call = s.stub.Generate(greedy_request((6, 7), 200), timeout=60)
                next(call), next(call)
                call.cancel()

        with concurrent.futures.ThreadPoolExecutor(len(hostile) + 2) as ex:
            fut_good = ex.submit(tokens, s.stub, good)
            time.sleep(0.2)  # the good stream is running before the others arrive
            futs = [ex.submit(attack, n) for n in hostile] + [ex.submit(hang_up)]
            for f in futs:
                f.result()
            assert fut_good.result() == solo
        assert tokens(s.stub, good) == solo  # and it keeps serving
        assert s.gpu.poll() is None and s.expert.poll() is None
    finally:
        s.stop()


# -- a frozen expert service -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_frozen_expert_service_fails_requests_within_the_deadline(checkpoints, tmp_path, transport):
    s = Services(checkpoints["deepseek_v3"], tmp_path, gpu_args=("--expert-timeout", "2", "--transport", transport))
    try:
        req = greedy_request((5, 9, 17), 400)
        before = tokens(s.stub, greedy_request((5, 9, 17), 20))
        call = s.stub.Generate(req, timeout=120)
        next(call)
        os.kill(s.expert.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            for _ in call:
                pass
        waited = time.monotonic() - t0
        assert e.value.code() == UNAVAILABLE and f"127.0.0.1:{s.expert_port}" in e.value.details(), e.value
        assert waited < 2 + 0.01 * 20 + 3, waited  # the deadline (with its per-token allowance) plus slack
        # while frozen, new requests end with UNAVAILABLE too, never hang
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            tokens(s.stub, greedy_request((5, 9, 17), 20), timeout=30)
        assert e.value.code() == UNAVAILABLE and time.monotonic() - t0 < 10
        os.kill(s.expert.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:  # the GPU service sees its expert service healthy again and serves
            try:
                assert tokens(s.stub, greedy_request((5, 9, 17), 20), timeout=30) == before
                break
            except grpc.RpcError as err:
                assert err.code() == UNAVAILABLE and time.monotonic() < deadline, err
                time.sleep(0.5)
        assert s.starts == 2  # one expert and one GPU service start: nothing was restarted
    finally:
        if s.expert.poll() is None:
            os.kill(s.expert.pid, signal.SIGCONT)
        s.stop()


# -- memory after a long prefill ---------------------------------------------------------------------
@pytest.mark.slow
def test_memory_returns_to_steady_after_a_long_prefill(tmp_path):
    d = tiny_models.build("deepseek_v3", tmp_path / "long", max_position_embeddings=16384)
    s = Services(d, tmp_path, expert_args=("--max-tokens", "8192"))
    try:
        for _ in range(2):  # warm up: steady state of a short request and 100 decode steps
            tokens(s.stub, greedy_request([5, 9, 17, 33] * 4, 100))
        steady = {p: status_mib(p.pid) * 2**20 for p in (s.gpu, s.expert)}
        long = tokens(s.stub, greedy_request([(i * 7) % 300 + 2 for i in range(8192)], 100), timeout=600)
        assert len(long) == 100
        tokens(s.stub, greedy_request([5, 9, 17, 33] * 4, 100))
        after = {p: status_mib(p.pid) * 2**20 for p in (s.gpu, s.expert)}
        for p, name in ((s.gpu, "gpu"), (s.expert, "expert")):
            assert after[p] <= 1.10 * steady[p], f"{name} service: {steady[p] / 2**20:.0f} MiB -> {after[p] / 2**20:.0f} MiB"
    finally:
        s.stop()
