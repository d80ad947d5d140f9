"""The native decode step of attention blocks on the CPU (native/decode/decode_step.cpp): for a step whose every sequence
adds one token, a layer's input norm, its attention (GQA: q/k/v, QK-norm, rope, KV append, paged attention; MLA: q
through its low-rank pair, the latent and rotary key, rope, both into the pool, the absorbed latent attention),
o_proj, residual and post-attention norm, and an MoE layer's router, are one native call for all the step's
sequences, instead of ~30 torch ops and 7 native calls a sequence (attention.gqa_attention / mla_attention and
layers.route, the reference: bit for bit for one sequence, the softmax router included; the sigmoid router's fp32
logits to the last bits).

Built per layer when the weights allow it (`blocks`); any other layer or step takes the torch path."""
from __future__ import annotations

import torch

from moe_core.config import SILU, ModelConfig
from moe_kernels import ISA, SIMD_ISAS, native
from moe_kernels import attention as native_attention
from moe_kernels.attention import KV_CODES, vector_kernel
from moe_kernels.dense import NativeLinear

from gpu_service.model.attention import QKV
from gpu_service.engine.kv_pool import BLOCK, KVPool, SeqCache
from gpu_service.model.layers import GATE_UP, softmax_scale

# torch's vector width decides which elements of its silu/sigmoid take Sleef's exp and which libm's (a loop's tail):
# the native MLP and sigmoid router compute each element as torch does (native/kernels/torch_rounding.h)
native.set_torch_vector_bytes({"AVX512": 64, "AVX2": 32}.get(torch.backends.cpu.get_cpu_capability(), 0))


def eligible(cfg: ModelConfig, dtype: torch.dtype, native_dense: bool) -> bool:
    """Whether the model's attention layers fit the native step: GQA (with QK-norm, biases, partial rotary by
    halves, sinks, sliding windows, values narrower than keys and scaled: gpt-oss, MiMo-V2-Flash) or MLA, no output
    gate or zero-centred norms, bf16 or fp32, on a vector kernel path."""
    return (native_dense and ISA in SIMD_ISAS and dtype in (torch.bfloat16, torch.float32) and not cfg.index_topk
            and not (cfg.attn_output_gate or cfg.qk_norm_full or cfg.norm_offset)
            and (cfg.attention == "mla" or vector_kernel(cfg.head_dim, cfg.value_dim)))


def blocks(cfg: ModelConfig, W: dict, dtype: torch.dtype, native_dense: bool) -> dict:
    """layer -> native.DecodeBlock for each attention layer the native step can run (none when `eligible` says no)."""
    if not eligible(cfg, dtype, native_dense):
        return {}
    out = {}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        if cfg.attention == "mla":
            block = _mla_block(cfg, W, layer, dtype)
            if block is not None:
                out[layer] = block
            continue
        if cfg.is_linear_attention(layer) or cfg.compress_rates:
            continue
        qkv, o = W.get(a + QKV), W.get(a + "o_proj.weight")
        if not (isinstance(qkv, NativeLinear) and isinstance(o, NativeLinear)):
            continue
        sinks = W.get(a + cfg.sinks_name) if cfg.attn_sinks else None  # (MiMo: its sliding layers only)
        sinks = None if sinks is None else sinks.float().contiguous()
        held = [W[p + "input_layernorm.weight"], W[p + "post_attention_layernorm.weight"]]
        held += [W.get(a + n) for n in ("q_norm.weight", "k_norm.weight", "q_proj.bias", "k_proj.bias",
                                        "v_proj.bias", "o_proj.bias")]
        if any(t is not None and (t.dtype != dtype or not t.is_contiguous()) for t in held):
            continue
        ptr = [t.data_ptr() if t is not None else 0 for t in held]
        router = _router(cfg, W, layer)
        out[layer] = native.DecodeBlock(
            ISA, dtype == torch.bfloat16, qkv.native, o.native, *ptr[:2], *(ptr[2:4] if cfg.qk_norm else (0, 0)),
            *ptr[4:], H=cfg.hidden_size, nh=cfg.num_heads, nkv=cfg.kv_heads(layer), d=cfg.head_dim,
            rot=cfg.rotary_dim or cfg.head_dim, eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5, top_k=cfg.top_k,
            norm_topk=bool(cfg.norm_topk_prob), round_w=cfg.model_type != "mixtral", dv=cfg.value_dim,
            v_scale=cfg.value_scale, window=cfg.window(layer), sinks=0 if sinks is None else sinks.data_ptr(),
            owner=(qkv, o, held, router, sinks), **router)
    return out


