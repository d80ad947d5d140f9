"""Reference routed-expert operator in plain torch: the numerical baseline for the native kernels
and the fallback where they are not built. Weights stay in their storage dtype; each expert's
SwiGLU runs on the tokens routed to it and is accumulated in fp32. gpt-oss's experts add biases and
use a clamped SwiGLU (set_extras)."""
from __future__ import annotations


import torch
import torch.nn.functional as F

from moe_core.config import SILU, ExpertAct


FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def activation(g: torch.Tensor, u: torch.Tensor, act: ExpertAct) -> torch.Tensor:
    if act.kind == "clamped_swiglu":  # gpt-oss, as transformers' GptOssExperts._apply_gate
        g, u = g.clamp(max=act.limit), u.clamp(-act.limit, act.limit)
        return (u + 1) * (g * torch.sigmoid(g * act.alpha))
    if act.kind == "clamped_silu":  # DeepSeek-V4, as transformers' DeepseekV4Experts._apply_gate
        return F.silu(g.clamp(max=act.limit)) * u.clamp(-act.limit, act.limit)
    return F.silu(g) * u


class TorchMoELayer:
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: str = "bf16",
                 threads: int | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"the torch path supports formats {sorted(FORMATS)}, not {fmt!r}")
        dt = FORMATS[fmt]
        E, I, H = gate.shape
        if up.shape != (E, I, H) or down.shape != (E, H, I):
            raise ValueError(f"expert shapes disagree: gate {tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}")
        self.num_experts, self.intermediate, self.hidden = E, I, H
        self.gate_up = torch.cat([gate.to(dt), up.to(dt)], dim=1).contiguous()  # [E, 2I, H]
        self.down = down.to(dt).contiguous()                                       # [E, H, I]
        self.fmt = fmt
        self.act, self.biases = SILU, (None, None)

    @classmethod
    def from_packed(cls, gate_up: torch.Tensor, down: torch.Tensor, fmt: str) -> "TorchMoELayer":
        """Over weights laid out already (gate_up [E, 2I, H], down [E, H, I]) in the format's dtype, on any
        device (the GPU side's hot experts): the operator computes where its weights are."""
        self = cls.__new__(cls)
        self.num_experts, self.intermediate, self.hidden = down.shape[0], down.shape[2], down.shape[1]
        self.gate_up, self.down, self.fmt = gate_up, down, fmt
        self.act, self.biases = SILU, (None, None)
        return self

    def set_extras(self, act: ExpertAct = SILU, gate_up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None) -> "TorchMoELayer":
        """gpt-oss's experts: their activation, and biases [E, 2I] (gate then up) and [E, H]."""
        self.act = act
        self.biases = tuple(None if b is None else b.to(self.gate_up.dtype) for b in (gate_up_bias, down_bias))
        return self

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H]; topk_ids [T, k] int (-1: none); topk_weights [T, k] fp32 -> [T, H] in hidden.dtype."""
        T, k = topk_ids.shape
        out = torch.zeros(T, self.hidden, dtype=torch.float32, device=self.down.device)
        if T == 0 or k == 0:
            return out.to(hidden.dtype)
        x_all = hidden.to(self.down.device, self.gate_up.dtype)
        flat_ids = topk_ids.reshape(-1).long()
        order = torch.argsort(flat_ids, stable=True)
        start = int((flat_ids < 0).sum())  # id -1 (no expert: another shard's pair) sorts first and is skipped
        counts = torch.bincount(flat_ids[flat_ids >= 0], minlength=self.num_experts).tolist()
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            tok = sel // k
            x = x_all[tok]
            bgu, bdn = (None if b is None else b[e] for b in self.biases)
            g, u = F.linear(x, self.gate_up[e], bgu).chunk(2, dim=-1)
            y = F.linear(activation(g, u, self.act), self.down[e], bdn).float()
            out.index_add_(0, tok, y * topk_weights.reshape(-1)[sel, None].to(y.device, torch.float32))
        return out.to(hidden.dtype)
