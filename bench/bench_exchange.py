"""Exchange round trip per MoE layer, gRPC vs shared memory, against a real expert service process.

    python bench/bench_exchange.py [--hidden 7168] [--rounds 10] [--n 300] [--transports grpc,shm]

Builds a one-MoE-layer DeepSeek-V3 checkpoint with the given hidden size (bf16, tiny experts so the
compute inside the round trip is small), starts the expert service pinned to core 1, pins this
client to core 0, and sends T=1 layer requests (top-8) one at a time through the GPU side's own
client (moe_exchange/dispatch.py: RemoteExperts.submit, then result). Per transport it reports the
median round trip, the expert compute the service measured inside it, their difference (what the
transport itself costs per layer), and the legs: submit -> the service has the request -> compute
starts, compute ends -> result() returns. Targets: gRPC <= 1.5x the floor (issue #16), shm <= 20 us.

The baseline measured in the same run: grpcio's own floor, a bidirectional stream that echoes bytes
of the request's size (an asyncio server on uvloop pinned to core 1, like the expert service, and the
same synchronous client): what any Python grpcio exchange costs here before our code does anything.
Rounds alternate the floor and the transports; each round's overhead is taken against that round's
floor and the median of those ratios reported (this machine's speed drifts over seconds).
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

from common import exchange_rtt  # noqa: E402
from moe_exchange import codec  # noqa: E402
from protos import expert_pb2  # noqa: E402

WARMUP = 50


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--n", type=int, default=300, help="round trips per transport and round")
    ap.add_argument("--rounds", type=int, default=10, help="rounds, transports and the floor interleaved (this "
                    "machine's speed drifts over seconds: each round's ratio is taken against that round's floor)")
    ap.add_argument("--weight-format", default="int4", help="the expert service's (int4: its compute inside the "
                    "round trip, which is not what is measured, stays small)")
    ap.add_argument("--transports", default="grpc,shm")
    ap.add_argument("--echo-server", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the floor's server process
    a = ap.parse_args()
    if a.echo_server:
        return echo_server(a.echo_server)
    import tiny_models
    from common import Services

    tmp = pathlib.Path(tempfile.mkdtemp())
    model = tiny_models.build("deepseek_v3", tmp / "model", dtype=torch.bfloat16, hidden_size=a.hidden,
                              num_hidden_layers=1, first_k_dense_replace=0, vocab_size=256, n_routed_experts=8,
                              num_experts_per_tok=8, n_group=1, topk_group=1, moe_intermediate_size=16)
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    svc = Services(model, tmp, expert_prefix=("taskset", "-c", "1"), gpu=False,
                   expert_args=("--weight-format", a.weight_format))
    from common import free_port
    echo_port = free_port()
    echo = subprocess.Popen(["taskset", "-c", "1", sys.executable, __file__, "--echo-server", str(echo_port)])
    # the request as it travels: hidden [1, H] bf16, top-8 ids and weights (the answer is about as large)
    nbytes = expert_pb2.LayerRequest(hidden=codec.encode(torch.zeros(1, a.hidden, dtype=torch.bfloat16)),
                                     topk_ids=codec.encode(torch.zeros(1, 8, dtype=torch.int32)),
                                     topk_weights=codec.encode(torch.zeros(1, 8))).ByteSize()
    res: dict = {t: ([], [], []) for t in a.transports.split(",")}
    floor: list = []
    ratios: dict = {t: [] for t in res}  # per round: overhead / that round's floor
    try:
        for _ in range(a.rounds):
            f = echo_rtt(echo_port, nbytes, a.n)
            for t in res:
                r, c, legs = exchange_rtt(svc.expert_port, t, 0, a.hidden, 8, 8, torch.bfloat16, a.n)
                res[t][0].extend(r)
                res[t][1].extend(c)
                res[t][2].extend(legs)
                ratios[t].append(statistics.median(x - y for x, y in zip(r, c)) / statistics.median(f))
            floor.extend(f)
    finally:
        echo.kill()
        svc.stop()
    rows = {}
    for t, (r, c, legs) in res.items():
        rows[t] = {"transport": t, "hidden": a.hidden, "dtype": "bf16", "T": 1, "rtt_us": round(statistics.median(r), 1),
                   "rtt_p90_us": round(sorted(r)[int(0.9 * len(r))], 1), "compute_us": round(statistics.median(c), 1),
                   "overhead_us": round(statistics.median(x - y for x, y in zip(r, c)), 1),
                   "to_service_us": round(statistics.median(x[0] for x in legs), 1),
                   "queued_us": round(statistics.median(x[1] for x in legs), 1),
                   "back_us": round(statistics.median(x[2] for x in legs), 1)}
        print(json.dumps(rows[t]))
    floor_us = round(statistics.median(floor), 1)
    print(json.dumps({"transport": "grpcio echo (floor)", "bytes": nbytes, "rtt_us": floor_us}))
    print("\n| transport | round trip (median) | p90 | expert compute inside | transport overhead | overhead / floor, "
          "median of rounds (range) | target |")
    print("|---|---|---|---|---|---|---|")
    for t, target in (("grpc", "<= 1.5x the floor"), ("shm", "<= 20 us")):
        if t in rows:
            r, q = rows[t], sorted(ratios[t])
            print(f"| {t} | {r['rtt_us']} us | {r['rtt_p90_us']} us | {r['compute_us']} us | {r['overhead_us']} us "
                  f"| {statistics.median(q):.2f}x ({q[0]:.2f}-{q[-1]:.2f}) | {target} |")
    print(f"| grpcio echo of {nbytes} bytes (floor, no work) | {floor_us} us | | | {floor_us} us | 1 | |")
    print("\nLegs (medians): submit -> the service has the request | -> compute starts | compute ends -> result() "
          "returns")
    for t, r in rows.items():
        print(f"  {t}: {r['to_service_us']} us | {r['queued_us']} us | {r['back_us']} us")
    print(f"\n(H={a.hidden} bf16, T=1, top-8, experts {a.weight_format}; {a.rounds} rounds of {a.n}, the floor "
          f"measured in each)")


if __name__ == "__main__":
    main()
