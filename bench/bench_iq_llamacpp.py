"""GGUF's grid types (IQ1_S ... IQ3_S) against llama.cpp's CPU kernels on one matrix: llama.cpp's test-backend-ops perf
(MUL_MAT of a 4096 x 14336 weight of the type by n f32 columns: its own shapes, n = 1 for decode and 512 for prefill)
against our native kernels on the same shape and type (the file's bytes, random valid blocks: the speed does not
depend on the values), in alternating rounds; medians. Each side on all cores; ours also against the DRAM read probe.

    python bench/bench_iq_llamacpp.py [--types IQ2_XXS,IQ1_S] [--rounds 3] [--work /tmp/llw]

llama.cpp is built from the llama-cpp-python sdist (bench/common.py: build_llama, GGML_NATIVE) with its tests on, for
test-backend-ops.

Caution: test-backend-ops' MUL_MAT runs llama.cpp's per-column vec_dot for these types, not the tiled int8 path its
models take (`tiled_run_microtile_*` on weights decoded to int8 tiles: 63% of a 512-token llama-bench prefill on an
AVX2 CPU, docs/performance/kernels.md 2026-12-08): the prefill ratios here overstate ours against llama.cpp's model;
bench_llamacpp.py's end-to-end figures are the ones to compare.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import statistics
import subprocess

import torch

from common import build_llama, cpu_name, median_ms, peer_env
from moe_kernels import ISA, iq_formats, native
from moe_kernels.dense import NativeLinear

M, K = 4096, 14336  # test-backend-ops' perf shape for MUL_MAT


def theirs(binary: pathlib.Path, qtype: str, n: int) -> float:
    """llama.cpp's us a run of MUL_MAT(type_a=qtype, m=M, n, k=K) (its -p filter: that case alone)."""
    case = f"type_a={qtype.lower()},type_b=f32,m={M},n={n},k={K},"
    out = subprocess.run([str(binary), "perf", "-o", "MUL_MAT", "-b", "CPU", "-p", case], capture_output=True,
                         text=True, check=True, env=peer_env()).stdout
    m = re.search(r"([\d.]+) us/run", out)
    if m is None:
        raise RuntimeError(f"no MUL_MAT line for {case} in:\n{out}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="IQ2_XXS,IQ2_XS,IQ2_S,IQ3_XXS,IQ3_S,IQ1_S,IQ1_M")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/llw"))
    a = ap.parse_args()
    src = build_llama(a.work, "native")
    build = src / "build-native"
    binary = build / "bin" / "test-backend-ops"
    if not binary.exists():
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DLLAMA_BUILD_TESTS=ON"], check=True,
                       capture_output=True)
        subprocess.run(["ninja", "-C", str(build), "test-backend-ops"], check=True, capture_output=True)
    threads = os.cpu_count() or 2
    native.init_pool(threads)
    probe = torch.ones(1 << 28)
    print(f"# {cpu_name()}; ours on the {ISA} path, {threads} threads; llama.cpp build-native test-backend-ops; "
          f"MUL_MAT {M} x {K}; {a.rounds} alternating rounds, medians")
    print("| type | bits | decode (n=1): ours us | llama.cpp us | ratio | ours GB/s | share of probe | "
          "prefill (n=512): ours ms | llama.cpp ms | ratio |\n|---|---|---|---|---|---|---|---|---|---|")
    for qtype in a.types.split(","):
        fmt = iq_formats.BY_QTYPE[qtype]
        lin = NativeLinear(iq_formats.random_blocks(fmt, M, K // 256, torch.Generator().manual_seed(0)), fmt)
        x1, x512 = torch.randn(1, K), torch.randn(512, K)
        ours1, ours512, t1, t512, bws = [], [], [], [], []
        for _ in range(a.rounds):
            bws.append(native.read_bandwidth(probe.data_ptr(), probe.numel()))
            ours1.append(median_ms(lambda: lin(x1), reps=20) * 1e3)
            ours512.append(median_ms(lambda: lin(x512), reps=3))
            t1.append(theirs(binary, qtype, 1))
            t512.append(theirs(binary, qtype, 512) / 1e3)
        o1, o512, l1, l512 = (statistics.median(v) for v in (ours1, ours512, t1, t512))
        gbs = lin.nbytes / (o1 * 1e-6) / 1e9
        print(f"| {qtype} | {iq_formats.bits(fmt)} | {o1:.0f} | {l1:.0f} | {l1 / o1:.2f}x | {gbs:.1f} | "
              f"{gbs * 1e9 / statistics.median(bws):.0%} | {o512:.1f} | {l512:.1f} | {l512 / o512:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
