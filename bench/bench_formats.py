"""Decode speed of expert formats against each other, interleaved: what a token's experts cost in each format, the
bytes each reads (from the packed layout: weights, scales, mins, sums) and the rate against the DRAM read probe
taken in the same round. Made for the block formats that keep GGUF / int4 checkpoints' numbers (int8g32 against
int8, uint4g32 and iq4nl against int4g32), where the question is whether a format reads its bytes as fast as the
kernels of its width do; bench_kernels.py has prefill, torch and the arithmetic rooflines.

Each format's compute ceiling is measured beside it: the same call on 2 experts whose weights stay in the last-level
cache (1 where 2 would not fit in 3/4 of it), one token, as GB/s of weights; a call's fixed cost (the activations'
quantization, the pool's dispatch: ~20 us on a Zen 1) is part of it, as it is of a layer's. Where that ceiling is
not well above the DRAM probe, decode cannot reach the probe: streaming and computing share the cores. The header
gives the kernel path's int8 dot product's peak (vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd) on one thread and on
all of them (equal where the vCPUs share one core's vector units).

The IQ grid formats (iq2xxs ... iq1m) hold GGUF files only: their experts here are random valid blocks (the speed does
not depend on the values).

    python bench/bench_formats.py [--formats int8,int4,int4g32,uint4g32,iq4nl,int8g32] [--shape qwen3] [--rounds 8]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

from common import SHAPES, cpu_name, expert_bytes, weights
from moe_experts.kernels.native_moe import NativeMoELayer  # noqa: E402
from moe_kernels import ISA, iq_formats, native  # noqa: E402
from moe_kernels.formats import format_of  # noqa: E402

# the kernel path's int8 dot product, probed for the header
INT8_PEAKS = {"amx": ("vpdpbusd", native.vnni_peak_ops), "avx512": ("vpdpbusd", native.vnni_peak_ops),
              "avxvnni": ("vpdpbusd (ymm)", native.avxvnni_peak_ops),
              "avx2": ("vpmaddubsw+vpmaddwd", native.avx2_int8_peak_ops),
              "portable": ("none", lambda n: float("nan"))}


def llc_bytes() -> int:
    """The last-level cache's size (sysfs), 8 MiB if unknown."""
    sizes = [0]
    for f in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        v = f.read_text().strip()
        sizes.append(int(v[:-1]) * {"K": 1 << 10, "M": 1 << 20}[v[-1]] if v[-1] in "KM" else int(v))
    return max(sizes) or 8 << 20


def layer(fmt: str, gate, up, down, threads: int) -> NativeMoELayer:
    """The experts in fmt: quantized from the floats, or for the exact-only formats random blocks of their shape."""
    if not format_of(fmt).exact_only:
        return NativeMoELayer(gate, up, down, fmt=fmt, threads=threads)
    (E, I, H), g = gate.shape, torch.Generator().manual_seed(0)
    parts = [tuple(iq_formats.random_blocks(fmt, r, k // 256, g, d_scale=1e-4) for r, k in ((I, H), (I, H), (H, I)))
             for _ in range(E)]
    return NativeMoELayer.from_experts(E, I, H, lambda e: parts[e], fmt=fmt, threads=threads)


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
    ops = {f: layer(f, gate, up, down, a.threads) for f in formats}
    del gate, up, down
    # the ceiling's experts: 2 where they fit in 3/4 of the last-level cache, else 1 (int8: 2 x 4.7 MB against a
    # Zen 1's 8 MB L3 would time DRAM, not the arithmetic)
    n_c = 2 if 2 * max(expert_bytes(f, H, I) for f in formats) <= 0.75 * llc_bytes() else 1
    gate, up, down = weights(n_c, H, I)
    cached = {f: layer(f, gate, up, down, a.threads) for f in formats}
    del gate, up, down
    two = (torch.randn(1, H).bfloat16(), torch.arange(n_c, dtype=torch.int32).view(1, n_c), torch.rand(1, n_c))
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
            ceil[f].append(n_c * expert_bytes(f, H, I) * 64 / (time.perf_counter() - t))
    what, probe_fn = INT8_PEAKS[ISA]
    native.set_threads(1)  # (init_pool would keep the pool's size)
    one = probe_fn(20_000_000)
    native.set_threads(a.threads)
    peak = probe_fn(20_000_000)
    base = formats[0]
    print(f"# {cpu_name()}, {a.threads} threads, shape {a.shape} (E {E}, H {H}, I {I}, top-{k}), {a.rounds} rounds; "
          f"{what} peak {one / 1e9:.0f} G int8 ops/s on 1 thread, {peak / 1e9:.0f} on {a.threads}; probe median "
          f"{statistics.median(bws) / 1e9:.1f} GB/s; ceiling on {n_c} cache-resident expert(s)")
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
