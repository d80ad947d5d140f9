"""RMSNorm and rotary embeddings on the native kernels (native/kernels/norm_rope.cpp) on the CPU: one call each instead
of torch's 7-8 ops (a decode step's few rows on the calling thread, a prefill's sliced over the native pool), with
torch's rounding (the same results as gpu_service.model.layers' torch versions, up to the order of the norm's sum of
squares)."""
from __future__ import annotations

import torch

from . import native

DTYPES = (torch.bfloat16, torch.float32)
BF16 = torch.bfloat16


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in DTYPES and weight.dtype in DTYPES and weight.dim() == 1
            and weight.shape[0] == x.shape[-1] and weight.is_contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n], weight [n] -> weight * (x / rms(x)) rounded as torch rounds it, in the promoted dtype."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    n = x.shape[-1]
    native.rms_norm(x.data_ptr(), x.dtype == BF16, weight.data_ptr(), weight.dtype == BF16, out.data_ptr(),
                    out.dtype == BF16, x.numel() // n, n, eps)
    return out


def rope_supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x [T, heads, dim] with cos [T, dim/2] of x's dtype: every dim rotated, halves (not interleaved)."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and cos.dtype == x.dtype and x.dim() == 3
            and cos.dim() == 2 and cos.shape[0] == x.shape[0] and 2 * cos.shape[1] == x.shape[2])


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    T, heads, dim = x.shape
    native.rope(x.data_ptr(), out.data_ptr(), x.dtype == BF16, T, heads, dim, cos.data_ptr(), sin.data_ptr())
    return out
