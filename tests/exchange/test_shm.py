"""The shared-memory data path: same tokens as gRPC, every offset checked, nothing left in /dev/shm."""
from __future__ import annotations

import os
import signal
import struct
import time

import grpc
import pytest
import torch

from harness import Services
from moe_kernels import native as native
from moe_experts.kernels import MoELayer
from moe_exchange.dispatch import ExpertServiceError, RemoteExperts
from moe_exchange.channel import ShmChannel
from moe_exchange import shm
from moe_core.routing import split_deferred
from protos import expert_pb2, expert_pb2_grpc, generate_pb2
from tiers import some

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="needs /dev/shm")


def leftovers(pid: int | None = None) -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if shm.NAME_RE.match(n) and (pid is None or f"-{pid}-" in n)]


def generate(stub, prompt=(5, 9, 17, 33, 2, 8), n=16, defer=0):
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=list(prompt)), max_tokens=n,
                                       ignore_eos=True, defer=defer, sampling=generate_pb2.SamplingParams(temperature=0))
    return [t for c in stub.Generate(req, timeout=120) for t in c.token_ids]


def expert_info(port: int) -> expert_pb2.ExpertInfo:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return expert_pb2_grpc.ExpertServiceStub(ch).Info(expert_pb2.ExpertInfoRequest(), timeout=5)


# -- the native part entry the ring uses, against the torch split + forward ----------------------
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("defer", [0, 1, 3])
def test_native_part_matches_split(hidden_dtype, defer):
    torch.manual_seed(0)
    E, I, H, T, k = 8, 40, 96, 7, 4
    op = MoELayer(torch.randn(E, I, H) * 0.1, torch.randn(E, I, H) * 0.1, torch.randn(E, H, I) * 0.1, "bf16", 1)
    if not hasattr(op, "forward_part"):
        pytest.skip("native kernels not built")
    x = torch.randn(T, H).to(hidden_dtype)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)
    w = torch.rand(T, k)
    w[0, 1] = w[0, 2]  # a tie: the earlier slot stays immediate, as in split_deferred
    parts = [(ids, w)] if defer == 0 else [split_deferred(ids, w, defer)[:2], split_deferred(ids, w, defer)[2:]]
    for part, (p_ids, p_w) in enumerate(parts):
        out = torch.full((T, H), float("nan"), dtype=hidden_dtype)
        op.forward_part(x.data_ptr(), hidden_dtype == torch.bfloat16, ids.data_ptr(), w.data_ptr(), out.data_ptr(),
                        hidden_dtype == torch.bfloat16, T, k, defer, part)
        assert torch.equal(out, op.forward(x, p_ids.contiguous(), p_w.contiguous()))


def test_native_part_refuses_bad_values():
    E, I, H = 4, 16, 64
    op = MoELayer(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I), "bf16", 1)
    if not hasattr(op, "forward_part"):
        pytest.skip("native kernels not built")
    x, out = torch.randn(1, H), torch.empty(1, H)
    ids, w = torch.tensor([[0, 3]], dtype=torch.int32), torch.rand(1, 2)

    def run(x=x, ids=ids, w=w, defer=0, part=0):
        op.forward_part(x.data_ptr(), False, ids.data_ptr(), w.data_ptr(), out.data_ptr(), False, 1, 2, defer, part)

    run()
    for bad, what in [(dict(ids=torch.tensor([[0, 4]], dtype=torch.int32)), "expert id"),
                      (dict(w=torch.tensor([[0.5, float("nan")]])), "topk_weights"),
                      (dict(x=torch.full((1, H), float("inf"))), "hidden"), (dict(defer=2), "defer"),
                      (dict(part=1), "deferred part")]:
        with pytest.raises(ValueError, match=what):
            run(**bad)


# -- whole services --------------------------------------------------------------------------------
# torch operator (generic ring path) / native entry
@pytest.mark.parametrize("weight_format", some(["fp32", "bf16"], fast=["fp32"]))
def test_shm_and_grpc_give_identical_tokens(weight_format, checkpoints, services_factory):
    d = checkpoints["deepseek_v3"]
    got = {}
    for transport in ("grpc", "shm"):
        s = services_factory(d, gpu_args=("--transport", transport), expert_args=("--weight-format", weight_format))
        info = s.stub.Info(generate_pb2.ServerInfoRequest(), timeout=5)
        assert info.transport == transport
        assert expert_info(s.expert_port).shm_sessions == (transport == "shm")
        got[transport] = [generate(s.stub, defer=defer) for defer in (0, 2)]
        s.stop()
    assert got["shm"] == got["grpc"]
    if weight_format == "fp32":
        assert got["shm"][0] != got["shm"][1]  # deferral did change something, on both paths alike


