"""DeepSeek-V4's compressed attention at depth on the CPU: one DeepSeek-V4-Flash CSA layer (entries of 4 positions, the
lightning indexer's 64 heads of 128 keeping 512) and one HCA layer (entries of 128) at full width (hidden 4096, 64
heads of 512 over one KV head, q_lora 1024, a window of 128), bf16, their caches filled directly (random rows) at each
length, through the service's own code (gpu_service/model/compressed_attention.py: torch's ops, the CSA indexer on the
native DSA kernels as on a CPU service) -- against the same layers
with their attention made dense (compression rate 1, index_topk at least the context: every position an entry, all
kept), interleaved, the median of each round's median.

Timed per layer: the attention (`attend`: the window's keys, the entries, the indexer's scores and pick, the softmax
attention) and the whole stage (projections, compressors, output). Each attention's two bounds from this run's own
ceilings: its multiply-adds at the fp32 FMA peak (native.fma_peak_flops) and its bytes of cache at the DRAM read probe
(native.read_bandwidth); the larger is the bound it meets.

    python bench/bench_compressed_attention.py [--lengths 2048 32768] [--rounds 3] [--reps 5] [--threads 2]
        [--prefill 2048 8192] [--prefill-at 30720]
    python bench/bench_compressed_attention.py --heads 1 2048 [--rounds 3] [--reps 20]

--heads T: only the heads' norm and rope (`rope_tail`) of T rows on the layer's shapes -- the query (64 heads of 512,
unweighted norm first), the key (one head), the output turned back (64 heads), the indexer's query (64 heads of 128)
-- torch's ops against the native call, interleaved (the native one turns x in place, as the service's callers let it:
the timing does not depend on the values).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import statistics
import sys

from common import cpu_name, median_ms  # noqa: E402
from moe_core.openmp import passive_by_default  # noqa: E402

passive_by_default()

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import synth_checkpoint  # noqa: E402

from gpu_service.engine.kv_pool import BLOCK, KVPool, SeqCache, block_bytes  # noqa: E402
from gpu_service.model import compressed_attention as ca  # noqa: E402
from gpu_service.model.attention import SequenceKV  # noqa: E402
from gpu_service.model.layers import rope_cos_sin, rope_inv_freq  # noqa: E402
from moe_core.config import parse_config  # noqa: E402
from moe_kernels import ISA, native  # noqa: E402

DT = torch.bfloat16


def layer_weights(cfg, L: int, g: torch.Generator) -> dict:
    """Layer L's attention weights at random (std 0.02; norms 1, the fp32 ones fp32, as the service keeps them)."""
    H, nh, D, qr, g_, R = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    rnd = lambda *shape, dt=DT: (torch.randn(*shape, generator=g) * 0.02).to(dt)  # noqa: E731
    p = f"model.layers.{L}.attn."
    W = {p + "wq_a.weight": rnd(qr, H), p + "q_norm.weight": torch.ones(qr), p + "wq_b.weight": rnd(nh * D, qr),
         p + "wkv.weight": rnd(D, H), p + "norm.weight": torch.ones(D), p + "wo_a.weight": rnd(g_ * R, nh * D // g_),
         p + "wo_b.weight": rnd(H, g_ * R), p + "attn_sink": torch.zeros(nh)}
    for cp, d, c in ((p + "compressor.", D, 2 if cfg.csa(L) else 1), (p + "indexer.compressor.", cfg.index_dim, 2)):
        if cp.endswith("indexer.compressor.") and not cfg.csa(L):
            continue
        W.update({cp + "wkv.weight": rnd(c * d, H, dt=torch.float32), cp + "wgate.weight": rnd(c * d, H, dt=torch.float32),
                  cp + "ape": rnd(cfg.compress_rates[L], c * d, dt=torch.float32), cp + "norm.weight": torch.ones(d)})
    if cfg.csa(L):
        W.update({p + "indexer.wq_b.weight": rnd(cfg.index_heads * cfg.index_dim, qr),
                  p + "indexer.weights_proj.weight": rnd(cfg.index_heads, H, dt=torch.float32)})
    return W


def state(cfg, L: int, start: int, g: torch.Generator) -> tuple:
    """Layer L's state (SeqCache.states) of a sequence at `start` positions, random: the window's keys, the kept
    compressor rows."""
    st = [torch.randn(min(start, cfg.sliding_window - 1), cfg.head_dim, generator=g).to(DT)]
    rate = cfg.compress_rates[L]
    for d, on in ((cfg.head_dim, rate), (cfg.index_dim, cfg.csa(L))):
        if on:
            rows, width = start - ca.first_open(start, rate, int(cfg.csa(L))), (2 if cfg.csa(L) else 1) * d
            st += [torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)]
    return tuple(st)


