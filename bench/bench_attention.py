"""GQA decode attention on the CPU (one query per head over L cached positions, Qwen3-30B-A3B's 32 query
and 4 KV heads of 128): torch's matmuls over a contiguous head-major cache ([kv heads, positions, dim] views
of a doubled-capacity buffer, the layout before the paged pool), the native kernel over that contiguous cache,
and the native kernel over the paged pool (gpu_service/kv_pool.py: 16-position blocks found through a block
table; consecutive, as a lone sequence's are, and scattered in the pool) -- the before and after of paging for
the decode step -- interleaved in one run. Also what the paths without a paged kernel pay for scattered blocks:
gathering them into one tensor per layer (consecutive ones are a view).

    python bench/bench_attention.py [--lengths 400 1500 6000] [--dtype bf16] [--kv fp16] [--isa avx2] [--threads 2]

--kv: the cache's element type when it is not the model's (--kv-cache-dtype; the torch path widens the blocks
it gathers, as gpu_service/attention.py does).

With --isa avx2, run torch limited to AVX2 too (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2).
"""
from __future__ import annotations

import argparse
import statistics
import time

from common import cpu_name  # noqa: E402
from moe_core.openmp import passive_by_default  # noqa: E402

passive_by_default()  # as both services run: torch's threads do not spin beside the native pool's

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe_kernels import ISA, native  # noqa: E402
from gpu_service.kv_pool import _empty  # noqa: E402
from moe_kernels.attention import decode_attention, paged_decode_attention  # noqa: E402

NH, NKV, D = 32, 4, 128


def with_torch(q, K, V):  # gpu_service/attention.py's CPU decode without the native kernel
    K, V = K.to(q.dtype), V.to(q.dtype)
    qg = q.view(NKV, NH // NKV, D)
    s = torch.matmul(qg, K.transpose(1, 2)) * D ** -0.5
    return torch.matmul(s.float().softmax(-1).to(q.dtype), V).view(NH, D)


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
    ap.add_argument("--kv", choices=["bf16", "fp32", "fp16"], default=None, help="the cache's type (default: --dtype)")
    ap.add_argument("--isa", default=ISA, help="native kernel isa (default: this CPU's)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    native.init_pool(a.threads)
    types = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    dt, kt = types[a.dtype], types[a.kv or a.dtype]
    print(f"CPU: {cpu_name()}; native isa {a.isa}; {a.threads} threads; {a.dtype}, cache {a.kv or a.dtype}; per layer, "
          f"median of {a.reps}")
    print("| positions | torch matmuls | native, contiguous | native, paged consecutive (/ contiguous) | native, paged "
          "scattered | native, paged in runs of 4 | gather scattered (torch paths) |\n|---|---|---|---|---|---|---|")
    B = 16  # kv_pool.BLOCK
    for L in a.lengths:
        cap = 1 << (L - 1).bit_length()  # the cache's doubled capacity
        q = torch.randn(NH, D, dtype=dt)
        K, V = torch.randn(NKV, cap, D, dtype=kt)[:, :L], torch.randn(NKV, cap, D, dtype=kt)[:, :L]
        nb = -(-L // B)
        # the sequence's blocks in a pool 4x its size: consecutive (a lone sequence's, the lowest free ids), and
        # scattered (after many requests came and went)
        runs = -(-nb // 4)  # two sequences growing side by side, 4 blocks at a time (kv_pool.GROW)
        tables = {"consecutive": torch.arange(nb, 2 * nb, dtype=torch.int32),
                  "scattered": torch.randperm(4 * nb)[:nb].to(torch.int32),
                  "runs of 4": (torch.arange(runs)[:, None] * 8 + torch.arange(4)).flatten()[:nb].to(torch.int32)}
        pools = {}
        for name, table in tables.items():
            size = max(4 * nb, int(table.max()) + 1)
            pk, pv = (_empty((NKV, size, B, D), kt, torch.device("cpu")).normal_() for _ in range(2))  # kv_pool's
            pk[:, table.long()] = F.pad(K, (0, 0, 0, nb * B - L)).view(NKV, nb, B, D)
            pv[:, table.long()] = F.pad(V, (0, 0, 0, nb * B - L)).view(NKV, nb, B, D)
            pools[name] = pk, pv

        def nat(q, K, V):
            return decode_attention(q, K, V, D ** -0.5, a.isa)

        def paged(name):  # as gpu_service/attention.py calls it: consecutive blocks without the table
            first = nb if name == "consecutive" else -1
            return lambda q, K, V: paged_decode_attention(q, *pools[name], tables[name], L, D ** -0.5, a.isa, first)

        def gather(q, K, V):  # SeqCache.gather of scattered blocks (consecutive ones are a view)
            return [p.view(NKV, p.shape[1], -1).index_select(1, tables["scattered"].long()).reshape(NKV, -1, D)
                    for p in pools["scattered"]]
        assert torch.allclose(with_torch(q, K, V).float(), nat(q, K, V), atol=2e-2, rtol=2e-2)
        for name in tables:
            assert torch.allclose(paged(name)(q, K, V), nat(q, K, V), atol=1e-5, rtol=1e-5)
        rows = []
        for _ in range(3):  # interleaved
            rows.append([timed(f, q, K, V, reps=a.reps) for f in (with_torch, nat, paged("consecutive"),
                                                                    paged("scattered"), paged("runs of 4"), gather)])
        t, c, pc, ps, pr, g = (statistics.median(r[i] for r in rows) for i in range(6))
        print(f"| {L} | {t:.0f} us | {c:.0f} us | {pc:.0f} us ({pc / c:.2f}) | {ps:.0f} us ({ps / c:.2f}) | "
              f"{pr:.0f} us ({pr / c:.2f}) | {g:.0f} us |", flush=True)


if __name__ == "__main__":
    main()
