"""Routed-expert operators. `MoELayer(gate, up, down, fmt, threads)` builds the best available
implementation for one model layer; all share forward / submit / wait.

Shapes: gate, up: [E, I, H]; down: [E, H, I]; hidden: [T, H]; topk_ids: [T, k] int32;
topk_weights: [T, k] fp32; out: [T, H] in hidden's dtype.
"""
from .torch_moe import TorchMoELayer

KERNEL_PATH = "torch"


def MoELayer(gate, up, down, fmt: str = "bf16", threads: int | None = None):
    return TorchMoELayer(gate, up, down, fmt=fmt, threads=threads)
