"""How the routed experts are kept: the --weight-format policy and the packed-weight cache, shared by the expert
service and the GPU service's in-process and GPU-prefill experts."""
from __future__ import annotations

import pathlib

from moe_core import gguf_model
from moe_core.config import FP8_BLOCK, ModelConfig, ModelConfigError
from moe_core.int4_checkpoints import published_format
from moe_core.shards import Shard

from moe_experts import kernels, packed_cache


def weight_format(arg: str, cfg: ModelConfig) -> str:
    """auto: the checkpoint's own (published MXFP4 experts stay MXFP4, published FP8 stays FP8 where its blocks
    are the kernels' 128 x 128, int4 checkpoints stay int4g32 (symmetric) or uint4g32 (zero points); a GGUF's
    experts on the format that keeps their block types, or requantized to about their size:
    gguf_model.expert_format). fp8 / int4g32 / uint4g32 on a quantized checkpoint whose layout the kernels cannot
    keep is refused (ModelConfigError) rather than requantized."""
    keeps_fp8 = cfg.fp8_block == (FP8_BLOCK, FP8_BLOCK) and cfg.moe_intermediate_size % FP8_BLOCK == 0
    if arg == gguf_model.PER_MATRIX and not gguf_model.expert_format(cfg.gguf_expert_types):
        raise ModelConfigError(f"--weight-format {arg} keeps each routed-expert matrix of a GGUF file in the format of "
                               "its block type; this model has no quantized GGUF experts")
    if arg == "fp8" and cfg.fp8_block is not None and not keeps_fp8:
        raise ModelConfigError(
            f"--weight-format fp8 keeps published FP8 experts in {FP8_BLOCK} x {FP8_BLOCK} blocks with gate and up "
            f"stacked; this checkpoint has {list(cfg.fp8_block)} blocks and moe_intermediate_size "
            f"{cfg.moe_intermediate_size}: use --weight-format bf16 (exact) or int8")
    int4_fmt = published_format(cfg.int4) if cfg.int4 is not None else None
    keeps = {"int4g32": ("int4g32",), "uint4g32": ("int4g32", "uint4g32")}  # zero points of 8 are a symmetric scheme's
    if arg in keeps and cfg.int4 is not None and int4_fmt not in keeps[arg]:
        s = cfg.int4
        raise ModelConfigError(
            f"--weight-format {arg} keeps {'symmetric ' if arg == 'int4g32' else ''}int4 groups as published; this "
            f"{s.method} checkpoint has "
            f"{'act-order groups' if s.act_order else 'zero points' if not s.symmetric else 'groups of ' + str(s.group)}: "
            f"use {'--weight-format uint4g32 (its zero points kept) or ' if int4_fmt == 'uint4g32' else ''}"
            "--weight-format bf16 (its weights dequantized exactly) or int4")
    if arg != "auto":
        return arg
    if cfg.mxfp4_experts:
        return "mxfp4"
    if keeps_fp8 and kernels.native("fp8"):
        return "fp8"
    for fmt in (int4_fmt, gguf_model.expert_format(cfg.gguf_expert_types)):
        if fmt is not None and kernels.native(fmt):
            return fmt
    return {"bfloat16": "bf16", "float16": "fp16"}.get(cfg.torch_dtype, "fp32")


def open_cache(where: str, ckpt, fp: str, fmt: str, shard: Shard = Shard()) -> packed_cache.PackedCache | None:
    """The packed-weight cache for this model, format and shard (native formats only), or None when off."""
    if where in ("", "off") or kernels.kernel_path(fmt) == "torch":  # torch: not a native format, or none built
        return None
    return packed_cache.PackedCache(pathlib.Path(where).expanduser(), fp, packed_cache.source_stamp(ckpt), fmt,
                                    f"{shard.index}-of-{shard.count}" if shard.count > 1 else "")
