"""The operator that computes one MoE layer's hot experts on the GPU side (hot_experts.py), in the expert
service's numbers: on the CPU the same native kernels and weight format the expert service runs (the same
numbers up to summation order); on CUDA torch's matmuls over the format's values (packing.format_values;
exact for fp32 and bf16 experts, the quantized formats' values rounded once to bf16 there, 2 bytes a weight).

Local index i of the operator is global expert experts[i]. A refresh that keeps some experts copies their
packed weights from the previous operator instead of reading and packing them again.
"""
from __future__ import annotations

import torch

from moe_experts import kernels
from moe_experts.kernels.native_moe import NativeMoELayer
from moe_experts.kernels.torch_moe import FORMATS as TORCH_FORMATS, TorchMoELayer
from moe_experts.store import expert_biases, expert_weights
from moe_core.checkpoint import Checkpoint
from moe_core.config import SILU, ModelConfig
from moe_core.gguf_model import layer_formats
from moe_kernels.packing import floats, format_values, layout, pack_expert, row_len, stack_rows, store_expert


def torch_dtype(fmt: str, device: torch.device) -> torch.dtype | None:
    """The dtype the torch operator holds a format's weights in: None where the native kernels run them."""
    if device.type == "cpu" and kernels.native(fmt):
        return None
    return TORCH_FORMATS.get(fmt, torch.bfloat16)


def expert_bytes(cfg: ModelConfig, ckpt: Checkpoint, fmt: str, device: torch.device) -> int:
    """Bytes one routed expert takes in the hot operator (for --gpu-experts-gb), in its largest layer."""
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    dt = torch_dtype(fmt, device)
    if dt is not None:
        return 3 * I * H * dt.itemsize

    def one(gu: str, dn: str) -> int:
        parts = [*layout(gu, 1, 2 * I, row_len(H, gu)), *layout(dn, 1, H, row_len(I, dn))]
        return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in filter(None, parts))
    return max(one(*layer_formats(cfg, ckpt, L, fmt)) for L in cfg.moe_layers)


def hot_layer(cfg: ModelConfig, ckpt: Checkpoint, layer: int, experts: list[int], fmt: str, device: torch.device,
              threads: int, old=None):
    """-> the operator for `experts` of `layer` (forward(x, local ids, weights) -> [T, H]); `old`: (its
    experts, the operator) of the previous placement, whose experts are copied rather than loaded."""
    I, H, n = cfg.moe_intermediate_size, cfg.hidden_size, len(experts)
    kept = {e: j for j, e in enumerate(old[0])} if old is not None else {}
    dt = torch_dtype(fmt, device)
    fmts = gu_fmt, dn_fmt = layer_formats(cfg, ckpt, layer, fmt)
    if dt is None:
        op = NativeMoELayer.empty(n, I, H, gu_fmt, down_fmt=dn_fmt)
        for i, e in enumerate(experts):
            if e in kept:
                j = kept[e]
                store_expert(op.gu, i, tuple(t[j] if t is not None else None for t in old[1].gu))
                store_expert(op.dn, i, tuple(t[j] if t is not None else None for t in old[1].dn))
                continue
            g, u, d = expert_weights(cfg, ckpt, layer, e, fmts)
            store_expert(op.gu, i, pack_expert(stack_rows([g, u], gu_fmt), gu_fmt, op.Kp_h))
            store_expert(op.dn, i, pack_expert(d, dn_fmt, op.Kp_i))
        op.ready(threads)
    else:
        gate_up = torch.empty(n, 2 * I, H, dtype=dt, device=device)
        down = torch.empty(n, H, I, dtype=dt, device=device)
        values = lambda t, f: floats(t) if f in TORCH_FORMATS else format_values(t, f)  # noqa: E731
        for i, e in enumerate(experts):
            if e in kept:
                gate_up[i].copy_(old[1].gate_up[kept[e]])
                down[i].copy_(old[1].down[kept[e]])
                continue
            g, u, d = expert_weights(cfg, ckpt, layer, e, fmts)
            # quantized as one, as the kernels pack it (fp8 blocks)
            gate_up[i].copy_(values(stack_rows([g, u], gu_fmt), gu_fmt))
            down[i].copy_(values(d, dn_fmt))
        op = TorchMoELayer.from_packed(gate_up, down, fmt if fmt in TORCH_FORMATS else "bf16")
    ckpt.close()  # the mapped pages read for this layer leave the process's RSS
    if cfg.expert_bias or cfg.expert_act != SILU:
        gu_b, dn_b = expert_biases(cfg, ckpt, layer, experts)
        op.set_extras(cfg.expert_act, *(None if b is None else b.to(device) for b in (gu_b, dn_b)))
    return op
