"""Dense layers on the native kernels: one packed [out, in] weight, y = x W^T. The GPU service runs its
projections, dense MLPs, shared experts and lm_head through these when it computes on the CPU
(gpu-service --dense-format), so those layers stream packed weights at DRAM speed as the experts do.
"""
from __future__ import annotations

import torch

from moe_core.config import FP8_BLOCK

from . import ISA, native
from .iq_formats import IqBlocks
from .packing import Fp8, alloc, data_ptr, floats, pack_expert, row_len

PACK_ROWS = 8192  # rows packed at a time: no fp32 copy of a whole lm_head
# bf16 weights on a CPU with bf16 arithmetic (the amx and avx512 paths): from this many tokens on, torch's matmul
# (oneDNN: AMX tiles or AVX512-BF16, with its own weight blocking) computes faster than our kernels on the row-major
# packing (Zen 5, avx512: torch's time 0.81x ours at 64 tokens, 0.51-0.65x at 512); below it, and at decode, ours
# stream the weights as fast or faster (`python bench/bench_dense.py`; docs/performance/kernels.md).
TORCH_FROM_TOKENS = 64
TORCH_PATHS = ("amx", "avx512")


class NativeLinear:
    def __init__(self, w, fmt: str, isa: str | None = None):
        """w [out, in] (a tensor, or packing.Fp8 as published for fmt fp8), or a list of them stacked along out
        (fused q/k/v, gate/up) without a copy of the whole. fp8: parts must start on 128-row blocks to keep their
        scales; otherwise the stacked matrix is requantized as one."""
        blocks = [w] if isinstance(w, (torch.Tensor, Fp8, IqBlocks)) else list(w)
        if fmt == "fp8" and any(sum(b.shape[0] for b in blocks[:i]) % FP8_BLOCK for i in range(1, len(blocks))):
            blocks = [torch.cat([floats(b).float() for b in blocks])]
        K = blocks[0].shape[1]
        if any(len(b.shape) != 2 or b.shape[1] != K for b in blocks):
            raise ValueError(f"linear: blocks of shapes {[list(b.shape) for b in blocks]} do not stack")
        rows = sum(b.shape[0] for b in blocks)
        self.rows, self.K, self.fmt, self.path = rows, K, fmt, isa or ISA
        self.Kp = row_len(K, fmt)
        self.parts = alloc(fmt, 1, rows, self.Kp)  # (data, scale, rowsum, rowcorr), each [1, rows, ...]
        at = 0
        for b in blocks:
            for r in range(0, b.shape[0], PACK_ROWS):  # (a multiple of FP8_BLOCK)
                chunk = b.rows(r, r + PACK_ROWS) if isinstance(b, (Fp8, IqBlocks)) else b[r:r + PACK_ROWS]
                n = chunk.shape[0]
                for i, (d, p) in enumerate(zip(self.parts, pack_expert(chunk, fmt, self.Kp))):
                    if d is None:
                        continue
                    if fmt == "fp8" and i == 1:  # scales: one row per block of 128 rows
                        d[0, (at + r) // FP8_BLOCK:(at + r) // FP8_BLOCK + p.shape[0]].copy_(p)
                    else:
                        d[0, at + r:at + r + n].copy_(p)
            at += b.shape[0]
        self.native = native.Linear(self.path, fmt, rows, K, self.Kp, tuple(map(data_ptr, self.parts)), owner=self.parts)
        # the packed bf16 rows themselves, as torch sees a weight (padding cut off; no copy when K = Kp)
        self._torch_weight = self.parts[0][0, :, :K] if fmt == "bf16" and self.path in TORCH_PATHS else None

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.K

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts if p is not None)

    def to_torch(self, x: torch.Tensor) -> bool:
        """Whether x goes to torch's matmul on this weight (bf16 prefill on a CPU with bf16 arithmetic)."""
        return self._torch_weight is not None and x.dtype == torch.bfloat16 and x.numel() >= TORCH_FROM_TOKENS * self.K

    def __call__(self, x: torch.Tensor, as_float: bool = False) -> torch.Tensor:
        """x [..., K] (any float dtype) -> [..., rows] in x's dtype; as_float: in fp32, the same values (the
        lm_head's logits: one pass where .to(dtype).float() takes two over a vocabulary's floats)."""
        if x.shape[-1] != self.K:
            raise ValueError(f"linear: input has {x.shape[-1]} features, the weight {self.K}")
        if self.to_torch(x):
            y = torch.nn.functional.linear(x, self._torch_weight)
            return y.float() if as_float else y
        xf = x.reshape(-1, self.K).float().contiguous()
        y = torch.empty(xf.shape[0], self.rows)
        if xf.shape[0]:
            self.native.forward(xf.data_ptr(), y.data_ptr(), xf.shape[0], as_float and x.dtype == torch.bfloat16)
        if as_float and x.dtype in (torch.bfloat16, torch.float32):
            return y.view(*x.shape[:-1], self.rows)
        y = y.to(x.dtype).view(*x.shape[:-1], self.rows)
        return y.float() if as_float else y


def linear_groups(parts: list[NativeLinear], x: torch.Tensor) -> torch.Tensor:
    """x [t, G, K] with group g through parts[g] (one shape and format: DeepSeek-V4's grouped output projection) ->
    [t, G, rows] in x's dtype: one native call for every group (the values of G calls of NativeLinear), or the
    groups one at a time where they go to torch's matmul."""
    t, G, K = x.shape
    if len(parts) != G or any(p.K != K or p.rows != parts[0].rows for p in parts):
        raise ValueError(f"linear_groups: x {list(x.shape)} does not fit {len(parts)} parts of [{parts[0].rows}, "
                         f"{parts[0].K}]")
    if any(p.to_torch(x[:, 0]) for p in parts):
        return torch.stack([p(x[:, g].contiguous()) for g, p in enumerate(parts)], dim=1)
    xf = x.float().contiguous()
    y = torch.empty(t, G, parts[0].rows)
    native.linear_groups([p.native for p in parts], xf.data_ptr(), y.data_ptr(), t)
    return y.to(x.dtype)
