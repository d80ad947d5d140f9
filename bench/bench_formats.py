"""Decode speed of expert formats against each other, interleaved: what a token's experts cost in each format, the
bytes each reads (from the packed layout: weights, scales, mins, sums) and the rate against the DRAM read probe
taken in the same round. Made for the block formats that keep GGUF / int4 checkpoints' numbers (int8g32 against
int8, uint4g32 and iq4nl against int4g32), where the question is whether a format reads its bytes as fast as the
kernels of its width do; bench_kernels.py has prefill, torch and the arithmetic rooflines.

Each format's compute ceiling is measured beside it: the same call on 2 experts whose weights stay in the L3 cache
(one token, both of them), as GB/s of weights. Where that ceiling is not well above the DRAM probe, decode cannot
reach the probe: streaming and computing share the cores. The header gives the vpdpbusd peak on one thread and on
all of them (on a VM whose vCPUs are SMT siblings of one core, they are equal).

    python bench/bench_formats.py [--formats int8,int4,int4g32,uint4g32,iq4nl,int8g32] [--shape qwen3] [--rounds 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common import SHAPES, cpu_name, expert_bytes, weights
from expert_service.kernels.native_moe import NativeMoELayer  # noqa: E402
from moe_kernels import native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="int8,int4,mxfp4,int4g32,uint4g32,iq4nl,int8g32")
    ap.add_argument("--shape", default="qwen3", choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    native.init_pool(a.threads)
    E, H, I, k = SHAPES[a.shape]
    gate, up, down = weights(E, H, I)
    formats = a.formats.split(",")
    ops = {f: NativeMoELayer(gate, up, down, fmt=f, threads=a.threads) for f in formats}
    del gate, up, down
    gate, up, down = weights(2, H, I)
    cached = {f: NativeMoELayer(gate, up, down, fmt=f, threads=a.threads) for f in formats}
    del gate, up, down
    two = (torch.randn(1, H).bfloat16(), torch.tensor([[0, 1]], dtype=torch.int32), torch.rand(1, 2))
    g = torch.Generator().manual_seed(1)
    # 64 tokens of k distinct experts each: their weights far exceed the caches, so each pass reads DRAM
    calls = [(torch.randn(1, H).bfloat16(), torch.randperm(E, generator=g)[:k].view(1, k).to(torch.int32),
              torch.rand(1, k)) for _ in range(64)]
    probe = torch.ones(1 << 28)
    for op in ops.values():
        op.forward(*calls[0])
    times, shares, ceil = {f: [] for f in formats}, {f: [] for f in formats}, {f: [] for f in formats}
    bws = []
    for _ in range(a.rounds):  # each round: the probe, then every format in turn
        bw = native.read_bandwidth(probe.data_ptr(), probe.numel())
        bws.append(bw)
        for f, op in ops.items():
            t = time.perf_counter()
            for c in calls:
                op.forward(*c)
            dt = (time.perf_counter() - t) / len(calls)
            times[f].append(dt)
            shares[f].append(k * expert_bytes(f, H, I) / dt / bw)
            for _ in range(8):  # the cached experts: warm, then timed
                cached[f].forward(*two)
            t = time.perf_counter()
            for _ in range(64):
                cached[f].forward(*two)
            ceil[f].append(2 * expert_bytes(f, H, I) * 64 / (time.perf_counter() - t))
    native.init_pool(1)
    one = native.vnni_peak_ops(20_000_000) if native.isa_supported("avx512") else float("nan")
    native.init_pool(a.threads)
    peak = native.vnni_peak_ops(20_000_000) if native.isa_supported("avx512") else float("nan")
    base = formats[0]
    print(f"# {cpu_name()}, {a.threads} threads, shape {a.shape} (E {E}, H {H}, I {I}, top-{k}), {a.rounds} rounds; "
          f"vpdpbusd peak {one / 1e9:.0f} G/s on 1 thread, {peak / 1e9:.0f} on {a.threads}; probe median "
          f"{statistics.median(bws) / 1e9:.1f} GB/s")
    print("| format | bytes a token | decode us | GB/s | share of the probe | time / " + base +
          " | cache-resident GB/s |\n|---|---|---|---|---|---|---|")
    for f in formats:
        t, nb = statistics.median(times[f]), k * expert_bytes(f, H, I)
        row = {"fmt": f, "bytes": nb, "us": round(t * 1e6, 1), "GBps": round(nb / t / 1e9, 2),
               "share_of_probe": round(statistics.median(shares[f]), 3),
               "time_vs_first": round(statistics.median(x / y for x, y in zip(times[f], times[base])), 3),
               "cached_GBps": round(statistics.median(ceil[f]) / 1e9, 1)}
        print(json.dumps(row))
        print(f"| {f} | {nb / 1e6:.1f} MB | {row['us']} | {row['GBps']} | {row['share_of_probe']:.0%} | "
              f"{row['time_vs_first']} | {row['cached_GBps']} |")


if __name__ == "__main__":
    main()
