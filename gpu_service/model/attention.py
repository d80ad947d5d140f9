"""Attention over the paged KV cache (kv_pool.py): GQA (Qwen-MoE, Mixtral, gpt-oss's windows and sinks) and MLA
(DeepSeek V2/V3). Decode on the native kernel reads the blocks where they are; the other paths gather the
sequence's blocks into one tensor per layer first, in the model dtype (the pool's may be narrower, or 8-bit rows
read back dequantized: --kv-cache-dtype).

MLA caches only the compressed latent (kv_lora_rank) and the shared rotary key per token, and
attends in the latent space ("absorbed" kv_b_proj): the cache is ~(512+64) values per token
instead of heads x (k + v) dims.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from moe_core.config import ModelConfig
from moe_kernels import attention as native_attention

from gpu_service.engine.kv_pool import BLOCK, SeqCache
from gpu_service.model.compressed_attention import compressed_attention
from gpu_service.model.layers import apply_rope, linear, rms_norm
from gpu_service.model.linear_attention import gated_deltanet, kimi_delta_attention

# An attention kind is one function (kinds below): (cfg, W, prefix, x [t, H], cos, sin, kv, layer, native, scale) ->
# [t, H]. `kv` is where the rows' keys go and come from: a SequenceKV (one sequence's new tokens, the per-op runner's)
# or the CUDA-graph runner's bucket (one token per row, each its own sequence's: cuda_graphs.Bucket). Both offer
# write(layer, *stored) and, for a decode, rows(layer, dtype) -> (each stored tensor gathered per row [.., rows,
# positions, ..], the positions past each row's own [rows, positions] or None); `decoding`: every row one sequence's
# newest token; `paged`: the SeqCache whose blocks the native kernels read in place, or None.

QKV = "qkv_proj.weight"  # GQA's q, k and v projections fused into one packed matrix (rows q, then k, then v)
NATIVE_ABSORB_TOKENS = 8  # MLA: tokens a segment up to which its absorbed products run natively (decode; above, torch's
                          # batched matmuls reuse each weight across the tokens)
SCORE_BYTES = 256 << 20  # MLA: most bytes of attention scores held at once (heads are grouped to fit)


def _causal_mask(t: int, start: int, device) -> torch.Tensor | None:
    """[t, start+t] bool, True where query i may see key j (j <= start + i); None for t == 1."""
    if t == 1:
        return None
    j = torch.arange(start + t, device=device)
    i = torch.arange(t, device=device) + start
    return j[None, :] <= i[:, None]


@dataclasses.dataclass(slots=True)
class SequenceKV:
    """One sequence's t new tokens at positions start.. (the per-op runner's view of its cache, one per step).
    selection: the keys its last DeepSeek Sparse Attention indexer picked this step, which GLM-5's shared layers
    reuse."""
    cache: SeqCache
    start: int
    t: int
    selection: torch.Tensor | None = None

    @property
    def decoding(self) -> bool:
        return self.t == 1

    @property
    def paged(self) -> SeqCache:
        return self.cache

    def write(self, layer: int, *xs: torch.Tensor) -> None:
        self.cache.write(layer, self.start, *xs)

    def rows(self, layer: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], None]:
        """Its one row's positions so far (views where the blocks are consecutive), every one seen."""
        dim = 0 if self.cache.pool.mla else 1  # GQA's [kv, positions, d], MLA's [positions, r]
        return [x.unsqueeze(dim) for x in self.cache.gather(layer, self.start + self.t, dtype=dtype)], None


