"""Exchange round trip per MoE layer, gRPC vs shared memory, against a real expert service process.

    python bench/bench_exchange.py [--hidden 7168] [--n 500]

Builds a one-MoE-layer DeepSeek-V3 checkpoint with the given hidden size (bf16, tiny experts so the
compute inside the round trip is small), starts the expert service pinned to core 1, pins this
client to core 0, and sends T=1 layer requests (top-8) one at a time. Per transport it reports the
median round trip, the expert compute the service measured inside it, and their difference: what
the transport itself costs per layer. Targets (issue #4): gRPC <= 150 us, shm <= 20 us.

The baseline measured in the same run: grpcio's own floor, a bidirectional stream that echoes bytes
of the request's size (an asyncio server on uvloop pinned to core 1, like the expert service, and the
same synchronous client): what any Python grpcio exchange costs here before our code does anything.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from moe_core import codec  # noqa: E402
from protos import expert_pb2, expert_pb2_grpc  # noqa: E402

WARMUP = 50


def grpc_rtt(stub, layer, x, ids, w, n) -> tuple[list[float], list[float]]:
    """-> (round trip us, compute us) over one Exchange stream."""
    q: queue.Queue = queue.Queue()
    responses = stub.Exchange(iter(q.get, None))
    req = expert_pb2.LayerRequest(layer=layer, hidden=codec.encode(x), topk_ids=codec.encode(ids),
                                  topk_weights=codec.encode(w))
    rtt, compute = [], []
    for i in range(n + WARMUP):
        t0 = time.perf_counter()
        q.put(req)
        r = next(responses)
        y = codec.decode(r.output, "output")
        dt = (time.perf_counter() - t0) * 1e6
        if i >= WARMUP:
            rtt.append(dt)
            compute.append(r.timing.compute_us)
    q.put(None)
    assert y.shape == x.shape
    return rtt, compute


def shm_rtt(stub, layer, x, ids, w, n) -> tuple[list[float], list[float]]:
    from gpu_service.shm_channel import ShmChannel

    ch = ShmChannel(stub, (), 16 << 20)
    rtt, compute = [], []
    try:
        for i in range(n + WARMUP):
            t0 = time.perf_counter()
            ch.submit(i, layer, x, ids, w, 0)
            y, timing = ch.result(layer, False, tuple(x.shape), x.dtype)
            dt = (time.perf_counter() - t0) * 1e6
            if i >= WARMUP:
                rtt.append(dt)
                compute.append(timing.compute_us)
    finally:
        ch.close()
    assert y.shape == x.shape
    return rtt, compute


def echo_server(port: int) -> None:
    """grpcio's floor: a generic bidi stream echoing raw bytes, no protobuf, no work."""
    import uvloop

    async def echo(requests, context):
        async for m in requests:
            yield m

    async def serve():
        server = grpc.aio.server()
        same = lambda b: b  # noqa: E731
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "Echo", {"Exchange": grpc.stream_stream_rpc_method_handler(echo, same, same)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()
    uvloop.run(serve())


def echo_rtt(port: int, nbytes: int, n: int) -> list[float]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    same = lambda b: b  # noqa: E731
    q: queue.Queue = queue.Queue()
    responses = channel.stream_stream("/Echo/Exchange", request_serializer=same, response_deserializer=same)(
        iter(q.get, None))
    payload, rtt = b"x" * nbytes, []
    try:
        for i in range(n + WARMUP):
            t0 = time.perf_counter()
            q.put(payload)
            next(responses)
            if i >= WARMUP:
                rtt.append((time.perf_counter() - t0) * 1e6)
    finally:
        q.put(None)
        channel.close()
    return rtt


def exchange_rtt(port: int, transport: str, layer: int, hidden: int, n_experts: int, top_k: int, dtype, n: int):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = expert_pb2_grpc.ExpertServiceStub(channel)
    x = torch.randn(1, hidden).to(dtype)
    ids = torch.randperm(n_experts)[:top_k].to(torch.int32).view(1, -1)
    w = torch.rand(1, top_k)
    try:
        return (grpc_rtt if transport == "grpc" else shm_rtt)(stub, layer, x, ids, w, n)
    finally:
        channel.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--n", type=int, default=500, help="round trips per transport and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, transports interleaved")
    ap.add_argument("--transports", default="grpc,shm")
    ap.add_argument("--echo-server", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the floor's server process
    a = ap.parse_args()
    if a.echo_server:
        return echo_server(a.echo_server)
    import tiny_models
    from conftest import Services

    tmp = pathlib.Path(tempfile.mkdtemp())
    model = tiny_models.build("deepseek_v3", tmp / "model", dtype=torch.bfloat16, hidden_size=a.hidden,
                              num_hidden_layers=1, first_k_dense_replace=0, vocab_size=256, n_routed_experts=8,
                              num_experts_per_tok=8, n_group=1, topk_group=1, moe_intermediate_size=16)
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    svc = Services(model, tmp, expert_prefix=("taskset", "-c", "1"), gpu=False)
    from conftest import free_port
    echo_port = free_port()
    echo = subprocess.Popen(["taskset", "-c", "1", sys.executable, __file__, "--echo-server", str(echo_port)])
    # the request as it travels: hidden [1, H] bf16, top-8 ids and weights (the answer is about as large)
    nbytes = expert_pb2.LayerRequest(hidden=codec.encode(torch.zeros(1, a.hidden, dtype=torch.bfloat16)),
                                     topk_ids=codec.encode(torch.zeros(1, 8, dtype=torch.int32)),
                                     topk_weights=codec.encode(torch.zeros(1, 8))).ByteSize()
    res: dict = {t: ([], []) for t in a.transports.split(",")}
    floor: list = []
    try:
        for _ in range(a.rounds):
            for t in a.transports.split(","):
                r, c = exchange_rtt(svc.expert_port, t, 0, a.hidden, 8, 8, torch.bfloat16, a.n)
                res[t][0].extend(r)
                res[t][1].extend(c)
            floor.extend(echo_rtt(echo_port, nbytes, a.n))
    finally:
        echo.kill()
        svc.stop()
    rows = {}
    for t, (r, c) in res.items():
        rows[t] = {"transport": t, "hidden": a.hidden, "dtype": "bf16", "T": 1, "rtt_us": round(statistics.median(r), 1),
                   "rtt_p90_us": round(sorted(r)[int(0.9 * len(r))], 1), "compute_us": round(statistics.median(c), 1),
                   "overhead_us": round(statistics.median(x - y for x, y in zip(r, c)), 1)}
        print(json.dumps(rows[t]))
    floor_us = round(statistics.median(floor), 1)
    print(json.dumps({"transport": "grpcio echo (floor)", "bytes": nbytes, "rtt_us": floor_us}))
    print("\n| transport | round trip (median) | p90 | expert compute inside | transport overhead | target |")
    print("|---|---|---|---|---|---|")
    for t, target in (("grpc", 150), ("shm", 20)):
        r = rows[t]
        print(f"| {t} | {r['rtt_us']} us | {r['rtt_p90_us']} us | {r['compute_us']} us | {r['overhead_us']} us "
              f"| <= {target} us |")
    print(f"| grpcio echo of {nbytes} bytes (floor, no work) | {floor_us} us | | | {floor_us} us | |")
    if "grpc" in rows:
        print(f"\ngRPC overhead vs grpcio's own floor: {rows['grpc']['overhead_us'] / floor_us:.2f}x")
    print(f"\nshm vs gRPC overhead: {rows['grpc']['overhead_us'] / max(rows['shm']['overhead_us'], 0.1):.1f}x less "
          f"(H={a.hidden} bf16, T=1, top-8; medians of {a.rounds * a.n})")


if __name__ == "__main__":
    main()