def _mla_block(cfg: ModelConfig, W: dict, layer: int, dtype: torch.dtype):
    """An MLA layer's native.DecodeBlock where its projections are packed (q_a and q_b, or q_proj; kv_a; o_proj),
    kv_b_proj is a plain matrix the absorbed products read (attention.mla_attention's decode branch) and the norms
    and biases are of the model dtype; else None."""
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    lora = cfg.q_lora_rank is not None
    q_a, q_b = (W.get(a + "q_a_proj.weight"), W.get(a + "q_b_proj.weight")) if lora else (None, W.get(a + "q_proj.weight"))
    kv_a, o, kv_b = W.get(a + "kv_a_proj_with_mqa.weight"), W.get(a + "o_proj.weight"), W.get(a + "kv_b_proj.weight")
    if not all(isinstance(w, NativeLinear) for w in (q_b, kv_a, o) + ((q_a,) if lora else ())) \
            or not native_attention.supports_kv_b(kv_b) or a + "q_proj.bias" in W or a + "q_b_proj.bias" in W \
            or cfg.qk_rope_head_dim % 2:
        return None
    held = [W[p + "input_layernorm.weight"], W[p + "post_attention_layernorm.weight"], W[a + "kv_a_layernorm.weight"]]
    held += [W.get(a + n) for n in ("q_a_layernorm.weight", "q_a_proj.bias", "kv_a_proj_with_mqa.bias", "o_proj.bias")]
    if any(t is not None and (t.dtype != dtype or not t.is_contiguous()) for t in held):
        return None
    ptr = [t.data_ptr() if t is not None else 0 for t in held]
    router = {"norm_topk": bool(cfg.norm_topk_prob), **_router(cfg, W, layer)}  # (V2's router: no renormalizing)
    return native.DecodeBlock.mla(
        ISA, dtype == torch.bfloat16, q_a.native if lora else None, q_b.native, kv_a.native, o.native, kv_b.data_ptr(),
        kv_b.dtype == torch.bfloat16, *ptr[:2], ptr[3], ptr[2], *ptr[4:], H=cfg.hidden_size, nh=cfg.num_heads,
        r=cfg.kv_lora_rank, dn=cfg.qk_nope_head_dim, dr=cfg.qk_rope_head_dim, dv=cfg.v_head_dim,
        interleave=cfg.rope_interleave, eps=cfg.rms_norm_eps,
        scale=softmax_scale(cfg, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), top_k=cfg.top_k,
        round_w=True, owner=(q_a, q_b, kv_a, o, kv_b, held, router), **router)


def _router(cfg: ModelConfig, W: dict, layer: int) -> dict:
    """An MoE layer's router as the native step runs it (DecodeBlock's keywords), {} where route() runs it (other
    scorings, biases, dense layers): a softmax router (Qwen-MoE, Mixtral: layers.route's last branch) packed for the
    native kernels, a sigmoid one (GLM-4.5, DeepSeek-V3: its fp32 weight and correction bias as loaded,
    group-limited), or DeepSeek-V2's softmax on fp32 logits (its fp32 weight; greedy or group_limited_greedy)."""
    if not cfg.is_moe_layer(layer):
        return {}
    fp = f"model.layers.{layer}.{cfg.ffn_prefix}."
    rp = fp + cfg.router_name + "."
    gate = W.get(rp + "weight")
    bias = W.get(rp + "e_score_correction_bias", W.get(fp + "e_score_correction_bias"))
    if cfg.scoring == "sigmoid":  # fp32 weights only (MiniMax-M2's router is in the model dtype: route() runs it)
        E = cfg.n_routed_experts
        if not (_fp32(gate, (E, cfg.hidden_size)) and (bias is None or _fp32(bias, (E,)))) or rp + "bias" in W:
            return {}
        return dict(w32=gate.data_ptr(), bias32=bias.data_ptr() if bias is not None else 0, E=E,
                    n_group=cfg.n_group, topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor)
    if cfg.scoring != "softmax" or bias is not None or rp + "bias" in W:
        return {}
    if cfg.model_type == "deepseek_v2":  # route()'s deepseek_v2 branch: no renormalization, scaled
        E = cfg.n_routed_experts
        if not _fp32(gate, (E, cfg.hidden_size)):
            return {}
        grouped = cfg.topk_method == "group_limited_greedy"
        return dict(w32=gate.data_ptr(), softmax32=True, E=E, n_group=cfg.n_group if grouped else 1,
                    topk_group=cfg.topk_group if grouped else 1, scaling=cfg.routed_scaling_factor, norm_topk=False)
    return dict(gate=gate.native) if isinstance(gate, NativeLinear) else {}


