"""The native kernels' weight formats as one table, as ggml-cpu's type_traits_cpu (and on the C++ side
native/kernels/kernels.h's Kernels): one Format per format in FORMATS, with the numbers it holds, how they are packed
and read back. moe_kernels/packing.py, the GGUF reader and the CLIs' choices read it; a new format is one entry here
plus its row kernels in native/kernels/kernels.h. Formats, one [rows, K] matrix (or E experts' of them) at a time:
- bf16: as is;
- int8: symmetric, one fp32 scale per output channel (row);
- int4: symmetric, one fp32 scale per group of 64 consecutive weights of a row (INT4_GROUP);
- mxfp4: OCP MX, e2m1 values with one power-of-two scale per 32 (MX_BLOCK): gpt-oss's experts as
  published (Mx4: taken bit for bit), or quantized here from float weights;
- fp8: e4m3 values with one fp32 scale per 128 x 128 block (FP8_BLOCK): DeepSeek-V3-style FP8 releases as
  published (Fp8: taken bit for bit), or quantized here from float weights with DeepSeek's recipe;
- int4g32: int4's nibbles with one fp32 scale per 32 weights: symmetric int4 checkpoints (Int4: groups of
  32, 64, 128... as published, their scales repeated per 32), or quantized here from float weights;
- iq4nl: codes of ggml's non-linear 4-bit grid (IQ4NL) with one fp32 scale per 32: GGUF's IQ4_NL and IQ4_XS
  as stored (Iq4: exact), or quantized here;
- int8g32: int8 with one fp32 scale per 32: GGUF's Q8_0 as stored (Q8: exact), or quantized here;
- uint4g32: unsigned nibbles with an fp32 scale and min per 32, w = scale x q - min: GGUF's Q4_1 (and Q4_K), AWQ
  and GPTQ zero points (UInt4: groups of 32 x n, exact), or quantized here;
- q4k: GGUF's Q4_K as stored (Q4K: unsigned nibbles, w = d sc q - dmin m with an fp32 d and dmin per 256 and a 6-bit
  sc and m per 32; 4.75 bits a weight against uint4g32's 6), or quantized here;
- q5k: GGUF's Q5_K as stored (Q5K: q4k's numbers with 5-bit q; 5.75 bits a weight against the file's 5.5), or
  quantized here;
- iq4xs: GGUF's IQ4_XS as stored (Iq4Xs: iq4nl's codes, w = d sc IQ4NL[code] with an fp32 d per 256 and an int8 sc per
  32; 4.375 bits a weight against iq4nl's 5), or quantized here;
- q6k: GGUF's Q6_K as stored (Q6K: 6-bit values, w = d sc (u - 32) with an fp32 d per 256 and an int8 sc per 16;
  6.625 bits a weight against the file's 6.5625), or quantized here;
- q3k: GGUF's Q3_K as stored (Q3K: q6k's numbers with 3-bit values, w = d sc (u - 4); 3.625 bits a weight against the
  file's 3.4375), or quantized here;
- q2k: GGUF's Q2_K as stored (Q2K: 2-bit q, w = d sc q - dmin m with an fp32 d and dmin per 256 and a 4-bit sc and m per
  16; 2.75 bits a weight against the file's 2.625), or quantized here;
- iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, iq1m: GGUF's IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M as stored
  (moe_kernels.iq_formats: the file's grid indices, signs and scales, its bytes moved into row blocks; exact only).
Rows are padded to row_len elements; the layouts are the ones native/moe.h describes. The grouped int formats (all
but bf16, int8 and fp8) are stored in row-interleaved blocks of 16 rows (BLOCK_ROWS, native/kernels/gemm_blocked.h):
_interleave_rows.
Pure Python and torch: no moe_core import (moe_core.config reads the names from here).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from moe_kernels import iq_formats
from moe_kernels.row_blocks import BLOCK_ROWS, _deinterleave_rows, _interleave_rows  # noqa: F401 (BLOCK_ROWS: re-exported)

FP8_BLOCK = 128  # fp8's blocks of 128 x 128: native/moe.h's FP8_BLOCK and moe_core.config's (tests check they agree)
INT4_GROUP = 64
MX_BLOCK = 32
G32 = 32  # int4g32's group
QK = 256  # the super-block of q4k, q5k, q6k, q3k, q2k and iq4xs (GGUF's QK_K): a d (q4k, q5k, q2k: and a dmin) per 256,
# sub-scales below
Q6_SUB = 16  # q6k, q3k: an int8 sc per 16; q2k: an sc and m
ROW_ALIGN = 64  # the unit of the other formats' row lengths: whole VNNI steps and int4 groups
E4M3_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0-7; bit 3 is the sign
MX4_TWICE = torch.cat([2 * E2M1, -2 * E2M1])  # code -> twice its value: what the kernels multiply (MX4_LUT)
# ggml's kvalues_iq4nl: an IQ4_NL / IQ4_XS code -> its value (native/kernels/gemm_blocked.h's IQ4NL_LUT)
IQ4NL = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32)


class Mx4(NamedTuple):
    """MXFP4 weights as published: codes [rows, K] uint8 (e2m1, 0-15) and exps [rows, K/32] uint8 (e8m0:
    the block's scale is 2^(e - 127))."""
    codes: torch.Tensor
    exps: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        v = (MX4_TWICE[self.codes.long()] / 2).view(self.codes.shape[0], -1, MX_BLOCK)
        return torch.ldexp(v, self.exps.to(torch.int32)[..., None] - 127).view(self.codes.shape)

    @staticmethod
    def cat(parts: list["Mx4"]) -> "Mx4":
        return Mx4(torch.cat([p.codes for p in parts]), torch.cat([p.exps for p in parts]))

    @staticmethod
    def from_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> "Mx4":
        """The published tensors, blocks [rows, K/32, 16] (byte j: element 2j low nibble, 2j+1 high) and
        scales [rows, K/32], as transformers' convert_moe_packed_tensors reads them."""
        codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).reshape(blocks.shape[0], -1)
        return Mx4(codes, scales.to(torch.uint8))


class Fp8(NamedTuple):
    """FP8 weights as published: values [rows, K] float8_e4m3fn and scale [ceil(rows/128), ceil(K/128)] fp32
    (the checkpoint's `weight_scale_inv`: a block's weights are value x scale)."""
    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        R, K = self.values.shape
        s = self.scale.float().repeat_interleave(FP8_BLOCK, 0)[:R].repeat_interleave(FP8_BLOCK, 1)[:, :K]
        return self.values.float() * s

    def rows(self, r0: int, r1: int) -> "Fp8":
        """Rows [r0, r1) (r0 on a block boundary) with their blocks' scales."""
        assert r0 % FP8_BLOCK == 0, r0
        return Fp8(self.values[r0:r1], self.scale[r0 // FP8_BLOCK: -(-min(r1, self.values.shape[0]) // FP8_BLOCK)])

    @staticmethod
    def cat(parts: list["Fp8"]) -> "Fp8":
        """Stacked along rows; every part but the last must fill whole 128-row blocks (a block never spans
        two of them)."""
        for p in parts[:-1]:
            if p.values.shape[0] % FP8_BLOCK:
                raise ValueError(f"fp8 matrices of {p.values.shape[0]} rows (not a multiple of {FP8_BLOCK}) cannot be "
                                 "stacked without requantizing a block")
        return Fp8(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]))


