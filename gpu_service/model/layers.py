"""Stateless layer functions: RMSNorm, rotary embeddings, SwiGLU MLP, MoE routers.
Numerics follow transformers' implementations (fp32 norm statistics, fp32 routing)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moe_core.config import ModelConfig

try:
    from moe_kernels import norm_rope
except ImportError:  # the native extension is not built: torch everywhere
    norm_rope = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
             native: bool = False) -> torch.Tensor:
    """offset: zero-centred weights (Qwen3-Next), x_normed * (1 + w) in fp32, then rounded, as
    transformers does (the plain form rounds x_normed first, then multiplies). native: the plain form
    in one native call where it applies (on the CPU: moe_kernels.norm_rope; a prefill's rows sliced over the
    native pool; docs/performance/kernels.md, "A prefill's norms and rotary embeddings native")."""
    wide = weight.dtype == torch.float32 and x.dtype != torch.float32  # fp32 weights (DeepSeek-V4) multiply in fp32
    if native and norm_rope and not offset and (wide or weight.dtype == x.dtype) and \
            norm_rope.rms_norm_supported(x, weight):
        return norm_rope.rms_norm(x, weight, eps, wide)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if wide:
        return (weight * xf).to(x.dtype)
    if offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or a weight packed for the native kernels (moe_kernels.dense, --dense-format)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, b)
    y = w(x)
    return y if b is None else y + b


GATE_UP = "gate_up_proj.weight"  # an MLP's gate and up projections fused into one packed matrix (gate rows first)


# -- rotary embeddings ------------------------------------------------------------------------
def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim/2] fp32, cos/sin scaling). YaRN as in transformers' _compute_yarn_parameters."""
    dim, base = cfg.rotary_dim or cfg.head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / pos_freqs
    if cfg.rope_type == "default":
        return inv_freq, 1.0
    p = cfg.rope_params
    omax = p["original_max_position_embeddings"]
    factor = p.get("factor") or cfg.max_position_embeddings / omax
    att = p.get("attention_factor")
    if att is None:
        ms, msa = p.get("mscale"), p.get("mscale_all_dim")
        att = _yarn_get_mscale(factor, ms) / _yarn_get_mscale(factor, msa) if ms and msa else _yarn_get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(n_rot):
        return (dim * math.log(omax / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(att)


def softmax_scale(cfg: ModelConfig, qk_head_dim: int) -> float:
    scale = qk_head_dim ** -0.5
    if cfg.attention == "mla" and cfg.rope_type != "default":
        msa = cfg.rope_params.get("mscale_all_dim", 0)
        if msa:
            m = _yarn_get_mscale(cfg.rope_params["factor"], msa)
            scale *= m * m
    return scale


def rope_cos_sin(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor, dtype: torch.dtype):
    """positions [T] -> cos, sin [T, dim/2] (one angle per rotated pair)."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
               native: bool = False) -> torch.Tensor:
    """x [T, heads, dim]; cos/sin [T, dim/2].
    interleave=False: rotate halves (Llama/Qwen/Mixtral). interleave=True: rotate (x0,x1),(x2,x3)...
    pairs and return them de-interleaved (evens then odds), as transformers' DeepSeek does; q and k
    get the same permutation, so their dot products are unchanged. native: as rms_norm's."""
    if native and norm_rope and norm_rope.rope_supported(x, cos):
        if interleave:  # the pairs' evens then odds, rotated as halves: the same products and sums
            T, heads, dim = x.shape
            x = x.reshape(T, heads, dim // 2, 2).transpose(-1, -2).reshape(T, heads, dim)
        return norm_rope.rope(x, cos, sin)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:  # partial rotary (GLM): the rest of each head passes through
        return torch.cat([apply_rope(x[..., :rot], cos[:, 0], sin[:, 0], interleave), x[..., rot:]], dim=-1)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# -- routers: hidden [T, H] -> (topk_ids [T, k] int32, topk_weights [T, k] fp32) ---------------
def packs_router(cfg: ModelConfig) -> bool:
    """Whether the router's logits may come from a packed bf16 matrix (moe_kernels.dense) on the CPU: the
    routers computed in the model's dtype (not DeepSeek's and GLM's fp32 ones, nor MiniMax-M2's)."""
    return cfg.scoring in ("softmax", "topk_softmax") and cfg.model_type != "deepseek_v2"


def route(cfg: ModelConfig, x: torch.Tensor, weight, bias: torch.Tensor | None, chosen: torch.Tensor | None = None):
    """chosen: the experts of a hash-routed layer's rows (DeepSeek-V4's token id -> experts table), weighted by the
    scores as the others."""
    k, E = cfg.top_k, cfg.n_routed_experts
    if cfg.scoring == "sqrtsoftplus":  # DeepSeek-V4: sqrt(softplus(logits)) in the router's dtype; bias only chooses
        scores = F.softplus(F.linear(x.to(weight.dtype), weight)).sqrt().float()
        ids = chosen.long() if chosen is not None else torch.topk(
            scores + bias.float() if bias is not None else scores, k=k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    elif cfg.scoring == "sigmoid":  # DeepSeek-V3 noaux_tc: bias only chooses, weights come from scores
        # in the router weight's dtype, as transformers does: fp32 for DeepSeek and GLM, which keep it
        # in fp32, the model's dtype for MiniMax-M2
        logits = F.linear(x.to(weight.dtype), weight).float()
        scores = logits.sigmoid()
        choice = scores + bias if bias is not None else scores
        choice = _group_mask(cfg, choice, choice.view(-1, cfg.n_group, E // cfg.n_group).topk(2, dim=-1)[0].sum(-1),
                             float("-inf"))
        ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * cfg.routed_scaling_factor
    elif cfg.scoring == "topk_softmax":  # gpt-oss: the router has a bias; softmax over the top-k logits
        top, ids = torch.topk(linear(x, weight, bias), k, dim=-1)
        w = top.softmax(dim=-1)  # in the model dtype, as transformers does
    elif cfg.model_type == "deepseek_v2":
        scores = F.linear(x.float(), weight.float()).softmax(dim=-1, dtype=torch.float32)
        if cfg.topk_method == "group_limited_greedy":
            scores = _group_mask(cfg, scores, scores.view(-1, cfg.n_group, E // cfg.n_group).max(dim=-1).values, 0.0)
        w, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
        w = w * cfg.routed_scaling_factor
    else:  # Mixtral / Qwen-MoE: softmax over the logits in the model dtype, then top-k
        probs = linear(x, weight).float().softmax(dim=-1)
        w, ids = torch.topk(probs, k, dim=-1)
        if cfg.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        if cfg.model_type != "mixtral":  # Qwen casts the weights back to the model dtype
            w = w.to(x.dtype)
    return ids.to(torch.int32), w.float()


def _group_mask(cfg: ModelConfig, scores, group_scores, fill):
    E = cfg.n_routed_experts
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = mask.unsqueeze(-1).expand(-1, cfg.n_group, E // cfg.n_group).reshape(-1, E)
    return scores.masked_fill(~mask.bool(), fill)
