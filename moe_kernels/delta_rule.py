"""The delta rule's one-token step on the native kernel (native/kernels/delta_rule.cpp): a decode's linear-attention
layer (GLM-5.3-Flash's KDA, Qwen3-Next's gated DeltaNet) in one read of the state and one write of the new one."""
from __future__ import annotations

import torch

from . import ISA, native


def supported(S: torch.Tensor) -> bool:
    """Whether the kernel takes this state: fp32 on the CPU."""
    return S.dtype == torch.float32 and S.device.type == "cpu"


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor, beta: torch.Tensor, S: torch.Tensor,
         isa: str = ISA) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, e [H, dk] (q scaled, q and k l2-normed; e the decay e^g per key channel), v [H, dv], beta [H], S [H, dk,
    dv], all fp32 -> (o [H, dv], the new state e S + k delta^T), delta = beta (v - k^T e S), o = (q e)^T S + (q . k)
    delta. S is left as it is (a retried step reads it again)."""
    H, dk, dv = S.shape
    if not supported(S) or tuple(q.shape) != (H, dk) or k.shape != q.shape or e.shape != q.shape or \
            tuple(v.shape) != (H, dv) or tuple(beta.shape) != (H,):
        raise ValueError(f"delta rule step: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, e "
                         f"{list(e.shape)}, beta {list(beta.shape)}, S {list(S.shape)} ({S.dtype}) do not fit")
    q, k, v, e, beta, S = (x.float().contiguous() for x in (q, k, v, e, beta, S))
    S_new, o = torch.empty_like(S), torch.empty(H, dv)
    native.delta_rule_step(isa, H, dk, dv, q.data_ptr(), k.data_ptr(), v.data_ptr(), e.data_ptr(), beta.data_ptr(),
                           S.data_ptr(), S_new.data_ptr(), o.data_ptr())
    return o, S_new
