"""The 8-bit KV cache rows (--kv-cache-dtype int8 / fp8): the one definition of their bytes, which the paged pool
(gpu_service/engine/kv_pool.py) stores, torch's paths read back, and the native kernels read in place
(native/kernels/kv_codes.h) and write (native/kernels/attention.cpp store_kv, the same bits).

A row of n values (one position of one KV head, of MLA's latent, of its rotary key, of an indexer key) is n codes
and one byte more, the row's scale: 2^(byte - 127), the least power of two with max|x| / scale <= the codes' largest
(127 for int8, 448 for fp8 e4m3), so the codes use their whole range. Codes are x / scale (exact) rounded to
nearest even. A scale per row (LMDeploy's int8 cache is per token and head too) never changes once written, so
chunked prefill, prefix-cache hits and decode all store the same bytes; a power of two (E8M0, as OCP's MX formats'
scales) makes every dequantized value exact in bf16 and lets a kernel apply the scale to a dot product's result:
the same bits as a cache holding the values. The byte costs 1/n: 1.98x a bf16 row at n = 128, 1.95x at the
embedded model's MLA widths (64 + 16).
"""
from __future__ import annotations

import torch

# the cache's element types whose rows are quantized here -> their codes' largest magnitude
TOP = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
LOW, HIGH = -126, 118  # a scale's exponents (native/kernels/kv_codes.h reads bytes 1..245)


def quantized(dtype: torch.dtype) -> bool:
    return dtype in TOP


def row_width(dtype: torch.dtype, n: int) -> int:
    """Elements of a pool buffer's row holding n values."""
    return n + 1 if dtype in TOP else n


def values(dtype: torch.dtype, width: int) -> int:
    """Values in a pool buffer's row of `width` elements."""
    return width - 1 if dtype in TOP else width


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., n] (any float dtype) -> its rows [..., n + 1] as `dtype`'s bytes (uint8): codes, then the scale byte.
    (n = 0, GLM-5.3-Flash's rotary key of no dims: the scale byte alone, 2^0.)"""
    xf = x.float()
    if xf.shape[-1] == 0:
        return torch.full((*xf.shape[:-1], 1), 127, dtype=torch.uint8, device=x.device)
    m, e = torch.frexp(xf.abs().amax(-1, keepdim=True) / TOP[dtype])  # amax / top = m 2^e, m in [0.5, 1)
    e = (e - (m == 0.5).int()).clamp(LOW, HIGH)
    inv = ((127 - e) << 23).view(torch.float32)  # 2^-e, exactly
    y = xf * inv
    if dtype == torch.int8:
        codes = y.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        codes = y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes, (e + 127).to(torch.uint8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype, out: torch.dtype) -> torch.Tensor:
    """Rows [..., n + 1] (uint8, or viewable as it) of `dtype` -> the values [..., n] in `out` (exact in bf16 and
    fp32)."""
    rows = rows.view(torch.uint8)
    codes = rows[..., :-1].view(dtype).float()
    scale = (rows[..., -1:].int() << 23).view(torch.float32)
    return (codes * scale).to(out)