def cache_bytes() -> str:
    """The published DeepSeek-V4-Flash's (43 layers) cache: the pool's bytes a position and a sequence's states."""
    cfg = parse_config(synth_checkpoint.config_of("deepseek-v4-flash", None, {}))
    per_pos = block_bytes(cfg, DT) / BLOCK
    kinds = collections.Counter(cfg.layer_types)
    return (f"published config ({cfg.num_layers} layers: {dict(kinds)}), bf16: the pool {per_pos / 1024:.2f} KiB a "
            f"position ({per_pos * 2**20 / 2**30:.2f} GiB at 1M), a sequence's states at most "
            f"{ca.state_bytes(cfg, DT) / 2**20:.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, nargs="*", default=[],
                    help="also time a prompt chunk of each of these lengths through each layer (from position 0)")
    ap.add_argument("--prefill-at", type=int, default=0,
                    help="with --prefill: the chunks start here (the cache before it filled directly), timed through "
                         "the CSA layer with each row gathering its kept entries and with every row over all of them")
    ap.add_argument("--heads", type=int, nargs="*", default=[],
                    help="only time the heads' norm and rope on this many rows each (torch's ops against native)")
    a = ap.parse_args()
    native.init_pool(a.threads)
    torch.set_num_threads(a.threads)
    comp = parse_config(synth_checkpoint.config_of("deepseek-v4-flash", 2, {"compress_ratios": [4, 128]}))
    if a.heads:
        return heads(a, comp)
    g = torch.Generator().manual_seed(0)
    W = {**layer_weights(comp, 0, g), **layer_weights(comp, 1, g)}
    W[ca.ROPE] = rope_inv_freq(comp)[0]
    peak = max(native.fma_peak_flops(10_000_000) for _ in range(5))
    probe = torch.ones(1 << 28)
    print(f"CPU: {cpu_name()}; native isa {ISA} (torch's bf16 matmuls, the indexer native); {a.threads} threads; "
          f"DeepSeek-V4-Flash CSA and HCA layers at full width, bf16 model and cache; fp32 FMA peak "
          f"{peak / 1e9:.0f} GFLOP/s", flush=True)
    print(cache_bytes(), flush=True)
    nh, D, Hi, Di, k, win = comp.num_heads, comp.head_dim, comp.index_heads, comp.index_dim, comp.index_topk, \
        comp.sliding_window
    rows = []
    for L in a.lengths:
        dense = dataclasses.replace(comp, compress_rates=(1, 1), index_topk=L + 1)
        caches = {}
        weights = {"compressed": W, "dense": {n: t[:1] if n.endswith(".ape") else t for n, t in W.items()}}  # (rate 1)
        for name, cfg in (("compressed", comp), ("dense", dense)):
            pool = KVPool(cfg, DT, torch.device("cpu"), -(-(L + 1) // BLOCK) + 1)
            cache = SeqCache(pool)
            cache.reserve(L + 1)
            for bufs in pool.bufs:  # the entries
                for buf in bufs:
                    buf.normal_(generator=g)
            cache.states = [state(cfg, layer, L, g) for layer in range(cfg.num_layers)]
            caches[name] = (cfg, cache)
        cos, sin = rope_cos_sin(W[ca.ROPE], 1.0, torch.tensor([L]), DT)
        x = torch.randn(1, comp.hidden_size, generator=g).to(DT)
        qr = torch.randn(1, comp.q_lora_rank, generator=g).to(DT)
        q = torch.randn(1, nh, D, generator=g).to(DT)
        key = torch.randn(1, D, generator=g).to(DT)

        def part(name: str, layer: int, whole: bool):
            cfg, cache = caches[name]
            p, w = f"model.layers.{layer}.attn.", weights[name]
            if whole:
                return lambda: ca.compressed_attention(cfg, w, p, x, cos, sin, SequenceKV(cache, L, 1), layer, True)
            K = torch.cat([cache.states[layer][0], key])  # the window's keys
            return lambda: ca.attend(cfg, w, p, x, qr, q, cos, sin, cache, layer, L, K, True)
        parts = {f"{n} {kind} {what}": part(n, layer, what == "stage") for n in ("compressed", "dense")
                 for layer, kind in ((0, "CSA"), (1, "HCA")) for what in ("attention", "stage")}
        per = {n: [] for n in parts}
        bw = []
        for _ in range(a.rounds):
            bw.append(native.read_bandwidth(probe.data_ptr(), probe.numel()) / 1e9)
            for n, f in parts.items():
                per[n].append(median_ms(f, a.reps))
        ms = {n: statistics.median(v) for n, v in per.items()}
        gbps = statistics.median(bw)
        n_csa, n_hca = L // 4, L // 128
        keys = {"compressed CSA": win + min(k, n_csa), "compressed HCA": win + n_hca, "dense": win + L}
        macs = {"compressed CSA": Hi * Di * n_csa + 2 * nh * D * keys["compressed CSA"],
                "compressed HCA": 2 * nh * D * keys["compressed HCA"], "dense": 2 * nh * D * keys["dense"]}
        cache_mb = {"compressed CSA": (n_csa * Di + keys["compressed CSA"] * D) * 2 / 1e6,
                    "compressed HCA": keys["compressed HCA"] * D * 2 / 1e6, "dense": keys["dense"] * D * 2 / 1e6}
        row = dict(positions=L, dram_gbps=round(gbps, 1), **{f"{n} ms": round(v, 2) for n, v in ms.items()})
        for kind in ("CSA", "HCA"):
            row[f"{kind} attention x"] = round(ms[f"dense {kind} attention"] / ms[f"compressed {kind} attention"], 2)
            row[f"{kind} stage x"] = round(ms[f"dense {kind} stage"] / ms[f"compressed {kind} stage"], 2)
        for side in macs:
            flo, blo = 2 * macs[side] / peak * 1e3, cache_mb[side] / 1e3 / gbps * 1e3
            row[f"{side}: GMAC / MB / bound"] = f"{macs[side] / 1e9:.3f} / {cache_mb[side]:.1f} / " + \
                f"{'arithmetic' if flo > blo else 'bytes'} ({flo:.2f} ms at the FMA peak, {blo:.2f} ms at the probe)"
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| positions | layer | dense attention ms | compressed attention ms | attention x | dense stage ms | "
          "compressed stage ms | stage x |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        for kind in ("CSA", "HCA"):
            print(f"| {r['positions']} | {kind} | {r[f'dense {kind} attention ms']} | "
                  f"{r[f'compressed {kind} attention ms']} | {r[f'{kind} attention x']} | "
                  f"{r[f'dense {kind} stage ms']} | {r[f'compressed {kind} stage ms']} | {r[f'{kind} stage x']} |")
    for r in rows:
        print(f"{r['positions']} positions, DRAM {r['dram_gbps']} GB/s: " +
              "; ".join(f"{s} {r[f'{s}: GMAC / MB / bound']}" for s in ("compressed CSA", "compressed HCA", "dense")))
    if a.prefill and a.prefill_at:
        late_prefill(a, comp, W, g)
    elif a.prefill:
        prefill(a, comp, W, g)


def heads(a, comp) -> None:
    """The heads' norm and rope (rope_tail) on torch's ops and as one native call, interleaved."""
    g = torch.Generator().manual_seed(0)
    print(f"CPU: {cpu_name()}; native isa {ISA}; {a.threads} threads; DeepSeek-V4-Flash's heads, bf16; medians of "
          f"{a.rounds} rounds' medians of {a.reps}", flush=True)
    print("| rows | heads | torch ms | native ms | torch / native |\n|---|---|---|---|---|")
    pairs = rope_inv_freq(comp)[0].shape[0]  # (the rotary dims' pairs: 32 of each head's 512)
    for t in a.heads:
        ang = torch.rand(t, pairs, generator=g) * 100
        cos, sin = ang.cos().to(DT), ang.sin().to(DT)
        cases = {"q (norm + rope)": (comp.num_heads, comp.head_dim, comp.rms_norm_eps, sin),
                 "k": (1, comp.head_dim, None, sin), "o (turned back)": (comp.num_heads, comp.head_dim, None, -sin),
                 "indexer q": (comp.index_heads, comp.index_dim, None, sin)}
        for name, (nh, d, eps, s) in cases.items():
            x = torch.randn(t, nh, d, generator=g).to(DT)
            times = collections.defaultdict(list)
            for _ in range(a.rounds):
                for native_ in (False, True):
                    times[native_].append(median_ms(lambda: ca.rope_tail(x, cos, s, native_, eps), a.reps))
            tt, tn = statistics.median(times[False]), statistics.median(times[True])
            print(f"| {t} | {name} | {tt:.3f} | {tn:.3f} | {tt / tn:.2f}x |", flush=True)


def late_prefill(a, comp, W: dict, g: torch.Generator) -> None:
    """A prompt chunk of each length from position a.prefill_at through the CSA layer's whole stage: its rows
    gathering their kept entries (the service's path) against every row over all the closed entries, masked,
    interleaved."""
    S = a.prefill_at
    print(f"\nchunks from position {S} ({S // 4} CSA entries before them, {comp.index_topk} kept a row)\n"
          "| chunk | gathered ms | all entries ms | x |\n|---|---|---|---|")
    for n in a.prefill:
        cache = SeqCache(KVPool(comp, DT, torch.device("cpu"), -(-(S + n) // BLOCK) + 1))
        cache.reserve(S + n)
        for bufs in cache.pool.bufs:
            for buf in bufs:
                buf.normal_(generator=g)
        cache.states = [state(comp, layer, S, g) for layer in range(comp.num_layers)]
        x = torch.randn(n, comp.hidden_size, generator=g).to(DT)
        cos, sin = rope_cos_sin(W[ca.ROPE], 1.0, torch.arange(S, S + n), DT)
        kv, per = SequenceKV(cache, S, n), {}
        for _ in range(a.rounds):
            for name, sparse in (("gathered", ca.SPARSE_ENTRIES), ("all", 1 << 30)):
                ca.SPARSE_ENTRIES, keep = sparse, ca.SPARSE_ENTRIES
                per.setdefault(name, []).append(median_ms(
                    lambda: ca.compressed_attention(comp, W, "model.layers.0.attn.", x, cos, sin, kv, 0), 1))
                ca.SPARSE_ENTRIES = keep
        ms = {k: statistics.median(v) for k, v in per.items()}
        print(f"| {n} | {ms['gathered']:.0f} | {ms['all']:.0f} | {ms['all'] / ms['gathered']:.2f} |", flush=True)


def prefill(a, comp, W: dict, g: torch.Generator) -> None:
    """A prompt chunk of each length through each layer's whole stage (projections, compressors, indexer, attention),
    compressed and made dense, interleaved: the median of each round's median."""
    print("\n| chunk | layer | dense stage ms | compressed stage ms | x |\n|---|---|---|---|---|")
    for n in a.prefill:
        dense = dataclasses.replace(comp, compress_rates=(1, 1), index_topk=n + 1)
        weights = {"compressed": W, "dense": {k: t[:1] if k.endswith(".ape") else t for k, t in W.items()}}
        x = torch.randn(n, comp.hidden_size, generator=g).to(DT)
        cos, sin = rope_cos_sin(W[ca.ROPE], 1.0, torch.arange(n), DT)
        per = {}
        for _ in range(a.rounds):
            for name, cfg in (("compressed", comp), ("dense", dense)):
                for layer in (0, 1):
                    cache = SeqCache(KVPool(cfg, DT, torch.device("cpu"), -(-n // BLOCK) + 1))
                    cache.reserve(n)
                    w, prefix, kv = weights[name], f"model.layers.{layer}.attn.", SequenceKV(cache, 0, n)
                    per.setdefault((name, layer), []).append(median_ms(
                        lambda: ca.compressed_attention(cfg, w, prefix, x, cos, sin, kv, layer), max(1, a.reps // 2)))
        ms = {k: statistics.median(v) for k, v in per.items()}
        for layer, kind in ((0, "CSA"), (1, "HCA")):
            d, c = ms[("dense", layer)], ms[("compressed", layer)]
            print(f"| {n} | {kind} | {d:.1f} | {c:.1f} | {d / c:.2f} |", flush=True)


if __name__ == "__main__":
    main()
