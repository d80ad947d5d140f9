"""Routed-expert operators. `MoELayer(gate, up, down, fmt, threads)` builds the best available
implementation for one model layer; all share forward / submit / wait.

Shapes: gate, up: [E, I, H]; down: [E, H, I]; hidden: [T, H]; topk_ids: [T, k] int32;
topk_weights: [T, k] fp32; out: [T, H] in hidden's dtype.

The NATIVE_FORMATS (bf16, int8, int4, mxfp4, fp8, the grouped int formats and GGUF's block formats) run on the native
kernels (native/; path in NATIVE_ISA, forced with
MOE_KERNEL_PATH=portable|avx2|avxvnni|avx512|amx, or MOE_KERNEL_PATH=torch for the torch reference); fp32/fp16
weights use the torch operator. Where only the portable (plain C++) path runs and nothing forced it,
bf16 weights use torch too: its vectorized bf16 code beats ours there (on a Zen 3 before the AVX2
path: bf16 decode 0.31x torch); the quantized formats have no torch operator and stay native.
"""
import logging
import os

import torch

from moe_core.gguf_model import PER_MATRIX

from moe_experts.kernels.torch_moe import FORMATS as TORCH_DTYPES, TorchMoELayer

log = logging.getLogger("moe_experts.kernels")

try:
    if os.environ.get("MOE_KERNEL_PATH") == "torch":
        raise ImportError("MOE_KERNEL_PATH=torch")
    from moe_experts.kernels.native_moe import ISA as NATIVE_ISA, NativeMoELayer
    from moe_kernels.formats import NAMES as NATIVE_FORMATS  # the format table's (moe_kernels/formats.py)
except ImportError as e:  # extension not built: the torch path still serves
    log.warning("native kernels unavailable (%s); using the torch path", e)
    NATIVE_ISA, NativeMoELayer, NATIVE_FORMATS = None, None, ()


def native(fmt: str) -> bool:
    """Whether weights of this format run on the native kernels (PER_MATRIX: each matrix in a native format)."""
    if fmt == PER_MATRIX:
        return NativeMoELayer is not None
    if NativeMoELayer is None or fmt not in NATIVE_FORMATS:
        return False
    return not (fmt == "bf16" and NATIVE_ISA == "portable" and not os.environ.get("MOE_KERNEL_PATH"))


def kernel_path(fmt: str) -> str:
    return NATIVE_ISA if native(fmt) else "torch"


def MoELayer(gate, up, down, fmt: str = "bf16", threads: int | None = None):
    return MoELayerFromExperts(gate.shape[0], gate.shape[1], gate.shape[2], lambda e: (gate[e], up[e], down[e]),
                               fmt, threads)


def MoELayerFromExperts(E: int, I: int, H: int, load, fmt: str = "bf16", threads: int | None = None,
                        down_fmt: str | None = None):
    """The same operator, built expert by expert: load(e) -> (gate [I, H], up [I, H], down [H, I]), floats or
    published MXFP4, FP8 or int4 (packing.Mx4, packing.Fp8, packing.Int4). gpt-oss's activation and biases: the operator's set_extras."""
    if native(fmt) and native(down_fmt or fmt):
        return NativeMoELayer.from_experts(E, I, H, load, fmt=fmt, threads=threads, down_fmt=down_fmt)
    if down_fmt not in (None, fmt):  # gate/up and down in two formats: the native kernels only
        raise ValueError(f"experts in {fmt} (gate/up) and {down_fmt} (down) need the native kernels for both")
    if fmt in NATIVE_FORMATS and fmt != "bf16":
        raise ValueError(f"weight format {fmt} needs the native kernels, which are not built")
    if fmt not in TORCH_DTYPES:
        raise ValueError(f"unknown weight format {fmt!r} (native: {NATIVE_FORMATS}, torch: {tuple(TORCH_DTYPES)})")
    dt = TORCH_DTYPES[fmt]
    # cast as read (published MXFP4 dequantized): no full-precision copy of the layer
    parts = [tuple((t.dequantize() if hasattr(t, "dequantize") else t).to(dt) for t in load(e)) for e in range(E)]
    return TorchMoELayer(*(torch.stack([p[i] for p in parts]) for i in range(3)), fmt=fmt, threads=threads)
