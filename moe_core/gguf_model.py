"""GGUF files (what llama.cpp users have on disk) as a model: `--model FILE.gguf`.

prepare(FILE.gguf) writes a small folder beside the cache (config.json from the GGUF's metadata,
tokenizer.json and tokenizer_config.json from its tokenizer and chat template, gguf.json naming the file)
that load_config and TextCodec read as they read a checkpoint folder; GGUFCheckpoint reads the tensors in
place from the mapped file, by llama.cpp's names shown under transformers' names, dequantized by the gguf
package (a routed expert one expert at a time from the stacked [E, rows, K] tensor). Experts of the block types
a kernel format holds exactly are kept bit for bit (AS_STORED: Q4_0 on int4g32; Q4_K on q4k (its own bytes' worth) or
uint4g32; Q5_K on q5k; Q6_K on q6k; Q3_K on q3k (its own bytes' worth) or q6k; Q2_K on q2k; Q4_1 on uint4g32; IQ4_XS
on iq4xs (its own bytes' worth) or iq4nl; IQ4_NL on iq4nl; Q8_0 on int8g32; MXFP4 on mxfp4; IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS,
IQ2_S, IQ3_XXS and IQ3_S each on its own format, the file's bytes); the other quant types (Q5_0, Q5_1) are dequantized
exactly (then requantized by default: covering).
Families: qwen3moe, qwen2moe, deepseek2 (both MLA layouts), deepseek32, glm-dsa, glm4moe, minimax-m2, minimax-m3,
deepseek4 (DeepSeek-V4: its MXFP4 experts kept as stored), glm5-next (GLM-5.3-Flash's text model), mimo2
(MiMo-V2-Flash), gpt-oss (MXFP4 experts kept as published) and llama files with experts (Mixtral); what the converter
changed is undone (a llama file's q/k rows, MLA's split kv_b, gpt-oss's split gate/up and nibble order, MiniMax-M3's
norms' added 1, a fused q/k/v split again);
others are refused by name.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
from typing import Callable, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, dequantize

from moe_core import gguf_check, tiktoken_vocab
from moe_core.checkpoint import Checkpoint
from moe_core.config import ModelConfigError, load_config
from moe_kernels.formats import Int4, Iq4, Iq4Xs, Mx4, Q2K, Q3K, Q4K, Q5K, Q6K, Q8, UInt4, format_of
from moe_kernels.iq_formats import BY_QTYPE as IQ_FORMATS, NUMBERS as IQ_NUMBERS, SPECS as IQ_SPECS
from moe_kernels.packing import layout

MARKER = "gguf.json"
FAMILIES = ("qwen3moe", "qwen2moe", "deepseek2", "deepseek32", "glm-dsa", "glm4moe", "minimax-m2", "minimax-m3",
            "deepseek4", "glm5-next", "mimo2", "gpt-oss", "llama")  # llama: Mixtral; deepseek32: DeepSeek-V3.2; glm-dsa: GLM-5
# `where` entries whose name is every expert's tensor at once, built expert by expert (get_row) from the file's
# tensors' slices: dequantized, or as stored (STACKED_RAW: gpt-oss's MXFP4 blocks)
STACKED, STACKED_RAW = -1, -2
FLOAT_TYPES = ("F32", "F16", "BF16")  # not block types: read as floats
# bits a value of the formats a type no format keeps is requantized into (covering), smallest first (not q2k: its 4
# levels per 16 are coarser than the IQ2 types' grids; it keeps Q2_K alone)
VALUE_BITS = {"q3k": 3, "iq4xs": 4, "q5k": 5, "q6k": 6, "int8g32": 8}


# The block types' numbers are moe_kernels.formats' (imported where used: moe_kernels loads the native library, which
# moe_core does without).


def _f16(b: np.ndarray) -> torch.Tensor:
    """[..., 2] bytes -> their fp16 values as float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def _halves(qs: np.ndarray) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] nibbles: the n low ones, then the n high ones (ggml's order within a block)."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    return torch.cat([q & 15, q >> 4], dim=-1)


def _q4_0(b: np.ndarray):  # 18 bytes per 32: fp16 d, 16 bytes; w = d (q - 8)
    blocks = b.reshape(b.shape[0], -1, 18)
    q = _halves(blocks[..., 2:]).reshape(b.shape[0], -1)
    return Int4((q.to(torch.int16) - 8).to(torch.int8), _f16(blocks[..., :2]), 32)


def _q8_0(b: np.ndarray):  # 34 bytes per 32: fp16 d, 32 int8; w = d q
    blocks = b.reshape(b.shape[0], -1, 34)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8)).reshape(b.shape[0], -1)
    return Q8(q, _f16(blocks[..., :2]))


def _q4_1(b: np.ndarray):  # 20 bytes per 32: fp16 d, fp16 m, 16 bytes; w = d q + m
    blocks = b.reshape(b.shape[0], -1, 20)
    return UInt4(_halves(blocks[..., 4:]).reshape(b.shape[0], -1), _f16(blocks[..., :2]), -_f16(blocks[..., 2:4]), 32)


def _k_scales(blocks: np.ndarray) -> tuple:
    """Q4_K's and Q5_K's first 16 bytes per 256 -> d, dmin [R, n] and the 8 sub-blocks' 6-bit sc, m [R, 8 n]."""
    R = blocks.shape[0]
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sm = torch.from_numpy(np.ascontiguousarray(blocks[..., 4:16])).view(R, -1, 3, 4)
    lo, hi, both = sm[..., 0, :], sm[..., 1, :], sm[..., 2, :]
    sc = torch.cat([lo & 63, (both & 15) | ((lo >> 2) & 48)], dim=-1)  # [R, blocks, 8]
    mn = torch.cat([hi & 63, (both >> 4) | ((hi >> 2) & 48)], dim=-1)
    return d, dmin, sc.reshape(R, -1), mn.reshape(R, -1)


def _q4_k(b: np.ndarray):
    """144 bytes per 256: fp16 d and dmin, 12 bytes of 6-bit scales and mins for the 8 sub-blocks of 32, 128 bytes
    (per 64 weights 32 bytes: the low nibbles the first sub-block, the high ones the second); w = d sc q - dmin m."""
    R = b.shape[0]
    blocks = b.reshape(R, -1, 144)
    q = _halves(blocks[..., 16:].reshape(R, -1, 4, 32)).reshape(R, -1)
    return Q4K(q, *_k_scales(blocks))


def _q5_k(b: np.ndarray):
    """176 bytes per 256: Q4_K's 16 bytes of d, dmin, scales and mins, 32 bytes of high bits (bit s of byte l: weight
    32 s + l), then Q4_K's 128 bytes of nibbles; w = d sc q - dmin m, q = nibble + 16 high bit."""
    R = b.shape[0]
    blocks = np.ascontiguousarray(b.reshape(R, -1, 176))
    n = blocks.shape[1]
    qh = torch.from_numpy(blocks[..., 16:48].copy()).view(R, n, 1, 32)
    high = (qh >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1  # [R, n, 8, 32]
    q = _halves(blocks[..., 48:].reshape(R, n, 4, 32)).reshape(R, n, 8, 32) | (high << 4)
    return Q5K(q.reshape(R, -1), *_k_scales(blocks))


def _q6_k(b: np.ndarray):
    """210 bytes per 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16), fp16 d. Per
    128 weights: 64 bytes of nibbles (the low ones weights 0-63, the high ones 64-127) and 32 bytes of pairs (bits 2k,
    2k + 1 of byte l: weight 32k + l); w = d sc (q - 32)."""
    R = b.shape[0]
    blocks = np.ascontiguousarray(b.reshape(R, -1, 210))
    n = blocks.shape[1]
    ql = torch.from_numpy(blocks[..., :128].copy()).view(R, n, 2, 1, 64)
    qh = torch.from_numpy(blocks[..., 128:192].copy()).view(R, n, 2, 1, 32)
    lo = (ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 15        # [R, n, 2, 2, 64]
    hi = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3   # [R, n, 2, 4, 32]
    q = (lo.reshape(R, n, 2, 4, 32) | (hi << 4)).to(torch.int8) - 32
    sc = torch.from_numpy(blocks[..., 192:208].copy().view(np.int8)).reshape(R, -1)
    return Q6K(q.reshape(R, -1), _f16(blocks[..., 208:210]), sc)


def _bit_pairs(qs: np.ndarray) -> torch.Tensor:
    """Q2_K's and Q3_K's 64 bytes of bit pairs per 256 ([R, n, 64]) -> [R, n, 256] values 0..3: pair j of byte 32 h + l
    is weight 128 h + 32 j + l."""
    R, n = qs.shape[:2]
    q = torch.from_numpy(np.ascontiguousarray(qs)).view(R, n, 2, 1, 32)
    return ((q >> (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)) & 3).reshape(R, n, 256)


def _q2_k(b: np.ndarray):
    """84 bytes per 256: 16 bytes of 4-bit scales and mins (sc | m << 4, one per 16), 64 of bit pairs, fp16 d, fp16
    dmin; w = d sc q - dmin m."""
    R = b.shape[0]
    blocks = np.ascontiguousarray(b.reshape(R, -1, 84))
    sm = torch.from_numpy(blocks[..., :16].copy()).reshape(R, -1)
    return Q2K(_bit_pairs(blocks[..., 16:80]).reshape(R, -1), _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84]),
               sm & 15, sm >> 4)


