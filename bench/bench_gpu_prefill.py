"""Prefill of a long prompt with the routed experts on the expert service (CPU) against on the GPU side
(gpu-service --gpu-prefill-tokens), one expert service kept up, the GPU side restarted with each setting,
rounds interleaved: time to first token of a --prompt-token prompt in one step.

    python bench/bench_gpu_prefill.py [--arch qwen3-30b-a3b] [--layers 2] [--prompt 2048] [--runs 2]
                                      [--weight-format bf16] [--device auto] [--threads 2]

A real-width synthetic checkpoint (tools/synth_checkpoint.py, vocabulary cut to 32000). On a CPU-only host the
GPU side's "device" is the same CPU running the same kernels from the mapped cache: the figure there is the
exchange saved, not the GPU's speed; scripts/gpu_check.sh runs it on CUDA.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile

from common import Services, cpu_name, generate, synth_model, wait_healthy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (one step)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--weight-format", default="bf16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="an existing checkpoint instead of a synthetic one")
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp())
    model = a.model or synth_model(a.arch, a.layers, tmp / "model", {"vocab_size": 32000})
    cache = tmp / "packed"
    print(f"# {cpu_name()}; {a.arch}, {a.layers} layers, experts {a.weight_format}, GPU side on {a.device}, "
          f"{a.prompt}-token prompt")
    base = ("--device", a.device, "--threads", str(a.threads), "--max-step-tokens", str(a.prompt),
            "--prefix-cache-gb", "0", "--gpu-prefill-cache-dir", str(cache))
    settings = {"expert service": (), "GPU side": ("--gpu-prefill-tokens", str(min(512, a.prompt)))}
    svc = Services(model, tmp, gpu_args=base, expert_args=("--threads", str(a.threads), "--weight-format",
                                                            a.weight_format, "--cache-dir", str(cache),
                                                            "--max-tokens", str(a.prompt)))
    prompt = [(i * 7919) % 30000 + 2 for i in range(a.prompt)]
    rows: dict = {k: [] for k in settings}
    try:
        for r in range(a.runs):
            for name, extra in settings.items():
                svc.gpu.terminate()
                svc.gpu.wait(60)
                svc.gpu_args = base + extra
                svc.gpu = svc.start_gpu()
                wait_healthy(svc.gpu_port, svc.gpu, timeout=600)
                generate(svc.gpu_port, prompt[:64], 2)  # warm-up
                ttft, _ = generate(svc.gpu_port, prompt, 2)
                rows[name].append(ttft)
                print(json.dumps({"experts_on": name, "round": r, "ttft_s": round(ttft, 3),
                                  "prefill_tok_s": round(a.prompt / ttft, 1)}), flush=True)
    finally:
        svc.stop()
    b = statistics.median(rows["expert service"])
    print("\n| routed experts of the prefill on | time to first token s | prefill tok/s | vs the expert service |"
          "\n|---|---|---|---|")
    for name, v in rows.items():
        m = statistics.median(v)
        print(f"| {name} | {m:.3f} | {a.prompt / m:.1f} | {b / m:.2f}x |")


if __name__ == "__main__":
    main()