@pytest.mark.slow
@pytest.mark.parametrize("spin", ["yield", "never"])
def test_every_wait_policy_gives_the_same_tokens(spin, checkpoints, services_factory, monkeypatch):
    """MOE_SPIN=yield (waits give the core away between polls) and never (they sleep at once): the hand-overs
    through the ring and the kernel pool's phases lose nothing, as with the default policy."""
    d = checkpoints["qwen3_moe"]
    s = services_factory(d, gpu_args=("--transport", "shm"), expert_args=("--weight-format", "bf16", "--threads", "2"))
    want = [generate(s.stub, defer=defer) for defer in (0, 1)]
    s.stop()
    monkeypatch.setenv("MOE_SPIN", spin)
    s = services_factory(d, gpu_args=("--transport", "shm"), expert_args=("--weight-format", "bf16", "--threads", "2"))
    assert [generate(s.stub, defer=defer) for defer in (0, 1)] == want


def test_busy_programs_make_the_waits_stop_yielding():
    """Two busy programs beside us (more CPU than the machine's noise, not ours): within a few sample windows
    the waits treat the machine as shared and spin/sleep instead of yielding (native/runtime/contention.h)."""
    import subprocess
    import sys
    import time

    from moe_kernels import native

    def settles(want: bool, within: float = 10) -> bool:
        until = time.monotonic() + within
        while time.monotonic() < until:
            if native.machine_shared() == want:
                return True
            time.sleep(0.05)
        return False

    assert settles(False)  # the test machine alone (the tests run one at a time): quiet, waits yield
    before = native.contention_stats()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        assert settles(True)
        during = native.contention_stats()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert settles(False)
    # what the metrics export (moe_core/metrics.py WaitPolicy) saw it too
    assert during["shared"] and during["turned_shared"] > before["turned_shared"]
    assert during["foreign_windows"] > before["foreign_windows"] and during["windows"] > before["windows"]


@pytest.mark.slow
def test_mixed_channels_and_oversize_requests_keep_order(checkpoints, tmp_path):
    """Requests that do not fit a slot go over gRPC while others use the ring; results still come back
    per layer and part, equal to the gRPC-only path."""
    d = checkpoints["qwen3_moe"]
    s = Services(d, tmp_path, gpu=False)
    try:
        fp = expert_info(s.expert_port).model_fingerprint
        torch.manual_seed(1)
        big, small = 700, 3  # 700 tokens do not fit a 1 MiB region's slot
        reqs = [(1, torch.randn(big, 64), big), (2, torch.randn(small, 64), small), (0, torch.randn(small, 64), small)]
        outs = {}
        for transport in ("grpc", "shm"):
            ex = RemoteExperts(f"127.0.0.1:{s.expert_port}", fp, 64 << 20, transport=transport, shm_bytes=1 << 20)
            assert ex.start_transport() == transport
            res = []
            for step in range(2):
                pending = None
                for layer, x, T in reqs:
                    torch.manual_seed(100 + step * 10 + layer)
                    ids = torch.stack([torch.randperm(8)[:2] for _ in range(T)]).to(torch.int32)
                    w = torch.rand(T, 2)
                    ex.submit(step, layer, x, ids, w, 1)
                    if pending is not None:
                        res.append(ex.result(pending, deferred=True))
                    res.append(ex.result(layer, deferred=False))
                    pending = layer
                res.append(ex.result(pending, deferred=True))
            if transport == "shm":
                assert ex.shm is not None and ex.shm.posted == 4  # the small ones went through the ring
            ex.close()
            outs[transport] = res
        assert len(outs["shm"]) == len(outs["grpc"]) == 12
        for a, b in zip(outs["shm"], outs["grpc"]):
            assert torch.equal(a, b)
    finally:
        s.stop()


