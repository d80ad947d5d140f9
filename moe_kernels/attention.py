"""Decode attention on the native kernels (native/attention.cpp): one new query per head against a
sequence's KV cache (bf16 or fp32), fp32 scores and sums. For the GPU service's layers when it computes
on the CPU, where torch's small matmuls and softmax make this a large part of a decode step."""
from __future__ import annotations

import torch

from . import ISA, SIMD_ISAS, native

VECTOR_DIMS = (64, 128, 256)  # head dims with a vector kernel; others run its plain loops
DTYPES = (torch.bfloat16, torch.float32)


def supported(K: torch.Tensor, isa: str = ISA) -> bool:
    """Whether the native kernel takes this cache ([kv heads, positions, dim], or a paged pool layer [kv heads,
    blocks, block, dim]) fast on this isa."""
    return (isa in SIMD_ISAS and K.dtype in DTYPES and K.device.type == "cpu"
            and K.shape[-1] in VECTOR_DIMS and K.stride(-1) == 1)


def decode_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scale: float,
                     isa: str = ISA) -> torch.Tensor:
    """q [nh, d] (any float dtype), K/V [nkv, L, d] bf16 or fp32 (unit stride along d) -> [nh, d] fp32."""
    nh, d = q.shape
    nkv, L, _ = K.shape
    if K.dtype not in DTYPES or V.dtype != K.dtype or K.stride(-1) != 1 or V.stride(-1) != 1:
        raise ValueError("decode_attention: K and V must be both bf16 or both fp32, unit stride along the head dim")
    if V.shape != K.shape or nh % nkv or q.shape[1] != K.shape[2]:
        raise ValueError(f"decode_attention: q {list(q.shape)}, K {list(K.shape)}, V {list(V.shape)} do not fit")
    qf = q.float().contiguous()
    out = torch.empty(nh, d)
    native.decode_attention(isa, qf.data_ptr(), nh, nkv, d, K.data_ptr(), K.dtype == torch.bfloat16, K.stride(0),
                            K.stride(1), V.data_ptr(), V.stride(0), V.stride(1), L, scale, out.data_ptr())
    return out


def paged_decode_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, table: torch.Tensor, L: int,
                           scale: float, isa: str = ISA, first: int = -1) -> torch.Tensor:
    """The same over a paged cache: K/V one layer of the pool, [nkv, blocks, block, d] (gpu_service/kv_pool.py), the
    sequence's positions 0..L-1 in blocks table[0], table[1], ... (int32, contiguous) -> [nh, d] fp32. first >= 0:
    the blocks are first, first + 1, ... (a head's rows are then one strided matrix: read without the table)."""
    nh, d = q.shape
    nkv, _, B, _ = K.shape
    if K.dtype not in DTYPES or V.dtype != K.dtype or not K.is_contiguous() or not V.is_contiguous():
        raise ValueError("paged_decode_attention: K and V must be both bf16 or both fp32 pools, contiguous")
    if V.shape != K.shape or nh % nkv or d != K.shape[3] or B & (B - 1):
        raise ValueError(f"paged_decode_attention: q {list(q.shape)}, K {list(K.shape)}, V {list(V.shape)} do not fit")
    if table.dtype != torch.int32 or not table.is_contiguous() or table.numel() * B < L or L < 1:
        raise ValueError(f"paged_decode_attention: {table.numel()} blocks of {B} do not hold {L} positions")
    qf = q.float().contiguous()
    out = torch.empty(nh, d)
    if first >= 0:
        if first + -(-L // B) > K.shape[1]:
            raise ValueError(f"paged_decode_attention: blocks {first}.. do not hold {L} positions")
        size = K.element_size()
        native.decode_attention(isa, qf.data_ptr(), nh, nkv, d, K.data_ptr() + first * K.stride(1) * size,
                                K.dtype == torch.bfloat16, K.stride(0), K.stride(2),
                                V.data_ptr() + first * V.stride(1) * size, V.stride(0), V.stride(2), L, scale,
                                out.data_ptr())
        return out
    native.decode_attention(isa, qf.data_ptr(), nh, nkv, d, K.data_ptr(), K.dtype == torch.bfloat16, K.stride(0),
                            K.stride(2), V.data_ptr(), V.stride(0), V.stride(2), L, scale, out.data_ptr(),
                            table.data_ptr(), B.bit_length() - 1, K.stride(1), V.stride(1))
    return out
