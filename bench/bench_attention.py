"""GQA decode attention on the CPU (one query over L cached positions, Qwen3-30B-A3B's 32 query and 4 KV
heads of 128): the head-major KV cache gpu_service keeps ([kv heads, positions, dim]) against the
token-major layout it replaced ([positions, kv heads, dim]), the same matmuls, in the same run.

    python bench/bench_attention.py [--lengths 400 1500 6000] [--dtype bf16]

The default lengths fall inside a doubled capacity (the usual case: strided views); at exactly the
capacity the views are contiguous and faster still.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_restart import cpu_name  # noqa: E402

NH, NKV, D = 32, 4, 128


def token_major(q, K, V):  # K, V [L, kv, d]: the layout before
    qg = q.view(NKV, NH // NKV, D)
    s = torch.matmul(qg, K.permute(1, 2, 0)) * D ** -0.5
    return torch.matmul(s.float().softmax(-1).to(q.dtype), V.transpose(0, 1))


def head_major(q, K, V):  # K, V [kv, L, d] views of [kv, capacity, d] buffers: gpu_service/attention.py
    qg = q.view(NKV, NH // NKV, D)
    s = torch.matmul(qg, K.transpose(1, 2)) * D ** -0.5
    return torch.matmul(s.float().softmax(-1).to(q.dtype), V)


def timed(f, *a, reps: int) -> float:
    for _ in range(5):
        f(*a)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(*a)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[400, 1500, 6000])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    print(f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}; {a.dtype}; per layer, median of {a.reps}")
    print("| positions | token-major (before) | head-major (now) | speed-up |\n|---|---|---|---|")
    for L in a.lengths:
        cap = 1 << (L - 1).bit_length()  # the cache's doubled capacity
        q = torch.randn(NH, D, dtype=dt)
        Kt, Vt = torch.randn(cap, NKV, D, dtype=dt)[:L], torch.randn(cap, NKV, D, dtype=dt)[:L]
        Kh, Vh = Kt.transpose(0, 1).contiguous(), Vt.transpose(0, 1).contiguous()
        Kb, Vb = torch.zeros(NKV, cap, D, dtype=dt), torch.zeros(NKV, cap, D, dtype=dt)
        Kb[:, :L], Vb[:, :L] = Kh, Vh
        Kh, Vh = Kb[:, :L], Vb[:, :L]
        assert torch.allclose(token_major(q, Kt, Vt).float(), head_major(q, Kh, Vh).float(), atol=1e-2, rtol=1e-2)
        rows = []
        for _ in range(3):  # interleaved
            rows.append((timed(token_major, q, Kt, Vt, reps=a.reps), timed(head_major, q, Kh, Vh, reps=a.reps)))
        before, now = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"| {L} | {before:.0f} us | {now:.0f} us | {before / now:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