class Int4(NamedTuple):
    """Symmetric int4 weights as a checkpoint publishes them: values [rows, K] int8 in -8..7 and scale
    [rows, K / group] fp32 (w = value x the scale of its group of `group` consecutive weights of a row)."""
    values: torch.Tensor
    scale: torch.Tensor
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scale.float().repeat_interleave(self.group, 1)[:, :self.values.shape[1]]

    @staticmethod
    def cat(parts: list["Int4"]) -> "Int4":
        if len({p.group for p in parts}) != 1:
            raise ValueError(f"int4 matrices of different group sizes {[p.group for p in parts]} cannot be stacked")
        return Int4(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), parts[0].group)


def _times_scale32(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Values [rows, K] (fp32) times the scale of their 32 [rows, ceil(K/32)]."""
    R, K = v.shape
    return (F.pad(v, (0, -K % G32)).view(R, -1, G32) * scale[..., None]).view(R, -1)[:, :K]


class Iq4(NamedTuple):
    """Weights on ggml's IQ4_NL grid: codes [rows, K] uint8 (0-15) and scale [rows, K/32] fp32 (w = IQ4NL[code] x
    the scale of its 32; IQ4_XS's fp16 scale times its 6-bit sub-scale is exact in fp32)."""
    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        return _times_scale32(IQ4NL[self.codes.long()], self.scale)

    @staticmethod
    def cat(parts: list["Iq4"]) -> "Iq4":
        return Iq4(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))


