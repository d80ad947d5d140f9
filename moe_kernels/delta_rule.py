"""The delta rule's recurrence on the native kernel (native/kernels/delta_rule.cpp): a linear-attention layer's tokens
(GLM-5.3-Flash's KDA, Qwen3-Next's gated DeltaNet) one at a time, each in one read of the state and one write of the
new one, a head's state kept in L2 between a prefill's tokens."""
from __future__ import annotations

import torch

from . import ISA, native


def supported(S: torch.Tensor) -> bool:
    """Whether the kernel takes this state: fp32 on the CPU."""
    return S.dtype == torch.float32 and S.device.type == "cpu"


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor, beta: torch.Tensor, S: torch.Tensor,
         isa: str = ISA) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [t, H, dk] (q scaled, q and k l2-normed), e the decay e^g per key channel [t, H, dk] or per head [t, H]
    (gated DeltaNet's), v [t, H, dv], beta [t, H], S [H, dk, dv], all fp32 -> (o [t, H, dv], the state after the t
    tokens); per token S <- e S + k delta^T, delta = beta (v - k^T e S), o = (q e)^T S + (q . k) delta on the state
    before it. S is left as it is (a retried step reads it again)."""
    H, dk, dv = S.shape
    t = q.shape[0]
    if not supported(S) or tuple(q.shape) != (t, H, dk) or k.shape != q.shape or \
            tuple(e.shape) not in ((t, H, dk), (t, H)) or tuple(v.shape) != (t, H, dv) or tuple(beta.shape) != (t, H):
        raise ValueError(f"delta rule: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, e {list(e.shape)}, "
                         f"beta {list(beta.shape)}, S {list(S.shape)} ({S.dtype}) do not fit")
    q, k, v, e, beta, S = (x.float().contiguous() for x in (q, k, v, e, beta, S))
    S_new, o = torch.empty_like(S), torch.empty(t, H, dv)
    native.delta_rule_step(isa, H, t, dk, dv, q.data_ptr(), k.data_ptr(), v.data_ptr(), e.data_ptr(), beta.data_ptr(),
                           S.data_ptr(), S_new.data_ptr(), o.data_ptr(), e.dim() == 2)
    return o, S_new
