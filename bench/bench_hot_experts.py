"""Hot experts on the GPU side: decode tokens/s with 0, 8 and 32 hot experts a layer (gpu-service
--gpu-experts N), one expert service kept up while the GPU side restarts with each N, rounds interleaved.

    python bench/bench_hot_experts.py [--arch qwen3-30b-a3b] [--layers 2] [--hot 0,8,32] [--tokens 32]
                                      [--runs 2] [--weight-format bf16] [--device auto]

A real-width synthetic checkpoint (tools/synth_checkpoint.py, random weights, its vocabulary cut to 32000 so the
experts dominate the bytes as at full depth). Prints per N: decode tok/s (median), its ratio to N = 0, and
the share of (token, expert) pairs the hot experts computed (moe_expert_pairs_total) in the timed runs. Random
routers spread tokens evenly, so the share is about N / E here; real models' routers are skewed and the share of
the same N higher. On a CPU-only host the GPU side computes its hot experts on the same cores and DRAM as the
expert service: the figure there is the cost of the split, not a gain; the gain needs a GPU (scripts/gpu_check.sh).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time
import urllib.request

from common import Services, cpu_name, free_port, generate, synth_model, wait_healthy


def counters(port: int) -> dict:
    """-> {"hot", "remote": pairs computed there, "swaps": layers whose placement changed} so far."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {"hot": 0.0, "remote": 0.0, "swaps": 0.0}
    for line in text.splitlines():
        if line.startswith("moe_expert_pairs_total{"):
            out[line.split('where="')[1].split('"')[0]] = float(line.split()[-1])
        elif line.startswith("moe_hot_experts_swaps_total "):
            out["swaps"] = float(line.split()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hot", default="0,8,32", help="hot experts a layer, comma-separated")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2, help="rounds over every N")
    ap.add_argument("--weight-format", default="bf16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=2, help="each service's threads")
    ap.add_argument("--settle", type=float, default=8.0,
                    help="seconds of warm-up requests before each timed set (placement refreshes every 2 s)")
    ap.add_argument("--model", default=None, help="an existing checkpoint instead of a synthetic one")
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp())
    model = a.model or synth_model(a.arch, a.layers, tmp / "model", {"vocab_size": 32000})
    ns = [int(n) for n in a.hot.split(",")]
    print(f"# {cpu_name()}; {a.arch}, {a.layers} layers, experts {a.weight_format}, GPU side on {a.device}")
    mport = free_port()
    base = ("--device", a.device, "--threads", str(a.threads), "--metrics-port", str(mport), "--gpu-experts-refresh", "2")
    svc = Services(model, tmp, gpu_args=base + ("--gpu-experts", str(ns[0])),
                   expert_args=("--threads", str(a.threads), "--weight-format", a.weight_format))
    prompt = list(range(100, 164))
    rows: dict = {n: {"rate": [], "share": [], "swaps": []} for n in ns}
    try:
        for r in range(a.runs):
            for n in ns:
                if r or n != ns[0]:  # the GPU side again with this N; the expert service stays up
                    svc.gpu.terminate()
                    svc.gpu.wait(60)
                    svc.gpu_args = base + ("--gpu-experts", str(n))
                    svc.gpu = svc.start_gpu()
                    wait_healthy(svc.gpu_port, svc.gpu, timeout=600)
                t0 = time.monotonic()  # warm-up: the placement follows the workload within a few refreshes
                while time.monotonic() - t0 < a.settle:
                    generate(svc.gpu_port, prompt, a.tokens)
                c0 = counters(mport)
                rates = [generate(svc.gpu_port, prompt, a.tokens)[1] for _ in range(3)]
                c1 = counters(mport)
                hot, remote = c1["hot"] - c0["hot"], c1["remote"] - c0["remote"]
                rows[n]["rate"].append(statistics.median(rates))
                rows[n]["share"].append(hot / (hot + remote) if hot + remote else 0.0)
                rows[n]["swaps"].append(c1["swaps"] - c0["swaps"])
                print(json.dumps({"gpu_experts": n, "round": r, "decode_tok_s": [round(x, 2) for x in rates],
                                  "hot_share": round(rows[n]["share"][-1], 3), "swaps": rows[n]["swaps"][-1]}),
                      flush=True)
    finally:
        svc.stop()
    b = statistics.median(rows[ns[0]]["rate"])
    print("\n| hot experts a layer | decode tok/s | vs first | pairs computed hot | layer swaps while timed |"
          "\n|---|---|---|---|---|")
    for n in ns:
        m = statistics.median(rows[n]["rate"])
        print(f"| {n} | {m:.2f} | {m / b:.3f}x | {statistics.median(rows[n]['share']):.1%} | {sum(rows[n]['swaps']):.0f} |")


if __name__ == "__main__":
    main()