# -- the region's checks ---------------------------------------------------------------------------
@pytest.fixture
def expert_alone(checkpoints, tmp_path):
    s = Services(checkpoints["deepseek_v3"], tmp_path, gpu=False, expert_args=("--weight-format", "bf16"))
    ch = grpc.insecure_channel(f"127.0.0.1:{s.expert_port}")
    yield s, expert_pb2_grpc.ExpertServiceStub(ch)
    ch.close()
    s.stop()


def open_raw(stub, name, size, nonce):
    call = stub.OpenShm(expert_pb2.ShmOpen(name=name, size=size, nonce=nonce), timeout=10)
    return next(call)


@pytest.mark.slow
def test_registration_is_checked(expert_alone):
    _, stub = expert_alone
    name, nonce, mm = shm.create(1 << 20)
    try:
        cases = [("../../etc/passwd", 1 << 20, nonce, grpc.StatusCode.INVALID_ARGUMENT, "not a region name"),
                 ("moe-shm-1-0123456789abcdef", 1 << 20, nonce, grpc.StatusCode.NOT_FOUND, "no region"),
                 (name, 2 << 20, nonce, grpc.StatusCode.INVALID_ARGUMENT, "size"),
                 (name, 1 << 40, nonce, grpc.StatusCode.INVALID_ARGUMENT, "outside"),
                 (name, 1 << 20, b"x" * 16, grpc.StatusCode.INVALID_ARGUMENT, "nonce")]
        for n, size, nc, code, text in cases:
            with pytest.raises(grpc.RpcError) as e:
                open_raw(stub, n, size, nc)
            assert e.value.code() == code and text in e.value.details(), (n, e.value.details())
        os.chmod(os.path.join(shm.SHM_DIR, name), 0o644)  # readable by others: refused
        with pytest.raises(grpc.RpcError) as e:
            open_raw(stub, name, 1 << 20, nonce)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "owner-only" in e.value.details()
        assert name in leftovers()  # refused registrations leave the name to its creator
    finally:
        mm.close()
        shm.unlink(name)
    assert oct(os.stat(shm.SHM_DIR).st_mode)  # /dev/shm itself untouched


@pytest.mark.slow
def test_region_is_owner_only_and_unlinked_once_served(expert_alone):
    _, stub = expert_alone
    ch = ShmChannel(stub, (), 1 << 20)
    try:
        assert ch.name not in leftovers()  # unlinked as soon as the expert service mapped it
        assert ch.layout.size == len(ch.mm)
    finally:
        ch.close()
    name, _, mm = shm.create(1 << 20)
    try:
        assert os.stat(os.path.join(shm.SHM_DIR, name)).st_mode & 0o777 == 0o600
    finally:
        mm.close()
        shm.unlink(name)


def raw_request(ch: ShmChannel, layer=1, T=1, k=4, defer=0, **spans):
    """Write one request descriptor by hand (offsets chosen by the test) and ring; -> response fields."""
    seq = ch.posted
    base = ch.layout.block(seq)
    H = 64
    ids = torch.tensor([[0, 5, 9, 15]] * T, dtype=torch.int32)  # the data is for k=4; k may lie
    w = torch.rand(T, 4)
    x = torch.randn(T, H)
    ch.buf[base: base + T * H * 4].view(torch.float32).copy_(x.view(-1))
    ch.buf[base + 4096: base + 4096 + T * 16].view(torch.int32).copy_(ids.view(-1))
    ch.buf[base + 8192: base + 8192 + T * 16].view(torch.float32).copy_(w.view(-1))
    s = dict(hidden=(base, T * H * 4), ids=(base + 4096, T * k * 4), w=(base + 8192, T * k * 4),
             out=(base + 12288, T * H * 4), dout=(base + 16384, T * H * 4))
    s.update(spans)
    shm.REQ_DESC.pack_into(ch.mm, shm.Layout.req_desc(seq), seq, 0, layer, T, k, defer, 1,  # 1 = FLOAT32
                           *s["hidden"], *s["ids"], *s["w"], *s["out"], *s["dout"])
    ch.posted += 1
    ch.expect.append((seq, layer, False))
    if defer:
        ch.expect.append((seq, layer, True))
    native.doorbell_ring(ch.mm, shm.REQ_SEQ, ch.posted & 0xFFFFFFFF)


