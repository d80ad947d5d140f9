"""The gated delta rule of one Qwen3-Next / Qwen3.5 linear-attention layer at the published shape
(16 q/k heads, 32 v heads, 128 dims), gpu_service.model.linear_attention against transformers' torch
implementation on the same inputs, interleaved, medians of --reps:

- prefill of t tokens (the chunked form), carrying a state in, and the share of the fp32 FMA peak
  (probed in the same run, CPU) its matrix products reach;
- decode of one token (the recurrence), and the time its state traffic (S read and written, fp32,
  2 MiB a layer) takes at the DRAM read bandwidth probed in the same run (CPU only).

    python bench/bench_deltanet.py --tokens 512 4096 --threads 2
    python bench/bench_deltanet.py --device cuda

--kda: GLM-5.3-Flash's Kimi Delta Attention instead (64 heads of 128, a decay per key channel): our kda_rule (chunked
for a prefill, the recurrence for a token) against transformers' chunk_kimi_delta_attention and
recurrent_kimi_delta_attention, and (prefill) our own recurrence token by token, the form before the chunked one.

Decode also runs our rule with its one-token step on torch's ops (the form before the native step, moe_kernels.delta_rule)
beside the native step, interleaved.

The projections around the rule (in_proj_*, out_proj) are ordinary dense layers: bench_kernels covers them."""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import types

from common import cpu_name  # noqa: E402
from moe_core.openmp import passive_by_default  # noqa: E402

passive_by_default()  # as the services run: torch's threads do not spin beside the native pool's (before torch loads)

import torch  # noqa: E402

from gpu_service.model.linear_attention import CHUNK, delta_rule  # noqa: E402

NK, NV, D = 16, 32, 128


@contextlib.contextmanager
def on_torch():
    """Our rule with its one-token step on torch's ops (no native step)."""
    from gpu_service.model import linear_attention as la
    native = la.native_delta
    la.native_delta = types.SimpleNamespace(supported=lambda S: False)
    try:
        yield
    finally:
        la.native_delta = native


def traffic_floor(state_bytes: int) -> tuple[float, float]:
    """(the probed DRAM read bandwidth, the seconds a state read once and written once takes at it)."""
    from moe_kernels import native
    probe = torch.ones(1 << 28)
    bw = statistics.median(native.read_bandwidth(probe.data_ptr(), probe.numel()) for _ in range(5))
    return bw, 2 * state_bytes / bw


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


