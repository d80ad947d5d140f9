"""MiniMax-M3's block-sparse attention at depth on the CPU: one sparse layer's attention stage at full width (hidden
6144, 64 query heads over 4 KV heads of 128; the block indexer's 4 heads of 128 keeping 16 blocks of 128 keys per KV
group), its cache filled directly (random rows) at each length, run through the service's own decode code
(gpu_service/model/attention.py on a bf16 model, its projections packed bf16 as --dense-format auto packs them, the
native decode kernels) -- block-sparse (block_sparse_attention) against the same layer attending to every position
(gqa_attention: the full-attention layers' native paged kernel), interleaved, the median of each round's median.

Beside the stage, its parts alone: the indexer's scores over the pool, the blocks' pick, the attention over each KV
head's kept positions; the attention over every position. Each attention's two bounds from this run's own ceilings:
its multiply-adds at the fp32 FMA peak (native.fma_peak_flops) and its bytes of cache at the DRAM read probe
(native.read_bandwidth): the larger is the bound it meets.

    python bench/bench_block_sparse.py [--lengths 2048 8192 32768] [--rounds 3] [--reps 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import statistics

from common import cpu_name, median_ms  # noqa: E402
from moe_core.openmp import passive_by_default  # noqa: E402

passive_by_default()  # as both services run: torch's threads do not spin beside the native pool's

import torch  # noqa: E402

from bench_sparse_attention import filled, synth_checkpoint  # noqa: E402
from gpu_service.model.attention import (QKV, SequenceKV, block_sparse_attention, gqa_attention,  # noqa: E402
                                         selected_positions)
from gpu_service.model.layers import rope_cos_sin, rope_inv_freq  # noqa: E402
from moe_core.config import parse_config  # noqa: E402
from moe_kernels import ISA, native  # noqa: E402
from moe_kernels.attention import head_scores, paged_decode_attention  # noqa: E402
from moe_kernels.dense import NativeLinear  # noqa: E402

DT = torch.bfloat16
LAYER = 1  # the preset's first sparse layer


def layer_weights(cfg, g: torch.Generator) -> dict:
    """The layer's attention weights at random (std 0.02), packed as the service packs them (q/k/v fused)."""
    H, nh, kv, d, ih, idim = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.index_heads, \
        cfg.index_dim
    p = f"model.layers.{LAYER}.self_attn."
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(DT)  # noqa: E731
    zeros = lambda n: torch.zeros(n, dtype=DT)  # noqa: E731  (zero-centred norms: a weight of 1)
    return {p + QKV: NativeLinear([rnd(nh * d, H), rnd(kv * d, H), rnd(kv * d, H)], "bf16"),
            p + "o_proj.weight": NativeLinear(rnd(H, nh * d), "bf16"), p + "q_norm.weight": zeros(d),
            p + "k_norm.weight": zeros(d), p + "index_q_proj.weight": NativeLinear(rnd(ih * idim, H), "bf16"),
            p + "index_k_proj.weight": NativeLinear(rnd(idim, H), "bf16"), p + "index_q_norm.weight": zeros(idim),
            p + "index_k_norm.weight": zeros(idim)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    native.init_pool(a.threads)
    torch.set_num_threads(a.threads)
    cfg = parse_config(synth_checkpoint.config_of("minimax-m3", 4, {}))
    assert cfg.block_sparse(LAYER)
    g = torch.Generator().manual_seed(0)
    W = layer_weights(cfg, g)
    inv_freq, rope_scaling = rope_inv_freq(cfg)
    nh, kv, d, ih, idim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.index_heads, cfg.index_dim
    kept = cfg.index_topk_blocks * cfg.index_block
    probe = torch.ones(1 << 28)
    peak = max(native.fma_peak_flops(10_000_000) for _ in range(5))
    print(f"CPU: {cpu_name()}; native isa {ISA}; {a.threads} threads; MiniMax-M3 sparse layer at full width, bf16 "
          f"model and cache; {cfg.index_topk_blocks} blocks of {cfg.index_block} kept; fp32 FMA peak "
          f"{peak / 1e9:.0f} GFLOP/s", flush=True)
    rows = []
    p = f"model.layers.{LAYER}.self_attn."
    for L in a.lengths:
        pool, cache = filled(cfg, L, g, LAYER)
        cos, sin = rope_cos_sin(inv_freq, rope_scaling, torch.tensor([L - 1]), DT)
        x = torch.randn(1, cfg.hidden_size, generator=g).to(DT)

        def stage(fn):
            return lambda: fn(cfg, W, p, x, cos, sin, SequenceKV(cache, L - 1, 1), LAYER, True)
        K, V, IK = pool.bufs[LAYER]
        table = cache.table()
        q, qi = torch.randn(nh, d, generator=g), torch.randn(ih, idim, generator=g)
        scores = head_scores(qi, IK[0], table, L)
        sel = selected_positions(cfg, scores, L - 1)
        parts = {
            "sparse stage": stage(block_sparse_attention), "dense stage": stage(gqa_attention),
            "indexer scores": lambda: head_scores(qi, IK[0], table, L),
            "block pick": lambda: selected_positions(cfg, scores, L - 1),
            "sparse attention": lambda: paged_decode_attention(q, K, V, table, L, d ** -0.5, selected=sel),
            "dense attention": lambda: paged_decode_attention(q, K, V, table, L, d ** -0.5),
        }
        per = {n: [] for n in parts}
        bw = []
        for _ in range(a.rounds):
            bw.append(native.read_bandwidth(probe.data_ptr(), probe.numel()) / 1e9)
            for n, f in parts.items():
                per[n].append(median_ms(f, a.reps))
        ms = {n: statistics.median(v) for n, v in per.items()}
        gbs = statistics.median(bw)
        n_sparse = min(kept, L)
        # multiply-adds (scores and weighted sums: 2 a key a dim a head) and cache bytes each attention reads
        flops = {"sparse": 2 * (ih * idim * L + 2 * nh * d * n_sparse), "dense": 2 * 2 * nh * d * L}
        bytes_ = {"sparse": 2 * (idim * L + 2 * kv * d * n_sparse), "dense": 2 * 2 * kv * d * L}
        bound = {s: ("arithmetic" if flops[s] / peak > bytes_[s] / (gbs * 1e9) else "bytes") for s in flops}
        row = dict(positions=L, **{f"{n} ms": round(v, 3) for n, v in ms.items()}, dram_gbs=round(gbs, 1),
                   stage_speedup=round(ms["dense stage"] / ms["sparse stage"], 2),
                   attention_speedup=round(ms["dense attention"] / (ms["indexer scores"] + ms["block pick"]
                                                                    + ms["sparse attention"]), 2),
                   sparse_floor_ms=round(max(flops["sparse"] / peak, bytes_["sparse"] / (gbs * 1e9)) * 1e3, 3),
                   dense_floor_ms=round(max(flops["dense"] / peak, bytes_["dense"] / (gbs * 1e9)) * 1e3, 3),
                   sparse_bound=bound["sparse"], dense_bound=bound["dense"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| positions | sparse stage ms | dense stage ms | stage speedup | indexer + pick + sparse attention ms | "
          "dense attention ms | attention speedup | bounds (sparse / dense) |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = r["indexer scores ms"] + r["block pick ms"] + r["sparse attention ms"]
        print(f"| {r['positions']} | {r['sparse stage ms']} | {r['dense stage ms']} | {r['stage_speedup']} | "
              f"{sp:.3f} | {r['dense attention ms']} | {r['attention_speedup']} | {r['sparse_bound']} "
              f"({r['sparse_floor_ms']} ms) / {r['dense_bound']} ({r['dense_floor_ms']} ms) |")


if __name__ == "__main__":
    main()
