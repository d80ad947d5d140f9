"""Dense layers on the CPU (what the GPU service runs when it computes there): our packed kernels
against torch's matmul on the same bf16 weights, per token count, interleaved in one run, and what
NativeLinear's default dispatch gives (it hands bf16 prefill from dense.TORCH_FROM_TOKENS tokens on
to torch where the kernel isa has bf16 arithmetic: dense.TORCH_PATHS).

    python bench/bench_dense.py [--threads 2] [--shapes 2048x2048,6144x2048] [--tokens 1,16,64,128,256,512]
                                [--format int4]

--format: ours in that packed format (e.g. int8, int4) against torch on the bf16 weights (MOE_PAIR_FROM=0 in the
environment: AVX-512's prefill without its paired blocks, native/runtime/common.h Tuning). A grid type (iq1s ...
iq3s: GGUF files only) runs on random valid blocks (the speed does not depend on the values), torch on random bf16
weights of the same shape.

One JSON line per case, then a table of medians and of per-round ratios (torch time / ours).

--groups G: instead, each shape as G matrices of that shape (DeepSeek-V4's grouped output projection: 8 of 1024 x 4096)
in one native call (dense.linear_groups) against G NativeLinear calls and their torch.stack (the earlier form),
interleaved: `python bench/bench_dense.py --groups 8 --shapes 1024x4096 --tokens 1,4 --format int4`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from common import cpu_name  # noqa: E402
from moe_core.openmp import passive_by_default  # noqa: E402

passive_by_default()  # as the GPU service runs: torch's threads do not spin beside the native pool's after its calls

import torch  # noqa: E402

from moe_kernels import dense, iq_formats, native  # noqa: E402
from moe_kernels.dense import NativeLinear  # noqa: E402


def median_ms(fn, x, calls: int) -> float:
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(x)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="2048x2048,6144x2048", help="rows x K, comma separated")
    ap.add_argument("--tokens", default="1,16,64,128,256,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=9)
    ap.add_argument("--format", default="bf16", help="our packed format (torch: the bf16 weights)")
    ap.add_argument("--groups", type=int, default=0, help="G matrices a shape: one grouped call against G calls")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    native.init_pool(a.threads)
    isa = native.best_isa()
    if a.groups:
        return groups(a, isa)
    rows_out = []
    for shape in a.shapes.split(","):
        rows, K = map(int, shape.split("x"))
        w = torch.randn(rows, K) * 0.02
        lin = NativeLinear(iq_formats.random_blocks(a.format, rows, K // 256, torch.Generator().manual_seed(0)),
                           a.format, isa=isa) if a.format in iq_formats.SPECS else NativeLinear(w, a.format, isa=isa)
        wb = w.bfloat16()
        ref = lambda x: torch.nn.functional.linear(x, wb)  # noqa: E731

        def ours(x):  # our kernels whatever the token count
            keep, dense.TORCH_FROM_TOKENS = dense.TORCH_FROM_TOKENS, 1 << 62
            try:
                return lin(x)
            finally:
                dense.TORCH_FROM_TOKENS = keep

        for T in map(int, a.tokens.split(",")):
            x = torch.randn(T, K).bfloat16()
            rounds = [(median_ms(ours, x, a.calls), median_ms(ref, x, a.calls), median_ms(lin, x, a.calls))
                      for _ in range(a.rounds)]
            o, t, d = (statistics.median(r[i] for r in rounds) for i in range(3))
            row = {"rows": rows, "K": K, "T": T, "ours_ms": round(o, 3), "torch_ms": round(t, 3), "default_ms": round(d, 3),
                   "torch_over_ours": round(statistics.median(r[1] / r[0] for r in rounds), 2),
                   "torch_over_default": round(statistics.median(r[1] / r[2] for r in rounds), 2)}
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    print(f"\n{cpu_name()}, isa {isa}, {a.threads} threads, ours {a.format}, torch bf16 weights; "
          f"pair_from {native.get_tuning()[3]}; torch_from_tokens "
          f"{dense.TORCH_FROM_TOKENS if isa in dense.TORCH_PATHS else 'never (no bf16 arithmetic)'}\n")
    print("| rows x K | T | ours | torch | default | torch/ours | torch/default |")
    print("|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['rows']}x{r['K']} | {r['T']} | {r['ours_ms']} ms | {r['torch_ms']} ms | {r['default_ms']} ms | "
              f"{r['torch_over_ours']}x | {r['torch_over_default']}x |")


def groups(a, isa: str) -> None:
    """--groups: one linear_groups call against G calls, per shape and token count."""
    print(f"{cpu_name()}, isa {isa}, {a.threads} threads, {a.groups} groups of {a.format}")
    print("| rows x K | T | G calls | one grouped call | G calls / grouped |\n|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        rows, K = map(int, shape.split("x"))
        parts = [NativeLinear(torch.randn(rows, K) * 0.02, a.format, isa=isa) for _ in range(a.groups)]
        for T in map(int, a.tokens.split(",")):
            x = torch.randn(T, a.groups, K).bfloat16()
            each = lambda x: torch.stack([p(x[:, g].contiguous()) for g, p in enumerate(parts)], dim=1)  # noqa: E731
            one = lambda x: dense.linear_groups(parts, x)  # noqa: E731
            assert torch.equal(each(x), one(x))
            rounds = [(median_ms(each, x, a.calls), median_ms(one, x, a.calls)) for _ in range(a.rounds)]
            e, o = (statistics.median(r[i] for r in rounds) for i in range(2))
            ratio = statistics.median(r[0] / r[1] for r in rounds)
            print(json.dumps({"rows": rows, "K": K, "T": T, "each_ms": round(e, 3), "grouped_ms": round(o, 3),
                              "each_over_grouped": round(ratio, 2)}), flush=True)
            print(f"| {rows}x{K} | {T} | {e:.3f} ms | {o:.3f} ms | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
