"""Gated DeltaNet, the linear attention of Qwen3-Next's hybrid layers, and Kimi Delta Attention (GLM-5.3-Flash's KDA:
the same delta rule with a decay per key channel), with their per-sequence state.

Instead of a KV cache growing with the context, each layer keeps a fixed-size state per sequence:
the last conv_kernel-1 inputs of a causal depthwise convolution over q, k and v, and a recurrent
matrix S [v heads, k_dim, v_dim] (fp32) that every token decays by exp(g) and corrects by the delta
rule, S += k (beta (v - k^T S))^T; a token reads q^T S. Prefill runs the chunked (WY / UT-transform)
form, C tokens at once with matrix products; decode the one-token recurrence. Numerics follow
transformers' torch implementation (fp32 state and rule, l2-normalised q and k).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_core.config import ModelConfig
from moe_kernels import delta_rule as native_delta

from gpu_service.engine.kv_pool import SeqCache
from gpu_service.model.layers import linear

CHUNK = 64  # tokens per block of the chunked form (transformers' and FLA's)


def gated_deltanet(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cache: SeqCache, layer: int) -> torch.Tensor:
    """x [t, H]: one sequence's new tokens -> [t, H]. Reads the committed state of `layer` and stages
    the new one (SeqCache.commit installs it after the step)."""
    sh = cfg.linear_attn
    t, nk, nv, dk, dv = x.shape[0], sh.k_heads, sh.v_heads, sh.k_dim, sh.v_dim
    if p + "in_proj_qkvz.weight" in W:
        # Qwen3-Next's projections are grouped by key head: [q, k, v, z] of each group, then [b, a]
        r = nv // nk
        q, k, v, z = linear(x, W[p + "in_proj_qkvz.weight"]).view(t, nk, -1).split([dk, dk, r * dv, r * dv], -1)
        b, a = linear(x, W[p + "in_proj_ba.weight"]).view(t, nk, 2 * r).split([r, r], -1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    else:  # one matrix per part, heads in order (Qwen3.5)
        mixed, z = linear(x, W[p + "in_proj_qkv.weight"]), linear(x, W[p + "in_proj_z.weight"])
        b, a = linear(x, W[p + "in_proj_b.weight"]), linear(x, W[p + "in_proj_a.weight"])
    z, b, a = z.reshape(t, nv, dv), b.reshape(t, nv), a.reshape(t, nv)

    state = cache.states[layer]
    conv_w = W[p + "conv1d.weight"]                                             # [conv_dim, 1, kernel]
    past = state[0] if state is not None else mixed.new_zeros(sh.conv_dim, sh.conv_kernel - 1)
    seq = torch.cat([past, mixed.T.to(conv_w.dtype)], dim=1)                    # [conv_dim, kernel-1+t]
    mixed = F.silu(F.conv1d(seq[None], conv_w, groups=sh.conv_dim)[0]).T.to(x.dtype)  # [t, conv_dim]
    conv_state = seq[:, seq.shape[1] - (sh.conv_kernel - 1):].clone()

    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    q, k, v = q.reshape(t, nk, dk), k.reshape(t, nk, dk), v.reshape(t, nv, dv)
    beta = b.float().sigmoid()
    g = -W[p + "A_log"].float().exp() * F.softplus(a.float() + W[p + "dt_bias"].float())  # log decay <= 0
    S = state[1] if state is not None else torch.zeros(nv, dk, dv, dtype=torch.float32, device=x.device)
    o, S = delta_rule(q, k, v, g, beta, S)
    cache.stage(layer, conv_state, S)

    # gated RMSNorm over each head's output (plain weights: not zero-centred), then out_proj
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    o = (W[p + "norm.weight"] * of.to(x.dtype)) * F.silu(z.float())
    return linear(o.to(x.dtype).reshape(t, nv * dv), W[p + "out_proj.weight"])


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule(q, k, v, g, beta, S):
    """q, k [t, nk, dk]; v [t, nv, dv]; g, beta [t, nv] fp32; S [nv, dk, dv] fp32 ->
    (o [t, nv, dv] in v's dtype, the state after the t tokens)."""
    t, nk, dk = k.shape
    nv = v.shape[1]
    r = nv // nk
    if native_delta.supported(S):  # the recurrence natively: a token in one read of S and one write (L2 in a prefill)
        qn, kn = (_l2norm(y.float()).repeat_interleave(r, dim=1) for y in (q, k))           # [t, nv, dk]
        o, S = native_delta.step(qn * dk ** -0.5, kn, v.float(), g.float().exp(), beta.float(), S)
        return o.to(v.dtype), S
    # head-major and contiguous: the chunked form's batched matmuls run ~10% faster on such operands
    q, k = (_l2norm(y.float()).repeat_interleave(r, dim=1).transpose(0, 1).contiguous() for y in (q, k))  # [nv, t, dk]
    q = q * dk ** -0.5
    vf, g, beta = v.float().transpose(0, 1).contiguous(), g.T.contiguous(), beta.T.contiguous()  # [nv, t, ...]
    if t == 1:
        # one token: with e = exp(g), k^T (e S) and q^T (e S + k delta^T) = e q^T S + (q.k) delta, so both
        # reads of S are one batched matvec of the old state, and the new one is written once and updated
        # in place (5 passes over S's 2 MiB a layer instead of 8; it stays a new tensor: a retried step
        # reads the old one)
        e = g[:, 0].exp()                                                    # [nv]
        qS, kS = torch.bmm(torch.cat([q, k], dim=1), S).unbind(1)            # [nv, dv] each
        delta = (vf[:, 0] - e[:, None] * kS) * beta[:, :1]
        o = e[:, None] * qS + (q[:, 0] * k[:, 0]).sum(-1, keepdim=True) * delta
        S = torch.mul(S, e[:, None, None]).baddbmm_(k.transpose(1, 2), delta[:, None, :])
        return o[None].to(v.dtype), S
    return _chunked(q, k, vf, g, beta, S, v.dtype)


def _chunked(q, k, v, g, beta, S, dtype):
    """The chunked form: within a chunk the t sequential rank-1 corrections become one triangular
    solve (the UT transform), so the work is matrix products; S is carried across chunks."""
    nv, t, dk = k.shape
    C = CHUNK
    pad = -t % C
    if pad:  # zero k, v, beta and g leave S as it is
        q, k, v = (F.pad(y, (0, 0, 0, pad)) for y in (q, k, v))
        g, beta = (F.pad(y, (0, pad)) for y in (g, beta))
    n = (t + pad) // C
    q, k, v = (y.reshape(nv, n, C, -1) for y in (q, k, v))
    g, beta = g.reshape(nv, n, C), beta.reshape(nv, n, C)
    gam = g.cumsum(-1)                                                     # log decay from the chunk start
    causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # i >= j
    kb, vb = k * beta[..., None], v * beta[..., None]
    # (I + L) u = v beta, (I + L) w = k beta exp(gam), L the strictly lower part of (k beta k^T) decay
    Lm = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(Lm, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(Lm, kb * gam.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay                               # within the chunk, j <= i
    qd = q * gam.exp()[..., None]                                          # reads the state at the chunk start
    kd = k * (gam[..., -1:] - gam).exp()[..., None]                        # writes decayed to the chunk end
    end = gam[..., -1].exp()
    o = torch.empty_like(v)
    for c in range(n):
        vn = u[:, c] - w[:, c] @ S
        o[:, c] = qd[:, c] @ S + attn[:, c] @ vn
        S = S * end[:, c, None, None] + kd[:, c].transpose(-1, -2) @ vn
    o = o.reshape(nv, n * C, -1)[:, :t].transpose(0, 1)
    return o.to(dtype), S


def kimi_delta_attention(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cache: SeqCache, layer: int) -> torch.Tensor:
    """GLM-5.3-Flash's KDA layer (transformers' Glm5NextTextLinearAttention): x [t, H] -> [t, H]. q, k, v through a
    causal depthwise conv (fp32, silu); a forget gate per head and key channel, bound * sigmoid(exp(A_log) (f + dt_bias))
    (log decay in (bound, 0)); beta = sigmoid(b); the delta rule per token on l2-normalised q and k with S decayed per
    key channel; the output RMS-normed per head times sigmoid(gate), then o_proj. The state (the conv's last inputs, S
    fp32) is staged as gated_deltanet's."""
    sh = cfg.linear_attn
    t, H, dk, dv = x.shape[0], sh.k_heads, sh.k_dim, sh.v_dim
    mixed = torch.cat([linear(x, W[p + f"{n}_proj.weight"]) for n in "qkv"], dim=-1)          # [t, 3 H dk]
    conv_w = torch.cat([W[p + f"{n}_conv1d.weight"] for n in "qkv"])                        # [3 H dk, 1, kernel]
    state = cache.states[layer]
    past = state[0] if state is not None else mixed.new_zeros(conv_w.shape[0], sh.conv_kernel - 1, dtype=conv_w.dtype)
    seq = torch.cat([past, mixed.T.to(conv_w.dtype)], dim=1)
    mixed = F.silu(F.conv1d(seq[None], conv_w, groups=conv_w.shape[0])[0]).T.to(x.dtype)   # [t, 3 H dk]
    conv_state = seq[:, seq.shape[1] - (sh.conv_kernel - 1):].clone()
    q, k, v = (y.reshape(t, H, -1) for y in mixed.split([H * dk, H * dk, H * dv], dim=-1))
    f = linear(linear(x, W[p + "f_a_proj.weight"]), W[p + "f_b_proj.weight"]).float() + W[p + "dt_bias"].float()
    g = cfg.linear_bound * torch.sigmoid(W[p + "A_log"].float().exp()[:, None] * f.view(t, H, dk))  # [t, H, dk]
    beta = torch.sigmoid(linear(x, W[p + "b_proj.weight"])).float()                            # [t, H]
    S = state[1] if state is not None else torch.zeros(H, dk, dv, dtype=torch.float32, device=x.device)
    o, S = kda_rule(q, k, v, g, beta, S)
    cache.stage(layer, conv_state, S)
    gate = linear(linear(x, W[p + "g_a_proj.weight"]), W[p + "g_b_proj.weight"]).view(t, H, dv).float()
    of = o.float()
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    o = (W[p + "o_norm.weight"].float() * of * torch.sigmoid(gate)).to(x.dtype)
    return linear(o.reshape(t, H * dv), W[p + "o_proj.weight"])


KDA_CHUNK = 64  # most tokens a chunk of KDA's chunked form (fewer where its decays would leave fp32's range)
KDA_SPAN = 80.0  # the most log decay a chunk spans: e^80 and e^-80 are fp32 normals, and so are their products


def kda_rule(q, k, v, g, beta, S):
    """KDA's delta rule: q, k [t, H, dk], v [t, H, dv], g [t, H, dk] (log decay per key channel), beta [t, H], S
    [H, dk, dv] fp32 -> (o [t, H, dv] in v's dtype, the state after the t tokens), as transformers'
    recurrent_kimi_delta_attention (l2-normalised q and k, q scaled by dk ** -0.5): a decode's token by the recurrence,
    a prefill's in chunks (_kda_chunked)."""
    t, H, dk = k.shape
    if native_delta.supported(S):  # the recurrence natively: a token in one read of S and one write (L2 in a prefill)
        o, S = native_delta.step(_l2norm(q.float()) * dk ** -0.5, _l2norm(k.float()), v.float(), g.float().exp(),
                                 beta.float(), S)
        return o.to(v.dtype), S
    qf, kf, vf = (y.float().transpose(0, 1) for y in (q, k, v))                    # [H, t, d]
    qf, kf = _l2norm(qf) * dk ** -0.5, _l2norm(kf)
    g, beta = g.float().transpose(0, 1), beta.float().T                            # [H, t, dk], [H, t]
    if t > 1:
        o, S = _kda_chunked(qf, kf, vf, g, beta, S)
        return o.transpose(0, 1).to(v.dtype), S
    # one token: with e = exp(g) per key channel, k^T (e S) and q^T (e S + k delta^T) = (q e)^T S + (q.k) delta, so
    # both reads of S are one batched product of the old state; the new one is written once and updated in place
    e = g[:, 0].exp()                                                              # [H, dk]
    qS, kS = torch.bmm(torch.stack([qf[:, 0] * e, kf[:, 0] * e], dim=1), S).unbind(1)  # [H, dv] each
    delta = (vf[:, 0] - kS) * beta[:, :1]
    o = qS + (qf[:, 0] * kf[:, 0]).sum(-1, keepdim=True) * delta
    S = torch.mul(S, e[..., None]).baddbmm_(kf[:, 0, :, None], delta[:, None, :])
    return o[None].to(v.dtype), S


def _kda_chunked(q, k, v, g, beta, S):
    """The chunked form with a decay per key channel, a chunk at a time: within a chunk with cumulative log decay G,
    (I + strict((beta k e^G) (k e^-G)^T)) delta = beta (v - (k e^G) S), o = (q e^G) S + lower((q e^G) (k e^-G)^T)
    delta, S <- e^(G_end) S + (k e^(G_end - G))^T delta: matrix products, the chunk short enough that e^G and e^-G
    stay fp32 normals (KDA_SPAN; GLM-5.3-Flash's gate bound of -5: 16 tokens)."""
    H, t, dk = k.shape
    C = max(1, min(KDA_CHUNK, int(KDA_SPAN / max(-float(g.min()), 1e-6))))
    o = torch.empty(H, t, v.shape[-1], dtype=torch.float32, device=v.device)
    for c0 in range(0, t, C):
        c = slice(c0, min(t, c0 + C))
        qc, kc, vc, bc = q[:, c], k[:, c], v[:, c], beta[:, c, None]
        n = kc.shape[1]
        G = g[:, c].cumsum(1)                                                      # [H, n, dk]
        eg, kn = G.exp(), kc * (-G).exp()
        A = ((kc * bc * eg) @ kn.transpose(1, 2)).tril(-1)
        B = ((qc * eg) @ kn.transpose(1, 2)).tril()
        T = A + torch.eye(n, device=k.device)
        u = torch.linalg.solve_triangular(T, vc * bc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(T, kc * bc * eg, upper=False, unitriangular=True)
        delta = u - w @ S
        o[:, c] = (qc * eg) @ S + B @ delta
        S = S * eg[:, -1, :, None] + (kc * (G[:, -1:] - G).exp()).transpose(1, 2) @ delta
    return o, S
