"""A hyper-connection's mix and expand (DeepSeek-V4-Flash's shape: 4 streams of 4096, 20 Sinkhorn iterations;
GLM-5.3-Flash's the same) on the native kernel (moe_kernels.hyper) against the same on torch's ops (gpu_service/model/
hyper_connections.py mix and expand without the kernel, the forms before it), interleaved, medians: a decode step's
one row and a prefill chunk's rows. Two mixes and two expands a layer (around attention and around the MLP).

    python bench/bench_hyper_mix.py [--rows 1 512] [--hidden 4096] [--dtype bf16] [--reps 200]
"""
from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

from common import cpu_name
from moe_core.openmp import passive_by_default

passive_by_default()  # as both services run: torch's threads do not spin beside the native pool's

from gpu_service.model import hyper_connections as hc  # noqa: E402
from moe_kernels import ISA, native  # noqa: E402


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 512])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    native.init_pool(a.threads)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    S, H = a.streams, a.hidden
    M = S * (2 + S)
    cfg = types.SimpleNamespace(hc_eps=1e-6, rms_norm_eps=1e-6, hc_iters=a.iters)
    W = {"p.fn": torch.randn(M, S * H) * 0.01, "p.base": torch.randn(M) * 0.1, "p.scale": torch.ones(3)}
    print(f"CPU: {cpu_name()}; kernel path {ISA}; {a.threads} threads; {a.dtype} streams, {S} of {H}, {a.iters} "
          f"Sinkhorn iterations; median of 5 runs of {a.reps} (interleaved)")
    print("| what, rows | torch's ops | native | torch / native |\n|---|---|---|---|")
    native_mix = hc.native_hyper
    on_torch = types.SimpleNamespace(supported=lambda h: False)
    for n in a.rows:
        h = torch.randn(n, S, H).to(dt)
        reps = max(1, a.reps // n)

        def with_torch():
            hc.native_hyper = on_torch
            try:
                return hc.mix(cfg, W, "p.", h)
            finally:
                hc.native_hyper = native_mix
        theirs, ours = with_torch(), hc.mix(cfg, W, "p.", h)
        assert all(torch.allclose(x.float(), y.float(), rtol=1e-2, atol=1e-3) for x, y in zip(theirs, ours))
        rows = [[timed(f, reps) for f in (with_torch, lambda: hc.mix(cfg, W, "p.", h))] for _ in range(5)]
        t, m = (statistics.median(r[i] for r in rows) for i in range(2))
        print(f"| mix, {n} | {t * 1e6:.0f} us | {m * 1e6:.0f} us | {t / m:.2f}x |", flush=True)
        s = hc.Streams(h, ours[0], ours[1])
        y = torch.randn(n, H).to(dt)

        def expand_torch():
            hc.native_hyper = on_torch
            try:
                return hc.expand(s, y)
            finally:
                hc.native_hyper = native_mix
        assert torch.allclose(expand_torch().float(), hc.expand(s, y).float(), rtol=1e-2, atol=1e-2)
        rows = [[timed(f, reps) for f in (expand_torch, lambda: hc.expand(s, y))] for _ in range(5)]
        t, m = (statistics.median(r[i] for r in rows) for i in range(2))
        print(f"| expand, {n} | {t * 1e6:.0f} us | {m * 1e6:.0f} us | {t / m:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