def test_bad_offsets_and_sizes_are_refused_and_the_ring_goes_on(expert_alone):
    s, stub = expert_alone
    ch = ShmChannel(stub, (), 1 << 20)
    L = ch.layout
    try:
        bad = [dict(hidden=(L.size, 256)), dict(hidden=(L.size - 128, 256)), dict(hidden=(0, 256)),
               dict(hidden=(2**64 - 1, 256)), dict(out=(2**63, 256)), dict(ids=(L.data_start, 2**64 - 1)),
               dict(hidden=(L.data_start, 255)), dict(w=(L.size - 8, 16)), dict(layer=0), dict(defer=4),
               dict(dout=(1 << 30, 256), defer=1), dict(k=0)]
        for spans in bad:
            raw_request(ch, **spans)
            with pytest.raises(Exception) as e:
                ch.result(spans.get("layer", 1), False, (1, 64), torch.float32)
            assert getattr(e.value, "code", None) == grpc.StatusCode.INVALID_ARGUMENT, (spans, e.value)
            ch.expect.clear()
            ch.consumed += 1
            struct.pack_into("<I", ch.mm, shm.RESP_READ, ch.consumed)
        # after all that, a good request is served on the same ring
        raw_request(ch)
        y, timing = ch.result(1, False, (1, 64), torch.float32)
        assert torch.isfinite(y).all() and y.abs().sum() > 0 and timing.compute_us >= 0
        assert expert_info(s.expert_port).shm_sessions == 1
    finally:
        ch.close()


# -- lifecycle: kill either side, nothing left behind -------------------------------------------------
def test_no_leftovers_after_killing_either_process(checkpoints, services_factory):
    s = services_factory(checkpoints["deepseek_v3"], gpu_args=("--transport", "shm"))
    want = generate(s.stub)
    gpu_pid = s.gpu.pid
    assert not leftovers(gpu_pid)
    s.expert.send_signal(signal.SIGKILL)
    s.expert.wait(10)
    assert not leftovers(gpu_pid)
    s.expert = s.start_expert()  # the GPU service reconnects, over shared memory again
    deadline = time.monotonic() + 60
    while True:
        try:
            assert generate(s.stub) == want
            break
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    assert expert_info(s.expert_port).shm_sessions == 1
    s.gpu.send_signal(signal.SIGKILL)
    s.gpu.wait(10)
    assert not leftovers(gpu_pid)
    deadline = time.monotonic() + 10  # the expert service notices the lifeline broke and unmaps
    while expert_info(s.expert_port).shm_sessions and time.monotonic() < deadline:
        time.sleep(0.2)
    assert expert_info(s.expert_port).shm_sessions == 0


def test_stale_regions_of_dead_creators_are_swept():
    dead = 2**22 + 12345  # above pid_max's default: no such process
    name = f"moe-shm-{dead}-0123456789abcdef"
    fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    assert shm.sweep_stale() >= 1
    assert name not in leftovers()


@pytest.mark.slow
def test_auto_falls_back_to_grpc_and_shm_fails_loudly(checkpoints, services_factory, tmp_path):
    d = checkpoints["deepseek_v3"]
    s = services_factory(d, expert_args=("--shm-max-mb", "0"))  # gpu: --transport auto (default)
    assert s.stub.Info(generate_pb2.ServerInfoRequest(), timeout=5).transport == "grpc"
    assert len(generate(s.stub)) == 16
    ex = RemoteExperts(f"127.0.0.1:{s.expert_port}", expert_info(s.expert_port).model_fingerprint, 1 << 20,
                       transport="shm")
    with pytest.raises(ExpertServiceError) as e:
        ex.start_transport()
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "--shm-max-mb" in str(e.value)
    ex.close()


def test_python_and_cpp_agree_on_the_ring_layout():
    """moe_exchange/shm.py and native/exchange/ring.h describe the same bytes."""
    c = native.ring_layout()
    assert (c["REQ_SEQ"], c["RESP_SEQ"], c["RESP_READ"], c["CLOSED"]) == (shm.REQ_SEQ, shm.RESP_SEQ, shm.RESP_READ,
                                                                          shm.CLOSED)
    assert (c["DESC_START"], c["REQ_SLOTS"], c["RESP_SLOTS"]) == (shm.DESC_START, shm.REQ_SLOTS, shm.RESP_SLOTS)
    assert (c["REQ_DESC_SIZE"], c["RESP_DESC_SIZE"], c["MSG_MAX"]) == (shm.REQ_DESC_SIZE, shm.RESP_DESC_SIZE,
                                                                       shm.MSG_MAX)
    assert (c["REQ_DESC_BYTES"], c["RESP_DESC_BYTES"]) == (shm.REQ_DESC.size, shm.RESP_DESC.size)
    assert c["DATA_START"] == shm.Layout(1 << 20).data_start and c["SPAN_ALIGN"] == shm.SPAN_ALIGN
    assert (c["OK"], c["INVALID_ARGUMENT"], c["INTERNAL"]) == (shm.OK, shm.INVALID_ARGUMENT, shm.INTERNAL) == tuple(
        code.value[0] for code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL))


