"""Interleaved A/B of the kernels' streaming knobs (native/runtime/common.h Tuning: prefetch distance,
task size) and of kernel isas on the Qwen3-30B-A3B expert shape, in one process: every
repetition runs each setting once in turn, so the machine's slow and fast moments fall on all of
them alike (on a shared 2-core box single runs drift by +-20%).

    python bench/bench_tuning.py [--formats int4,int8,bf16] [--settings 0:64,8192:1024] [--case decode|prefill]
                                 [--isas avx2,avxvnni]

A setting is PF_BYTES:TASK_KB[:PAIR_FROM] (PAIR_FROM: tokens from which AVX-512's prefill of the formats with a
scale per group pairs 16-row blocks, 0 never; e.g. --case prefill --settings 32768:1024:0,32768:1024:8). The first is
the baseline; each line gives medians and the ratio
to it (below 1 = faster). 0:1 is the earlier behaviour (prefetch the next 4-row block only, the
minimum of 64 rows per task); 32768:1024 is the default. With --isas, every setting runs on each
isa (the first isa's first setting is the baseline).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import SHAPES, weights  # noqa: E402
from moe_kernels import native as native  # noqa: E402
from moe_experts.kernels.native_moe import NativeMoELayer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="int4,int8,bf16")
    ap.add_argument("--settings", default="0:1,8192:1024")
    ap.add_argument("--case", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--shape", default="qwen3", choices=SHAPES)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isas", default=None, help="kernel isas to compare (default: the one chosen for this CPU)")
    a = ap.parse_args()
    isas = a.isas.split(",") if a.isas else [native.best_isa()]
    settings = [(p, *(int(v) for v in s.split(":"))) for p in isas for s in a.settings.split(",")]
    E, H, I, k = SHAPES[a.shape]
    gate, up, down = weights(E, H, I)
    torch.set_num_threads(a.threads)
    native.init_pool(a.threads)
    default = native.get_tuning()
    g = torch.Generator().manual_seed(1)
    if a.case == "decode":  # fresh experts every call: the weights come from DRAM
        calls = [(torch.randn(1, H).bfloat16(), torch.randperm(E, generator=g)[:k].view(1, k).to(torch.int32),
                  torch.rand(1, k)) for _ in range(64)]
    else:
        T = 512
        calls = [(torch.randn(T, H).bfloat16(),
                  torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32), torch.rand(T, k))]
    for fmt in a.formats.split(","):
        ops = {p: NativeMoELayer(gate, up, down, fmt=fmt, threads=a.threads, isa=p) for p in isas}
        times: dict = {s: [] for s in settings}
        for _ in range(a.reps):
            for s in settings:
                native.set_tuning(s[1], s[2], -1, *s[3:])
                t0 = time.perf_counter()
                for c in calls:
                    ops[s[0]].forward(*c)
                times[s].append((time.perf_counter() - t0) / len(calls) * 1e6)
        base = statistics.median(times[settings[0]])
        print(f"{a.case} {a.shape} {fmt}: " + "  ".join(
            f"{s[0]} {':'.join(map(str, s[1:]))} {statistics.median(v):.0f} us ({statistics.median(v) / base:.2f})" for s, v in times.items()),
            flush=True)
        del ops
    native.set_tuning(*default)


if __name__ == "__main__":
    main()