def kda(a, sync) -> None:
    """GLM-5.3-Flash's KDA rule: ours vs transformers', and ours chunked vs token by token."""
    from transformers.models.glm5_next import modeling_glm5_next as hf

    from gpu_service.model import linear_attention as la
    H = 64
    print(f"{cpu_name()}; {torch.get_num_threads()} threads; KDA {H} heads of {D}, fp32 state; medians of {a.reps}")

    def inputs_kda(t):
        g = torch.Generator().manual_seed(t)
        q, k, v = (torch.randn(t, H, D, generator=g) for _ in range(3))
        return q, k, v, -5 * torch.sigmoid(torch.randn(t, H, D, generator=g)), torch.rand(t, H, generator=g), \
            torch.randn(H, D, D, generator=g) * 0.1

    def token_by_token(q, k, v, gg, b, S):
        out = []
        for i in range(q.shape[0]):
            o, S = la.kda_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], gg[i:i + 1], b[i:i + 1], S)
            out.append(o)
        return torch.cat(out), S

    @torch.inference_mode()
    def theirs(fn, q, k, v, gg, b, S):
        return fn(q[None], k[None], v[None], gg[None], b[None], initial_state=S[None], output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    for t in a.tokens:
        x = inputs_kda(t)
        o1, S1 = la.kda_rule(*x)
        o2, S2 = theirs(hf.chunk_kimi_delta_attention, *x)
        err = max((o1 - o2[0]).abs().max().item(), (S1 - S2[0]).abs().max().item())
        def chunked():
            with on_torch():
                return la.kda_rule(*x)
        err = max(err, (la.kda_rule(*x)[0] - chunked()[0]).abs().max().item())
        rows = [[timed(f, sync) for f in (lambda: la.kda_rule(*x), chunked, lambda: token_by_token(*x),
                                          lambda: theirs(hf.chunk_kimi_delta_attention, *x))] for _ in range(a.reps)]
        m, ch, tb, r = (statistics.median(row[i] for row in rows) for i in range(4))
        print(f"prefill {t:5} tokens: {m * 1e3:8.1f} ms ours (native recurrence), {ch * 1e3:8.1f} ms ours chunked on "
              f"torch's ops ({ch / m:.2f}x), {tb * 1e3:8.1f} ms a call a token ({tb / m:.2f}x), {r * 1e3:8.1f} ms "
              f"transformers' chunk ({r / m:.2f}x); max |difference| {err:.1e}")
    x = inputs_kda(1)

    def torch_ops():
        with on_torch():
            return la.kda_rule(*x)
    err = (la.kda_rule(*x)[1] - torch_ops()[1]).abs().max().item()
    rows = [[timed(f, sync) for f in (lambda: la.kda_rule(*x), torch_ops,
                                      lambda: theirs(hf.recurrent_kimi_delta_attention, *x))]
            for _ in range(max(20, a.reps))]
    m, tt, r = (statistics.median(row[i] for row in rows) for i in range(3))
    bw, floor = traffic_floor(H * D * D * 4)
    print(f"decode 1 token: {m * 1e6:.0f} us ours (native step), {tt * 1e6:.0f} us ours on torch's ops ({tt / m:.2f}x), "
          f"{r * 1e6:.0f} us transformers' recurrent ({r / m:.2f}x); state max |difference| native / torch ops "
          f"{err:.1e}; its state traffic at the probed {bw / 1e9:.1f} GB/s: {floor * 1e6:.0f} us ({floor / m:.0%} of "
          f"ours)")


def main() -> None:
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--kda", action="store_true", help="GLM-5.3-Flash's Kimi Delta Attention (see above)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev, dtype = torch.device(a.device), {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    if dev.type == "cpu":
        from moe_kernels import native
        native.init_pool(torch.get_num_threads())
    if a.kda:
        return kda(a, sync)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    peak = None
    if dev.type == "cpu":
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
        def chunked():
            with on_torch():
                return ours(*x)
        mine, ch, ref = [], [], []
        for _ in range(a.reps):
            mine.append(timed(lambda: ours(*x), sync))
            ch.append(timed(chunked, sync))
            ref.append(timed(lambda: theirs(*x, hf.torch_chunk_gated_delta_rule), sync))
        m, c, r = statistics.median(mine), statistics.median(ch), statistics.median(ref)
        share = f" ({chunked_flops(t) / c / peak:.0%} of the FMA peak)" if peak else ""
        print(f"prefill {t:5} tokens: {m * 1e3:8.1f} ms ours, {c * 1e3:8.1f} ms ours chunked on torch's ops{share} "
              f"({c / m:.2f}x), {r * 1e3:8.1f} ms transformers' torch_chunk ({r / m:.2f}x); max |difference| {err:.1e}")
    x = inputs(1, dev, dtype)
    (o1, S1), (o2, S2) = ours(*x), theirs(*x, hf.torch_recurrent_gated_delta_rule)
    err = max((o1.float() - o2[0].float()).abs().max().item(), (S1 - S2[0]).abs().max().item())
    def torch_ops():
        with on_torch():
            return ours(*x)
    mine, ops, ref = [], [], []
    for _ in range(max(20, a.reps)):
        mine.append(timed(lambda: ours(*x), sync))
        ops.append(timed(torch_ops, sync))
        ref.append(timed(lambda: theirs(*x, hf.torch_recurrent_gated_delta_rule), sync))
    m, tt, r = statistics.median(mine), statistics.median(ops), statistics.median(ref)
    line = (f"decode 1 token: {m * 1e6:.0f} us ours, {tt * 1e6:.0f} us ours on torch's ops ({tt / m:.2f}x), "
            f"{r * 1e6:.0f} us transformers' torch_recurrent ({r / m:.2f}x); max |difference| {err:.1e}")
    if dev.type == "cpu":
        bw, floor = traffic_floor(NV * D * D * 4)
        line += f"; its state traffic at the probed {bw / 1e9:.1f} GB/s: {floor * 1e6:.0f} us ({floor / m:.0%} of ours)"
    print(line)


if __name__ == "__main__":
    main()
