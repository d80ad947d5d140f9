"""Dense layers on the native kernels: one packed [out, in] weight, y = x W^T. The GPU service runs its
projections, dense MLPs, shared experts and lm_head through these when it computes on the CPU
(gpu-service --dense-format), so those layers stream packed weights at DRAM speed as the experts do.
"""
from __future__ import annotations

import torch

from . import ISA, native
from .packing import alloc, data_ptr, pack_expert, row_len

PACK_ROWS = 8192  # rows packed at a time: no fp32 copy of a whole lm_head
# bf16 weights on an AMX CPU: from this many tokens on, torch's matmul (oneDNN: tiles, with its own
# weight blocking) computes faster than our tiles on the row-major packing; below it, and at decode,
# ours stream the weights as fast or faster (`python bench/bench_dense.py`; docs/kernels.md).
TORCH_FROM_TOKENS = 64


class NativeLinear:
    def __init__(self, w: torch.Tensor | list[torch.Tensor], fmt: str, isa: str | None = None):
        """w [out, in], or a list of them stacked along out (fused q/k/v, gate/up) without a copy of
        the whole."""
        blocks = [w] if isinstance(w, torch.Tensor) else list(w)
        K = blocks[0].shape[1]
        if any(b.dim() != 2 or b.shape[1] != K for b in blocks):
            raise ValueError(f"linear: blocks of shapes {[list(b.shape) for b in blocks]} do not stack")
        rows = sum(b.shape[0] for b in blocks)
        self.rows, self.K, self.fmt, self.path = rows, K, fmt, isa or ISA
        self.Kp = row_len(K, fmt)
        self.parts = alloc(fmt, 1, rows, self.Kp)  # (data, scale, rowsum, rowcorr), each [1, rows, ...]
        at = 0
        for b in blocks:
            for r in range(0, b.shape[0], PACK_ROWS):
                chunk = b[r:r + PACK_ROWS]
                for d, p in zip(self.parts, pack_expert(chunk, fmt, self.Kp)):
                    if d is not None:
                        d[0, at + r:at + r + chunk.shape[0]].copy_(p)
            at += b.shape[0]
        self.native = native.Linear(self.path, fmt, rows, K, self.Kp, tuple(map(data_ptr, self.parts)), owner=self.parts)
        # the packed bf16 rows themselves, as torch sees a weight (padding cut off; no copy when K = Kp)
        self._torch_weight = self.parts[0][0, :, :K] if fmt == "bf16" and self.path == "amx" else None

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.K

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts if p is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (any float dtype) -> [..., rows] in x's dtype."""
        if x.shape[-1] != self.K:
            raise ValueError(f"linear: input has {x.shape[-1]} features, the weight {self.K}")
        if self._torch_weight is not None and x.dtype == torch.bfloat16 and x.numel() >= TORCH_FROM_TOKENS * self.K:
            return torch.nn.functional.linear(x, self._torch_weight)
        xf = x.reshape(-1, self.K).float().contiguous()
        y = torch.empty(xf.shape[0], self.rows)
        if xf.shape[0]:
            self.native.forward(xf.data_ptr(), y.data_ptr(), xf.shape[0])
        return y.to(x.dtype).view(*x.shape[:-1], self.rows)
