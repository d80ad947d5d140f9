"""Routed-expert kernel benchmark: decode (T=1) and prefill (T=512) for each weight format,
against the machine's own probes (DRAM read bandwidth, the arithmetic peak of the kernel isa;
probed again right before each case) and torch's idiomatic MoE on the same weights, all measured in
this run. Runs on any x86-64 (and elsewhere): every probe is chosen by what the CPU has.

    python bench/bench_kernels.py [--threads 2] [--shapes qwen3,dsv3] [--formats bf16] [--reps 5]
                                  [--isa avx2]

One JSON line per case, then a table. Decode efficiency = bytes of the chosen experts' weights /
time, as a share of the DRAM read bandwidth probed right before (the median over repetitions that
each probe once and then time 64 calls). Prefill efficiency = 2*T*k*3*H*I FLOP / time, as a share
of the peak of the instructions the isa computes with: avx512: vdpbf16ps (bf16) and vpdpbusd
(int8, int4, mxfp4); fp8 widens to bf16 and is measured against bf16's peak on every isa;
amx: TDPBF16PS (bf16), TDPBSUD (int8; the row-blocked signed formats', q6k's and iq4xs's TDPBSSD runs at its rate), vpdpbusd (uint4g32, q4k); avx2: 256-bit fp32 FMA (bf16) and vpmaddubsw+vpmaddwd+vpaddd (int formats); avxvnni: 256-bit fp32 FMA (bf16) and
vpdpbusd on ymm (int formats); portable: none (only the comparison with torch). Prefill also reads every routed expert once, so it is reported against the roofline
model too: the longer of FLOP / peak and weight bytes / DRAM bandwidth, as a share of our time
(with 128 experts and 512 tokens an expert sees about 32 tokens, and AMX is bound by DRAM).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from common import SHAPES, cpu_name, expert_bytes, timed, weights  # noqa: E402
from moe_kernels import native as native  # noqa: E402
from moe_experts.kernels import TorchMoELayer  # noqa: E402
from moe_experts.kernels.native_moe import NativeMoELayer  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="qwen3,dsv3")
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--isa", default=None, help="kernel isa to measure (default: the one chosen for this CPU)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    native.init_pool(a.threads)
    isa = a.isa or native.best_isa()
    probe = torch.ones(1 << 28)
    # the instructions each isa computes with: (name, probe, iterations) for bf16 weights, for int8,
    # for the other int formats. AMX tiles run bf16, int8 and the row-blocked signed formats (int4, int4g32, iq4nl,
    # mxfp4, int8g32, q6k, iq4xs); uint4g32 and q4k run on AVX-512 there.
    vdp = ("vdpbf16ps peak", native.bf16_peak_flops, 10_000_000)
    vnni = ("vpdpbusd peak", native.vnni_peak_ops, 10_000_000)
    fma = ("fp32 FMA peak", native.fma_peak_flops, 10_000_000)
    roof = {"avx512": (vdp, vnni, vnni),
            "avx2": (fma,) + (("vpmaddubsw peak", native.avx2_int8_peak_ops, 10_000_000),) * 2,
            "avxvnni": (fma,) + (("vpdpbusd ymm peak", native.avxvnni_peak_ops, 10_000_000),) * 2,
            "amx": (("TDPBF16PS peak", native.amx_bf16_peak_flops, 500_000),
                    ("TDPBSUD peak", native.amx_int8_peak_ops, 500_000), vnni)}
    tiles = {f: 1 for f in ("int8", "int4", "int4g32", "iq4nl", "mxfp4", "int8g32", "q6k", "iq4xs")} if isa == "amx" else {"int8": 1}
    slot = lambda fmt: {"bf16": 0, "fp8": 0, **tiles}.get(fmt, 2)  # noqa: E731  (fp8 computes in bf16)

    def dram_bw() -> float:
        return statistics.median(native.read_bandwidth(probe.data_ptr(), probe.numel()) for _ in range(5))

    def peaks(fmt: str) -> tuple[float | None, float | None]:  # (bf16's, fmt's); a peak: the best of several
        if isa not in roof:
            return None, None
        best = lambda r: max(r[1](r[2]) for _ in range(5))  # noqa: E731
        bf16 = best(roof[isa][0])
        return bf16, bf16 if slot(fmt) == 0 else best(roof[isa][slot(fmt)])
    bw = dram_bw()
    peak, ipeak = peaks("int8")
    g9 = lambda v: None if v is None else round(v / 1e9, 1)  # noqa: E731
    rows = [{"case": "probe", "cpu": cpu_name(), "isa": isa, "threads": a.threads,
             "dram_read_GBps": round(bw / 1e9, 2), "bf16_roofline_G": g9(peak), "int_roofline_G": g9(ipeak),
             "rooflines": [r[0] for r in roof.get(isa, ())[:2]]}]
    print(json.dumps(rows[0]), flush=True)
    for shape in a.shapes.split(","):
        E, H, I, k = SHAPES[shape]
        gate, up, down = weights(E, H, I)
        ref = TorchMoELayer(gate, up, down, fmt="bf16")
        for fmt in a.formats.split(","):
            op = NativeMoELayer(gate, up, down, fmt=fmt, threads=a.threads, isa=isa)
            # the weights' own bytes (and scales, sums); the kernels' row padding is not counted
            bytes_per_expert = expert_bytes(fmt, H, I)
            g = torch.Generator().manual_seed(1)
            # decode: fresh experts every call, so the weights come from DRAM, not the cache
            calls = [(torch.randn(1, H).bfloat16(), torch.randperm(E, generator=g)[:k].view(1, k).to(torch.int32),
                      torch.rand(1, k)) for _ in range(64)]
            # the roofline is probed next to each measurement: one probe pass, then our 64 calls, then
            # torch's, in turn, and each repetition's ratio is against its own probe. This shared
            # machine's bandwidth drifts by tens of percent within a minute; a ratio against a probe
            # from another moment says more about the neighbours than about the kernel.
            moved, torch_moved = k * bytes_per_expert, k * (ref.nbytes / E)
            for c in calls[:4]:
                op.forward(*c)
                ref.forward(*c)
            bws, ours, theirs = [], [], []
            for _ in range(2 * a.reps):
                bws.append(native.read_bandwidth(probe.data_ptr(), probe.numel()))
                ours.append(timed(lambda: [op.forward(*c) for c in calls]) / len(calls))
                theirs.append(timed(lambda: [ref.forward(*c) for c in calls]) / len(calls))
            bw, t_ours, t_torch = (statistics.median(v) for v in (bws, ours, theirs))
            row = {"case": "decode", "shape": shape, "fmt": fmt, "T": 1, "ours_us": round(t_ours * 1e6, 1),
                   "torch_bf16_us": round(t_torch * 1e6, 1), "ours_GBps": round(moved / t_ours / 1e9, 2),
                   "dram_read_GBps": round(bw / 1e9, 2),
                   "share_of_dram_bw": round(statistics.median(moved / t / b for t, b in zip(ours, bws)), 3),
                   "torch_share_of_dram_bw": round(statistics.median(torch_moved / t / b for t, b in zip(theirs, bws)), 3),
                   "speedup_vs_torch": round(statistics.median(b / a_ for a_, b in zip(ours, theirs)), 2)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            T = a.prefill_tokens
            x = torch.randn(T, H).bfloat16()
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
            w = torch.rand(T, k)
            op.forward(x, ids, w)
            ref.forward(x, ids, w)
            flop = 2 * T * k * 3 * H * I
            # every expert the prompt routes to is read once: at this size the bound may be DRAM, not
            # arithmetic, so the roofline is the slower of the two (probed, as everything, per repetition)
            weight_bytes = int(ids.unique().numel()) * bytes_per_expert
            # as for decode: per repetition the probes, then ours, then torch; ratios per repetition
            roofs, bf16_peaks, bws, ours, theirs = [], [], [], [], []
            for _ in range(a.reps):
                peak, fpeak = peaks(fmt)
                roofs.append(fpeak)
                bf16_peaks.append(peak)
                bws.append(native.read_bandwidth(probe.data_ptr(), probe.numel()))
                ours.append(timed(lambda: op.forward(x, ids, w)))
                theirs.append(timed(lambda: ref.forward(x, ids, w)))
            t_ours, t_torch = statistics.median(ours), statistics.median(theirs)
            share = lambda ts, rs: None if rs[0] is None else round(statistics.median(flop / t / r for t, r in zip(ts, rs)), 3)  # noqa: E731
            row = {"case": "prefill", "shape": shape, "fmt": fmt, "T": T, "ours_ms": round(t_ours * 1e3, 1),
                   "torch_bf16_ms": round(t_torch * 1e3, 1), "ours_GFLOPs": round(flop / t_ours / 1e9, 1),
                   "roofline": roof[isa][slot(fmt)][0] if isa in roof else None,
                   "roofline_GOPs": g9(statistics.median(roofs)) if roofs[0] else None,
                   "share_of_peak": share(ours, roofs), "torch_share_of_bf16_peak": share(theirs, bf16_peaks),
                   "weight_GB": round(weight_bytes / 1e9, 3), "dram_read_GBps": round(statistics.median(bws) / 1e9, 2),
                   "share_of_dram_bw": round(statistics.median(weight_bytes / t / b for t, b in zip(ours, bws)), 3),
                   # the roofline model: time at the peak or at DRAM speed, whichever is longer, over ours
                   "share_of_roofline": None if roofs[0] is None else round(statistics.median(
                       max(flop / r, weight_bytes / b) / t for t, r, b in zip(ours, roofs, bws)), 3),
                   "speedup_vs_torch": round(statistics.median(b / a_ for a_, b in zip(ours, theirs)), 2)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            op = None  # free the packed weights before the next format's
    p = rows[0]
    print(f"\n{p['cpu']}, isa {p['isa']}, {a.threads} threads. Probes at the start: DRAM read {p['dram_read_GBps']} GB/s, "
          f"rooflines {', '.join(p['rooflines']) or 'none'}: {p['bf16_roofline_G']} / {p['int_roofline_G']} G/s; "
          f"each case is compared with the probe taken right before it (in brackets)\n")
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    print("| case | shape | fmt | ours | torch bf16 | ours vs roofline | torch vs roofline | speedup | prefill: DRAM share, roofline share |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows[1:]:
        if r["case"] == "decode":
            print(f"| decode T=1 | {r['shape']} | {r['fmt']} | {r['ours_us']} us | {r['torch_bf16_us']} us | "
                  f"{r['share_of_dram_bw']:.0%} of DRAM BW ({r['dram_read_GBps']} GB/s) | {r['torch_share_of_dram_bw']:.0%} | {r['speedup_vs_torch']}x | |")
        else:
            print(f"| prefill T={r['T']} | {r['shape']} | {r['fmt']} | {r['ours_ms']} ms | {r['torch_bf16_ms']} ms | "
                  f"{pct(r['share_of_peak'])} of {r['roofline']} ({r['roofline_GOPs']} G/s) | {pct(r['torch_share_of_bf16_peak'])} of the bf16 roofline | "
                  f"{r['speedup_vs_torch']}x | {pct(r['share_of_dram_bw'])} of {r['dram_read_GBps']} GB/s, {pct(r['share_of_roofline'])} |")


if __name__ == "__main__":
    main()
