"""DeepSeek Sparse Attention at depth on the CPU: one DeepSeek-V3.2 layer's attention stage at full width (hidden 7168,
128 heads over a latent of 512 and a rotary key of 64, q_lora 1536; the indexer's 64 heads of 128 keeping 2048 keys),
its cache filled directly (random rows: a dense prefill of 32k positions takes tens of minutes here) at each length,
run through the service's own decode code (gpu_service/model/attention.py mla_attention on a bf16 model, its
projections packed bf16 as --dense-format auto packs them, the native decode kernels) -- sparse (the indexer's top
2048) against the same layer with every position kept (index_topk 0: MLA's dense absorbed attention over the whole
pool), interleaved, the median of each round's median.

Beside the stage, its parts alone: the indexer's scores over the pool, the top k, the latent attention over the
selection; the dense latent attention over every position; and the projections both sides share (the stage less its
attention). Each attention's two bounds from this run's own ceilings: its multiply-adds at the fp32 FMA peak
(native.fma_peak_flops) and its bytes of cache at the DRAM read probe (native.read_bandwidth): the larger is the bound
it meets.

    python bench/bench_sparse_attention.py [--lengths 2048 8192 32768] [--rounds 3] [--reps 5] [--threads 2]

--glm: GLM-5.3-Flash's DSA layer instead (64 heads over a NoPE latent of 512; the k-pool indexer's 32 heads of 128 over
pools of 16 keys, keeping 2048 positions), its decode stage on the native kernels against the same stage on torch's
path (the pools' keys gathered and sorted, the latent attention over every gathered row, masked), interleaved.

--model DIR (a DeepSeek Sparse Attention checkpoint, e.g. `tools/synth_checkpoint.py --arch deepseek-v3.2 --layers 4`):
the whole model's decode instead, one process (its dense layers as `--dense-format auto` packs them, its routed
experts in --weight-format in this process, as `--experts local` runs them), one sequence whose every layer's cache
is filled directly at each length: tokens/s of the model as published against the same model with every position kept
(its config's index_topk set to 0), interleaved per round.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time

from common import cpu_name, median_ms  # noqa: E402
from moe_core.openmp import passive_by_default  # noqa: E402

passive_by_default()  # as both services run: torch's threads do not spin beside the native pool's

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import synth_checkpoint  # noqa: E402

from gpu_service.engine.kv_pool import BLOCK, KVPool, SeqCache  # noqa: E402
from gpu_service.model.attention import SequenceKV, mla_attention  # noqa: E402
from gpu_service.model.layers import rope_cos_sin, rope_inv_freq  # noqa: E402
from moe_core.config import parse_config  # noqa: E402
from moe_kernels import ISA, native  # noqa: E402
from moe_kernels.attention import dsa_scores, dsa_top_k, mla_paged_attention  # noqa: E402
from moe_kernels.dense import NativeLinear  # noqa: E402

DT = torch.bfloat16


def layer_weights(cfg, g: torch.Generator, layer: int = 0) -> dict:
    """A layer's attention weights at random (std 0.02), packed as the service packs them."""
    H, nh, r, dr = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv, qr, ih, idim = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.index_heads, cfg.index_dim
    p = f"model.layers.{layer}.self_attn."
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(DT)  # noqa: E731
    ones = lambda n: torch.ones(n, dtype=DT)  # noqa: E731
    W = {p + "q_a_proj.weight": NativeLinear(rnd(qr, H), "bf16"), p + "q_a_layernorm.weight": ones(qr),
         p + "q_b_proj.weight": NativeLinear(rnd(nh * (dn + dr), qr), "bf16"),
         p + "kv_a_proj_with_mqa.weight": NativeLinear(rnd(r + dr, H), "bf16"), p + "kv_a_layernorm.weight": ones(r),
         p + "kv_b_proj.weight": rnd(nh * (dn + dv), r), p + "o_proj.weight": NativeLinear(rnd(H, nh * dv), "bf16")}
    ip = p + "indexer."
    W.update({ip + "wq_b.weight": NativeLinear(rnd(ih * idim, qr), "bf16"),
              ip + "wk.weight": NativeLinear(rnd(idim, H), "bf16"), ip + "k_norm.weight": ones(idim),
              ip + "k_norm.bias": torch.zeros(idim, dtype=DT), ip + "weights_proj.weight": rnd(ih, H)})
    if cfg.index_kpool:  # GLM-5.3-Flash's pools: their gate logits' projection and per-slot bias
        W.update({ip + "index_kpool_compress_gate": rnd(idim, H),
                  ip + "index_kpool_compress_ape": rnd(cfg.index_kpool, idim)})
    return W


