"""Packed weight formats of the native kernels, one [rows, K] matrix (or E experts' of them) at a time:
- bf16: as is;
- int8: symmetric, one fp32 scale per output channel (row);
- int4: symmetric, one fp32 scale per group of 64 consecutive weights of a row (INT4_GROUP).
Rows are padded to row_len elements; the layouts are the ones native/moe.h describes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native

FORMATS = ("bf16", "int8", "int4")
INT4_GROUP = 64


def _ptr_of(buf) -> int:
    return torch.frombuffer(buf, dtype=torch.uint8).data_ptr()


def row_len(n: int, fmt: str) -> int:
    """Packed row length: a multiple of 64 elements (whole VNNI steps and int4 groups), bumped when
    the row's byte stride is a multiple of 512 so the rows a micro-kernel reads together do not all
    fall in one L1 set."""
    n = (n + 63) // 64 * 64
    nbytes = {"bf16": 2 * n, "int8": n, "int4": n // 2}[fmt]
    return n + 64 if nbytes % 512 == 0 else n


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
    if fmt == "bf16":
        return ((E, rows, Kp), torch.bfloat16), None, None, None
    if fmt == "int8":
        return ((E, rows, Kp), torch.int8), ((E, rows), torch.float32), ((E, rows), torch.int32), None
    return ((E, rows, Kp // 2), torch.uint8), ((E, rows, Kp // INT4_GROUP), torch.float32), None, \
        ((E, rows), torch.float32)


def alloc(fmt: str, E: int, rows: int, Kp: int) -> tuple:
    """Empty packed storage (layout()): the weights on huge pages, their scales and sums beside."""
    data, *rest = layout(fmt, E, rows, Kp)
    return huge(*data), *(None if p is None else torch.empty(p[0], dtype=p[1]) for p in rest)


def pack_expert(w: torch.Tensor, fmt: str, Kp: int) -> tuple:
    """One expert's w [rows, K] (any float dtype) -> its (data, scale, rowsum, rowcorr) in the kernels' layout."""
    w = F.pad(w.float(), (0, Kp - w.shape[-1]))
    if fmt == "bf16":
        return w.to(torch.bfloat16), None, None, None
    if fmt == "int8":
        scale = (w.abs().amax(-1) / 127).clamp_min(1e-12)
        q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
        return q, scale, q.sum(-1, dtype=torch.int32), None
    R = w.shape[0]
    g = w.view(R, Kp // INT4_GROUP, INT4_GROUP)
    scale = (g.abs().amax(-1) / 7).clamp_min(1e-12)
    q = (torch.round(g / scale[..., None]).clamp(-7, 7) + 8).to(torch.uint8)      # 1..15, 8 = zero
    packed = q[..., :INT4_GROUP // 2] | (q[..., INT4_GROUP // 2:] << 4)           # byte i: elems i, i+32
    rowcorr = 128 * (scale * (q.float() - 8).sum(-1)).sum(-1)                      # takes the +128 of u8 x out
    return packed.reshape(R, Kp // 2), scale, None, rowcorr


def store_expert(dst: tuple, e: int, parts: tuple) -> None:
    for d, p in zip(dst, parts):
        if d is not None:
            d[e].copy_(p)


def data_ptr(t: torch.Tensor | None) -> int:  # 0 for a part the format has none of
    return t.data_ptr() if t is not None else 0