def gqa_decode(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, unseen: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """Decode rows' attention in matmuls over each KV head's query group: q [B, nh, d], K, V [kv, B, C, d], unseen
    [B, C] (masked) or None -> [B, nh, d]. On the CPU torch's SDPA kernel is ~50x slower for one query
    (docs/performance/kernels.md, "Measured choices"); CUDA graphs need fixed shapes, hence the mask."""
    B, nh, d = q.shape
    nkv = K.shape[0]
    qg = q.view(B, nkv, nh // nkv, d).transpose(0, 1)                          # [kv, B, group, d]
    s = (torch.matmul(qg, K.transpose(-1, -2)) * scale).float()                # [kv, B, group, C]
    if unseen is not None:
        s = s.masked_fill(unseen[None, :, None, :], float("-inf"))
    return torch.matmul(s.softmax(-1).to(q.dtype), V).transpose(0, 1)         # [B, kv, group, d]


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, C: torch.Tensor, P: torch.Tensor, unseen: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """Decode rows' latent attention: q_lat [B, nh, r], q_pe [B, nh, dr], the cached latents C [B, L, r] and rotary
    keys P [B, L, dr], unseen [B, L] or None -> o_lat [B, nh, r]."""
    s = ((torch.matmul(q_lat, C.transpose(1, 2)) + torch.matmul(q_pe, P.transpose(1, 2))) * scale).float()
    if unseen is not None:
        s = s.masked_fill(unseen[:, None, :], float("-inf"))
    return torch.matmul(s.softmax(-1).to(q_lat.dtype), C)


def masked_rows(xs: list[torch.Tensor], unseen: torch.Tensor) -> list[torch.Tensor]:
    """Gathered rows with the positions past each row's own zeroed: those read whatever the pool's memory holds
    (never-written rows: anything, NaN included), and a masked weight of 0 times NaN is NaN."""
    return [x.masked_fill(unseen[None, :, :, None] if x.dim() == 4 else unseen[:, :, None], 0) for x in xs]


def gqa_project(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin, native: bool = False,
                layer: int | None = None):
    """x [t, H] -> (q [t, nh, d], k [t, kv heads, d] and v [t, kv heads, value dim]: normed, rotated and scaled as
    the layer's keys and values are stored, the output gate [t, nh * d] or None). Shared by gqa_attention and the
    graphed decode step (cuda_graphs.py). layer: for its KV heads where layers differ (MiMo-V2-Flash)."""
    t = x.shape[0]
    nh, d, dv = cfg.num_heads, cfg.head_dim, cfg.value_dim
    nkv = cfg.num_kv_heads if layer is None else cfg.kv_heads(layer)
    nq = nh * d * (2 if cfg.attn_output_gate else 1)  # Qwen3-Next: each head's query, then its gate
    if p + QKV in W:  # packed for the native kernels as one matrix: one call instead of three
        q, k, v = linear(x, W[p + QKV]).split([nq, nkv * d, nkv * dv], dim=-1)
        q, k, v = (y if W.get(p + n + ".bias") is None else y + W[p + n + ".bias"]
                   for y, n in zip((q, k, v), ("q_proj", "k_proj", "v_proj")))
    else:
        q = linear(x, W[p + "q_proj.weight"], W.get(p + "q_proj.bias"))
        k = linear(x, W[p + "k_proj.weight"], W.get(p + "k_proj.bias"))
        v = linear(x, W[p + "v_proj.weight"], W.get(p + "v_proj.bias"))
    gate = None
    if cfg.attn_output_gate:
        q, gate = q.view(t, nh, 2 * d).chunk(2, dim=-1)
        gate = gate.reshape(t, nh * d)
    if cfg.qk_norm_full:
        q = rms_norm(q, W[p + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, W[p + "k_norm.weight"], cfg.rms_norm_eps)
    q, k, v = q.reshape(t, nh, d), k.reshape(t, nkv, d), v.reshape(t, nkv, dv)
    if cfg.value_scale != 1.0:  # MiMo-V2-Flash: as transformers scales its values, in the model dtype
        v = v * cfg.value_scale
    if cfg.qk_norm:
        q = rms_norm(q, W[p + "q_norm.weight"], cfg.rms_norm_eps, cfg.norm_offset, native)
        k = rms_norm(k, W[p + "k_norm.weight"], cfg.rms_norm_eps, cfg.norm_offset, native)
    return apply_rope(q, cos, sin, False, native), apply_rope(k, cos, sin, False, native), v, gate


def gqa_output(cfg: ModelConfig, W: dict, p: str, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """The heads' outputs (t x nh x d values, head-major within a token) -> [t, H]: the output gate where the layer
    has one, then o_proj."""
    o = o.reshape(-1, cfg.num_heads * cfg.value_dim)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return linear(o, W[p + "o_proj.weight"], W.get(p + "o_proj.bias"))


def gqa_attention(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin, kv, layer: int,
                  native: bool = False, scale: float | None = None) -> torch.Tensor:
    """x [t, H] (the rows `kv` covers) -> [t, H]. native: decode on the native kernel where it takes the pool (fp32,
    bf16 or fp16 on the CPU; moe_kernels.attention)."""
    q, k, v, gate = gqa_project(cfg, W, p, x, cos, sin, native, layer)
    kv.write(layer, k, v)
    return gqa_output(cfg, W, p, gqa_attend(cfg, W, p, q, kv, layer, native), gate)


def gqa_attend(cfg: ModelConfig, W: dict, p: str, q: torch.Tensor, kv, layer: int, native: bool) -> torch.Tensor:
    """The attention of the layer's queries q [t, nh, d] (their keys and values written) over every key each sees (a
    window's where the layer has one) -> [t, nh, value dim]."""
    t = q.shape[0]
    nh, nkv, d = cfg.num_heads, cfg.kv_heads(layer), cfg.head_dim
    # (MiMo-V2-Flash: only its sliding layers have sinks)
    window, sinks = cfg.window(layer), W.get(p + cfg.sinks_name) if cfg.attn_sinks else None
    cache = kv.paged
    if (window or sinks is not None) and kv.decoding and native and cache is not None and \
            native_attention.any_dims(cache.pool.bufs[layer][0]):
        # gpt-oss, MiMo: the native kernel with each head's sink, over the window's positions where the layer has one
        pos, K, V = kv.start, *cache.pool.bufs[layer][:2]
        lo = max(0, pos - window + 1) if window else 0
        sel = None
        if lo:
            at = torch.arange(lo, pos + 1, dtype=torch.int32).expand(nkv, -1).contiguous()
            sel = (at, torch.full((nkv,), pos + 1 - lo, dtype=torch.int32))
        return native_attention.paged_decode_attention(
            q[0], K, V, cache.table(layer), pos + 1, d ** -0.5, first=cache.first(layer) if sel is None else -1,
            selected=sel, sinks=sinks).to(q.dtype)[None]
    if window or sinks is not None:  # gpt-oss: SDPA has no sinks (a sequence's own cache: no graph takes these)
        start = kv.start
        first = max(0, start - window + 1) if window else 0  # no query of this chunk sees keys before it
        K, V = cache.gather(layer, start + t, first, q.dtype)[:2]
        if native and native_attention.ISA in native_attention.PREFILL_PATHS and \
                native_attention.prefill_supported(q, K, V):
            return native_attention.prefill_attention(q, K, V, start, d ** -0.5, window=window, sinks=sinks,
                                                      lo=first).to(q.dtype)
        o = windowed_attention(q, K, V, start, window, sinks, d ** -0.5, first)
    elif kv.decoding and native and cache is not None and \
            native_attention.supported(cache.pool.bufs[layer][0], V=cache.pool.bufs[layer][1]):
        # consecutive blocks (a lone sequence's) are read as one strided matrix a head, without the table
        o = native_attention.paged_decode_attention(q[0], *cache.pool.bufs[layer][:2], cache.table(layer),
                                                    kv.start + 1, d ** -0.5, first=cache.first(layer)).to(q.dtype)
    elif kv.decoding:
        (K, V, *_), unseen = kv.rows(layer, q.dtype)
        o = gqa_decode(q, K, V, unseen, d ** -0.5)
    else:
        start = kv.start
        K, V = cache.gather(layer, start + t, dtype=q.dtype)[:2]                 # [kv, L, d] each
        if native and native_attention.ISA in native_attention.PREFILL_PATHS and \
                native_attention.prefill_supported(q, K, V):
            # the native flash kernel: torch's CPU one widens bf16 to an fp32 sgemm (3-4x slower at 512 tokens)
            return native_attention.prefill_attention(q, K, V, start, d ** -0.5).to(q.dtype)
        # 4-D inputs: torch's fused (flash) CPU kernel; 3-D ones fall back to its math path, which builds the
        # [heads, t, L] scores and masks in fp32 (2.5x slower at 512 tokens, docs/performance/kernels.md)
        causal = start == 0  # a first chunk: torch's own causal mask (top-left aligned) is ours
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], K[None], V[None], is_causal=causal,
                                           attn_mask=None if causal else _causal_mask(t, start, q.device),
                                           enable_gqa=nkv != nh)[0].transpose(0, 1)
    return o


def windowed_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, start: int, window: int,
                       sinks: torch.Tensor | None, scale: float, lo: int) -> torch.Tensor:
    """q [t, nh, d] at positions start.., K [kv, L, d] and V [kv, L, dv] the keys and values of positions lo.. (the
    first any query sees) -> [t, nh, dv]. Query i sees keys j with i - window < j <= i (window 0: every j <= i); `sinks`
    [nh] is one more logit per head in each softmax, whose share is dropped (gpt-oss; transformers' eager
    attention with s_aux)."""
    t, nh, d = q.shape
    nkv, dv = K.shape[0], V.shape[-1]
    g = nh // nkv
    L = K.shape[1]
    j = torch.arange(lo, lo + L, device=q.device)
    i = torch.arange(start, start + t, device=q.device)[:, None]
    allowed = (j <= i) & (j > i - window) if window else j <= i                 # [t, L]
    qg = q.transpose(0, 1).reshape(nkv, g * t, d)                               # [kv, group x t, d]
    o = torch.empty(nkv, g * t, dv, dtype=q.dtype, device=q.device)
    step = max(1, min(nkv, SCORE_BYTES // max(1, g * t * L * 4)))  # kv heads whose fp32 scores fit at once
    for h in range(0, nkv, step):
        s = torch.matmul(qg[h:h + step], K[h:h + step].transpose(1, 2)).float() * scale  # [n, group x t, L]
        s = s.view(-1, g, t, L).masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks[h * g:(h + step) * g].float().view(-1, g, 1, 1).expand(-1, g, t, 1)
            s = torch.cat([s, sink], dim=-1)
        pr = s.softmax(-1)[..., :L].to(V.dtype).view(-1, g * t, L)
        o[h:h + step] = torch.matmul(pr, V[h:h + step])
    return o.view(nh, t, dv).transpose(0, 1)


def _latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: SeqCache, layer: int, start: int,
                      scale: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's attention in the latent space on torch: q_lat [nh, t, r], q_pe [t, nh, dr] (the model dtype) against
    the layer's cached latents and rotary keys up to start + t -> o_lat [nh, t, r]. allowed: [t, start + t] bool, the
    keys each query may see besides causality (DeepSeek Sparse Attention's selection), or None."""
    nh, t, r = q_lat.shape
    C, KPE = cache.gather(layer, start + t, dtype=q_lat.dtype)[:2]             # [L, r], [L, dr]
    q_pe = q_pe.transpose(0, 1)                                                # [nh, t, dr]
    mask = _causal_mask(t, start, q_lat.device)
    if allowed is not None:
        mask = allowed if mask is None else mask & allowed
    L = C.shape[0]
    # the scores are [heads, t, L] fp32: DeepSeek-V3's 128 heads x a 2048-token chunk x 8k context would
    # be 8.6 GB at once, so heads go in groups of at most SCORE_BYTES of scores
    group = max(1, min(nh, SCORE_BYTES // max(1, t * L * 4)))
    o_lat = torch.empty(nh, t, r, dtype=q_lat.dtype, device=q_lat.device)
    for h in range(0, nh, group):
        scores = (torch.matmul(q_lat[h:h + group], C.T) + torch.matmul(q_pe[h:h + group], KPE.T)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        o_lat[h:h + group] = torch.matmul(scores.float().softmax(dim=-1).to(q_lat.dtype), C)  # [group, t, r]
    return o_lat


def mla_project(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin, native: bool = False):
    """x [t, H] -> (q_nope [t, nh, dn], q_pe [t, nh, dr] rotated, the latent c [t, r] normed, the rotary key k_pe
    [t, dr] rotated: c and k_pe as the pool stores them; the normed low-rank query q_a, which DeepSeek Sparse
    Attention's indexer reads, or None without q_lora_rank)."""
    t = x.shape[0]
    nh, dn, dr, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    qa = None
    if cfg.q_lora_rank is None:
        q = linear(x, W[p + "q_proj.weight"])
    else:
        qa = rms_norm(linear(x, W[p + "q_a_proj.weight"], W.get(p + "q_a_proj.bias")),
                      W[p + "q_a_layernorm.weight"], 1e-6, native=native)
        q = linear(qa, W[p + "q_b_proj.weight"])
    q = q.view(t, nh, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    ckv = linear(x, W[p + "kv_a_proj_with_mqa.weight"], W.get(p + "kv_a_proj_with_mqa.bias"))
    c = rms_norm(ckv[:, :r], W[p + "kv_a_layernorm.weight"], 1e-6, native=native)  # [t, r]
    k_pe = ckv[:, r:].view(t, 1, dr)
    q_pe = apply_rope(q_pe, cos, sin, cfg.rope_interleave, native)             # [t, nh, dr]
    k_pe = apply_rope(k_pe, cos, sin, cfg.rope_interleave, native)[:, 0]       # [t, dr]
    return q_nope, q_pe, c, k_pe, qa


def mla_attention(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin, kv, layer: int,
                  native: bool = False, scale: float | None = None) -> torch.Tensor:
    """Multi-head latent attention, absorbed form. x [t, H] -> [t, H]. native: a decode step's norms and rope (as
    layers.rms_norm's) and its (up to NATIVE_ABSORB_TOKENS tokens) absorbed products on the native kernels
    (moe_kernels.attention.mla_absorb_*); a decode's attention too where the pool allows, DeepSeek Sparse
    Attention's indexer and selection included."""
    t = x.shape[0]
    nh, dn, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_nope, q_pe, c, k_pe, qa = mla_project(cfg, W, p, x, cos, sin, native)
    cache = kv.paged
    kv_b = W[p + "kv_b_proj.weight"]                                           # [nh * (dn + dv), r]
    absorb = native and t <= NATIVE_ABSORB_TOKENS and native_attention.supports_kv_b(kv_b)
    # decode on the native kernel, over the pool's blocks where they are (fp32 scores; torch's bf16 matmuls here run
    # at a few GFLOP/s on a CPU without bf16 arithmetic: docs/performance/decode_step.md)
    paged = absorb and kv.decoding and cache is not None and native_attention.mla_supported(*cache.pool.bufs[layer][:2])
    if cfg.index_topk:
        paged = paged and isinstance(kv, SequenceKV) and (not cfg.has_indexer(layer) or (
            kpool_native(cfg, cache.pool.bufs[layer][4]) if cfg.index_kpool else
            native_attention.dsa_supported(cache.pool.bufs[layer][2])))
        allowed, rows = dsa_select(cfg, W, p, x, qa, c, k_pe, cos, sin, kv, layer, paged)
    else:
        kv.write(layer, c, k_pe)
        allowed = rows = None
    # the latent math in the model dtype; kv_b_proj may be kept narrower (model.py: bf16 for an fp32 model)
    wkv = None if absorb else kv_b.to(x.dtype).view(nh, dn + dv, r)
    if absorb:
        q_lat = native_attention.mla_absorb_q(q_nope, kv_b, nh, dn, dv).to(x.dtype)
    else:
        q_lat = torch.einsum("thd,hdr->htr", q_nope, wkv[:, :dn])              # [nh, t, r]
    if paged:  # allowed: the selected positions (DeepSeek Sparse Attention) or None (all)
        o_lat = native_attention.mla_paged_attention(
            torch.cat([q_lat[:, 0], q_pe[0]], dim=-1), *cache.pool.bufs[layer][:2], cache.table(), kv.start + 1, scale,
            first=cache.blocks[0] if cache.consecutive() and allowed is None else -1,
            selected=allowed).to(x.dtype)[:, None]                           # [nh, 1, r]
    elif kv.decoding:
        (C, P, *_), unseen = rows or kv.rows(layer, x.dtype)
        if allowed is not None:
            unseen = ~allowed if unseen is None else unseen | ~allowed
        o_lat = mla_decode(q_lat.transpose(0, 1), q_pe, C, P, unseen, scale).transpose(0, 1)  # [nh, t, r]
    else:
        o_lat = _latent_attention(q_lat, q_pe, cache, layer, kv.start, scale, allowed)
    if absorb:
        o = native_attention.mla_absorb_o(o_lat, kv_b, nh, dn, dv).to(x.dtype)
    else:
        o = torch.einsum("htr,hvr->thv", o_lat, wkv[:, dn:]).reshape(t, nh * dv)
    return linear(o, W[p + "o_proj.weight"], W.get(p + "o_proj.bias"))


def dsa_select(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, qa: torch.Tensor, c, k_pe, cos, sin, kv,
               layer: int, paged: bool):
    """DeepSeek Sparse Attention: writes the layer's new latents, rotary keys and (a full layer) indexer keys, and
    picks each query's keys -> (paged: the one decode row's selected positions, int32 ascending; else allowed [rows, L]
    bool; the rows a decode read, or None). None for every position a query sees: where the sequence holds at most
    index_topk, the indexer would keep them all. A GLM-5 shared layer takes the previous full layer's pick
    (kv.selection)."""
    if not cfg.has_indexer(layer):
        kv.write(layer, c, k_pe)
        return _selection(kv.selection, paged, kv), None
    ip = p + "indexer."
    if cfg.index_kpool:  # GLM-5.3-Flash: pools of keys
        return kpool_select(cfg, W, ip, x, qa, c, k_pe, cos, sin, kv, layer, paged), None
    kv.write(layer, c, k_pe, index_key(cfg, W, ip, x, cos, sin))
    if kv.start + x.shape[0] <= cfg.index_topk:
        kv.selection = None
        return None, None
    q, w = index_query(cfg, W, ip, x, qa, cos, sin)
    cache, rows = kv.paged, None
    if paged:  # the native indexer over the pool's keys, then the top k
        scores = native_attention.dsa_scores(q[0], w[0], cache.pool.bufs[layer][2], cache.table(), kv.start + 1,
                                             cfg.index_dim ** -0.5)
        kv.selection = native_attention.dsa_top_k(scores, cfg.index_topk)
        return kv.selection, None
    if kv.decoding:
        rows = kv.rows(layer, x.dtype)  # (read once: the attention takes the same rows)
        (_, _, keys), hide = rows                                                  # [rows, L, D]
    else:
        t = x.shape[0]
        keys, hide = kv.paged.gather(layer, kv.start + t, dtype=x.dtype)[2][None], \
            ~_causal_mask(t, kv.start, x.device) if t > 1 else None
    kv.selection = index_select(cfg, q, w, keys, hide)
    return kv.selection, rows


def kpool_native(cfg: ModelConfig, keys: torch.Tensor) -> bool:
    """Whether kpool_select takes a decode row natively on this layer's pool keys (its pool buffer 4): the keys are
    every index_kpool-th row, so a block holds a whole number of them."""
    return BLOCK % cfg.index_kpool == 0 and native_attention.dsa_supported(keys)


def kpool_select(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, qa: torch.Tensor, c, k_pe, cos, sin, kv,
                 layer: int, native: bool = False) -> torch.Tensor | None:
    """GLM-5.3-Flash's lightning indexer over pools of index_kpool keys (transformers' Glm5NextTextIndexer): writes the
    layer's latents, its indexer keys, their pool gate logits and, at each pool's last position, the pool's key (the
    softmax over its positions, per dim, of gate logit + ape, weighting its keys); picks each query's index_topk /
    index_kpool best complete pools it sees (scored as V3.2's indexer scores keys) and adds its own unfinished pool ->
    allowed [t, start + t] bool, or None (every position: the pools a query sees fit the top k). native (a decode
    row, kpool_native): the scores and the top k on DeepSeek Sparse Attention's kernels over the pools' keys where
    the pool holds them -> the selected positions (int32, ascending)."""
    t, start, kp = x.shape[0], kv.start, cfg.index_kpool
    key = index_key(cfg, W, p, x, cos, sin)
    gate = F.linear(x, W[p + "index_kpool_compress_gate"].to(x.dtype))
    kv.write(layer, c, k_pe, key, gate, _pool_keys(cfg, W, p, key, gate, kv.paged, layer, start))
    end = start + t
    if end <= cfg.index_topk:
        kv.selection = None
        return None
    q, w = index_query(cfg, W, p, x, qa, cos, sin)                                # [t, H, D], [t, H]
    n = end // kp                                                                  # complete pools
    if native and t == 1:  # pool i's key: row i % (BLOCK / kp) of block i // (BLOCK / kp); every pool ended by now
        cache = kv.paged
        pools = native_attention.dsa_top_k(native_attention.dsa_scores(
            q[0], w[0], cache.pool.bufs[layer][4][:, kp - 1::kp], cache.table(), n, cfg.index_dim ** -0.5),
            cfg.index_topk // kp)
        kv.selection = torch.cat([(pools[:, None] * kp + torch.arange(kp, dtype=torch.int32)).flatten(),
                                  torch.arange(n * kp, end, dtype=torch.int32)])  # (and the unfinished pool)
        return kv.selection
    keys = kv.paged.gather(layer, n * kp, 0, x.dtype, only=(4,))[0][kp - 1::kp].float()  # [n, D]
    pos = torch.arange(start, end, device=x.device)[:, None]                       # [t, 1]
    seen = torch.arange(n, device=x.device)[None, :] < (pos + 1) // kp             # [t, n]: pools ended by the query
    allowed = torch.zeros(t, end, dtype=torch.bool, device=x.device)
    H, D = q.shape[1:]
    group = max(1, SCORE_BYTES // max(1, H * n * 4))
    for i in range(0, t, group):
        r = slice(i, i + group)
        g = q[r].shape[0]
        s = (F.relu(torch.matmul(q[r].float().reshape(g * H, D), keys.T) * D ** -0.5)).view(g, H, n)
        s = torch.matmul(w[r, None, :], s)[:, 0].masked_fill(~seen[r], float("-inf"))
        top = s.sort(dim=-1, descending=True, stable=True).indices[:, :min(cfg.index_topk // kp, n)]  # ties: earlier
        picked = torch.zeros(g, n, dtype=torch.bool, device=x.device).scatter_(-1, top, True) & seen[r]
        allowed[r, :n * kp] = picked.repeat_interleave(kp, dim=-1)
    j = torch.arange(end, device=x.device)[None, :]
    allowed |= (j <= pos) & (j >= pos + 1 - (pos + 1) % kp)                         # the unfinished pool
    kv.selection = allowed
    return allowed


def closing_windows(cache, layer: int, start: int, rate: int, rows: list, bufs: tuple) -> tuple:
    """The windows of `rate` positions that new positions start.. close (w0..w1-1: each closes at its last position) and
    the rows they read: `rows` (the new positions', one per pool buffer of `bufs`) after the pool's rows of w0's earlier
    positions -> (w0, w1, the rows)."""
    t = rows[0].shape[0]
    w0, w1 = start // rate, (start + t) // rate
    lo = w0 * rate
    if w1 > w0 and lo < start:
        old = cache.gather(layer, start, lo, rows[0].dtype, only=bufs)
        rows = [torch.cat([o.reshape(-1, o.shape[-1]), r]) for o, r in zip(old, rows)]  # (MLA's [n, d])
    return w0, w1, rows


def _pool_keys(cfg: ModelConfig, W: dict, p: str, key: torch.Tensor, gate: torch.Tensor, cache, layer: int,
               start: int) -> torch.Tensor:
    """The keys of the pools the new positions complete, each at its pool's last position (zeros elsewhere) -> [t, D];
    a pool's earlier positions' keys and gate logits come from the pool."""
    kp = cfg.index_kpool
    out = torch.zeros_like(key)
    w0, w1, (K, G) = closing_windows(cache, layer, start, kp, [key, gate], (2, 3))
    if w1 > w0:
        n = w1 - w0
        K, G = K[:n * kp].view(n, kp, -1), G[:n * kp].view(n, kp, -1)
        probs = (G.float() + W[p + "index_kpool_compress_ape"].float()).softmax(dim=1).to(K.dtype)
        out[torch.arange(w0 + 1, w1 + 1, device=key.device) * kp - 1 - start] = (probs * K).sum(dim=1)
    return out


def _selection(sel: torch.Tensor, positions: bool, kv) -> torch.Tensor:
    """A selection as the attention at hand reads it: positions (int32, one decode row's) or allowed [rows, L]."""
    if sel is None:
        return None
    if positions and sel.dtype == torch.bool:
        return sel[0].nonzero()[:, 0].to(torch.int32)
    if not positions and sel.dtype != torch.bool:
        return torch.zeros(1, kv.start + kv.t, dtype=torch.bool).index_fill_(1, sel.long(), True)
    return sel


def index_key(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """DeepSeek Sparse Attention's indexer key of each new position: x [t, H] -> [t, D], LayerNorm'd, its first
    qk_rope_head_dim dims rotated (V3.2 by halves, unlike MLA's own rotary key; GLM-5 in pairs); cached with the
    layer."""
    k = F.layer_norm(linear(x, W[p + "wk.weight"]), (cfg.index_dim,), W[p + "k_norm.weight"], W[p + "k_norm.bias"],
                     1e-6)
    dr = cfg.qk_rope_head_dim
    return torch.cat([apply_rope(k[:, None, :dr], cos, sin, cfg.index_rope_interleave)[:, 0], k[:, dr:]], dim=-1)


def index_query(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, qa: torch.Tensor, cos, sin):
    """The indexer's query heads and their weights for x [n, H] and q_a [n, q_lora_rank] (MLA's normed low-rank
    query) -> (q [n, heads, D] rotated as the keys, w [n, heads] fp32 with transformers' heads ** -0.5)."""
    n, H, D, dr = x.shape[0], cfg.index_heads, cfg.index_dim, cfg.qk_rope_head_dim
    q = linear(qa, W[p + "wq_b.weight"]).view(n, H, D)
    q = torch.cat([apply_rope(q[..., :dr], cos, sin, cfg.index_rope_interleave), q[..., dr:]], dim=-1)
    wp = W[p + "weights_proj.weight"]
    return q, linear(x.to(wp.dtype), wp).float() * H ** -0.5


def index_select(cfg: ModelConfig, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                 hide: torch.Tensor | None) -> torch.Tensor:
    """The lightning indexer on torch: each query row's index_topk keys. q [n, heads, D] and w [n, heads]
    (index_query's), keys [rows or 1, L, D] (each row's cached indexer keys, or one sequence's for all its rows), hide
    [n, L] (positions a row may not see: causality, a graph bucket's padding) or None -> allowed [n, L] bool. Scores as
    transformers' DeepseekV32Indexer: sum over heads of weight x relu(q . k / sqrt(D)), in fp32."""
    n, H, L = q.shape[0], q.shape[1], keys.shape[-2]
    allowed = torch.empty(n, L, dtype=torch.bool, device=q.device)
    # the scores are [rows, heads, L] fp32: a 4k-token prompt's 64 heads would be 4 GB at once, so rows go in groups
    # of at most SCORE_BYTES of scores
    group = max(1, SCORE_BYTES // max(1, H * L * 4))
    for i in range(0, n, group):
        rows = slice(i, i + group)
        k = keys[rows] if keys.shape[0] > 1 else keys
        scores = F.relu(torch.matmul(q[rows].float(), k.transpose(-1, -2).float()) * cfg.index_dim ** -0.5)
        index = torch.matmul(w[rows, None, :], scores)[:, 0]                                 # [group, L]
        if hide is not None:
            index = index.masked_fill(hide[rows], float("-inf"))
        # ties (keys every head's relu zeroes score 0) broken towards the earlier position, so that a query picks the
        # same keys whether its prompt is prefilled whole, in chunks or after a prefix-cache hit (torch.topk's order
        # among ties depends on the row's length); the native dsa_top_k orders them so too
        top = index.sort(dim=-1, descending=True, stable=True).indices[:, :cfg.index_topk]
        allowed[rows] = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, top, True)
    return allowed if hide is None else allowed & ~hide


def block_sparse_attention(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin, kv, layer: int,
                           native: bool = False, scale: float | None = None) -> torch.Tensor:
    """MiniMax-M3's sparse layers: GQA (gqa_project's queries, keys and values) over the key blocks the layer's block
    lightning indexer keeps for each query and KV group (block_select). x [t, H] (the rows `kv` covers) -> [t, H]."""
    t = x.shape[0]
    q, k, v, gate = gqa_project(cfg, W, p, x, cos, sin, native, layer)
    kv.write(layer, k, v, block_index_key(cfg, W, p, x, cos, sin)[:, None])
    start, cache = kv.start, kv.paged
    if -(-(start + t) // cfg.index_block) <= cfg.index_topk_blocks:  # every block is kept: every key a query sees
        return gqa_output(cfg, W, p, gqa_attend(cfg, W, p, q, kv, layer, native), gate)
    iq = block_index_query(cfg, W, p, x, cos, sin)                               # [t, index heads, D]
    K, V, keys = cache.pool.bufs[layer]
    if kv.decoding and native and isinstance(kv, SequenceKV) and cfg.index_heads == cfg.kv_heads(layer) and \
            native_attention.block_sparse_supported(K, keys[0]):
        # the indexer's scores over the pool's keys, the blocks picked per KV head, the attention over their positions
        table = cache.table()
        scores = native_attention.head_scores(iq[0], keys[0], table, start + 1)  # [kv heads, L]
        o = native_attention.paged_decode_attention(q[0], K, V, table, start + 1, cfg.head_dim ** -0.5,
                                                    selected=selected_positions(cfg, scores, start))
        return gqa_output(cfg, W, p, o.to(q.dtype), gate)
    K, V, keys = cache.gather(layer, start + t, dtype=q.dtype)                   # [kv, L, d], [kv, L, dv], [1, L, D]
    nh, L = cfg.num_heads, K.shape[1]
    qh = q.transpose(0, 1)[None]                                                 # [1, nh, t, d]
    o = torch.empty(1, nh, t, cfg.value_dim, dtype=q.dtype, device=q.device)
    rows = max(1, SCORE_BYTES // max(1, nh * L * 4))  # queries whose fp32 scores (and mask) fit at once
    for i in range(0, t, rows):
        r = slice(i, i + rows)
        allowed = block_select(cfg, iq[r], keys[0][:start + i + iq[r].shape[0]], start + i)  # [index heads, n, L']
        mask = allowed.repeat_interleave(nh // allowed.shape[0], dim=0)          # [nh, n, L']: a head its group's
        n = mask.shape[-1]
        o[:, :, r] = F.scaled_dot_product_attention(qh[:, :, r], K[None, :, :n], V[None, :, :n], attn_mask=mask[None],
                                                    enable_gqa=K.shape[0] != nh)
    return gqa_output(cfg, W, p, o[0].transpose(0, 1), gate)


def block_index_key(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """MiniMax-M3's block indexer key of each new position: x [t, H] -> [t, D], RMS-normed (zero-centred) and rotated
    as the attention's keys are (its first rotary dims); cached with the layer."""
    k = rms_norm(linear(x, W[p + "index_k_proj.weight"]), W[p + "index_k_norm.weight"], cfg.rms_norm_eps,
                 cfg.norm_offset)
    return apply_rope(k[:, None], cos, sin, False)[:, 0]


def block_index_query(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """Its query heads: x [t, H] -> [t, index heads, D], each RMS-normed and rotated as block_index_key's."""
    q = linear(x, W[p + "index_q_proj.weight"]).view(x.shape[0], cfg.index_heads, cfg.index_dim)
    return apply_rope(rms_norm(q, W[p + "index_q_norm.weight"], cfg.rms_norm_eps, cfg.norm_offset), cos, sin, False)


def block_select(cfg: ModelConfig, q: torch.Tensor, keys: torch.Tensor, start: int) -> torch.Tensor:
    """The block lightning indexer on torch, as transformers' MiniMaxM3VLIndexer: q [t, heads, D] at positions
    start.., keys [L, D] (L = start + t) -> allowed [heads, t, L] bool: the keys each query may see in the blocks its
    head keeps. A key block's score is the max of q . k (fp32) over its keys the query sees; the index_local_blocks
    blocks ending at the query's own always kept, then the best others up to index_topk_blocks. (The blocks a query
    keeps do not depend on how many follow it: its selection is the same prefilled whole, in chunks or decoded.)"""
    t, heads = q.shape[:2]
    L, bs = keys.shape[0], cfg.index_block
    nb = -(-L // bs)
    pos = torch.arange(start, start + t, device=q.device)
    future = torch.arange(L, device=q.device)[None, :] > pos[:, None]           # [t, L]
    allowed = torch.empty(heads, t, L, dtype=torch.bool, device=q.device)
    rows = max(1, SCORE_BYTES // max(1, heads * nb * bs * 4))  # queries whose fp32 scores fit at once
    for i in range(0, t, rows):
        r = slice(i, i + rows)
        s = torch.matmul(q[r].float().transpose(0, 1), keys.float().T).masked_fill(future[r], float("-inf"))
        n = s.shape[1]
        top, ids = kept_blocks(cfg, s, pos[r] // bs)
        kept = torch.zeros(heads, n, nb + 1, dtype=torch.bool, device=q.device).scatter_(
            -1, ids.masked_fill(top == float("-inf"), nb), True)[..., :nb]         # (column nb: the unfilled ones)
        allowed[:, r] = kept.repeat_interleave(bs, dim=-1)[..., :L] & ~future[r]
    return allowed


def kept_blocks(cfg: ModelConfig, s: torch.Tensor, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores s [heads, n, L] (fp32, -inf where a query may not look) of n queries whose own blocks are `own` [n] ->
    (each query's top block scores, their blocks) [heads, n, min(index_topk_blocks, blocks)]: a block's score is its
    keys' max; the local blocks first (+inf), then the best; -inf: no block (fewer exist before the query)."""
    heads, n, L = s.shape
    bs = cfg.index_block
    nb = -(-L // bs)
    s = F.pad(s, (0, nb * bs - L), value=float("-inf")).view(heads, n, nb, bs).amax(-1)       # [heads, n, nb]
    for back in range(cfg.index_local_blocks):
        s.scatter_(-1, (own - back).clamp(min=0)[None, :, None].expand(heads, n, 1), float("inf"))
    return s.topk(min(cfg.index_topk_blocks, nb), dim=-1)


def selected_positions(cfg: ModelConfig, scores: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query's selection as the native attention reads it: its indexer heads' scores [heads, L] (L = pos +
    1, every key visible) -> (positions [heads, n] int32 ascending, how many of each head's are at or before pos
    [heads] int32: only the query's own block, the last, runs past it)."""
    bs = cfg.index_block
    _, ids = kept_blocks(cfg, scores[:, None], torch.tensor([pos // bs]))
    ids = ids[:, 0].sort(dim=-1).values                                          # [heads, k] ascending
    at = (ids[..., None] * bs + torch.arange(bs)).flatten(1)                     # [heads, k * bs]
    return at.clamp(max=pos).to(torch.int32), (at <= pos).sum(-1, dtype=torch.int32)  # (the rest unread)


def linear_attention(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin, kv, layer: int,
                     native: bool = False, scale: float | None = None) -> torch.Tensor:
    """Gated DeltaNet or (GLM-5.3-Flash) Kimi Delta Attention (linear_attention.py): a state per sequence instead of
    keys, no rotary embedding."""
    if p + "f_a_proj.weight" in W:
        return kimi_delta_attention(cfg, W, p, x, kv.paged, layer)
    return gated_deltanet(cfg, W, p, x, kv.paged, layer)


# the attention kinds: a new kind is one function here (its torch reference, which CUDA graphs capture where it
# takes a graph's bucket as `kv`) and, optionally, a native block in native_stages.py
KINDS = {"gqa": gqa_attention, "mla": mla_attention, "dsa": mla_attention, "linear": linear_attention,
         "block_sparse": block_sparse_attention, "compressed": compressed_attention}


def kind(cfg: ModelConfig, layer: int) -> str:
    """The attention kind of a layer (dsa: MLA behind DeepSeek Sparse Attention's indexer, mla_attention's;
    block_sparse: MiniMax-M3's sparse layers; compressed: DeepSeek-V4's, compressed_attention.py)."""
    if cfg.attention == "compressed":
        return "compressed"
    if cfg.is_linear_attention(layer):
        return "linear"
    if cfg.block_sparse(layer):
        return "block_sparse"
    return "dsa" if cfg.index_topk else cfg.attention