def filled(cfg, L: int, g: torch.Generator, layer: int = 0):
    """A pool holding one sequence of L positions (random rows in `layer`) in scattered blocks, as a long-lived
    server's are."""
    pool = KVPool(cfg, DT, torch.device("cpu"), -(-L // BLOCK) * 2)
    cache = SeqCache(pool)
    order = torch.randperm(pool.num_blocks, generator=g)  # scattered: take every other block of a random order
    pool.free = sorted(order[: pool.num_blocks // 2].tolist())
    cache.reserve(L)
    for buf in pool.bufs[layer]:
        buf.normal_(generator=g)
    return pool, cache


def whole_model(a) -> None:
    """Decode tokens/s of the model at each length, sparse against every position kept (--model)."""
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import DTYPES, Model, Segment, dense_format
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    from moe_core.fingerprint import fingerprint
    from moe_experts import packed_cache
    from moe_experts.loading import open_cache
    from moe_experts.store import load_expert_layers

    cfg, ckpt = load_config(a.model), Checkpoint(a.model)
    if not cfg.index_topk:
        raise SystemExit(f"{a.model}: not a DeepSeek Sparse Attention checkpoint")
    dense = dense_format("auto", torch.device("cpu"), DTYPES[cfg.torch_dtype], "auto", cfg.fp8_block)
    t0 = time.perf_counter()
    model = Model(cfg, ckpt, torch.device("cpu"), DT, dense_format=dense)
    cache = open_cache(str(packed_cache.default_dir()), ckpt, fingerprint(ckpt), a.weight_format)  # the services'
    experts = LocalExperts(load_expert_layers(cfg, ckpt, a.weight_format, a.threads, progress=False, cache=cache))
    print(f"CPU: {cpu_name()}; native isa {ISA}; {a.threads} threads; {a.model.name}: {cfg.architecture}, "
          f"{cfg.num_layers} layers, dense {dense}, experts {a.weight_format}; loaded in {time.perf_counter() - t0:.0f} s",
          flush=True)
    every = dataclasses.replace(cfg, index_topk=0)
    g = torch.Generator().manual_seed(0)
    rows = []
    for L in a.lengths:
        pool = KVPool(cfg, DT, torch.device("cpu"), -(-(L + a.reps + 2) // BLOCK) + 4)
        cache = SeqCache(pool)
        cache.reserve(L + a.reps + 2)
        for bufs in pool.bufs:
            for buf in bufs:
                buf.normal_(generator=g)
        per = {"sparse": [], "every position": []}
        for _ in range(a.rounds):
            for name, c in (("sparse", cfg), ("every position", every)):
                model.cfg = c
                ts = []
                for i in range(a.reps + 1):  # the first: warm-up
                    t = time.perf_counter()
                    model.forward([Segment(cache, torch.tensor([5 + i]), L - 1)], experts)
                    ts.append(time.perf_counter() - t)
                per[name].append(statistics.median(ts[1:]))
        model.cfg = cfg
        tps = {n: 1 / statistics.median(v) for n, v in per.items()}
        row = dict(positions=L, **{f"{n} tok/s": round(v, 2) for n, v in tps.items()},
                   speedup=round(tps["sparse"] / tps["every position"], 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| positions | sparse tok/s | every position tok/s | sparse / every |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['positions']} | {r['sparse tok/s']} | {r['every position tok/s']} | {r['speedup']} |")


def kpool(a) -> None:
    """--glm: GLM-5.3-Flash's DSA layer (a NoPE latent; the k-pool indexer), its decode stage native against torch's."""
    cfg = parse_config(synth_checkpoint.config_of("glm-5.3-flash", 4, {}))
    layer = next(L for L in range(cfg.num_layers) if cfg.has_indexer(L) and not cfg.is_linear_attention(L))
    g = torch.Generator().manual_seed(0)
    W = layer_weights(cfg, g, layer)
    inv_freq, rope_scaling = rope_inv_freq(cfg)
    scale = cfg.qk_nope_head_dim ** -0.5
    print(f"CPU: {cpu_name()}; native isa {ISA}; {a.threads} threads; GLM-5.3-Flash's DSA layer at full width "
          f"({cfg.num_heads} heads over a NoPE latent of {cfg.kv_lora_rank}; the indexer's {cfg.index_heads} x "
          f"{cfg.index_dim} over pools of {cfg.index_kpool} keeping {cfg.index_topk} positions), bf16 model and cache",
          flush=True)
    rows = []
    for L in a.lengths:
        pool, cache = filled(cfg, L, g, layer)
        cos, sin = rope_cos_sin(inv_freq, rope_scaling, torch.tensor([L - 1]), DT)
        x = torch.randn(1, cfg.hidden_size, generator=g).to(DT)
        p = f"model.layers.{layer}.self_attn."
        sides = {n: (lambda native=native: mla_attention(cfg, W, p, x, cos, sin, SequenceKV(cache, L - 1, 1), layer,
                                                          native, scale)) for n, native in (("native", True),
                                                                                            ("torch", False))}
        torch.testing.assert_close(sides["native"]().float(), sides["torch"]().float(), rtol=0.05, atol=0.02)
        per = {n: [] for n in sides}
        for _ in range(a.rounds):
            for n, f in sides.items():
                per[n].append(median_ms(f, a.reps))
        ms = {n: statistics.median(v) for n, v in per.items()}
        row = dict(positions=L, **{f"{n} ms": round(v, 2) for n, v in ms.items()},
                   speedup=round(ms["torch"] / ms["native"], 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| positions | torch path ms | native ms | torch / native |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['positions']} | {r['torch ms']} | {r['native ms']} | {r['speedup']}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=pathlib.Path, help="the whole model's decode (see above)")
    ap.add_argument("--weight-format", default="int4", help="--model: the routed experts' format")
    ap.add_argument("--glm", action="store_true", help="GLM-5.3-Flash's DSA layer instead (see above)")
    a = ap.parse_args()
    native.init_pool(a.threads)
    torch.set_num_threads(a.threads)
    if a.model:
        return whole_model(a)
    if a.glm:
        return kpool(a)
    raw = synth_checkpoint.config_of("deepseek-v3.2", 4, {})
    sparse = parse_config(raw)
    dense = dataclasses.replace(sparse, index_topk=0)  # every position kept: MLA's dense attention
    g = torch.Generator().manual_seed(0)
    W = layer_weights(sparse, g)
    inv_freq, rope_scaling = rope_inv_freq(sparse)
    nh, r, dr, ih, idim, k = sparse.num_heads, sparse.kv_lora_rank, sparse.qk_rope_head_dim, sparse.index_heads, \
        sparse.index_dim, sparse.index_topk
    scale = (sparse.qk_nope_head_dim + dr) ** -0.5
    probe = torch.ones(1 << 28)
    peak = max(native.fma_peak_flops(10_000_000) for _ in range(5))
    print(f"CPU: {cpu_name()}; native isa {ISA}; {a.threads} threads; DeepSeek-V3.2 layer at full width, bf16 model "
          f"and cache; fp32 FMA peak {peak / 1e9:.0f} GFLOP/s", flush=True)
    rows = []
    for L in a.lengths:
        pool, cache = filled(sparse, L, g)
        cos, sin = rope_cos_sin(inv_freq, rope_scaling, torch.tensor([L - 1]), DT)
        x = (torch.randn(1, sparse.hidden_size, generator=g)).to(DT)
        p = "model.layers.0.self_attn."

        def stage(cfg):
            return lambda: mla_attention(cfg, W, p, x, cos, sin, SequenceKV(cache, L - 1, 1), 0, True, scale)
        C, KPE, IK = pool.bufs[0]
        table = cache.table()
        q_idx, w_idx = torch.randn(ih, idim, generator=g), torch.randn(ih, generator=g)
        q_lat = torch.randn(nh, r + dr, generator=g) * 0.05
        sel = dsa_top_k(dsa_scores(q_idx, w_idx, IK, table, L, idim ** -0.5), k)
        parts = {
            "sparse stage": stage(sparse), "dense stage": stage(dense),
            "indexer scores": lambda: dsa_scores(q_idx, w_idx, IK, table, L, idim ** -0.5),
            "top k": lambda s=dsa_scores(q_idx, w_idx, IK, table, L, idim ** -0.5): dsa_top_k(s, k),
            "sparse latent attention": lambda: mla_paged_attention(q_lat, C, KPE, table, L, scale, selected=sel),
            "dense latent attention": lambda: mla_paged_attention(q_lat, C, KPE, table, L, scale),
        }
        per = {n: [] for n in parts}
        bw = []
        for _ in range(a.rounds):
            bw.append(native.read_bandwidth(probe.data_ptr(), probe.numel()) / 1e9)
            for n, f in parts.items():
                per[n].append(median_ms(f, a.reps))
        ms = {n: statistics.median(v) for n, v in per.items()}
        gbps = statistics.median(bw)
        n_sel = min(k, L)
        macs = {"sparse": ih * idim * L + nh * n_sel * (2 * r + dr), "dense": nh * L * (2 * r + dr)}
        cache_bytes = {"sparse": L * idim * 2 + n_sel * (r + dr) * 2, "dense": L * (r + dr) * 2}
        attn = {"sparse": ms["indexer scores"] + ms["top k"] + ms["sparse latent attention"],
                "dense": ms["dense latent attention"]}
        row = dict(positions=L, dram_gbps=round(gbps, 1), **{f"{n} ms": round(v, 3) for n, v in ms.items()},
                   stage_speedup=round(ms["dense stage"] / ms["sparse stage"], 2),
                   attention_speedup=round(attn["dense"] / attn["sparse"], 2))
        for side in ("sparse", "dense"):
            row[f"{side} GMAC"] = round(macs[side] / 1e9, 3)
            row[f"{side} cache MB"] = round(cache_bytes[side] / 1e6, 1)
            row[f"{side} compute floor ms"] = round(2 * macs[side] / peak * 1e3, 2)
            row[f"{side} bytes floor ms"] = round(cache_bytes[side] / (gbps * 1e9) * 1e3, 2)
            row[f"{side} bound"] = "arithmetic" if macs[side] * 2 / peak > cache_bytes[side] / (gbps * 1e9) \
                else "bytes"
        rows.append(row)
        print(json.dumps(row), flush=True)

    print("\n| positions | dense stage ms | sparse stage ms | stage x | dense attention ms | sparse attention ms "
          "(scores + top k + latent) | attention x | dense: GMAC / MB / bound | sparse: GMAC / MB / bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in rows:
        print(f"| {w['positions']} | {w['dense stage ms']:.2f} | {w['sparse stage ms']:.2f} | {w['stage_speedup']} | "
              f"{w['dense latent attention ms']:.2f} | {w['indexer scores ms']:.2f} + {w['top k ms']:.2f} + "
              f"{w['sparse latent attention ms']:.2f} | {w['attention_speedup']} | {w['dense GMAC']} / "
              f"{w['dense cache MB']} / {w['dense bound']} ({w['dense compute floor ms']} ms at peak) | "
              f"{w['sparse GMAC']} / {w['sparse cache MB']} / {w['sparse bound']} "
              f"({w['sparse compute floor ms']} ms at peak) |")


if __name__ == "__main__":
    main()