class Iq4Xs(NamedTuple):
    """GGUF's IQ4_XS numbers: codes [rows, K] uint8 (0-15, ggml's IQ4_NL grid), d [rows, ceil(K / 256)] fp32 (the file's
    fp16), sc [rows, 8 per 256] int8 (its 6-bit ls - 32); w = d sc IQ4NL[code] (d sc exact in fp32, as ggml's)."""
    codes: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def to_iq4(self) -> "Iq4":
        """The same numbers with a scale per 32 (exact in fp32): what iq4nl holds."""
        n = -(-self.codes.shape[1] // G32)
        return Iq4(self.codes, (self.d.float().repeat_interleave(QK // G32, 1) * self.sc.float())[:, :n])

    def dequantize(self) -> torch.Tensor:
        return self.to_iq4().dequantize()

    @staticmethod
    def cat(parts: list["Iq4Xs"]) -> "Iq4Xs":
        return Iq4Xs(*(torch.cat([getattr(p, f) for p in parts]) for f in Iq4Xs._fields))


class Q8(NamedTuple):
    """int8 weights with a scale per 32: values [rows, K] int8, scale [rows, K/32] fp32 (GGUF's Q8_0: w = value x its
    block's fp16 scale)."""
    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        return _times_scale32(self.values.float(), self.scale)

    @staticmethod
    def cat(parts: list["Q8"]) -> "Q8":
        return Q8(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]))


class UInt4(NamedTuple):
    """Asymmetric 4-bit weights: values [rows, K] uint8 (0-15), scale and min [rows, K / group] fp32 (w = value x
    scale - min of its group of `group` consecutive weights: Q4_K's d x sc and dmin x m, a zero point's scale x
    zero, both exact in fp32)."""
    values: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        K = self.values.shape[1]
        rep = lambda t: t.float().repeat_interleave(self.group, 1)[:, :K]  # noqa: E731
        return self.values.float() * rep(self.scale) - rep(self.min)

    @staticmethod
    def cat(parts: list["UInt4"]) -> "UInt4":
        if len({p.group for p in parts}) != 1:
            raise ValueError(f"uint4 matrices of different group sizes {[p.group for p in parts]} cannot be stacked")
        return UInt4(*(torch.cat([getattr(p, f) for p in parts]) for f in ("values", "scale", "min")), parts[0].group)


class Q4K(NamedTuple):
    """GGUF's Q4_K numbers: values [rows, K] uint8 (0-15), d and dmin [rows, ceil(K / 256)] fp32 (the file's fp16), sc
    and m [rows, 8 per 256] uint8 (0-63); w = d sc value - dmin m. (Q5K: the same with values 0-31; Q2K: its own.)"""
    values: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def to_uint4(self) -> "UInt4":
        """The same numbers with a scale and min per 32 (each product exact in fp32)."""
        per32 = lambda t: t.float().repeat_interleave(QK // G32, 1)  # noqa: E731
        n = -(-self.values.shape[1] // G32)
        return UInt4(self.values, (per32(self.d) * self.sc.float())[:, :n], (per32(self.dmin) * self.m.float())[:, :n], G32)

    def dequantize(self) -> torch.Tensor:
        return self.to_uint4().dequantize()

    @staticmethod
    def cat(parts: list["Q4K"]) -> "Q4K":
        return type(parts[0])(*(torch.cat([getattr(p, f) for p in parts]) for f in Q4K._fields))


class Q5K(Q4K):
    """GGUF's Q5_K numbers: Q4K's with values 0-31 (a type of its own: the q4k and uint4g32 formats cannot hold them)."""
    __slots__ = ()


class Q2K(Q4K):
    """GGUF's Q2_K numbers: Q4K's fields with values 0-3 and a 4-bit sc and m per 16 (16 per 256); w = d sc value -
    dmin m (d sc value and dmin m exact in fp32: one rounding, as ggml's)."""
    __slots__ = ()

    def to_uint4(self) -> "UInt4":
        raise TypeError("Q2_K's scales and mins are per 16: uint4g32's per 32 cannot hold them")

    def dequantize(self) -> torch.Tensor:
        R, K = self.values.shape
        per16 = lambda t: t.float().repeat_interleave(QK // Q6_SUB, 1)  # noqa: E731
        s, mins = per16(self.d) * self.sc.float(), per16(self.dmin) * self.m.float()
        v = F.pad(self.values.float(), (0, -K % Q6_SUB)).view(R, -1, Q6_SUB)
        n = v.shape[1]
        return (s[:, :n, None] * v - mins[:, :n, None]).view(R, -1)[:, :K]


class Q6K(NamedTuple):
    """GGUF's Q6_K numbers: values [rows, K] int8 (-32..31: the file's 6-bit u less 32), d [rows, ceil(K / 256)] fp32
    (the file's fp16), sc [rows, 16 per 256] int8; w = d sc value (d sc exact in fp32: one rounding, as ggml's)."""
    values: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        R, K = self.values.shape
        s = self.d.float().repeat_interleave(QK // Q6_SUB, 1) * self.sc.float()
        v = F.pad(self.values.float(), (0, -K % Q6_SUB)).view(R, -1, Q6_SUB)
        return (s[:, :v.shape[1], None] * v).view(R, -1)[:, :K]

    @staticmethod
    def cat(parts: list["Q6K"]) -> "Q6K":
        return type(parts[0])(*(torch.cat([getattr(p, f) for p in parts]) for f in Q6K._fields))


class Q3K(Q6K):
    """GGUF's Q3_K numbers: Q6K's with values -4..3 (the file's 3-bit u less 4) and sc -32..31 (its 6-bit scale less
    32); the q6k format holds them too, at 6.625 bits."""
    __slots__ = ()


class Int8(NamedTuple):
    """The int8 format's numbers: values [rows, K] int8 in -127..127, scale [rows] fp32 (one per row)."""
    values: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scale[:, None]



# every type of published / quantized numbers above (floats() dequantizes them)
CONTAINERS = (Mx4, Fp8, Int4, Int8, Iq4, Iq4Xs, UInt4, Q8, Q4K, Q6K, iq_formats.IqBlocks)


def floats(w) -> torch.Tensor:
    """A weight as float values: published MXFP4 / FP8 / int4 dequantized, floats as they are."""
    return w.dequantize() if isinstance(w, CONTAINERS) else w

def fp8_quantize(w: torch.Tensor) -> Fp8:
    """Float w [rows, K] -> FP8 with 128 x 128 blocks, each block's largest magnitude mapped to e4m3's 448
    (DeepSeek's recipe, as tools/synth_checkpoint.py writes its checkpoints)."""
    R, K = w.shape
    sr, sc = -(-R // FP8_BLOCK), -(-K // FP8_BLOCK)
    padded = F.pad(w.float(), (0, sc * FP8_BLOCK - K, 0, sr * FP8_BLOCK - R)).view(sr, FP8_BLOCK, sc, FP8_BLOCK)
    scale = (padded.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(1e-30)
    q = (padded / scale[:, None, :, None]).view(sr * FP8_BLOCK, sc * FP8_BLOCK)[:R, :K]
    return Fp8(q.to(torch.float8_e4m3fn), scale)


def mx4_quantize(w: torch.Tensor) -> Mx4:
    """Float w [rows, K] (K a multiple of 32) -> MXFP4: per block the smallest power of two that keeps
    every value within e2m1's +-6 (no clipping), then each value to its nearest e2m1 value."""
    R = w.shape[0]
    g = w.float().view(R, -1, MX_BLOCK)
    amax = g.abs().amax(-1)
    e = torch.ceil(torch.log2(amax / 6)).clamp(-125, 127)  # e + 127 >= 2: a scale the kernels represent
    e = torch.where(amax > 0, e, torch.zeros_like(e))
    v = g / torch.ldexp(torch.ones_like(e), e.to(torch.int32))[..., None]
    idx = (v.abs()[..., None] - E2M1).abs().argmin(-1)  # ties: the smaller magnitude
    codes = (idx | ((v < 0) & (idx > 0)).long() << 3).to(torch.uint8)
    return Mx4(codes.view(R, -1), (e + 127).to(torch.uint8))

def iq4xs_quantize(w: torch.Tensor) -> Iq4Xs:
    """Float w [rows, K] -> IQ4_XS's numbers (each 32's iq4nl scale on an int8 sc under the 256's d, -32..31 as the
    file's 6 bits; then the nearest codes; no search)."""
    R, K = w.shape
    g = F.pad(w.float(), (0, -K % QK)).view(R, -1, G32)
    want = g.gather(-1, g.abs().argmax(-1, keepdim=True))[..., 0] / -127
    d = (want.abs().view(R, -1, QK // G32).amax(-1) / 32).clamp_min(1e-30)
    sc = torch.round(want / d.repeat_interleave(QK // G32, 1)).clamp(-32, 31)
    step = (d.repeat_interleave(QK // G32, 1) * sc)[..., None]
    v = torch.where(step != 0, g / torch.where(step != 0, step, torch.ones_like(step)), torch.zeros_like(g))
    codes = (v[..., None] - IQ4NL).abs().argmin(-1).to(torch.uint8)
    return Iq4Xs(codes.view(R, -1)[:, :K], d, sc.to(torch.int8))


def q6k_quantize(w: torch.Tensor, bits: int = 6) -> Q6K:
    """Float w [rows, K] -> Q6_K's numbers (each 16's largest magnitude on -32, its scale on an int8 under the 256's
    d; no search, as ggml's first guess); bits 3: Q3_K's (on -4, an sc of -32..31, as the file's 6 bits less 32)."""
    half, sc_max = 1 << (bits - 1), 127 if bits == 6 else 31
    R, K = w.shape
    g = F.pad(w.float(), (0, -K % QK)).view(R, -1, Q6_SUB)
    want = g.gather(-1, g.abs().argmax(-1, keepdim=True))[..., 0] / -half
    d = (want.abs().view(R, -1, QK // Q6_SUB).amax(-1) / (sc_max + 1 if bits == 3 else sc_max)).clamp_min(1e-30)
    sc = torch.round(want / d.repeat_interleave(QK // Q6_SUB, 1)).clamp(-sc_max - 1, sc_max)
    step = (d.repeat_interleave(QK // Q6_SUB, 1) * sc)[..., None]
    q = torch.where(step != 0, torch.round(g / torch.where(step != 0, step, torch.ones_like(step))),
                    torch.zeros_like(g)).clamp(-half, half - 1)
    return (Q6K if bits == 6 else Q3K)(q.to(torch.int8).view(R, -1)[:, :K], d, sc.to(torch.int8))


def q4k_quantize(w: torch.Tensor, bits: int = 4) -> Q4K:
    """Float w [rows, K] -> Q4_K's numbers (each 32's range on 0..15 with a min <= 0, its scale and min on 6 bits under
    the 256's d and dmin; no search, as uint4_quantize); bits 5: Q5_K's (0..31); bits 2: Q2_K's (each 16's on 0..3,
    scale and min on 4 bits)."""
    top, (per, smax) = (1 << bits) - 1, (Q6_SUB, 15) if bits == 2 else (G32, 63)
    R, K = w.shape
    g = F.pad(w.float(), (0, -K % QK)).view(R, -1, per)
    lo, hi = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)
    scale, mn = (hi - lo) / top, -lo
    d = (scale.view(R, -1, QK // per).amax(-1) / smax).clamp_min(1e-12)
    dmin = (mn.view(R, -1, QK // per).amax(-1) / smax).clamp_min(1e-12)
    rep = lambda t: t.repeat_interleave(QK // per, 1)  # noqa: E731
    sc = torch.round(scale / rep(d)).clamp(0, smax)
    m = torch.round(mn / rep(dmin)).clamp(0, smax)
    step, off = (rep(d) * sc)[..., None], (rep(dmin) * m)[..., None]
    q = torch.where(step > 0, torch.round((g + off) / step.clamp_min(1e-30)), torch.zeros_like(g)).clamp(0, top)
    kind = {4: Q4K, 5: Q5K, 2: Q2K}[bits]
    return kind(q.to(torch.uint8).view(R, -1)[:, :K], d, dmin, sc.to(torch.uint8), m.to(torch.uint8))


def int8g32_quantize(w: torch.Tensor) -> Q8:
    """Float w [rows, K] -> int8 per 32 (each group's largest magnitude on 127)."""
    R, K = w.shape
    g = F.pad(w.float(), (0, -K % G32)).view(R, -1, G32)
    scale = (g.abs().amax(-1) / 127).clamp_min(1e-12)
    return Q8(torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8).view(R, -1)[:, :K], scale)


def iq4nl_quantize(w: torch.Tensor) -> Iq4:
    """Float w [rows, K] -> the IQ4_NL grid per 32 (ggml's first guess: the group's largest magnitude on the grid's
    end, -127, then the nearest code; no search)."""
    R, K = w.shape
    g = F.pad(w.float(), (0, -K % G32)).view(R, -1, G32)
    peak = g.gather(-1, g.abs().argmax(-1, keepdim=True))[..., 0]
    scale = peak / -127
    scale = torch.where(scale == 0, torch.full_like(scale, 1e-12), scale)
    codes = ((g / scale[..., None])[..., None] - IQ4NL).abs().argmin(-1).to(torch.uint8)
    return Iq4(codes.view(R, -1)[:, :K], scale)


def uint4_quantize(w: torch.Tensor, group: int = G32) -> UInt4:
    """Float w [rows, K] -> asymmetric 4-bit in groups (each group's range on 0..15)."""
    R, K = w.shape
    g = F.pad(w.float(), (0, -K % group)).view(R, -1, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(R, -1)[:, :K]
    return UInt4(q, scale, -lo, group)


def int4_quantize(w: torch.Tensor, group: int = G32) -> Int4:
    """Float w [rows, K] -> symmetric int4 in groups (each group's largest magnitude maps to 7)."""
    R, K = w.shape
    g = F.pad(w.float(), (0, -K % group)).view(R, -1, group)
    scale = (g.abs().amax(-1) / 7).clamp_min(1e-12)
    q = torch.round(g / scale[..., None]).clamp(-8, 7).to(torch.int8).view(R, -1)[:, :K]
    return Int4(q, scale, group)

def int8_quantize(w: torch.Tensor) -> Int8:
    w = w.float()
    scale = (w.abs().amax(-1) / 127).clamp_min(1e-12)
    return Int8(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale)

def _blocked_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[R, Kp] values 0-15 -> [R, Kp/2] bytes in row blocks: per group of 32, chunk v (elements 4v..4v+3) in the
    low nibbles and chunk v + 4 in the high ones of one 4-byte lane."""
    R, Kp = q.shape
    c = q.view(R, Kp // G32, 8, 4)
    return _interleave_rows(c[:, :, :4] | (c[:, :, 4:] << 4))


def _pairs(v: torch.Tensor) -> torch.Tensor:
    """Per 32 [R, G, 8 chunks, 4] values 0..3 -> [R, G, 2, 4] bytes: chunk c's at bits 2 (c % 4) of vector c // 4."""
    R, G = v.shape[:2]
    return (v.view(R, G, 2, 4, 4) << (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)).sum(3, dtype=torch.uint8)


def _bits(v: torch.Tensor) -> torch.Tensor:
    """Per 32 [R, G, 8 chunks, 4] values 0..1 -> [R, G, 1, 4] bytes: chunk c's at bit c."""
    return (v << torch.arange(8, dtype=torch.uint8).view(8, 1)).sum(2, keepdim=True, dtype=torch.uint8)


def _unpairs(t: torch.Tensor) -> torch.Tensor:
    """_pairs undone: [..., 2, 4] -> [..., 8, 4] values 0..3."""
    shift = (2 * torch.arange(4, device=t.device)).view(4, 1)
    return ((t.unsqueeze(-2) >> shift) & 3).flatten(-3, -2)


def _unbits(t: torch.Tensor) -> torch.Tensor:
    """_bits undone: [..., 1, 4] -> [..., 8, 4] values 0..1."""
    return (t >> torch.arange(8, device=t.device).view(8, 1)) & 1


def _blocked_bytes(q: torch.Tensor) -> torch.Tensor:
    """[R, Kp] int8 -> [R, Kp] in row blocks, chunks of 4 bytes as lanes."""
    R, Kp = q.shape
    return _interleave_rows(q.view(torch.uint8).view(R, Kp // G32, 8, 4)).view(torch.int8)


def _blocked_scales(s: torch.Tensor) -> torch.Tensor:
    """[R, Kp/32] -> the same in row blocks: per group, the block's rows side by side."""
    return _interleave_rows(s[:, :, None, None])


def mx_scale(exps: torch.Tensor) -> torch.Tensor:
    """The kernels' fp32 scale of each published exponent: 2^(e - 127) / 2 (they multiply twice the e2m1
    value, an integer), 0 for e <= 1 (as native/kernels/gemm_blocked.h's mx_scale)."""
    e = exps.to(torch.int32)
    return torch.where(e > 1, torch.ldexp(torch.ones(e.shape), e - 128), torch.zeros(e.shape))

def pack_mx4(w: Mx4, Kp: int) -> tuple:
    """MXFP4 [rows, K] -> (codes, exponents, None, None) in row blocks, bit-exact: codes and 1-byte exponents kept."""
    R, K = w.codes.shape
    codes = F.pad(w.codes, (0, Kp - K))                     # code 0 is +0
    exps = F.pad(w.exps, (0, (Kp - K) // MX_BLOCK), value=127)
    return _blocked_nibbles(codes), _blocked_scales(exps), None, None


def pack_fp8(w: Fp8, Kp: int) -> tuple:
    """FP8 [rows, K] -> (e4m3 bytes, scale x 256, None, None), bit-exact: the kernels widen a byte to its
    value / 256 (native/kernels/gemm_fp8.cpp)."""
    R, K = w.values.shape
    want = (-(-R // FP8_BLOCK), -(-K // FP8_BLOCK))
    if tuple(w.scale.shape) != want:
        raise ValueError(f"fp8 weight [{R}, {K}] needs {list(want)} block scales ({FP8_BLOCK} x {FP8_BLOCK}), "
                         f"got {list(w.scale.shape)}")
    data = F.pad(w.values.view(torch.uint8), (0, Kp - K))  # byte 0 is +0
    if bool(((data & 0x7F) == 0x7F).any()):
        raise ValueError("fp8 weight holds NaN")
    scale = F.pad(w.scale.float() * 256, (0, -(-Kp // FP8_BLOCK) - want[1]), value=1.0)
    return data, scale, None, None


def pack_int4g32(w: Int4, Kp: int) -> tuple:
    """Symmetric int4 [rows, K] with groups of 32 x n -> (nibbles, a scale per 32, None, rowcorr), bit-exact."""
    R, K = w.values.shape
    if w.group % G32 or w.scale.shape != (R, -(-K // w.group)):
        raise ValueError(f"int4 weight [{R}, {K}] in groups of {w.group}: the int4g32 format keeps groups of a "
                         f"multiple of {G32} with a scale each, got scales {list(w.scale.shape)}")
    if int(w.values.min()) < -8 or int(w.values.max()) > 7:
        raise ValueError("int4 values outside -8..7")
    q = F.pad(w.values.to(torch.int16) + 8, (0, Kp - K), value=8).to(torch.uint8)  # 8 = zero
    scale = w.scale.float().repeat_interleave(w.group // G32, 1)
    scale = F.pad(scale, (0, Kp // G32 - scale.shape[1]), value=1.0)[:, :Kp // G32]
    return _blocked_nibbles(q), _blocked_scales(scale), None, None


def _per32(t: torch.Tensor, group: int, Kp: int, pad: float) -> torch.Tensor:
    """[R, K / group] -> [R, Kp / 32]: each group's number repeated per 32, padding groups `pad`."""
    t = t.float().repeat_interleave(group // G32, 1)
    return F.pad(t, (0, Kp // G32 - t.shape[1]), value=pad)[:, :Kp // G32]


def pack_iq4nl(w: Iq4, Kp: int) -> tuple:
    """IQ4_NL-grid codes [rows, K] -> (nibbles, a scale per 32, None, rowcorr), bit-exact."""
    R, K = w.codes.shape
    if w.scale.shape != (R, -(-K // G32)):
        raise ValueError(f"iq4nl weight [{R}, {K}] needs a scale per {G32}, got {list(w.scale.shape)}")
    codes = F.pad(w.codes, (0, Kp - K), value=8)  # any code: the padding's activations are 0, rowcorr counts it
    scale = _per32(w.scale, G32, Kp, 0.0)
    return _blocked_nibbles(codes), _blocked_scales(scale), None, None


def pack_uint4g32(w: UInt4, Kp: int) -> tuple:
    """Asymmetric 4-bit [rows, K] in groups of 32 x n -> (nibbles, [the rows' scales per 32; then their mins per 32],
    None, rowcorr), bit-exact."""
    R, K = w.values.shape
    if w.group % G32 or w.scale.shape != (R, -(-K // w.group)) or w.min.shape != w.scale.shape:
        raise ValueError(f"uint4 weight [{R}, {K}] in groups of {w.group}: the uint4g32 format keeps groups of a "
                         f"multiple of {G32} with a scale and a min each, got {list(w.scale.shape)}, {list(w.min.shape)}")
    if int(w.values.max()) > 15:
        raise ValueError("uint4 values outside 0..15")
    q = F.pad(w.values, (0, Kp - K)).to(torch.uint8)
    scale, mins = _per32(w.scale, w.group, Kp, 0.0), _per32(w.min, w.group, Kp, 0.0)
    return _blocked_nibbles(q), torch.cat([_blocked_scales(scale), _blocked_scales(mins)]), None, None


def pack_int8g32(w: Q8, Kp: int) -> tuple:
    """int8 [rows, K] with a scale per 32 -> (bytes, a scale per 32, None, rowcorr), bit-exact."""
    R, K = w.values.shape
    if w.scale.shape != (R, -(-K // G32)):
        raise ValueError(f"int8g32 weight [{R}, {K}] needs a scale per {G32}, got {list(w.scale.shape)}")
    data = F.pad(w.values, (0, Kp - K))
    scale = _per32(w.scale, G32, Kp, 0.0)
    return _blocked_bytes(data), _blocked_scales(scale), None, None


def pack_q4k(w: Q4K, Kp: int, bits: int = 4) -> tuple:
    """Q4_K numbers [rows, K] -> (nibbles, [per 256: d, dmin, 8 sc, 8 m] bytes, None, None) in row blocks, bit-exact.
    bits 5 (Q5_K): per 32 the nibble vectors, then one vector of the high bits (chunk c's at bit c)."""
    R, K = w.values.shape
    fmt = f"q{bits}k"
    if Kp % QK or w.d.shape != (R, -(-K // QK)) or w.sc.shape != (R, w.d.shape[1] * (QK // G32)):
        raise ValueError(f"{fmt} weight [{R}, {K}] needs a d and dmin per {QK} and an sc and m per {G32} (rows padded "
                         f"to {QK}), got {list(w.d.shape)}, {list(w.sc.shape)} for rows of {Kp}")
    if int(w.values.max()) >= 1 << bits or int(w.sc.max()) > 63 or int(w.m.max()) > 63:
        raise ValueError(f"{fmt} values outside 0..{(1 << bits) - 1} or sub-scales outside 0..63")
    q = F.pad(w.values, (0, Kp - K)).to(torch.uint8)
    (d, sc), (dmin, m) = _d_and_bytes(w.d, w.sc, Kp // QK), _d_and_bytes(w.dmin, w.m, Kp // QK)
    scales = _interleave_rows(d, dmin, sc, m)
    if bits == 4:
        return _blocked_nibbles(q), scales, None, None
    c = q.view(R, Kp // G32, 8, 4)  # per 32: chunks of 4
    nib = (c[:, :, :4] & 15) | ((c[:, :, 4:] & 15) << 4)
    return _interleave_rows(nib, _bits(c >> 4)), scales, None, None


def pack_q6k(w: Q6K, Kp: int, bits: int = 6) -> tuple:
    """Q6_K numbers [rows, K] -> (per 32: 4 vectors of low nibbles, 2 of high bit pairs; [per 256: d, 16 sc] bytes,
    None, None) in row blocks, bit-exact. bits 3 (Q3_K): per 32 2 vectors of low bit pairs, 1 of high bits."""
    R, K = w.values.shape
    fmt, half = f"q{bits}k", 1 << (bits - 1)
    if Kp % QK or w.d.shape != (R, -(-K // QK)) or w.sc.shape != (R, w.d.shape[1] * (QK // Q6_SUB)):
        raise ValueError(f"{fmt} weight [{R}, {K}] needs a d per {QK} and an sc per {Q6_SUB} (rows padded to {QK}), "
                         f"got {list(w.d.shape)}, {list(w.sc.shape)} for rows of {Kp}")
    if int(w.values.min()) < -half or int(w.values.max()) >= half:
        raise ValueError(f"{fmt} values outside {-half}..{half - 1}")
    u = F.pad(w.values.to(torch.int16) + half, (0, Kp - K), value=half).to(torch.uint8)  # half = zero
    c = u.view(R, Kp // G32, 8, 4)  # per 32: chunks of 4
    if bits == 6:
        data = _interleave_rows((c[:, :, :4] & 15) | ((c[:, :, 4:] & 15) << 4), _pairs(c >> 4))
    else:
        data = _interleave_rows(_pairs(c & 3), _bits(c >> 2))
    return data, _interleave_rows(*_d_and_bytes(w.d, w.sc, Kp // QK)), None, None


def pack_q2k(w: Q2K, Kp: int) -> tuple:
    """Q2_K numbers [rows, K] -> (per 32: 2 vectors of bit pairs; [per 256: d, dmin, 16 sc | m << 4 (a 32's two side
    by side)] bytes, None, None) in row blocks, bit-exact."""
    R, K = w.values.shape
    if Kp % QK or w.d.shape != (R, -(-K // QK)) or w.sc.shape != (R, w.d.shape[1] * (QK // Q6_SUB)):
        raise ValueError(f"q2k weight [{R}, {K}] needs a d and dmin per {QK} and an sc and m per {Q6_SUB} (rows padded "
                         f"to {QK}), got {list(w.d.shape)}, {list(w.sc.shape)} for rows of {Kp}")
    if int(w.values.max()) > 3 or int(w.sc.max()) > 15 or int(w.m.max()) > 15:
        raise ValueError("q2k values outside 0..3 or sub-scales outside 0..15")
    q = F.pad(w.values, (0, Kp - K)).to(torch.uint8)
    both = (w.sc.to(torch.uint8) | (w.m.to(torch.uint8) << 4)).view(torch.int8)  # sc in the low nibble, as the file's
    (d, both), dmin = _d_and_bytes(w.d, both, Kp // QK), _d_and_bytes(w.dmin, w.m, Kp // QK)[0]
    both = both.reshape(R, Kp // QK, QK // G32, 2)  # a 32's two bytes of a row side by side (the kernels' int16 pairs)
    return _interleave_rows(_pairs(q.view(R, Kp // G32, 8, 4))), _interleave_rows(d, dmin, both), None, None


def _d_and_bytes(d: torch.Tensor, sc: torch.Tensor, nsg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A super-blocked format's d [R, <= nsg] and sub-scales [R, <= nsg x n] (int8, or q4k's 0..63) as _interleave_rows
    fields, padded with zeros (zero weights)."""
    R, per = d.shape[0], sc.shape[1] // max(d.shape[1], 1)
    d = F.pad(d.float(), (0, nsg - d.shape[1])).contiguous().view(torch.uint8).view(R, nsg, 1, 4)
    sc = F.pad(sc.to(torch.int8), (0, nsg * per - sc.shape[1])).view(torch.uint8).view(R, nsg, per, 1)
    return d, sc


def pack_iq4xs(w: Iq4Xs, Kp: int) -> tuple:
    """IQ4_XS numbers [rows, K] -> (nibbles as iq4nl's, [per 256: d, 8 sc] bytes, None, None) in row blocks, bit-exact."""
    R, K = w.codes.shape
    if Kp % QK or w.d.shape != (R, -(-K // QK)) or w.sc.shape != (R, w.d.shape[1] * (QK // G32)):
        raise ValueError(f"iq4xs weight [{R}, {K}] needs a d per {QK} and an sc per {G32} (rows padded to {QK}), got "
                         f"{list(w.d.shape)}, {list(w.sc.shape)} for rows of {Kp}")
    codes = F.pad(w.codes, (0, Kp - K), value=8)  # any code: the padding's scales are 0
    return _blocked_nibbles(codes), _interleave_rows(*_d_and_bytes(w.d, w.sc, Kp // QK)), None, None


def pack_int4(w: Int4, Kp: int) -> tuple:
    """Symmetric int4 in groups of 64 -> (nibbles, a scale per 64, None, None) in row blocks."""
    R, K = w.values.shape
    q = F.pad(w.values.to(torch.int16) + 8, (0, Kp - K), value=8).to(torch.uint8)  # 8 = zero
    scale = F.pad(w.scale.float(), (0, Kp // INT4_GROUP - w.scale.shape[1]), value=1e-12)
    return _blocked_nibbles(q), _blocked_scales(scale), None, None


def _pack_bf16(w: torch.Tensor, Kp: int) -> tuple:
    return F.pad(w, (0, Kp - w.shape[-1])), None, None, None


def _pack_int8(w: Int8, Kp: int) -> tuple:
    """int8 per row -> (bytes, the rows' scales, the rows' sums (the kernels' u8 activation offset), None)."""
    data = F.pad(w.values, (0, Kp - w.values.shape[-1]))
    return data, w.scale, data.sum(-1, dtype=torch.int32), None


# unpack: packed experts (data, scale, rowsum, rowcorr) [E, rows, Kp...] -> the values the kernels multiply, fp32
# [E, rows, K], on the packed tensors' device


def _rows(w: torch.Tensor, data: torch.Tensor, K: int) -> torch.Tensor:
    """Values [E, R, ...] of packed data [E, R, ...] -> [E, R, K]."""
    return w.reshape(*data.shape[:2], -1)[..., :K]


def _nibble_codes(data: torch.Tensor) -> torch.Tensor:
    """_blocked_nibbles undone: [E, R, Kp / 2] bytes -> [E, R, Kp / 32, 8, 4] values 0-15 (int64)."""
    b = _deinterleave_rows(data, data.shape[-1] // 16, (4, 4))[0].long()
    return torch.cat([b & 15, b >> 4], -2)


def _group_scales(scale: torch.Tensor, r0: int, R: int) -> torch.Tensor:
    """Packed per-group scales' rows [r0, r0 + R) ([E, R', groups] in row blocks) -> [E, R, groups, 1]."""
    E, ng = scale.shape[0], scale.shape[-1]
    return _deinterleave_rows(scale[:, r0:r0 + R], ng, (1, 1))[0].reshape(E, R, ng, 1)


def _times_group_scales(v: torch.Tensor, scale: torch.Tensor, to_scale=None) -> torch.Tensor:
    """Values [E, R, Kp / 32, 8, 4] (fp32) times their group's scale -> [E, R, groups, Kp / groups]."""
    E, R = v.shape[:2]
    s = _group_scales(scale, 0, R)
    return v.reshape(E, R, s.shape[2], -1) * (s if to_scale is None else to_scale(s))


def _unpack_bf16(packed: tuple, K: int) -> torch.Tensor:
    return packed[0].float()[..., :K]


def _unpack_int8(packed: tuple, K: int) -> torch.Tensor:
    return (packed[0].float() * packed[1][..., None])[..., :K]


def _unpack_fp8(packed: tuple, K: int) -> torch.Tensor:
    data, scale = packed[:2]
    s = (scale / 256).repeat_interleave(FP8_BLOCK, 1)[:, :data.shape[1]].repeat_interleave(FP8_BLOCK, 2)
    return (data.view(torch.float8_e4m3fn).float() * s[..., :data.shape[2]])[..., :K]


def _unpack_int4(packed: tuple, K: int) -> torch.Tensor:  # int4, int4g32: nibbles less 8
    data, scale = packed[:2]
    return _rows(_times_group_scales(_nibble_codes(data).float() - 8, scale), data, K)


def _unpack_mx4(packed: tuple, K: int) -> torch.Tensor:
    data, scale = packed[:2]
    v = MX4_TWICE.to(data.device)[_nibble_codes(data)]
    return _rows(_times_group_scales(v, scale, lambda s: mx_scale(s.cpu()).to(data.device)), data, K)


def _unpack_iq4nl(packed: tuple, K: int) -> torch.Tensor:
    data, scale = packed[:2]
    return _rows(_times_group_scales(IQ4NL.to(data.device)[_nibble_codes(data)], scale), data, K)


def _unpack_uint4g32(packed: tuple, K: int) -> torch.Tensor:  # an expert's scales, then its mins
    data, scale = packed[:2]
    R = data.shape[1]
    return _rows(_times_group_scales(_nibble_codes(data).float(), scale) - _group_scales(scale, R, R), data, K)


def _unpack_int8g32(packed: tuple, K: int) -> torch.Tensor:
    data, scale = packed[:2]
    return _rows(_times_group_scales(_deinterleave_rows(data, scale.shape[-1], (8, 4))[0].float(), scale), data, K)


def _d_times_sc(scale: torch.Tensor, E: int, R: int, per: int) -> torch.Tensor:
    """q6k's and iq4xs's packed scales ([d, `per` int8 sc] a 256, in row blocks) -> d x sc per sub-block, fp32
    [E, R, Kp / 256 x per] (exact: an fp16 value times an int8)."""
    d, sc = _deinterleave_rows(scale, scale.shape[-1] // (4 + per), (1, 4), (per, 1))
    return (d.contiguous().view(torch.float32).reshape(E, R, -1).repeat_interleave(per, -1) *
            sc.contiguous().view(torch.int8).reshape(E, R, -1).float())


def _f32(t: torch.Tensor, E: int, R: int) -> torch.Tensor:
    """Deinterleaved fp32 fields (as bytes) -> [E, R, n] fp32."""
    return t.contiguous().view(torch.float32).reshape(E, R, -1)


def _unpack_iq4xs(packed: tuple, K: int) -> torch.Tensor:  # per 256: d (fp32), then 8 sc (bytes)
    data, scale = packed[:2]
    E, R, _ = data.shape
    v = IQ4NL.to(data.device)[_nibble_codes(data)]
    s = _d_times_sc(scale, E, R, QK // G32)
    return (s[..., None] * v.reshape(E, R, -1, G32)).reshape(E, R, -1)[..., :K]


def _times_k_scales(v: torch.Tensor, scale: torch.Tensor, K: int) -> torch.Tensor:
    """q4k's and q5k's values [E, R, ...] (fp32) with their scales (per 256: d, dmin (fp32), then 8 sc and 8 m)."""
    E, R = v.shape[:2]
    d, dmin, sc, m = _deinterleave_rows(scale, scale.shape[-1] // 24, (1, 4), (1, 4), (8, 1), (8, 1))
    s = (_f32(d, E, R).repeat_interleave(QK // G32, -1) * sc.reshape(E, R, -1).float())[..., None]
    mins = (_f32(dmin, E, R).repeat_interleave(QK // G32, -1) * m.reshape(E, R, -1).float())[..., None]
    return (v.reshape(E, R, -1, G32) * s - mins).reshape(E, R, -1)[..., :K]


def _unpack_q4k(packed: tuple, K: int) -> torch.Tensor:
    return _times_k_scales(_nibble_codes(packed[0]).float(), packed[1], K)


def _unpack_q5k(packed: tuple, K: int) -> torch.Tensor:  # per 32: 4 vectors of nibbles, 1 of high bits (chunk c's: bit c)
    data = packed[0]
    nib, hi = (t.long() for t in _deinterleave_rows(data, data.shape[-1] // 20, (4, 4), (1, 4)))
    return _times_k_scales((torch.cat([nib & 15, nib >> 4], -2) | (_unbits(hi) << 4)).float(), packed[1], K)


def _unpack_q6k(packed: tuple, K: int) -> torch.Tensor:
    """Per 32: 4 vectors of nibbles, 2 of high bit pairs (chunk c's at bits 2c of vector c // 4)."""
    data, scale = packed[:2]
    E, R, _ = data.shape
    nib, hi = (t.long() for t in _deinterleave_rows(data, data.shape[-1] // 24, (4, 4), (2, 4)))
    v = torch.cat([nib & 15, nib >> 4], -2) | (_unpairs(hi) << 4)
    s = _d_times_sc(scale, E, R, QK // Q6_SUB)
    return (s[..., None] * (v.reshape(E, R, -1, Q6_SUB) - 32).float()).reshape(E, R, -1)[..., :K]


def _unpack_q3k(packed: tuple, K: int) -> torch.Tensor:
    """Per 32: 2 vectors of low bit pairs (chunk c's at bits 2c of vector c // 4), 1 of high bits."""
    data, scale = packed[:2]
    E, R, _ = data.shape
    low, hi = (t.long() for t in _deinterleave_rows(data, data.shape[-1] // 12, (2, 4), (1, 4)))
    v = _unpairs(low) | (_unbits(hi) << 2)
    s = _d_times_sc(scale, E, R, QK // Q6_SUB)
    return (s[..., None] * (v.reshape(E, R, -1, Q6_SUB) - 4).float()).reshape(E, R, -1)[..., :K]


def _unpack_q2k(packed: tuple, K: int) -> torch.Tensor:
    """Per 32: 2 vectors of bit pairs (chunk c's at bits 2c of vector c // 4); per 256: d, dmin, 16 sc | m << 4."""
    data, scale = packed[:2]
    E, R, _ = data.shape
    v = _unpairs(_deinterleave_rows(data, data.shape[-1] // 8, (2, 4))[0].long()).float()
    d, dmin, b = _deinterleave_rows(scale, scale.shape[-1] // 24, (1, 4), (1, 4), (QK // G32, 2))
    b = b.reshape(E, R, -1).long()
    s = _f32(d, E, R).repeat_interleave(QK // Q6_SUB, -1) * (b & 15).float()
    mins = _f32(dmin, E, R).repeat_interleave(QK // Q6_SUB, -1) * (b >> 4).float()
    return (s[..., None] * v.reshape(E, R, -1, Q6_SUB) - mins[..., None]).reshape(E, R, -1)[..., :K]


# layout: the packed storage of E experts' [rows, Kp] matrices, (data, scale, rowsum, rowcorr) as (shape, dtype), None
# where the format has none


def _layout_bf16(E: int, rows: int, Kp: int) -> tuple:
    return ((E, rows, Kp), torch.bfloat16), None, None, None


def _layout_int8(E: int, rows: int, Kp: int) -> tuple:
    return ((E, rows, Kp), torch.int8), ((E, rows), torch.float32), ((E, rows), torch.int32), None


def _layout_fp8(E: int, rows: int, Kp: int) -> tuple:
    blocks = (E, -(-rows // FP8_BLOCK), -(-Kp // FP8_BLOCK))
    return ((E, rows, Kp), torch.uint8), (blocks, torch.float32), None, None


def _layout_int8g32(E: int, rows: int, Kp: int) -> tuple:
    return ((E, rows, Kp), torch.int8), ((E, rows, Kp // G32), torch.float32), None, None


def _layout_nibbles(group: int, dtype: torch.dtype, scale_rows: int = 1) -> Callable:
    """The 4-bit formats with a scale per `group` (uint4g32: scale_rows 2, an expert's scales, then its mins); no
    rowcorr (their kernels take activations as s8)."""
    def layout(E: int, rows: int, Kp: int) -> tuple:
        return ((E, rows, Kp // 2), torch.uint8), ((E, scale_rows * rows, Kp // group), dtype), None, None
    return layout


def _layout_super(bits: int, scale_bytes: int) -> Callable:
    """The super-blocked formats: `bits` a weight, `scale_bytes` a 256 of a row (d's and sub-scales)."""
    def layout(E: int, rows: int, Kp: int) -> tuple:
        return ((E, rows, Kp // 8 * bits), torch.uint8), ((E, rows, Kp // QK * scale_bytes), torch.uint8), None, None
    return layout


@dataclasses.dataclass(frozen=True)
class Format:
    """One weight format: what ggml-cpu's type_traits_cpu holds per type; the Python half of
    native/kernels/kernels.h's Kernels."""
    name: str
    bits: float        # bits a weight as packed: values and per-group scales (int8's per-row scale and sum and fp8's
    #                    per-block scale not counted)
    group: int         # weights of a row per scale (0: none, or one a row); the super-blocked formats: per sub-scale
    row_unit: int      # rows padded to a multiple of this: ROW_ALIGN, or QK for the super-blocked formats
    row_blocked: bool  # rows stored in interleaved blocks of BLOCK_ROWS (_interleave_rows)
    keeps: tuple       # the published numbers' types it holds bit for bit: quantize passes them through (exact types)
    quantize: Callable[[torch.Tensor], object]    # float weights [rows, K] -> the format's numbers
    pack: Callable[[object, int], tuple]          # (its numbers [rows, K], Kp) -> (data, scale, rowsum, rowcorr)
    unpack: Callable[[tuple, int], torch.Tensor]  # (packed [E, rows, Kp...], K) -> the values multiplied [E, rows, K]
    layout: Callable[[int, int, int], tuple]      # (E, rows, Kp) -> (data, scale, rowsum, rowcorr): (shape, dtype)s
    exact_only: bool = False  # holds published numbers only: quantize refuses float weights (the IQ grid types)

    @property
    def super_blocked(self) -> bool:
        return self.row_unit == QK


def _register(*formats: Format) -> dict[str, Format]:
    table = {f.name: f for f in formats}
    assert len(table) == len(formats), "a format registered twice"
    return table


# native/moe.h's Fmt, in its order (the CLIs list them so)
FORMATS: dict[str, Format] = _register(
    # name, bits, group, row_unit, row_blocked, keeps, quantize, pack, unpack, layout
    Format("bf16", 16, 0, ROW_ALIGN, False, (), lambda w: w.to(torch.bfloat16), _pack_bf16, _unpack_bf16, _layout_bf16),
    Format("int8", 8, 0, ROW_ALIGN, False, (), int8_quantize, _pack_int8, _unpack_int8, _layout_int8),
    Format("int4", 4.5, INT4_GROUP, ROW_ALIGN, True, (), functools.partial(int4_quantize, group=INT4_GROUP), pack_int4,
           _unpack_int4, _layout_nibbles(INT4_GROUP, torch.float32)),
    Format("mxfp4", 4.25, MX_BLOCK, ROW_ALIGN, True, (Mx4,),
           lambda w: mx4_quantize(F.pad(w.float(), (0, -w.shape[-1] % MX_BLOCK))), pack_mx4, _unpack_mx4,
           _layout_nibbles(MX_BLOCK, torch.uint8)),
    Format("fp8", 8, FP8_BLOCK, ROW_ALIGN, False, (Fp8,), fp8_quantize, pack_fp8, _unpack_fp8, _layout_fp8),
    Format("int4g32", 5, G32, ROW_ALIGN, True, (Int4,), int4_quantize, pack_int4g32, _unpack_int4,
           _layout_nibbles(G32, torch.float32)),
    Format("iq4nl", 5, G32, ROW_ALIGN, True, (Iq4,), iq4nl_quantize, pack_iq4nl, _unpack_iq4nl,
           _layout_nibbles(G32, torch.float32)),
    Format("uint4g32", 6, G32, ROW_ALIGN, True, (UInt4,), uint4_quantize, pack_uint4g32, _unpack_uint4g32,
           _layout_nibbles(G32, torch.float32, scale_rows=2)),
    Format("int8g32", 9, G32, ROW_ALIGN, True, (Q8,), int8g32_quantize, pack_int8g32, _unpack_int8g32, _layout_int8g32),
    Format("q4k", 4.75, G32, QK, True, (Q4K,), q4k_quantize, pack_q4k, _unpack_q4k, _layout_super(4, 24)),
    # q6k holds Q3_K's numbers too (its values fit 6 bits)
    Format("q6k", 6.625, Q6_SUB, QK, True, (Q6K, Q3K), q6k_quantize, pack_q6k, _unpack_q6k, _layout_super(6, 20)),
    Format("iq4xs", 4.375, G32, QK, True, (Iq4Xs,), iq4xs_quantize, pack_iq4xs, _unpack_iq4xs, _layout_super(4, 12)),
    Format("q5k", 5.75, G32, QK, True, (Q5K,), functools.partial(q4k_quantize, bits=5),
           functools.partial(pack_q4k, bits=5), _unpack_q5k, _layout_super(5, 24)),
    Format("q3k", 3.625, Q6_SUB, QK, True, (Q3K,), functools.partial(q6k_quantize, bits=3),
           functools.partial(pack_q6k, bits=3), _unpack_q3k, _layout_super(3, 20)),
    Format("q2k", 2.75, Q6_SUB, QK, True, (Q2K,), functools.partial(q4k_quantize, bits=2), pack_q2k, _unpack_q2k,
           _layout_super(2, 24)),
    # GGUF's grid types as stored (moe_kernels.iq_formats: the file's bytes, moved; no quantizer)
    *(Format(n, iq_formats.bits(n), Q6_SUB, QK, True, (t,), iq_formats.quantizer(n), iq_formats.pack,
             iq_formats.unpacker(n), iq_formats.layout(n), exact_only=True) for n, t in iq_formats.NUMBERS.items()),
)
NAMES = tuple(FORMATS)  # the format names (the CLIs' choices: moe_experts.kernels.NATIVE_FORMATS)


def format_of(name: str) -> Format:
    """The table's entry for a format name; ValueError naming it and the known ones."""
    f = FORMATS.get(name)
    if f is None:
        raise ValueError(f"the native kernels support {NAMES}, not {name!r}")
    return f
