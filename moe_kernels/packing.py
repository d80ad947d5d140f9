"""Weights packed into the native kernels' formats, and read back, one [rows, K] matrix (or E experts' of them) at a
time: the part common to every format. What differs per format (its numbers, layout, packing, unpacking) is one entry
of the table in moe_kernels/formats.py (FORMATS), read here by name; this module adds the packed buffers (huge pages,
NUMA placement) and keeps the names it always exported (the formats' numbers Mx4, Fp8, Int4..., their quantizers and
packers) for its importers.
"""
from __future__ import annotations

import torch

from . import native
from .formats import (
    BLOCK_ROWS, CONTAINERS, E2M1, E4M3_MAX, FP8_BLOCK, G32, INT4_GROUP, IQ4NL, MX4_TWICE, MX_BLOCK, Q6_SUB, QK,
    ROW_ALIGN, Format, Fp8, Int4, Int8, Iq4, Iq4Xs, Mx4, Q2K, Q3K, Q4K, Q5K, Q6K, Q8, UInt4, floats, format_of,
    fp8_quantize, int4_quantize, int8_quantize, int8g32_quantize, iq4nl_quantize, iq4xs_quantize, mx4_quantize,
    mx_scale, pack_fp8, pack_int4, pack_int4g32, pack_int8g32, pack_iq4nl, pack_iq4xs, pack_mx4, pack_q2k, pack_q4k,
    pack_q6k, pack_uint4g32, q4k_quantize, q6k_quantize, uint4_quantize)
from .formats import FORMATS as TABLE, NAMES as FORMATS  # FORMATS here: the names, as always

# what importers take from here: this module's functions, and the formats' names, numbers and functions it always had
__all__ = [
    "FORMATS", "ROW_BLOCKED", "SUPER_BLOCKED", "alloc", "data_ptr", "format_values", "huge", "layout", "pack_expert",
    "quantize", "row_len", "stack_rows", "store_expert", "unpack",
    "BLOCK_ROWS", "CONTAINERS", "E2M1", "E4M3_MAX", "FP8_BLOCK", "G32", "INT4_GROUP", "IQ4NL", "MX4_TWICE", "MX_BLOCK",
    "Q6_SUB", "QK", "ROW_ALIGN", "Format", "Fp8", "Int4", "Int8", "Iq4", "Iq4Xs", "Mx4", "Q2K", "Q3K", "Q4K", "Q5K",
    "Q6K", "Q8", "UInt4", "floats", "format_of", "fp8_quantize", "int4_quantize", "int8_quantize", "int8g32_quantize",
    "iq4nl_quantize", "iq4xs_quantize", "mx4_quantize", "mx_scale", "pack_fp8", "pack_int4", "pack_int4g32",
    "pack_int8g32", "pack_iq4nl", "pack_iq4xs", "pack_mx4", "pack_q2k", "pack_q4k", "pack_q6k", "pack_uint4g32",
    "q4k_quantize", "q6k_quantize", "uint4_quantize"]

ROW_BLOCKED = tuple(n for n, f in TABLE.items() if f.row_blocked)
SUPER_BLOCKED = tuple(n for n, f in TABLE.items() if f.super_blocked)  # rows in whole super-blocks of 256 (QK)


def _ptr_of(buf) -> int:
    return torch.frombuffer(buf, dtype=torch.uint8).data_ptr()


def row_len(n: int, fmt: str) -> int:
    """Packed row length: a multiple of the format's row unit (64 elements: whole VNNI steps and int4 groups; 256 for
    the super-blocked formats), bumped when the row's byte stride is a multiple of 512 so the rows a micro-kernel
    reads together do not all fall in one L1 set (not for the row-blocked formats, whose block is one stream)."""
    f = format_of(fmt)
    n = -(-n // f.row_unit) * f.row_unit
    if f.row_blocked:
        return n
    return n + ROW_ALIGN if int(n * f.bits) // 8 % 512 == 0 else n  # (their scales are kept apart: bits = the values')


def huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized [E, ...] tensor on huge-page-advised memory (streaming GBs of weights without a
    TLB miss per 4 KiB), each expert's slice bound to its NUMA node before anything touches it."""
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    buf = native.HugeBuffer(n)
    native.numa_place(_ptr_of(buf), n // shape[0], shape[0])
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # keeps `buf` alive


def layout(fmt: str, E: int, rows: int, Kp: int) -> tuple:
    """The packed storage of E experts' [rows, Kp] matrices: (data, scale, rowsum, rowcorr) as
    (shape, dtype), None where the format has none."""
    return format_of(fmt).layout(E, rows, Kp)


def alloc(fmt: str, E: int, rows: int, Kp: int) -> tuple:
    """Empty packed storage (layout()): the weights on huge pages, their scales and sums beside."""
    data, *rest = layout(fmt, E, rows, Kp)
    return huge(*data), *(None if p is None else torch.empty(p[0], dtype=p[1]) for p in rest)


def quantize(w, fmt: str):
    """One weight [rows, K] (floats, or Mx4 / Fp8 / Int4 / Iq4 / Iq4Xs / UInt4 / Q8 / Q4K / Q5K / Q6K / Q3K / Q2K as
    published) in a format's numbers, before packing: bf16 floats, Int8, Int4 (int4: groups of 64; int4g32: as published
    or 32), Mx4, Fp8, Iq4, Iq4Xs, UInt4, Q8, Q4K, Q5K, Q6K, Q3K or Q2K;
    what a format keeps as published (its table entry's keeps) stays bit for bit."""
    f = format_of(fmt)
    return w if type(w) in f.keeps else f.quantize(floats(w))


def format_values(w, fmt: str) -> torch.Tensor:
    """The fp32 values the kernels multiply for weight w [rows, K] in format fmt (where the weights are computed
    by other means, as torch on a GPU, in the same numbers)."""
    q = quantize(w, fmt)
    return (q if isinstance(q, torch.Tensor) else q.dequantize()).float()[:, :w.shape[-1]]


def pack_expert(w, fmt: str, Kp: int) -> tuple:
    """One expert's w [rows, K] (any float dtype, or numbers the format keeps) -> its (data, scale, rowsum, rowcorr)
    in the kernels' layout."""
    return format_of(fmt).pack(quantize(w, fmt), Kp)


def unpack(packed: tuple, fmt: str, K: int) -> torch.Tensor:
    """Packed experts (data, scale, rowsum, rowcorr) [E, rows, Kp...] -> the values the kernels multiply, fp32
    [E, rows, K], on the packed tensors' device (where the kernels do not run, as a GPU computing from the
    expert service's packed cache)."""
    return format_of(fmt).unpack(packed, K)


def stack_rows(parts: list, fmt: str):
    """Matrices of one K stacked along rows (gate and up) in what pack_expert takes: published MXFP4 always, and
    numbers the format keeps (fmt may be a torch dtype's name too: floats then)."""
    if all(isinstance(p, Mx4) for p in parts):
        return Mx4.cat(parts)
    f = TABLE.get(fmt)
    if f is not None and all(type(p) in f.keeps for p in parts):  # (q6k: Q6_K and Q3_K numbers side by side)
        return type(parts[0]).cat(parts)
    return torch.cat([floats(p) for p in parts])


def store_expert(dst: tuple, e: int, parts: tuple) -> None:
    for d, p in zip(dst, parts):
        if d is not None:
            d[e].copy_(p)


def data_ptr(t: torch.Tensor | None) -> int:  # 0 for a part the format has none of
    return t.data_ptr() if t is not None else 0