@pytest.mark.slow
def test_two_sessions_at_once_are_served_independently(expert_alone):
    """Two GPU-side processes (here two channels in threads) on one expert service: each ring gets its
    own answers, computed one at a time on the shared kernels."""
    import concurrent.futures

    s, stub = expert_alone
    chans = [ShmChannel(stub, (), 1 << 20) for _ in range(2)]
    try:
        assert expert_info(s.expert_port).shm_sessions == 2

        def run(ch, seed):
            g = torch.Generator().manual_seed(seed)
            outs = []
            for step in range(30):
                x = torch.randn(2, 64, generator=g)
                ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(2)]).to(torch.int32)
                w = torch.rand(2, 4, generator=g)
                ch.submit(step, 1 + step % 2, x, ids, w, 1)
                outs.append(ch.result(1 + step % 2, False, (2, 64), torch.float32)[0]
                            + ch.result(1 + step % 2, True, (2, 64), torch.float32)[0])
            return outs

        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            together = list(ex.map(run, chans, (1, 2)))
        alone = [run(chans[0], 1), run(chans[1], 2)]
        for a, b in zip(together, alone):
            assert all(torch.equal(p, q) for p, q in zip(a, b))
        assert not all(torch.equal(p, q) for p, q in zip(together[0], together[1]))
    finally:
        for ch in chans:
            ch.close()


NAP_PROBE = r"""
import mmap, os, sys, threading, time
from moe_kernels import native
os.sched_setaffinity(0, {int(sys.argv[1])})
buf = mmap.mmap(-1, 4096)
if sys.argv[2] == "ring":  # rung 200 ms into the wait: -> (the value, seconds waited)
    threading.Timer(0.2, native.doorbell_ring, (buf, 0, 7)).start()
t0, c0 = time.perf_counter(), time.thread_time()
v = native.doorbell_wait(buf, 0, 0, 300_000 if sys.argv[2] == "idle" else 5_000_000, 5_000_000)  # spin it all
print(v, time.perf_counter() - t0, (time.thread_time() - c0) / (time.perf_counter() - t0))
"""


def nap_probe(mode: str, nap_us: str | None = None) -> tuple[int, float, float]:
    """The probe alone on one CPU with yielding waits: -> (value, seconds waited, the waiting thread's CPU share)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MOE_YIELD_NAP_US"} | {"MOE_SPIN": "yield"}
    if nap_us is not None:
        env["MOE_YIELD_NAP_US"] = nap_us
    out = subprocess.run([sys.executable, "-c", NAP_PROBE, str(max(os.sched_getaffinity(0))), mode], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), float(out[1]), float(out[2])


def test_a_yielding_wait_naps_when_its_yields_come_straight_back():
    """Alone on a CPU (its yields come straight back, as they do when the scheduler keeps picking the waiter over a
    thread that needs the core), a yielding wait sleeps part of the time (contention.h YIELD_NAP_AFTER_NS); with
    MOE_YIELD_NAP_US=0 it holds the core throughout."""
    (_, waited, napping), (_, _, holding) = nap_probe("idle"), nap_probe("idle", "0")
    assert 0.29 < waited < 0.6, waited  # the spin phase ends at the wait's timeout (300 ms of 5 s)
    assert napping < 0.85, napping  # ~50 us of yields, then a 30 us nap
    assert holding > napping + 0.1, (holding, napping)


def test_a_ring_wakes_a_napping_wait_at_once():
    """A wait between naps (on its futex) returns as soon as the word is rung, not at a nap's or the wait's end."""
    value, waited, _ = nap_probe("ring")
    assert value == 7 and 0.19 < waited < 0.5, (value, waited)