def _q3_k(b: np.ndarray):
    """110 bytes per 256: 32 bytes of high bits (bit 4h + j of byte l: weight 128 h + 32 j + l), 64 of low bit pairs
    (bits 2j of byte 32 h + l: the same weight), 12 of the 16 6-bit scales (ggml's kmask shuffle), fp16 d;
    w = d (sc - 32) (u - 4) with u = pair + 4 high bit."""
    R = b.shape[0]
    blocks = np.ascontiguousarray(b.reshape(R, -1, 110))
    n = blocks.shape[1]
    hm = torch.from_numpy(blocks[..., :32].copy()).view(R, n, 1, 32)
    high = (hm >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1            # [R, n, 8, 32]
    q = (_bit_pairs(blocks[..., 32:96]).view(R, n, 8, 32) | (high << 2)).to(torch.int8) - 4
    a = blocks[..., 96:108].copy().view(np.uint32)                              # [R, n, 3]
    m1, m2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    a0, a1, t = a[..., 0], a[..., 1], a[..., 2]
    sc = np.stack([(a0 & m2) | ((t & m1) << 4), (a1 & m2) | (((t >> 2) & m1) << 4),
                   ((a0 >> 4) & m2) | (((t >> 4) & m1) << 4), ((a1 >> 4) & m2) | (((t >> 6) & m1) << 4)], -1)
    sc = torch.from_numpy(np.ascontiguousarray(sc).view(np.uint8).astype(np.int16) - 32).to(torch.int8)
    return Q3K(q.reshape(R, -1), _f16(blocks[..., 108:110]), sc.reshape(R, -1))


def _iq4_nl(b: np.ndarray):  # 18 bytes per 32: fp16 d, 16 bytes of codes; w = d IQ4NL[code]
    blocks = b.reshape(b.shape[0], -1, 18)
    return Iq4(_halves(blocks[..., 2:]).reshape(b.shape[0], -1), _f16(blocks[..., :2]))


def _iq4_xs(b: np.ndarray):
    """136 bytes per 256: fp16 d, the 8 sub-blocks' 6-bit scales (2 high bits each in a uint16, 4 low bits in 4
    bytes), 128 bytes of codes (16 per sub-block of 32); w = d (ls - 32) IQ4NL[code], the scale exact in fp32."""
    R = b.shape[0]
    blocks = b.reshape(R, -1, 136)
    d = _f16(blocks[..., 0:2])
    high = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)[..., 0].astype(np.int32))
    low = torch.from_numpy(np.ascontiguousarray(blocks[..., 4:8])).int()
    j = torch.arange(8)
    ls = ((low[..., j // 2] >> (4 * (j % 2))) & 15) | (((high[..., None] >> (2 * j)) & 3) << 4)
    codes = _halves(blocks[..., 8:].reshape(R, -1, 8, 16)).reshape(R, -1)
    return Iq4Xs(codes, d, (ls - 32).to(torch.int8).reshape(R, -1))


def _iq_blocks(fmt: str) -> Callable:
    """A grid type's rows of bytes -> its blocks as stored (moe_kernels.iq_formats: the kernels read the file's fields)."""
    size = IQ_SPECS[fmt].size
    return lambda b: IQ_NUMBERS[fmt](torch.from_numpy(np.ascontiguousarray(b).reshape(b.shape[0], -1, size).copy()))


def _q4_0_as_uint4(w):  # Q4_0 on uint4g32: d (q - 8) = d q - 8 d
    return UInt4((w.values.to(torch.int16) + 8).to(torch.uint8), w.scale, 8 * w.scale, w.group)


class Stored(NamedTuple):
    """How the experts of one GGUF block type are kept as stored: decode (the bytes of rows -> the type's numbers,
    moe_kernels.formats' Int4, Q4K, Mx4...; gpt-oss's MXFP4 experts are read as published blocks by _fused_experts) and the expert formats
    that hold those numbers exactly, preferred first, each with what makes the numbers that format's (None: as
    decoded; the format's table entry keeps them)."""
    decode: Callable | None
    kept_by: dict[str, Callable | None]


# GGUF block type -> how it is kept as stored (Q4_0's q - 8 is also a min of 8 scales; Q4_K's and IQ4_XS's scales
# multiplied out per 32 are exact in fp32)
AS_STORED = {
    "Q4_0": Stored(_q4_0, {"int4g32": None, "uint4g32": _q4_0_as_uint4}),
    "Q4_1": Stored(_q4_1, {"uint4g32": None}),
    "Q2_K": Stored(_q2_k, {"q2k": None}),
    "Q3_K": Stored(_q3_k, {"q3k": None, "q6k": None}),
    "Q4_K": Stored(_q4_k, {"q4k": None, "uint4g32": lambda w: w.to_uint4()}),
    "Q5_K": Stored(_q5_k, {"q5k": None}),
    "Q6_K": Stored(_q6_k, {"q6k": None}),
    "IQ4_NL": Stored(_iq4_nl, {"iq4nl": None}),
    "IQ4_XS": Stored(_iq4_xs, {"iq4xs": None, "iq4nl": lambda w: w.to_iq4()}),
    "Q8_0": Stored(_q8_0, {"int8g32": None}),
    "MXFP4": Stored(lambda b: Mx4.from_blocks(*_mx_blocks(b)), {"mxfp4": None}),
    # the grid types: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, each on its own format (the file's bytes)
    **{t: Stored(_iq_blocks(f), {f: None}) for t, f in IQ_FORMATS.items()},
}
# block type -> the expert formats that hold it exactly (what the file stores, in the kernels' numbers), preferred first
KEEPS = {t: tuple(s.kept_by) for t, s in AS_STORED.items()}


V4_LAYER = (  # DeepSeek-V4: (our name under model.layers.N., llama.cpp's under blk.N.)
    ("attn_norm.weight", "attn_norm.weight"), ("ffn_norm.weight", "ffn_norm.weight"),
    *((f"hc_{b}_{p}", f"hc_{b}_{p}.weight") for b in ("attn", "ffn") for p in ("fn", "base", "scale")),
    ("attn.attn_sink", "attn_sinks.weight"), ("attn.wq_a.weight", "attn_q_a.weight"),
    ("attn.wq_b.weight", "attn_q_b.weight"), ("attn.q_norm.weight", "attn_q_a_norm.weight"),
    ("attn.wkv.weight", "attn_kv.weight"), ("attn.norm.weight", "attn_kv_a_norm.weight"),
    ("attn.wo_a.weight", "attn_output_a.weight"), ("attn.wo_b.weight", "attn_output_b.weight"),
    *((f"attn.{c}compressor.{o}", f"{t}_compressor_{n}.weight") for c, t in (("", "attn"), ("indexer.", "indexer"))
      for o, n in (("ape", "ape"), ("wkv.weight", "kv"), ("wgate.weight", "gate"), ("norm.weight", "norm"))),
    ("attn.indexer.wq_b.weight", "indexer.attn_q_b.weight"), ("attn.indexer.weights_proj.weight", "indexer.proj.weight"),
    ("ffn.gate.weight", "ffn_gate_inp.weight"), ("ffn.gate.bias", "exp_probs_b.bias"),
    ("ffn.gate.tid2eid", "ffn_gate_tid2eid.weight"), ("ffn.shared_experts.w1.weight", "ffn_gate_shexp.weight"),
    ("ffn.shared_experts.w3.weight", "ffn_up_shexp.weight"), ("ffn.shared_experts.w2.weight", "ffn_down_shexp.weight"))
GLM53_LAYER = (  # GLM-5.3-Flash's beyond the common names: KDA's, the k-pool's, the hyper-connections'
    *((f"self_attn.{o}", f"ssm_{t}.weight") for o, t in (("f_a_proj.weight", "f_a"), ("f_b_proj.weight", "f_b"),
                                                          ("b_proj.weight", "beta"), ("g_a_proj.weight", "g_a"),
                                                          ("g_b_proj.weight", "g_b"), ("o_norm.weight", "norm"))),
    *((f"self_attn.{n}_conv1d.weight", f"ssm_conv1d_{n}.weight") for n in "qkv"),
    ("self_attn.A_log", "ssm_a"), ("self_attn.dt_bias", "ssm_dt.bias"),
    ("self_attn.indexer.index_kpool_compress_ape", "indexer_compressor_ape.weight"),
    ("self_attn.indexer.index_kpool_compress_gate", "indexer_compressor_gate.weight"),
    *((f"hc_{b}_{p}", f"hc_{b}_{p}.weight") for b in ("attn", "ffn") for p in ("fn", "base", "scale")))
V4_TOP = (("model.hc_head.hc_fn", "output_hc_fn.weight"), ("model.hc_head.hc_base", "output_hc_base.weight"),
          ("model.hc_head.hc_scale", "output_hc_scale.weight"), ("head.weight", "output.weight"))


def layer_names(cfg, L: int) -> list[tuple[str, str]]:
    """(transformers' name, llama.cpp's) of one layer's weights, every family's; a file has some of them
    (the routed experts, stacked in the file, are placed apart)."""
    if cfg.model_type == "deepseek_v4":
        return [(f"model.layers.{L}.{o}", f"blk.{L}.{t}") for o, t in V4_LAYER]
    if cfg.model_type == "glm5_next":
        pairs = [(f"model.layers.{L}.{o}", f"blk.{L}.{t}") for o, t in GLM53_LAYER]
        return pairs + [(o, t) for o, t in _common_layer_names(cfg, L)]
    return _common_layer_names(cfg, L)


def _common_layer_names(cfg, L: int) -> list[tuple[str, str]]:
    ffn, shared = cfg.ffn_prefix + ".", "shared_expert." if cfg.shared_expert_gate else "shared_experts."
    beside = cfg.model_type in ("minimax_m2", "minimax_m3_vl")  # MiniMax's choice bias is beside its router
    pairs = [("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
             ("post_attention_layernorm.weight", "post_attention_norm.weight"),  # GLM's name for it
             ("self_attn.q_norm.weight", "attn_q_norm.weight"), ("self_attn.k_norm.weight", "attn_k_norm.weight"),
             ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
             ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
             (ffn + cfg.router_name + ".weight", "ffn_gate_inp.weight"),
             (ffn + cfg.router_name + ".bias", "ffn_gate_inp.bias"),  # gpt-oss's router bias
             (f"self_attn.{cfg.sinks_name}", "attn_sinks.weight"),
             # the choice bias: under the router (DeepSeek, GLM), beside it (MiniMax)
             (ffn + ("" if beside else cfg.router_name + ".") + "e_score_correction_bias", "exp_probs_b.bias"),
             ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight")]
    if cfg.index_block:  # MiniMax-M3's block indexer (its k_norm has DeepSeek's indexer's name in a file)
        pairs += [(f"self_attn.index_{n}.weight", f"indexer.{n}.weight") for n in ("q_proj", "k_proj", "q_norm", "k_norm")]
    else:  # DeepSeek Sparse Attention's indexer
        pairs += [("self_attn.indexer.wq_b.weight", "indexer.attn_q_b.weight"),
                  ("self_attn.indexer.wk.weight", "indexer.attn_k.weight"),
                  ("self_attn.indexer.k_norm.weight", "indexer.k_norm.weight"),
                  ("self_attn.indexer.k_norm.bias", "indexer.k_norm.bias"),
                  ("self_attn.indexer.weights_proj.weight", "indexer.proj.weight")]
    for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"),
                         ("q_a_proj", "attn_q_a"), ("q_b_proj", "attn_q_b"), ("kv_a_proj_with_mqa", "attn_kv_a_mqa"),
                         ("kv_b_proj", "attn_kv_b")):
        pairs += [(f"self_attn.{ours}.{k}", f"{theirs}.{k}") for k in ("weight", "bias")]
    for proj, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
        pairs += [(f"mlp.{proj}.weight", f"{theirs}.weight"), (f"{ffn}{shared}{proj}.weight", f"{theirs}_shexp.weight")]
    return [(f"model.layers.{L}.{o}", f"blk.{L}.{t}") for o, t in pairs]


EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")  # as expert_tensor_names' order


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders a llama file's q/k rows for its rope, which rotates adjacent pairs
    (each head's rows i and i + d/2 made neighbours); back to transformers' halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """MLA's kv_b_proj [heads x (nope + v), kv_lora] from llama.cpp's split: k_b [heads, kv_lora, nope] (transposed
    for the absorbed form) and v_b [heads, v, kv_lora]."""
    kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return kv.reshape(-1, kv.shape[-1])


def _qkv_rows(cfg, L: int) -> list[tuple[str, Callable]]:
    """(projection, what takes its rows from the fused q/k/v matrix) of a GQA layer: q's heads, k's and v's KV heads
    (v's heads of the value width)."""
    sizes = (cfg.num_heads * cfg.head_dim, cfg.kv_heads(L) * cfg.head_dim, cfg.kv_heads(L) * cfg.value_dim)
    starts = np.cumsum((0,) + sizes)
    return [(p, lambda w, a=int(a), n=n: w[a:a + n]) for p, a, n in zip(("q_proj", "k_proj", "v_proj"), starts, sizes)]


def _interleave(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """a at the even, b at the odd indices of `dim`: gpt-oss's gate and up, as transformers keeps them."""
    dim %= a.dim()
    return torch.stack([a, b], dim=dim + 1).flatten(dim, dim + 1)


def _mx_blocks(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 rows ([rows, blocks x 17]: a scale byte, then 16 bytes whose byte j holds elements j (low
    nibble) and j + 16) -> the published layout, (blocks [rows, n, 16]: byte j holds elements 2j and 2j + 1,
    scales [rows, n]); the codes and scale bytes themselves unchanged."""
    b = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(raw.shape[0], -1, 17)  # (a copy: the map is read-only)
    codes = torch.cat([b[..., 1:] & 15, b[..., 1:] >> 4], dim=-1)  # elements 0..31 of each block
    return codes[..., 0::2] | (codes[..., 1::2] << 4), b[..., 0].contiguous()


def _fused_experts(cfg, L: int, by_name: dict) -> dict:
    """gpt-oss: llama.cpp splits its experts into gate, up and down (and their biases); transformers' names
    show them fused again (gate and up interleaved), as published MXFP4 blocks where the file has them."""
    b, (gate_up, down) = f"blk.{L}.", cfg.stacked_expert_names(L)
    g, u, d = (b + f"ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
    if g not in by_name:
        return {}
    out = {gate_up + "_bias": ((g[:-6] + "bias", u[:-6] + "bias"), None, lambda x, y: _interleave(x, y, -1)),
           down + "_bias": ((d[:-6] + "bias",), None, None)}
    if by_name[g].tensor_type == GGMLQuantizationType.MXFP4:
        out[gate_up + "_blocks"] = ((g, u), STACKED_RAW, lambda x, y: _interleave(_mx_blocks(x)[0], _mx_blocks(y)[0], 0))
        out[gate_up + "_scales"] = ((g, u), STACKED_RAW, lambda x, y: _interleave(_mx_blocks(x)[1], _mx_blocks(y)[1], 0))
        out[down + "_blocks"] = ((d,), STACKED_RAW, lambda x: _mx_blocks(x)[0])
        out[down + "_scales"] = ((d,), STACKED_RAW, lambda x: _mx_blocks(x)[1])
    else:  # gate_up_proj [H, 2I] (columns interleaved), down_proj [I, H]: the transposes of the file's
        out[gate_up] = ((g, u), STACKED, lambda x, y: _interleave(x.T, y.T, -1))
        out[down] = ((d,), STACKED, lambda x: x.T.contiguous())
    return out


def _transform(cfg, arch: str, ours: str):
    """What turns the file's tensor into transformers' (None: as it is)."""
    if arch == "llama" and ours.endswith((".q_proj.weight", ".k_proj.weight")):
        heads = cfg.num_heads if ours.endswith(".q_proj.weight") else cfg.num_kv_heads
        return lambda w: _unpermute(w, heads)
    if ours.endswith(".shared_expert_gate.weight"):  # [H] or [1, H] in the file
        return lambda w: w.reshape(1, -1)
    if arch == "minimax-m3" and ours.endswith("norm.weight"):  # the converter adds the 1 of x * (1 + w) to w
        return lambda w: w - 1
    if arch == "glm5-next" and ours.endswith("_conv1d.weight"):  # [1, channels, 1, kernel] in the file
        return lambda w: w.reshape(-1, 1, w.shape[-1])
    if arch == "glm5-next" and ours.endswith(".A_log"):  # the file holds -exp(A_log)
        return lambda w: (-w).log()
    return None


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gguf") and pathlib.Path(path).is_file()


SPLIT = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")  # llama.cpp's gguf-split names


def split_files(path: pathlib.Path) -> list[pathlib.Path]:
    """A GGUF file, or every file of the split set whose first file it is (NAME-00001-of-0000N.gguf)."""
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    i, n = int(m["i"]), int(m["n"])
    if i != 1:
        raise ModelConfigError(f"{path} is part {i} of a split GGUF set: pass its first file, "
                               f"{m['stem']}-00001-of-{m['n']}.gguf")
    files = [path.with_name(f"{m['stem']}-{k:05d}-of-{m['n']}.gguf") for k in range(1, n + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelConfigError(f"{path}: the split set lacks {', '.join(missing)}")
    return files


def _reader(path: pathlib.Path):
    gguf_check.check(path)  # every count, length and extent against the file, before the reader trusts them
    try:
        return GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001  (a truncated or foreign file: the reader's own error says why)
        raise ModelConfigError(f"{path} is not a readable GGUF file: {e}") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _decimal(x: float | None) -> float | None:
    """A config's decimal (1e-05) back from the float32 a file holds it in (9.99999975e-06): float32's 7 digits."""
    return None if x is None else float(f"{x:.7g}")


def config_of(readers: list, path: pathlib.Path) -> dict:
    """config.json fields from the GGUF's metadata (transformers' names and meanings): the first file's, the
    tensors of every file of a split set."""
    reader = readers[0]
    arch = _field(reader, "general.architecture")
    if arch not in FAMILIES:
        raise ModelConfigError(f"{path}: GGUF architecture {arch!r} is not supported yet (supported: "
                               f"{', '.join(FAMILIES)})")
    if int(_field(reader, "split.count", 1)) != len(readers):
        raise ModelConfigError(f"{path} is one of a split set of {_field(reader, 'split.count')} files "
                               "(-0000N-of-0000M.gguf): pass the first one, named so")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name: [int(v) for v in t.shape] for r in readers for t in r.tensors}  # (ggml's order: ne0 first)
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    heads = a("attention.head_count")
    cfg = {"hidden_size": a("embedding_length"), "intermediate_size": a("feed_forward_length"),
           # GLM's files add its multi-token-prediction layers as further blocks, which this server does not run
           "num_hidden_layers": a("block_count") - a("nextn_predict_layers", 0), "num_attention_heads": heads,
           "num_key_value_heads": a("attention.head_count_kv", heads),
           "rms_norm_eps": _decimal(a("attention.layer_norm_rms_epsilon")), "rope_theta": a("rope.freq_base", 10000.0),
           "max_position_embeddings": a("context_length"), "num_experts_per_tok": a("expert_used_count"),
           "vocab_size": len(tokens), "tie_word_embeddings": "output.weight" not in names,
           "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
           "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"), "torch_dtype": "bfloat16",
           # how the routed experts are stored: the expert service's format follows (Q4_0 -> int4g32)
           "quantization_config": {"quant_method": "gguf", "expert_types": sorted(
               {t.tensor_type.name for r in readers for t in r.tensors if t.name.endswith("_exps.weight")})}}
    cfg.update(_FAMILY_CONFIG[arch](a, cfg, path, names))
    optional = ("bos_token_id", "eos_token_id", "q_lora_rank", "sliding_window")
    missing = [k for k, v in cfg.items() if v is None and k not in optional]
    if missing:
        raise ModelConfigError(f"{path}: GGUF metadata lacks what {', '.join(missing)} come from")
    return cfg


def _qwen3moe(a, cfg, path, names) -> dict:
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "head_dim": a("attention.key_length"),
            "moe_intermediate_size": a("expert_feed_forward_length"), "num_experts": a("expert_count"),
            "norm_topk_prob": True,  # llama.cpp's qwen3moe normalizes the top-k weights
            "mlp_only_layers": [], "decoder_sparse_step": 1}


def _qwen2moe(a, cfg, path, names) -> dict:
    return {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
            "moe_intermediate_size": a("expert_feed_forward_length"), "num_experts": a("expert_count"),
            "shared_expert_intermediate_size": a("expert_shared_feed_forward_length"),
            "norm_topk_prob": bool(a("expert_weights_norm", False)), "mlp_only_layers": [], "decoder_sparse_step": 1}


def _mixtral(a, cfg, path, names) -> dict:
    if not a("expert_count"):
        raise ModelConfigError(f"{path}: a llama GGUF without experts is a dense model, not an MoE")
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": a("expert_count"),
            "head_dim": a("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"]),
            "sliding_window": None}


def _deepseek2(a, cfg, path, names) -> dict:
    """Both MLA layouts llama.cpp has written: kv_b_proj whole (attn_kv_b; key_length = nope + rope) or split for
    the absorbed form (attn_k_b / attn_v_b; key_length_mla); the key/value-head count there is MLA's 1, not
    transformers' heads. Sigmoid gating (DeepSeek-V3, Kimi-K2) is deepseek_v3 with its choice bias, softmax V2."""
    rope, heads = a("rope.dimension_count"), cfg["num_attention_heads"]
    if a("attention.key_length_mla") is not None:
        nope, v = a("attention.key_length_mla") - rope, a("attention.value_length_mla")
    else:
        nope, v = a("attention.key_length") - rope, a("attention.value_length")
    sigmoid = a("expert_gating_func", 1) == 2  # llama.cpp: 1 softmax, 2 sigmoid (absent: V2's softmax)
    if not sigmoid and any(n.endswith(".exp_probs_b.bias") for n in names):
        # llama.cpp would run this softmax scores chosen with DeepSeek-V3's bias: neither V2 nor V3 (what its
        # converter writes from a config.json without V3's scoring_func, as transformers saves one)
        raise ModelConfigError(f"{path}: a deepseek2 file with a choice bias (exp_probs_b) but no sigmoid "
                               "expert_gating_func; convert it from a config.json with \"scoring_func\": \"sigmoid\"")
    groups, used = a("expert_group_count", 1), a("expert_group_used_count", 1)
    out = {"model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
           "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
           "num_key_value_heads": heads, "moe_intermediate_size": a("expert_feed_forward_length"),
           "n_routed_experts": a("expert_count"), "n_shared_experts": a("expert_shared_count", 0),
           "first_k_dense_replace": a("leading_dense_block_count", 0),
           "routed_scaling_factor": a("expert_weights_scale", 1.0), "norm_topk_prob": bool(a("expert_weights_norm", False)),
           "n_group": groups, "topk_group": used, "q_lora_rank": a("attention.q_lora_rank"),
           "kv_lora_rank": a("attention.kv_lora_rank"), "qk_rope_head_dim": rope, "qk_nope_head_dim": nope,
           "v_head_dim": v, "scoring_func": "sigmoid" if sigmoid else "softmax",
           "topk_method": "noaux_tc" if sigmoid else ("group_limited_greedy" if groups > 1 else "greedy"),
           "moe_layer_freq": 1, "rope_interleave": True}
    if a("rope.scaling.type") == "yarn":
        # llama.cpp keeps 0.1 x mscale_all_dim as the log multiplier and no separate mscale: DeepSeek's releases
        # have mscale == mscale_all_dim, which makes transformers' cos/sin factor 1
        m = round(a("rope.scaling.yarn_log_multiplier", 0.0) / 0.1, 6)  # (stored as float32)
        out["rope_scaling"] = {"type": "yarn", "factor": a("rope.scaling.factor"),
                               "original_max_position_embeddings": a("rope.scaling.original_context_length"),
                               "beta_fast": a("rope.scaling.yarn_beta_fast", 32.0),
                               "beta_slow": a("rope.scaling.yarn_beta_slow", 1.0), "mscale": m, "mscale_all_dim": m}
    return out


def _dsa(arch: str):
    """DeepSeek-V3.2 (deepseek32) and GLM-5 (glm-dsa): deepseek2's MLA and MoE with the lightning indexer's shape;
    both route by sigmoid (glm-dsa's default, as llama.cpp's; deepseek32 says so). GLM-5's indexer_types are bools,
    true for a layer with its own indexer; absent, every layer has one (GLM-5, 5.1), as llama.cpp reads files of
    under 1M positions (longer ones, GLM-5.2's, it gives a built-in pattern this reader does not know)."""
    def config(a, cfg, path, names) -> dict:
        glm = arch == "glm-dsa"
        if glm and a("expert_gating_func") is None:
            a = (lambda get: lambda k, d=None: 2 if k == "expert_gating_func" else get(k, d))(a)
        out = _deepseek2(a, cfg, path, names)
        if out["model_type"] != "deepseek_v3":
            raise ModelConfigError(f"{path}: a {arch} file whose experts are not routed by sigmoid")
        out.update(model_type="glm_moe_dsa" if glm else "deepseek_v32",
                   architectures=["GlmMoeDsaForCausalLM" if glm else "DeepseekV32ForCausalLM"],
                   index_n_heads=a("attention.indexer.head_count"), index_head_dim=a("attention.indexer.key_length"),
                   index_topk=a("attention.indexer.top_k"))
        if glm:
            types = a("attention.indexer.types")
            if types is None and cfg["max_position_embeddings"] >= 1 << 20:
                raise ModelConfigError(f"{path}: a glm-dsa file of 1M positions without attention.indexer.types "
                                       "(GLM-5.2's built-in pattern is not known here)")
            n = cfg["num_hidden_layers"]
            out["indexer_types"] = ["full" if t else "shared" for t in (types or [True] * n)][:n]
        return out
    return config


def _glm4moe(a, cfg, path, names) -> dict:
    head_dim = a("attention.key_length")
    return {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "head_dim": head_dim,
            "partial_rotary_factor": a("rope.dimension_count", head_dim) / head_dim,
            "moe_intermediate_size": a("expert_feed_forward_length"), "n_routed_experts": a("expert_count"),
            "n_shared_experts": a("expert_shared_count", 0), "first_k_dense_replace": a("leading_dense_block_count", 0),
            "routed_scaling_factor": a("expert_weights_scale", 1.0), "norm_topk_prob": bool(a("expert_weights_norm", False)),
            "n_group": a("expert_group_count", 1), "topk_group": a("expert_group_used_count", 1),
            "attention_bias": "blk.0.attn_q.bias" in names, "use_qk_norm": "blk.0.attn_q_norm.weight" in names}


def _minimax_m2(a, cfg, path, names) -> dict:
    head_dim = a("attention.key_length")
    return {"model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "head_dim": head_dim,
            "rotary_dim": a("rope.dimension_count", head_dim), "intermediate_size": a("expert_feed_forward_length"),
            "num_local_experts": a("expert_count"), "scoring_func": "sigmoid"}


def _minimax_m3(a, cfg, path, names) -> dict:
    """MiniMax-M3 (minimax-m3) as llama.cpp's converter writes it: its text model (served under its wrapper's
    config), feed_forward_length the dense layers' width, one shared expert of the experts' width, and what llama.cpp
    builds of it: block-sparse attention in every MoE layer, full attention in the leading dense ones, the clamped
    SwiGLU at its constants (alpha 1.702, limit 7), sigmoid routing."""
    if a("expert_gating_func", 2) != 2:
        raise ModelConfigError(f"{path}: a minimax-m3 file whose experts are not routed by sigmoid")
    n, dense, head_dim = cfg["num_hidden_layers"], a("leading_dense_block_count", 0), a("attention.key_length")
    width = a("expert_feed_forward_length")
    # the shared expert's width as its tensor has it (llama.cpp's reading: expert_shared_count experts' worth)
    shexp = names.get(f"blk.{dense}.ffn_gate_shexp.weight")
    text = {k: v for k, v in cfg.items() if k != "quantization_config"}
    text.update(model_type="minimax_m3_vl_text", head_dim=head_dim, intermediate_size=width,
                partial_rotary_factor=a("rope.dimension_count", head_dim) / head_dim,
                dense_intermediate_size=cfg["intermediate_size"],
                shared_intermediate_size=shexp[1] if shexp else width * a("expert_shared_count", 1),
                num_local_experts=a("expert_count"), routed_scaling_factor=a("expert_weights_scale", 1.0),
                swiglu_alpha=1.702, swiglu_limit=7.0, mlp_layer_types=["dense"] * dense + ["sparse"] * (n - dense),
                layer_types=["full_attention"] * dense + ["minimax_m3_sparse"] * (n - dense),
                index_n_heads=a("attention.indexer.head_count"), index_head_dim=a("attention.indexer.key_length"),
                index_topk_blocks=a("attention.indexer.top_k"), index_block_size=a("attention.indexer.block_size"),
                index_local_blocks=a("attention.indexer.local_blocks"))
    return {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "text_config": text}


def _deepseek4(a, cfg, path, names) -> dict:
    """DeepSeek-V4 (deepseek4) as llama.cpp's converter writes it: DeepSeek's own config fields (compress_ratios per
    layer, 0 / 4 / 128; the compressed layers' rope base and YaRN), the routed experts MXFP4 (kept as stored), its
    FP8 projections requantized to Q8_0 by the converter."""
    if a("expert_gating_func", 4) != 4:
        raise ModelConfigError(f"{path}: a deepseek4 file whose experts are not routed by sqrtsoftplus")
    n = cfg["num_hidden_layers"]
    limits = a("swiglu_clamp_exp") or [10.0]
    out = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "intermediate_size": 0,
           "head_dim": a("attention.key_length"), "qk_rope_head_dim": a("rope.dimension_count"),
           "q_lora_rank": a("attention.q_lora_rank"), "o_groups": a("attention.output_group_count"),
           "o_lora_rank": a("attention.output_lora_rank"),
           "compress_ratios": [int(r) for r in a("attention.compress_ratios")][:n],
           "compress_rope_theta": a("attention.compress_rope_freq_base"),
           "moe_intermediate_size": a("expert_feed_forward_length"), "n_routed_experts": a("expert_count"),
           "n_shared_experts": a("expert_shared_count", 1), "routed_scaling_factor": a("expert_weights_scale", 1.0),
           "norm_topk_prob": bool(a("expert_weights_norm", True)), "swiglu_limit": float(limits[0]),
           "sliding_window": a("attention.sliding_window"), "index_n_heads": a("attention.indexer.head_count"),
           "index_head_dim": a("attention.indexer.key_length"), "index_topk": a("attention.indexer.top_k"),
           "hc_mult": a("hyper_connection.count"), "hc_sinkhorn_iters": a("hyper_connection.sinkhorn_iterations"),
           "hc_eps": _decimal(a("hyper_connection.epsilon")),
           "num_hash_layers": a("hash_layer_count", 0)}
    if a("rope.scaling.type") == "yarn":
        out["rope_scaling"] = {"type": "yarn", "factor": a("rope.scaling.factor"),
                               "original_max_position_embeddings": a("rope.scaling.original_context_length"),
                               "beta_fast": a("rope.scaling.yarn_beta_fast", 32.0),
                               "beta_slow": a("rope.scaling.yarn_beta_slow", 1.0)}
    if cfg["quantization_config"]["expert_types"] == ["MXFP4"]:  # kept as stored: the mxfp4 kernels' format
        out["expert_dtype"] = "fp4"
    return out


def _glm5_next(a, cfg, path, names) -> dict:
    """GLM-5.3-Flash (glm5-next) as llama.cpp's converter writes it: its text model (served under its wrapper's
    config); a layer with no KV heads is KDA, the others DSA on a NoPE MLA (key_length_mla the nope head, kv_lora_rank
    the latent) with the k-pool indexer; leading_dense_block_count dense MLPs; sigmoid routing (the converter writes
    no gating function for it)."""
    n = cfg["num_hidden_layers"]
    kv = a("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * n
    dense = a("leading_dense_block_count", 0)
    types = a("attention.indexer.types")
    limits = a("swiglu_clamp_exp") or [10.0]
    text = {k: v for k, v in cfg.items() if k not in ("quantization_config", "num_key_value_heads")}
    text.update(model_type="glm5_next_text", num_key_value_heads=cfg["num_attention_heads"],
                moe_intermediate_size=a("expert_feed_forward_length"), n_routed_experts=a("expert_count"),
                n_shared_experts=a("expert_shared_count", 1), routed_scaling_factor=a("expert_weights_scale", 1.0),
                norm_topk_prob=bool(a("expert_weights_norm", True)), n_group=a("expert_group_count", 1),
                topk_group=a("expert_group_used_count", 1), kv_lora_rank=a("attention.kv_lora_rank"),
                q_lora_rank=a("attention.q_lora_rank"), qk_nope_head_dim=a("attention.key_length_mla"),
                v_head_dim=a("attention.value_length_mla"), qk_rope_head_dim=a("rope.dimension_count", 0),
                index_n_heads=a("attention.indexer.head_count"), index_head_dim=a("attention.indexer.key_length"),
                index_topk=a("attention.indexer.top_k"), index_kpool=a("attention.indexer.kpool"),
                index_kpool_always_select_tail=bool(a("attention.indexer.kpool_select_tail", True)),
                linear_attn_config={"num_heads": cfg["num_attention_heads"], "head_dim": a("kda.head_dim"),
                                    "short_conv_kernel_size": a("ssm.conv_kernel"),
                                    "gate_lower_bound": a("kda.gate_lower_bound")},
                hc_mult=a("hyper_connection.count"), hc_sinkhorn_iters=a("hyper_connection.sinkhorn_iterations"),
                hc_eps=_decimal(a("hyper_connection.epsilon")), swiglu_limit=float(limits[0]),
                layer_types=["linear_attention" if h == 0 else "indexed_attention" for h in kv[:n]],
                mlp_layer_types=["dense"] * dense + ["sparse"] * (n - dense))
    if types is not None:
        text["indexer_types"] = ["full" if t else "shared" for t in types][:n]
    return {"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"], "text_config": text}


def _gpt_oss(a, cfg, path, names) -> dict:
    """gpt-oss as llama.cpp writes it: gate and up experts apart (their MXFP4 blocks as published, nibbles in
    ggml's order), sliding windows on every other layer from the first, YaRN without truncation and the clamped
    SwiGLU at 7 (llama.cpp's constants for the family, as the published config has them)."""
    n = cfg["num_hidden_layers"]
    out = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "head_dim": a("attention.key_length"),
           "intermediate_size": a("expert_feed_forward_length"), "num_local_experts": a("expert_count"),
           "sliding_window": a("attention.sliding_window"), "attention_bias": True, "swiglu_limit": 7.0,
           "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]}
    if a("rope.scaling.type") == "yarn":
        out["rope_scaling"] = {"type": "yarn", "factor": a("rope.scaling.factor"), "truncate": False,
                               "original_max_position_embeddings": a("rope.scaling.original_context_length"),
                               "beta_fast": a("rope.scaling.yarn_beta_fast", 32.0),
                               "beta_slow": a("rope.scaling.yarn_beta_slow", 1.0)}
    if cfg["quantization_config"]["expert_types"] == ["MXFP4"]:  # kept as published: the mxfp4 kernels' format
        out["quantization_config"] = {**cfg["quantization_config"], "quant_method": "mxfp4"}
    return out


def _mimo2(a, cfg, path, names) -> dict:
    """MiMo-V2-Flash (mimo2) as llama.cpp's converter writes it: KV heads per layer and the sliding pattern (both with
    its multi-token-prediction blocks' entries after the model's), the published sliding_window (the keys before the
    query a sliding layer sees: transformers' window is one more, as the reference attends), the sliding layers' rope
    base, the value scale; a layer without a router is dense; sigmoid routing with a choice bias and the top-k weights
    normalized (llama.cpp's constants for the family)."""
    n, head_dim = cfg["num_hidden_layers"], a("attention.key_length")
    kv, pattern = a("attention.head_count_kv"), a("attention.sliding_window_pattern")
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * n
    if not isinstance(pattern, (list, tuple)) or len(pattern) < n or len(kv) < n:
        raise ModelConfigError(f"{path}: a mimo2 file needs attention.sliding_window_pattern and head_count_kv per layer")
    sliding = [bool(p) for p in pattern[:n]]
    full_kv = {kv[L] for L in range(n) if not sliding[L]} or {kv[sliding.index(True)] // 2}
    if len(full_kv) != 1 or any(kv[L] != 2 * min(full_kv) for L in range(n) if sliding[L]):
        raise ModelConfigError(f"{path}: KV heads per layer {kv[:n]}: MiMo-V2-Flash's sliding layers have twice the "
                               "full layers' (one count each)")
    value_scale = a("attention.value_scale")
    rot = a("rope.dimension_count", head_dim)
    rope = lambda theta: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rot / head_dim}  # noqa: E731
    return {"model_type": "mimo_v2_flash", "architectures": ["MiMoV2FlashForCausalLM"], "head_dim": head_dim,
            "num_key_value_heads": full_kv.pop(), "v_head_dim": a("attention.value_length", head_dim),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "mlp_layer_types": ["sparse" if f"blk.{L}.ffn_gate_inp.weight" in names else "dense" for L in range(n)],
            "sliding_window_size": a("attention.sliding_window"),
            "rope_parameters": {"full_attention": rope(a("rope.freq_base")),
                                "sliding_attention": rope(a("rope.freq_base_swa", a("rope.freq_base")))},
            "attention_value_scale": _decimal(value_scale),
            "attention_bias": "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
            "moe_intermediate_size": a("expert_feed_forward_length"), "n_routed_experts": a("expert_count"),
            "n_group": a("expert_group_count", 1), "topk_group": a("expert_group_used_count", 1),
            "norm_topk_prob": True, "routed_scaling_factor": a("expert_weights_scale", 1.0)}


_FAMILY_CONFIG = {"gpt-oss": _gpt_oss, "qwen3moe": _qwen3moe, "qwen2moe": _qwen2moe, "llama": _mixtral, "deepseek2": _deepseek2,
                  "deepseek32": _dsa("deepseek32"), "glm-dsa": _dsa("glm-dsa"), "glm4moe": _glm4moe,
                  "minimax-m2": _minimax_m2, "minimax-m3": _minimax_m3, "deepseek4": _deepseek4,
                  "glm5-next": _glm5_next, "mimo2": _mimo2}


def _tokenizer_files(path: pathlib.Path, out: pathlib.Path, reader=None) -> None:
    """tokenizer.json / tokenizer_config.json (with the chat template) from the GGUF's tokenizer, by
    transformers' own GGUF converter; Kimi's (pre-tokenizer kimi-k2, whose split transformers' converter does not
    know) as the tiktoken vocabulary it is (_kimi_tokenizer_files)."""
    reader = reader or _reader(path)
    if _field(reader, "tokenizer.ggml.pre") == "kimi-k2":
        _kimi_tokenizer_files(reader, path, out)
        return
    try:
        import transformers  # (seconds to import: only a GGUF's tokenizer conversion needs it)
    except ImportError as e:
        raise ModelConfigError(f"converting {path}'s tokenizer needs transformers (pip install transformers): {e}")
    try:
        # the tokenizer class itself: AutoTokenizer would load the model config too, which transformers reads
        # for fewer GGUF architectures than its tokenizer converter knows
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 (the tokenizers library's Rust panics are pyo3 PanicExceptions, BaseExceptions)
        raise ModelConfigError(f"{path}: its tokenizer cannot be converted: {type(e).__name__}: {e}") from None
    tok.save_pretrained(str(out))


def _kimi_tokenizer_files(reader, path: pathlib.Path, out: pathlib.Path) -> None:
    """llama.cpp's converter writes Kimi's vocabulary as a byte-level token list: its tiktoken ranks first (normal
    tokens, id = rank, each spelled in GPT-2's byte alphabet), then the special tokens (control) and unused ids; the
    merges it adds are the ranks' own. Back to tiktoken.model and tokenizer_config.json (tiktoken_vocab.py)."""
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    n = next((i for i, t in enumerate(types) if t != 1), len(types))  # 1: NORMAL
    if any(t == 1 for t in types[n:]):
        raise ModelConfigError(f"{path}: Kimi's vocabulary with normal tokens after its special ones (id {n} on)")
    to_byte = tiktoken_vocab.byte_level_decoder()
    try:
        ranks = [bytes(to_byte[c] for c in t) for t in tokens[:n]]
    except KeyError as e:
        raise ModelConfigError(f"{path}: a token of Kimi's vocabulary is not byte-level text ({e})") from None
    specials = {i: t for i, t in enumerate(tokens) if i >= n and types[i] == 3}  # 3: CONTROL
    extra = {k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")}
    extra = {f"{k}_token": tokens[i] for k, i in extra.items() if i is not None and 0 <= i < len(tokens)}
    template = _field(reader, "tokenizer.chat_template")
    if template:
        extra["chat_template"] = template
    tiktoken_vocab.write(out, ranks, "tokenization_kimi.TikTokenTokenizer", specials, extra)


def prepare(path: str | os.PathLike, cache: pathlib.Path) -> pathlib.Path:
    """The folder that stands for the GGUF file or split set (made once per version of its files, under
    cache/gguf)."""
    path = pathlib.Path(path).resolve()
    files = split_files(path)
    key = hashlib.sha256("".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns};" for f in files).encode())
    out = cache / "gguf" / f"{path.stem}-{key.hexdigest()[:16]}"
    if (out / MARKER).exists():
        return out
    readers = [_reader(f) for f in files]
    cfg = config_of(readers, path)  # (an unsupported file is refused before anything is written)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        _tokenizer_files(path, tmp, readers[0])
        (tmp / MARKER).write_text(json.dumps({"file": str(path), "files": [str(f) for f in files]}))
        try:
            tmp.rename(out)
        except OSError:  # another process made it meanwhile
            if not (out / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class GGUFCheckpoint:
    """The Checkpoint interface over a GGUF file (prepare()'s folder)."""

    fp8_block = None
    int4 = None

    def __init__(self, model_dir: pathlib.Path):
        self.dir = pathlib.Path(model_dir)
        marker = json.loads((self.dir / MARKER).read_text())
        self.path = pathlib.Path(marker["file"])
        files = [pathlib.Path(f) for f in marker.get("files", [marker["file"]])]
        for f in files:
            if not f.exists():
                raise ModelConfigError(f"{f} (named in {self.dir / MARKER}) is missing")
        readers = [_reader(f) for f in files]
        self.reader = readers[0]  # the metadata
        self.by_name = {t.name: t for r in readers for t in r.tensors}
        file_of = {t.name: str(f) for f, r in zip(files, readers) for t in r.tensors}
        cfg = load_config(self.dir)
        arch = _field(self.reader, "general.architecture")
        # transformers' name -> (the GGUF tensors it comes from, expert index or None, what makes it of them)
        self.where: dict[str, tuple[tuple[str, ...], int | None, object]] = {}
        pairs = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight")]
        pairs += V4_TOP if cfg.model_type == "deepseek_v4" else [("lm_head.weight", "output.weight")]
        for L in range(cfg.num_layers):
            pairs += layer_names(cfg, L)
        for ours, theirs in pairs:
            if theirs in self.by_name:
                self.where[ours] = ((theirs,), None, _transform(cfg, arch, ours))
        for L in range(cfg.num_layers):
            b = f"blk.{L}."
            if b + "attn_k_b.weight" in self.by_name:  # MLA split for the absorbed form: kv_b_proj again
                self.where[f"model.layers.{L}.self_attn.kv_b_proj.weight"] = (
                    (b + "attn_k_b.weight", b + "attn_v_b.weight"), None, _kv_b)
            for k in ("weight", "bias"):  # q, k and v fused in one matrix (MiMo's qkv_proj): transformers' three
                if f"{b}attn_qkv.{k}" in self.by_name:
                    self.where.update({f"model.layers.{L}.self_attn.{p}.{k}": ((f"{b}attn_qkv.{k}",), None, rows)
                                       for p, rows in _qkv_rows(cfg, L)})
            if cfg.fused_experts:
                self.where.update(_fused_experts(cfg, L, self.by_name))
                continue
            for i, theirs in enumerate(EXPERTS):
                if b + theirs in self.by_name:
                    for e in range(cfg.n_routed_experts):
                        self.where[cfg.expert_tensor_names(L, e)[i]] = ((b + theirs,), e, None)
        # blocks past the model's layers: GLM's multi-token-prediction layers (config_of counts them out)
        mtp = {t for t in self.by_name if t.startswith("blk.") and int(t.split(".")[1]) >= cfg.num_layers}
        unknown = set(self.by_name) - mtp - {t for ts, _, _ in self.where.values() for t in ts}
        if unknown:
            raise ModelConfigError(f"{self.path}: tensors this reader does not place: {sorted(unknown)[:5]}")
        # the file each name is read from (the packed cache stamps them)
        self.weight_map = {n: file_of[ts[0]] for n, (ts, _, _) in self.where.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def tensors(self) -> list[str]:
        return sorted(self.by_name)

    def meta(self, name: str) -> tuple[list[int], str]:
        t = self.by_name[name]
        return [int(v) for v in reversed(t.shape)], t.tensor_type.name

    def names(self, keep=lambda n: True):
        return (n for n in sorted(self.where) if keep(n))

    def _data(self, name: str):
        """-> (the GGUF tensor, its data: the whole, or one expert's of a stacked one), for names of one tensor."""
        theirs, e, _ = self.where.get(name, ((None,), None, None))
        if theirs[0] is None:
            raise ModelConfigError(f"tensor {name!r} is not in {self.path}")
        t = self.by_name[theirs[0]]
        return t, (t.data if e is None else t.data[e])

    def _floats(self, theirs: str, e: int | None) -> torch.Tensor:
        t = self.by_name[theirs]
        data = t.data if e is None else t.data[e]
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return torch.from_numpy(np.array(data, dtype=np.float32))
        if t.tensor_type == GGMLQuantizationType.I32:  # (DeepSeek-V4's token id -> experts tables)
            return torch.from_numpy(np.array(data, dtype=np.int64))
        if t.tensor_type == GGMLQuantizationType.BF16:
            return torch.from_numpy(np.array(data)).view(torch.bfloat16).float()
        return torch.from_numpy(np.ascontiguousarray(dequantize(np.asarray(data), t.tensor_type)))

    def get(self, name: str, fp8_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight dequantized exactly to float32 (gguf's dequantizers), in transformers' layout."""
        theirs, e, fn = self.where.get(name, (None, None, None))
        if theirs is None:
            raise ModelConfigError(f"tensor {name!r} is not in {self.path}")
        if e in (STACKED, STACKED_RAW):
            return torch.stack([self.get_row(name, i) for i in range(self.by_name[theirs[0]].data.shape[0])])
        parts = [self._floats(t, e) for t in theirs]
        return fn(*parts) if fn is not None else parts[0]

    def get_row(self, name: str, i: int) -> torch.Tensor:
        theirs, e, fn = self.where.get(name, (None, None, None))
        if e == STACKED:
            return fn(*[self._floats(t, i) for t in theirs])
        if e == STACKED_RAW:
            return fn(*[np.asarray(self.by_name[t].data[i]) for t in theirs])
        return self.get(name)[i]

    def get_fp8(self, name: str):
        return None

    def block_type(self, name: str) -> str:
        """The ggml type a tensor is stored in (Q4_K, F16...)."""
        return self._data(name)[0].tensor_type.name

    def get_published(self, name: str, fmt: str):
        """The weight as stored where expert format `fmt` keeps its block type (AS_STORED: Int4, UInt4, Q4K, Iq4...,
        bit for bit what the gguf package dequantizes); None for other types and formats."""
        t, data = self._data(name)
        stored = AS_STORED.get(t.tensor_type.name)
        if stored is None or stored.decode is None or fmt not in stored.kept_by:
            return None
        w, convert = stored.decode(np.asarray(data)), stored.kept_by[fmt]
        return w if convert is None else convert(w)

    def close(self) -> None:  # the map stays: a GGUF is read in place
        pass


FLOAT_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0}  # the formats that hold floats (bf16: a kernel format too)


def type_bits(name: str) -> float:
    """Bits a weight of a ggml tensor type, its block's scales and mins included (the gguf package's sizes)."""
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    return 8 * nbytes / block


def format_bits(fmt: str) -> float:
    """Bits a weight of an expert format as the packed layout stores it (scales and sums included, the rows'
    alignment padding not)."""
    if fmt in FLOAT_BITS:
        return FLOAT_BITS[fmt]
    rows, Kp = 128, 4096
    parts = [p for p in layout(fmt, 1, rows, Kp) if p is not None]
    return 8 * sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in parts) / (rows * Kp)


# the expert "format" that holds each matrix of a GGUF in the format keeping its block type (layer_formats): a
# mix (Q4_K_M's Q4_K gate/up beside Q6_K down in some layers) kept as stored, as llama.cpp reads it
PER_MATRIX = "gguf"


def expert_format(types: tuple[str, ...]) -> str | None:
    """The expert format a GGUF's routed experts default to (None: floats): each quantized type's own (own_format);
    where they differ, PER_MATRIX (each matrix in its own type's: a Q4_K_M or Q6_K/Q8_0 mix read as stored, IQ4_XS
    beside IQ4_NL at their own sizes)."""
    quantized = [t for t in types if t not in FLOAT_TYPES]
    if not quantized:
        return None
    own = {own_format(t) for t in quantized}
    return own.pop() if len(own) == 1 else PER_MATRIX


def own_format(t: str) -> str:
    """The format a matrix of ggml type t runs in by default: the first that keeps it as stored (KEEPS), else covering."""
    return KEEPS[t][0] if t in KEEPS else covering(t)


def covering(t: str) -> str:
    """For a type no format keeps (Q5_0, Q5_1; floats): the smallest format whose values have
    at least the type's bits (its bits a weight less about half a bit of scales; at least q3k's 3), so it is requantized
    onto a grid no coarser than the file's and stays about the file's size (Q5_0: q5k), not a 2-4x larger
    exact copy (a 2-bit DeepSeek file must fit the RAM its user has). Measured on the default model against
    llama-perplexity on the same files (docs/performance/accuracy.md); --weight-format bf16 keeps them exact."""
    need = max(int(type_bits(t) - 0.5), 1) if t not in FLOAT_TYPES else 16
    return next((f for f, bits in VALUE_BITS.items() if bits >= need), "int8g32")


def layer_formats(cfg, ckpt, layer: int, fmt: str) -> tuple[str, str]:
    """(gate/up's, down's) expert format of a MoE layer: fmt for both, except PER_MATRIX on a GGUF: each matrix in the
    format keeping its block type (gate and up share one: a format keeping both, else the larger type's own), the
    types none keeps in the covering format."""
    if fmt != PER_MATRIX:
        return fmt, fmt
    quantized = [t for t in cfg.gguf_expert_types if t not in FLOAT_TYPES]
    if not isinstance(ckpt, GGUFCheckpoint) or not quantized:
        raise ModelConfigError(f"--weight-format {PER_MATRIX} keeps a GGUF file's quantized experts as stored; this "
                               "model is not one")
    if cfg.fused_experts:  # gpt-oss: its gate and up fused in one tensor, one format for the layer
        one = own_format(max(quantized, key=type_bits))
        return one, one
    gate, up, down = (ckpt.block_type(n) for n in cfg.expert_tensor_names(layer, 0))
    both = [f for f in KEEPS.get(gate, ()) if f in KEEPS.get(up, ())]
    if both:
        return both[0], own_format(down)
    # apart: the larger type's own format holds the other requantized, unless it holds published numbers only (the
    # grid types' formats): then the covering format holds both
    own = own_format(max(gate, up, key=type_bits))
    return (covering(max(gate, up, key=type_bits)) if format_of(own).exact_only else own), own_format(down)


def dequantized_experts(cfg, fmt: str) -> str | None:
    """For a GGUF whose routed experts the chosen format does not keep as stored: what that costs, for the log
    (None otherwise). The types KEEPS maps to `fmt` run as stored; the others are dequantized exactly, then held in
    `fmt` (PER_MATRIX: each in its covering format)."""
    quantized = [t for t in cfg.gguf_expert_types if t not in FLOAT_TYPES]
    if fmt == PER_MATRIX:
        held = {t: covering(t) for t in quantized if t not in KEEPS}
    else:
        held = {t: fmt for t in quantized if fmt not in KEEPS.get(t, ())}
    if not held:
        return None
    what = f"the file's routed experts ({', '.join(held)}) are not kept as stored by the {fmt} format"
    if fmt in FLOAT_BITS:
        stored, bits = max(type_bits(t) for t in held), format_bits(fmt)
        return (f"{what}: dequantized exactly and held as {fmt} ({bits:.3g} bits, {bits / stored:.1f}x the file's bytes "
                "for them and as slow to decode)")
    into = ", ".join(f"{f} ({t}: {type_bits(t):.3g} -> {format_bits(f):.3g} bits a weight)" for t, f in held.items())
    return (f"{what}: requantized to {into}; docs/performance/accuracy.md measures the cost; --weight-format bf16 holds them "
            "exactly, at 16 bits")


def resolve(model: str | os.PathLike, cache: pathlib.Path) -> pathlib.Path:
    """--model as a folder: itself, or for a GGUF file prepare()'s folder."""
    return prepare(model, cache) if is_gguf(model) else pathlib.Path(model)


def open_checkpoint(model_dir: str | os.PathLike):
    """A folder's Checkpoint: the safetensors reader, or GGUFCheckpoint for prepare()'s folders."""
    d = pathlib.Path(model_dir)
    return GGUFCheckpoint(d) if (d / MARKER).exists() else Checkpoint(d)
