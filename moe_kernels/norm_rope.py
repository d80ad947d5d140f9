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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, wide: bool = False) -> torch.Tensor:
    """x [..., n], weight [n] -> weight * (x / rms(x)) rounded as torch rounds it, in the promoted dtype; wide (an fp32
    weight, DeepSeek-V4's): (weight * the fp32 normalized row) rounded once, in x's dtype."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype if wide else torch.promote_types(x.dtype, weight.dtype))
    n = x.shape[-1]
    native.rms_norm(x.data_ptr(), x.dtype == BF16, weight.data_ptr(), weight.dtype == BF16, out.data_ptr(),
                    out.dtype == BF16, x.numel() // n, n, eps, wide)
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


def head_rope_supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x [T, heads, D] with cos [T, pairs], 2 pairs <= D: DeepSeek-V4's heads (their trailing dims turned)."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and x.dim() == 3 and cos.dim() == 2
            and cos.shape[0] == x.shape[0] and 2 * cos.shape[1] <= x.shape[2])


def head_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float | None = None,
              inplace: bool = False) -> torch.Tensor:
    """Each head of x [T, heads, D] divided by its RMS without a weight (eps given), then its trailing 2 x pairs dims
    turned in interleaved pairs in fp32 by cos/sin [T, pairs]: compressed_attention's unweighted_norm and rope_tail
    in one call, with torch's rounding. inplace: into x where it is contiguous (a prefill's heads are hundreds of MB:
    a new tensor's page faults cost more than the arithmetic)."""
    out = x if inplace and x.is_contiguous() else None
    x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty_like(x) if out is None else out
    T, heads, D = x.shape
    native.head_rope(x.data_ptr(), out.data_ptr(), x.dtype == BF16, T, heads, D, cos.shape[1], cos.data_ptr(),
                     sin.data_ptr(), 0.0 if eps is None else eps, eps is not None)
    return out
