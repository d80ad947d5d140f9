"""FP8 experts (e4m3, one scale per 128x128 block, as DeepSeek-V3/R1, Kimi-K2 and GLM-4.5 publish them):
kept as published (the fp8 weight format) against converting them at load to the other formats.
Measured on routed experts of DeepSeek-V3's shape, FP8-quantized as published:

- error: each format's expert output against the exact one (the FP8 weights dequantized, float64
  matmuls), relative L2 over tokens; "fp8 bound" is what any kernel that rounds its activations to
  bf16 gets on the exact weights (ours round x * block scale instead, the same size of error);
- bytes per weight the kernels stream (what decode costs) and decode / prefill time of one MoE layer
  on our kernels, the fp8 format's packed from the published values and scales bit for bit.

    python bench/bench_fp8.py [--experts 8] [--spread 0 0.5 1.0] [--reps 5]

--spread: the standard deviation of ln(block magnitude) across a matrix's 128x128 blocks (0: every
block alike; real checkpoints vary by block, which is why they carry a scale per block and what
hurts a per-row int8 scale most). Synthetic weights: the conclusion holds for weights like these.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import cpu_name  # noqa: E402
from moe_experts.kernels.native_moe import NativeMoELayer  # noqa: E402
from moe_core.checkpoint import dequantize_fp8  # noqa: E402
from moe_kernels.packing import Fp8  # noqa: E402
from synth_checkpoint import quantize_fp8  # noqa: E402

BLOCK = (128, 128)
H, I = 7168, 2048  # DeepSeek-V3's routed expert


def fp8_matrix(rows: int, cols: int, spread: float, gen: torch.Generator) -> Fp8:
    """A [rows, cols] weight quantized to FP8 as published (e4m3 values and scale_inv per block)."""
    mag = torch.exp(spread * torch.randn(-(-rows // 128), -(-cols // 128), generator=gen))
    w = torch.randn(rows, cols, generator=gen) * 0.02
    w *= mag.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return Fp8(*quantize_fp8(w, BLOCK))


def expert_out(x: torch.Tensor, g: torch.Tensor, u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def timed(op, x, ids, w, reps: int) -> float:
    op.forward(x, ids, w)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        op.forward(x, ids, w)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--spread", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens for the error")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"CPU: {cpu_name()}; DeepSeek-V3 expert [{I}, {H}] x {a.experts}, FP8 blocks {BLOCK}")
    E = a.experts
    for spread in a.spread:
        gen = torch.Generator().manual_seed(0)
        published = [(fp8_matrix(I, H, spread, gen), fp8_matrix(I, H, spread, gen), fp8_matrix(H, I, spread, gen))
                     for _ in range(E)]
        exact = lambda j: torch.stack([dequantize_fp8(*p[j], BLOCK) for p in published])  # noqa: E731
        gate, up, down = exact(0), exact(1), exact(2)
        x = torch.randn(a.tokens, H, generator=gen)
        ids = torch.arange(E, dtype=torch.int32).repeat(a.tokens, 1)      # every token to every expert
        wts = torch.full((a.tokens, E), 1.0 / E)
        ref = sum(expert_out(x.double(), gate[e].double(), up[e].double(), down[e].double()) for e in range(E)) / E
        # an FP8 kernel: exact weights, activations rounded to bf16 on the way in and between the matmuls
        xb = x.bfloat16().double()
        kept = sum(((torch.nn.functional.silu(xb @ gate[e].double().T) * (xb @ up[e].double().T)).bfloat16().double()
                    @ down[e].double().T) for e in range(E)) / E
        print(f"\nblock magnitude spread {spread}: "
              f"| format | bytes / weight | output error vs exact | decode T=1 (ms) | prefill T={a.prefill} (ms) |")
        print("|---|---|---|---|---|")
        print(f"| fp8 bound (bf16 activations, exact weights) | {1 + 4 / 128**2:.4f} | {rel(kept, ref):.2e} | | |")
        for fmt in ("fp8", "bf16", "int8", "int4"):
            if fmt == "fp8":  # the published values and scales, packed bit for bit
                op = NativeMoELayer.from_experts(E, I, H, lambda e: published[e], fmt="fp8")
            else:
                op = NativeMoELayer(gate, up, down, fmt=fmt)
            err = rel(op.forward(x, ids, wts), ref)
            dec = timed(op, x[:1], ids[:1], wts[:1], a.reps * 4)
            xp = torch.randn(a.prefill, H, generator=gen)
            pre = timed(op, xp, ids[:1].repeat(a.prefill, 1), wts[:1].repeat(a.prefill, 1), a.reps)
            print(f"| {fmt} | {op.weight_bytes_per_expert / (3 * H * I):.4f} | {err:.2e} | {dec:.2f} | {pre:.0f} |",
                  flush=True)
            del op


if __name__ == "__main__":
    main()