def _fp32(t, shape: tuple) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == shape and t.is_contiguous() \
        and t.device.type == "cpu"


def mlps(cfg: ModelConfig, W: dict, dtype: torch.dtype, blocks: dict) -> dict:
    """layer -> native.Mlp for each layer whose block the native step runs and whose dense MLP (a dense layer) or
    shared experts (an MoE layer) are packed for the native kernels (gate and up fused); the decode steps run them
    natively (decode_mlp.cpp) in the layer loop and the decode loop alike."""
    out = {}
    if cfg.mlp_act != SILU:  # (decode_mlp.cpp's activation is SwiGLU's)
        return out
    for layer in blocks:
        ffn = fp = f"model.layers.{layer}.{cfg.ffn(layer)}."
        gated = cfg.is_moe_layer(layer) and cfg.shared_expert_gate  # Qwen2-MoE's gate on its shared expert
        if cfg.is_moe_layer(layer):
            if not cfg.shared_intermediate_size:
                continue
            fp += "shared_expert." if cfg.shared_expert_gate else "shared_experts."
        gate_up, down = W.get(fp + GATE_UP), W.get(fp + "down_proj.weight")
        if not (isinstance(gate_up, NativeLinear) and isinstance(down, NativeLinear)):
            continue
        gate = W.get(ffn + "shared_expert_gate.weight") if gated else None
        if gated and not isinstance(gate, NativeLinear):
            continue
        out[layer] = native.Mlp(dtype == torch.bfloat16, gate_up.native, down.native, gate.native if gated else None,
                                owner=(gate_up, down, gate))
    return out


def mlp(m, x: torch.Tensor) -> torch.Tensor:
    """A native MLP of decode rows x [B, H] (the model dtype) -> [B, H]."""
    y = torch.empty_like(x)
    m.forward(x.shape[0], x.data_ptr(), y.data_ptr())
    return y


def sequences(caches: list[SeqCache], starts: list[int]) -> torch.Tensor:
    """The step's sequences as the native step takes them: int64 [2, B, 3], per sequence (block table address, the
    new token's position, the first of consecutive blocks or -1), first for the main pool's layers, then for the
    window pool's (kv_pool.window_layers; the same rows where the model has none); each cache's block for the
    position reserved."""
    rows = []
    pool = caches[0].pool
    if any(c.pool is not pool for c in caches):
        raise ValueError("the step's sequences hold blocks of different KV pools")
    for c, pos in zip(caches, starts):
        if not c.reserve(pos + 1):
            raise MemoryError(f"the KV pool ({c.pool.num_blocks} blocks of {BLOCK}) is full")
        rows.append((c.table().data_ptr(), pos, c.first()))
    window = rows if pool.window is None else [(c.window_table().data_ptr(), pos, -1) for c, pos in zip(caches, starts)]
    return torch.tensor([rows, window], dtype=torch.int64)


def run(block, pool: KVPool, layer: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqs: torch.Tensor,
        top_k: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """h [B, H] (updated in place: h + attention) -> (the post-attention norm of the new h [B, H], the router's
    (ids int32 [B, k], weights fp32 [B, k]) where the block routes, else None)."""
    K, V = pool.bufs[layer]
    B = h.shape[0]
    seqs = seqs[1] if pool.windowed[layer] else seqs  # (the main rows first: no op for them)
    x = torch.empty_like(h)
    routed = (torch.empty(B, top_k, dtype=torch.int32), torch.empty(B, top_k)) if block.routes else None
    block.run(B, h.data_ptr(), cos.data_ptr(), sin.data_ptr(), K.data_ptr(), V.data_ptr(), KV_CODES[K.dtype],
              K.stride(0), K.stride(1),
              BLOCK.bit_length() - 1, seqs.data_ptr(), x.data_ptr(), *((routed[0].data_ptr(), routed[1].data_ptr())
                                                                       if routed else (0, 0)), V.stride(0), V.stride(1))
    return x, routed
