"""The gated delta rule of one Qwen3-Next / Qwen3.5 linear-attention layer at the published shape
(16 q/k heads, 32 v heads, 128 dims), gpu_service.model.linear_attention against transformers' torch
implementation on the same inputs, interleaved, medians of --reps:

- prefill of t tokens (the chunked form), carrying a state in, and the share of the fp32 FMA peak
  (probed in the same run, CPU) its matrix products reach;
- decode of one token (the recurrence), and the time its state traffic (S read and written, fp32,
  2 MiB a layer) takes at the DRAM read bandwidth probed in the same run (CPU only).

    python bench/bench_deltanet.py --tokens 512 4096 --threads 2
    python bench/bench_deltanet.py --device cuda

The projections around the rule (in_proj_*, out_proj) are ordinary dense layers: bench_kernels covers them."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import cpu_name  # noqa: E402
from gpu_service.model.linear_attention import CHUNK, delta_rule  # noqa: E402

NK, NV, D = 16, 32, 128


def inputs(t: int, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, NK, D, generator=g), torch.randn(t, NK, D, generator=g)
    v = torch.randn(t, NV, D, generator=g)
    decay = -torch.rand(t, NV, generator=g) * 0.5
    beta = torch.rand(t, NV, generator=g)
    S = torch.randn(NV, D, D, generator=g) * 0.1
    cast = lambda x: x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), decay.to(device), beta.to(device), S.to(device)


def chunked_flops(t: int) -> int:
    """Floating-point operations of the chunked form's matrix products and triangular solves for t tokens."""
    C, n = CHUNK, -(-t // CHUNK)
    per_head_chunk = 2 * C * C * D * 2 + C * C * D * 2 + 2 * C * D * D * 2 + 2 * C * C * D + 2 * D * C * D
    return NV * n * per_head_chunk


def timed(fn, sync) -> float:
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev, dtype = torch.device(a.device), {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    peak = None
    if dev.type == "cpu":
        from moe_kernels import native
        native.init_pool(torch.get_num_threads())
        peak = max(native.fma_peak_flops(10_000_000) for _ in range(5))
    print(f"{where}; {torch.get_num_threads()} threads; q/k/v in {a.dtype}, state fp32; {NK} q/k heads, {NV} v heads, "
          f"{D} dims" + (f"; fp32 FMA peak {peak / 1e9:.0f} GFLOP/s" if peak else ""))

    @torch.inference_mode()
    def ours(q, k, v, g, b, S):
        return delta_rule(q, k, v, g, b, S)

    @torch.inference_mode()
    def theirs(q, k, v, g, b, S, fn):
        return fn(q[None], k[None], v[None], g[None], b[None], initial_state=S[None], output_final_state=True,
                  use_qk_l2norm_in_kernel=True)

    for t in a.tokens:
        x = inputs(t, dev, dtype)
        o1, S1 = ours(*x)
        o2, S2 = theirs(*x, hf.torch_chunk_gated_delta_rule)
        err = max((o1.float() - o2[0].float()).abs().max().item(), (S1 - S2[0]).abs().max().item())
        mine, ref = [], []
        for _ in range(a.reps):
            mine.append(timed(lambda: ours(*x), sync))
            ref.append(timed(lambda: theirs(*x, hf.torch_chunk_gated_delta_rule), sync))
        m, r = statistics.median(mine), statistics.median(ref)
        share = f", {chunked_flops(t) / m / peak:.0%} of the FMA peak" if peak else ""
        print(f"prefill {t:5} tokens: {m * 1e3:8.1f} ms ours{share}, {r * 1e3:8.1f} ms transformers' torch_chunk "
              f"({r / m:.2f}x); max |difference| {err:.1e}")
    x = inputs(1, dev, dtype)
    (o1, S1), (o2, S2) = ours(*x), theirs(*x, hf.torch_recurrent_gated_delta_rule)
    err = max((o1.float() - o2[0].float()).abs().max().item(), (S1 - S2[0]).abs().max().item())
    mine, ref = [], []
    for _ in range(max(20, a.reps)):
        mine.append(timed(lambda: ours(*x), sync))
        ref.append(timed(lambda: theirs(*x, hf.torch_recurrent_gated_delta_rule), sync))
    m, r = statistics.median(mine), statistics.median(ref)
    line = (f"decode 1 token: {m * 1e6:.0f} us ours, {r * 1e6:.0f} us transformers' torch_recurrent ({r / m:.2f}x); "
            f"max |difference| {err:.1e}")
    if dev.type == "cpu":
        probe = torch.ones(1 << 28)
        bw = statistics.median(native.read_bandwidth(probe.data_ptr(), probe.numel()) for _ in range(5))
        floor = 2 * NV * D * D * 4 / bw  # the state read once and written once
        line += f"; its state traffic at the probed {bw / 1e9:.1f} GB/s: {floor * 1e6:.0f} us ({floor / m:.0%} of ours)"
    print(line)


if __name__ == "__main__":
    main()
