"""GQA decode attention on the CPU (one query per head over L cached positions, Qwen3-30B-A3B's 32 query
and 4 KV heads of 128): torch's matmuls over a contiguous head-major cache ([kv heads, positions, dim] views
of a doubled-capacity buffer, the layout before the paged pool), the native kernel over that contiguous cache,
and the native kernel over the paged pool (gpu_service/engine/kv_pool.py: 16-position blocks found through a block
table; consecutive, as a lone sequence's are, and scattered in the pool) -- the before and after of paging for
the decode step -- interleaved in one run. Also what the paths without a paged kernel pay for scattered blocks:
gathering them into one tensor per layer (consecutive ones are a view).

    python bench/bench_attention.py [--lengths 400 1500 6000] [--dtype bf16] [--kv fp16] [--isa avx2] [--threads 2]

--kv: the cache's element type when it is not the model's (--kv-cache-dtype; the torch path widens the blocks
it gathers, as gpu_service/model/attention.py does).

Then the native kernel as decode meets the cache, cold (--cold-layers layers' caches read in turn: the weights read
between two tokens sweep every cache), over a lone sequence's consecutive blocks, runs of 4 and scattered blocks,
with a head's V fetched into L2 while its scores read K (the default, up to half this core's L2:
native.get_tuning()) and without (`set_tuning(..., v_prefetch_kb=0)`), interleaved.

With --isa avx2, run torch limited to AVX2 too (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2).

--mla: DeepSeek-V3's latent attention instead (128 query heads over one shared latent of 512 and rotary key of 64 a
position; gpu_service/model/attention.py mla_attention): torch's matmuls in the model dtype over the gathered cache (the
decode path before the native kernel) against the native kernel over the pool (consecutive and scattered blocks),
each also as a share of this CPU's fp32 FMA peak measured in the same run (the attention is compute-bound).

--sinks: gpt-oss-20b's attention (64 query heads, 8 KV heads of 64, a sink per head): a full layer over every
position and a sliding layer over its window of 128, the decode path before the native kernel took sinks
(gpu_service/model/attention.py windowed_attention over the gathered cache, the model dtype) against the native
kernel with its sinks over the pool (consecutive blocks; the window as each KV head's selection), interleaved.

--mimo: the same for MiMo-V2-Flash's layers (64 query heads; keys of 192, values of 128; a full layer's 4 KV heads
without sinks over every position, a sliding layer's 8 with sinks over its window of 129), the decode path before the
native kernel took values narrower than keys (windowed_attention over the gathered cache) against the native kernel.

--prefill: a causal prefill chunk of each length (the queries of positions 0..L-1 over their own keys and values,
Qwen3-30B-A3B's heads) in --dtype: torch's SDPA (its CPU flash kernel, as gpu_service/model/attention.py called it
before) against the native flash kernel (moe_kernels.attention.prefill_attention), interleaved, each also in GFLOP/s
(4 L^2 / 2 x heads x dim: the causal half of two products). With --sinks or --mimo: a prefill chunk of each length
of that model's sliding layer (its window, its sinks; the model before the native kernel took them: windowed_attention)
against the native kernel, interleaved.
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
from gpu_service.engine.kv_pool import _empty  # noqa: E402
from moe_kernels.attention import (decode_attention, mla_paged_attention, paged_decode_attention,  # noqa: E402
                                   prefill_attention)

NH, NKV, D = 32, 4, 128


def with_torch(q, K, V):  # gpu_service/model/attention.py's CPU decode without the native kernel
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


def mla(a, dt, kt) -> None:
    """DeepSeek-V3's latent attention: torch (the model dtype) vs the native kernel over the MLA pool."""
    nh, r, dr, B = 128, 512, 64, 16
    scale = 192 ** -0.5
    peak = max(native.fma_peak_flops(10_000_000) for _ in range(5))
    print(f"CPU: {cpu_name()}; native isa {a.isa}; {a.threads} threads; {a.dtype}, cache {a.kv or a.dtype}; MLA "
          f"{nh} heads x ({r} + {dr}); fp32 FMA peak {peak / 1e9:.0f} GFLOP/s; per layer, median of {a.reps}")
    print("| positions | torch matmuls | native, paged consecutive | native, paged scattered | native GFLOP/s (% of "
          "peak) | torch / native |\n|---|---|---|---|---|---|")
    for L in a.lengths:
        nb = -(-L // B)
        tables = {"consecutive": torch.arange(nb, 2 * nb, dtype=torch.int32),
                  "scattered": torch.randperm(4 * nb)[:nb].to(torch.int32)}
        C, KPE = (_empty((4 * nb, B, n), kt, torch.device("cpu")).normal_() for n in (r, dr))
        q = (torch.randn(nh, r + dr) * 0.05).to(dt)

        def with_torch(name="consecutive"):  # mla_attention's decode before the native kernel: SeqCache.gather's
            # rows (consecutive blocks a view, scattered ones a copy) in the model dtype, then torch's matmuls
            rows = (x[nb:2 * nb] if name == "consecutive" else x.index_select(0, tables[name].long()) for x in (C, KPE))
            c, k = (x.reshape(-1, x.shape[-1])[:L].to(dt) for x in rows)
            s = (torch.matmul(q[:, None, :r], c.T) + torch.matmul(q[:, None, r:], k.T)) * scale
            return torch.matmul(s.float().softmax(dim=-1).to(dt), c)[:, 0]

        def paged(name):
            first = nb if name == "consecutive" else -1
            return lambda: mla_paged_attention(q, C, KPE, tables[name], L, scale, a.isa, first)

        for name in tables:
            assert torch.allclose(with_torch(name).float(), paged(name)(), atol=3e-2, rtol=3e-2)
        reps = max(3, a.reps // (1 if dt == torch.float32 else 20))  # torch's bf16 bmm is slow where bf16 is emulated
        rows = [[timed(f, reps=n) for f, n in ((with_torch, reps), (paged("consecutive"), a.reps),
                                               (paged("scattered"), a.reps))] for _ in range(3)]  # interleaved
        t, pc, ps = (statistics.median(row[i] for row in rows) for i in range(3))
        flops = 2 * nh * L * (2 * r + dr)
        print(f"| {L} | {t:.0f} us | {pc:.0f} us | {ps:.0f} us | {flops / pc / 1e3:.0f} ({flops / pc / 1e3 / (peak / 1e9) * 100:.0f}%) "
              f"| {t / pc:.2f}x |", flush=True)


# (name, query heads, keys' dim, values' dim, window; per layer kind: (window or 0, KV heads, sinks))
SINK_MODELS = {"gpt-oss-20b": (64, 64, 64, ((0, 8, True), (128, 8, True))),
               "MiMo-V2-Flash": (64, 192, 128, ((0, 4, False), (129, 8, True)))}


def sinks(a, dt, kt, model: str = "gpt-oss-20b") -> None:
    """Decode attention with sinks and windows (gpt-oss) or values narrower than keys (MiMo-V2-Flash), full and
    windowed: torch's windowed_attention vs the native kernel."""
    from gpu_service.model.attention import windowed_attention
    nh, d, dv, kinds = SINK_MODELS[model]
    B = 16
    print(f"CPU: {cpu_name()}; native isa {a.isa}; {a.threads} threads; {a.dtype}, cache {a.kv or a.dtype}; {model} "
          f"{nh} query heads, keys of {d}, values of {dv}; per layer, median of {a.reps}")
    print("| positions | layer | torch (gathered, windowed_attention) | native | torch / native |\n"
          "|---|---|---|---|---|")
    for L in a.lengths:
        nb = -(-L // B)
        table = torch.arange(nb, dtype=torch.int32)
        q = torch.randn(nh, d, dtype=dt)
        for window, nkv, with_sinks in kinds:
            pk, pv = (_empty((nkv, nb, B, w), kt, torch.device("cpu")).normal_() for w in (d, dv))
            s = torch.randn(nh) if with_sinks else None
            lo = max(0, L - window) if window else 0
            sel = None if not lo else (torch.arange(lo, L, dtype=torch.int32).expand(nkv, -1).contiguous(),
                                       torch.full((nkv,), L - lo, dtype=torch.int32))

            def with_torch():  # SeqCache.gather's rows from the window's first position (a view), the model dtype
                K, V = (x.view(nkv, nb * B, -1)[:, lo:L].to(dt) for x in (pk, pv))
                return windowed_attention(q[None], K, V, L - 1, window, s, d ** -0.5, lo)[0]

            def nat():
                return paged_decode_attention(q, pk, pv, table, L, d ** -0.5, a.isa, first=0 if sel is None else -1,
                                              selected=sel, sinks=s)
            assert torch.allclose(with_torch().float(), nat(), atol=3e-2, rtol=3e-2)
            rows = [[timed(f, reps=a.reps) for f in (with_torch, nat)] for _ in range(3)]  # interleaved
            t, n = (statistics.median(r[i] for r in rows) for i in range(2))
            print(f"| {L} | {'window ' + str(window) if window else 'full'} | {t:.0f} us | {n:.0f} us | {t / n:.2f}x |",
                  flush=True)


def prefill(a, dt) -> None:
    print(f"CPU: {cpu_name()}; native isa {a.isa}; {a.threads} threads; {a.dtype}; causal prefill of L positions, "
          f"{NH} query heads over {NKV} kv heads of {D}; median of {a.reps}, interleaved")
    print("| positions | torch SDPA ms | GFLOP/s | native ms | GFLOP/s | native / torch |\n|---|---|---|---|---|---|")
    for L in a.lengths:
        q = torch.randn(L, NH, D, dtype=dt)
        K, V = torch.randn(NKV, L, D, dtype=dt), torch.randn(NKV, L, D, dtype=dt)
        sdpa = lambda: F.scaled_dot_product_attention(q.transpose(0, 1)[None], K[None], V[None], is_causal=True,  # noqa: E731
                                                      enable_gqa=True)
        nat = lambda: prefill_attention(q, K, V, 0, D ** -0.5, a.isa).to(dt)  # noqa: E731
        ts, tn = [], []
        for _ in range(3):
            ts.append(timed(sdpa, reps=max(1, a.reps // 3)))
            tn.append(timed(nat, reps=max(1, a.reps // 3)))
        t_s, t_n = statistics.median(ts) / 1e3, statistics.median(tn) / 1e3
        flop = 4 * L * L / 2 * NH * D
        print(f"| {L} | {t_s:.2f} | {flop / t_s / 1e6:.0f} | {t_n:.2f} | {flop / t_n / 1e6:.0f} | {t_s / t_n:.2f}x |",
              flush=True)


def prefill_windowed(a, dt, model: str) -> None:
    """A sliding layer's prefill chunk (gpt-oss, MiMo): torch's windowed_attention vs the native kernel."""
    from gpu_service.model.attention import windowed_attention
    nh, d, dv, kinds = SINK_MODELS[model]
    window, nkv, _ = kinds[1]
    print(f"CPU: {cpu_name()}; native isa {a.isa}; {a.threads} threads; {a.dtype}; {model}'s sliding layer: a prefill "
          f"chunk of L positions, {nh} query heads over {nkv} kv heads, keys of {d}, values of {dv}, window {window}, "
          f"sinks; median of {a.reps}, interleaved")
    print("| positions | torch (windowed_attention) ms | native ms | torch / native |\n|---|---|---|---|")
    for L in a.lengths:
        q, s = torch.randn(L, nh, d, dtype=dt), torch.randn(nh)
        K, V = torch.randn(nkv, L, d, dtype=dt), torch.randn(nkv, L, dv, dtype=dt)
        tw = lambda: windowed_attention(q, K, V, 0, window, s, d ** -0.5, 0)  # noqa: E731
        nat = lambda: prefill_attention(q, K, V, 0, d ** -0.5, a.isa, window=window, sinks=s).to(dt)  # noqa: E731
        assert torch.allclose(tw().float(), nat().float(), atol=3e-2, rtol=3e-2)
        ts, tn = [], []
        for _ in range(3):
            ts.append(timed(tw, reps=max(1, a.reps // 3)))
            tn.append(timed(nat, reps=max(1, a.reps // 3)))
        t_s, t_n = statistics.median(ts) / 1e3, statistics.median(tn) / 1e3
        print(f"| {L} | {t_s:.2f} | {t_n:.2f} | {t_s / t_n:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[400, 1500, 6000])
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--kv", choices=["bf16", "fp32", "fp16"], default=None, help="the cache's type (default: --dtype)")
    ap.add_argument("--isa", default=ISA, help="native kernel isa (default: this CPU's)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--mla", action="store_true", help="DeepSeek-V3's latent attention (see above)")
    ap.add_argument("--sinks", action="store_true", help="gpt-oss's attention with sinks (see above)")
    ap.add_argument("--mimo", action="store_true", help="MiMo-V2-Flash's layers (see above)")
    ap.add_argument("--cold-layers", type=int, default=48, help="caches read in turn for the cold table (0: none)")
    ap.add_argument("--prefill", action="store_true", help="a causal prefill chunk, torch's SDPA vs native (see above)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    native.init_pool(a.threads)
    types = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    dt, kt = types[a.dtype], types[a.kv or a.dtype]
    if a.mla:
        return mla(a, dt, kt)
    if (a.sinks or a.mimo) and a.prefill:
        return prefill_windowed(a, dt, "MiMo-V2-Flash" if a.mimo else "gpt-oss-20b")
    if a.sinks or a.mimo:
        return sinks(a, dt, kt, "MiMo-V2-Flash" if a.mimo else "gpt-oss-20b")
    if a.prefill:
        return prefill(a, dt)
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

        def paged(name):  # as gpu_service/model/attention.py calls it: consecutive blocks without the table
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
    if a.cold_layers:
        cold(a, dt, kt)


def cold(a, dt, kt) -> None:
    """The paged kernel over --cold-layers layers' caches in turn (a lone sequence's consecutive blocks, runs of 4 as
    sequences growing side by side take them, every block elsewhere), V prefetched into L2 or not, interleaved."""
    default = native.get_tuning()
    passes = max(5, a.reps // 20)
    print(f"\ncold: {a.cold_layers} layers' caches read in turn; us a layer, median of {passes} passes; V prefetched "
          f"into L2 during the scores up to {default[2]} KiB a head / not")
    print("| positions | consecutive blocks | ratio | runs of 4 | ratio | scattered | ratio |\n|---|---|---|---|---|---|---|")
    B, pool_blocks = 16, 1024  # a pool of 16 MiB a head buffer (bf16, 128 dims): huge pages, as kv_pool's
    for L in a.lengths:
        nb = -(-L // B)
        size = max(pool_blocks, 4 * nb)
        runs = -(-nb // 4)
        tables = {"consecutive": (torch.arange(nb, dtype=torch.int32), 0),
                  "runs of 4": ((torch.randperm(size // 4)[:runs, None] * 4 + torch.arange(4)).flatten()[:nb]
                                .to(torch.int32), -1),
                  "scattered": (torch.randperm(size)[:nb].to(torch.int32), -1)}
        layers = [tuple(_empty((NKV, size, B, D), kt, torch.device("cpu")).normal_() for _ in range(2))
                  for _ in range(a.cold_layers)]
        q = torch.randn(NH, D, dtype=dt)

        def one_pass(table, first) -> float:
            t0 = time.perf_counter()
            for pk, pv in layers:
                paged_decode_attention(q, pk, pv, table, L, D ** -0.5, a.isa, first)
            return (time.perf_counter() - t0) / len(layers) * 1e6

        times: dict = {(name, kb): [] for name in tables for kb in (default[2], 0)}
        try:
            for _ in range(passes):
                for name, kb in times:
                    native.set_tuning(*default[:2], kb)
                    times[(name, kb)].append(one_pass(*tables[name]))
        finally:
            native.set_tuning(*default)
        cells = []
        for name in tables:
            on, off = statistics.median(times[(name, default[2])]), statistics.median(times[(name, 0)])
            cells += [f"{on:.0f} / {off:.0f} us", f"{on / off:.2f}x"]
        print(f"| {L} | " + " | ".join(cells) + " |", flush=True)
        layers.clear()  # (their memory back before the next length)

if __name__ == "__main__":
    main()
