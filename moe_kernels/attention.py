"""Decode attention on the native kernels (native/attention.cpp): one new query per head against a
sequence's bf16 KV cache, fp32 scores and sums. For the GPU service's layers when it computes on the
CPU in bf16, where torch's bf16 matmuls make this the slowest part of a decode step."""
from __future__ import annotations

import torch

from . import PATH, native

VECTOR_DIMS = (64, 128, 256)  # head dims with a vector kernel; others run its plain loops


def supported(K: torch.Tensor, path: str = PATH) -> bool:
    """Whether the native kernel takes this cache ([kv heads, positions, dim] bf16) fast on this path."""
    return (path in ("avx512", "amx") and K.dtype == torch.bfloat16 and K.device.type == "cpu"
            and K.shape[-1] in VECTOR_DIMS and K.stride(-1) == 1)


def decode_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scale: float,
                     path: str = PATH) -> torch.Tensor:
    """q [nh, d] (any float dtype), K/V [nkv, L, d] bf16 (unit stride along d) -> [nh, d] fp32."""
    nh, d = q.shape
    nkv, L, _ = K.shape
    if K.dtype != torch.bfloat16 or V.dtype != torch.bfloat16 or K.stride(-1) != 1 or V.stride(-1) != 1:
        raise ValueError("decode_attention: K and V must be bf16 with unit stride along the head dim")
    if V.shape != K.shape or nh % nkv or q.shape[1] != K.shape[2]:
        raise ValueError(f"decode_attention: q {list(q.shape)}, K {list(K.shape)}, V {list(V.shape)} do not fit")
    qf = q.float().contiguous()
    out = torch.empty(nh, d)
    native.decode_attention(path, qf.data_ptr(), nh, nkv, d, K.data_ptr(), K.stride(0), K.stride(1), V.data_ptr(),
                            V.stride(0), V.stride(1), L, scale, out.data_ptr())
    return out
