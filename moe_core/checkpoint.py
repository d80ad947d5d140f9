"""Read-only, memory-mapped access to a checkpoint's safetensors shards.

One shard (model.safetensors) or several (model.safetensors.index.json). Tensors are read
one at a time from the mmap'ed files, never the whole checkpoint into Python objects.
FP8 block-quantized checkpoints (quantization_config fp8, as DeepSeek-V3 publishes them) are
dequantized here, one tensor at a time: get() returns e4m3 value x its block's `_scale_inv`
in float32, and names() lists the weights without their scale companions.
A vision-language checkpoint whose text model is served (Qwen3.5, Kimi-K2.5/K2.6) is seen as that text model: its
weights under the names a text model has (Qwen3.5's model.language_model.*, Kimi's language_model.model.* and
language_model.lm_head.*: config.TEXT_IN_WRAPPER), its vision tower and projector left out.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import re
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from moe_core import safetensors_check
from moe_core.config import ModelConfigError, fp8_block, text_weights
from moe_core.int4_checkpoints import int4_scheme, stored_parts, unpack
from moe_kernels.formats import Mx4

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale_inv"
# DeepSeek-V4 as published (no model. prefix, the hyper-head's and the attention's norm under their own names, an FP8 or
# FP4 weight's scale as X.scale) -> the names transformers saves it under, which the model reads: prefixes, then within
V4_PREFIXES = (("layers.", "model.layers."), ("embed.weight", "model.embed_tokens.weight"),
               ("norm.weight", "model.norm.weight"), ("hc_head_", "model.hc_head.hc_"))


def v4_name(stored: str) -> str:
    name = next((new + stored[len(old):] for old, new in V4_PREFIXES if stored.startswith(old)), stored)
    name = name.replace(".attn.kv_norm.", ".attn.norm.")
    return name[: -len(".scale")] + ".weight" + SCALE_SUFFIX if name.endswith(".scale") else name


# a routed expert's weight as transformers names it one expert at a time (fused experts are other names)
EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(gate|up|down|w1|w2|w3)(_proj)?\.weight$")


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [rows, cols] e4m3, scale_inv [ceil(rows/br), ceil(cols/bc)] fp32 -> w * scale of its block in
    fp32, rounded to `dtype` (edge blocks may be partial). One block row at a time: the result is the
    only full-size tensor made (a whole fp32 copy of an 18432 x 7168 MLP matrix is 528 MB)."""
    (rows, cols), (br, bc) = w.shape, block
    want = (-(-rows // br), -(-cols // bc))
    if w.dim() != 2 or tuple(scale_inv.shape) != want:
        raise ModelConfigError(f"fp8 weight of shape {list(w.shape)} with {list(block)} blocks needs scale_inv of "
                               f"shape {list(want)}, got {list(scale_inv.shape)}")
    out = torch.empty(rows, cols, dtype=dtype)
    s = scale_inv.float()
    for i in range(want[0]):
        r = slice(i * br, min(rows, (i + 1) * br))
        out[r] = w[r].float() * s[i].repeat_interleave(bc)[:cols]
    return out


class Checkpoint:
    def __init__(self, model_dir: str | pathlib.Path):
        self.dir = pathlib.Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        checked: set[str] = set()  # the files whose headers safetensors_check passed already
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ModelConfigError(f"no *.safetensors files in {self.dir}")
            weight_map = {}
            for f in files:
                safetensors_check.check(f)
                checked.add(f.name)
                with safe_open(f, framework="pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        cfg = self.dir / "config.json"
        raw = json.loads(cfg.read_text()) if cfg.exists() else {}
        self.stored: dict[str, str] = {}  # name used here -> name in the file, where they differ
        wrapped = text_weights(raw)
        if raw.get("model_type") == "deepseek_v4" and any(k.startswith("layers.") for k in weight_map):
            for k in list(weight_map):  # DeepSeek's own names
                if (ours := v4_name(k)) != k:
                    self.stored[ours] = k
                    weight_map[ours] = weight_map.pop(k)
        if wrapped:
            renames, dropped = wrapped
            for k in list(weight_map):
                ours = next((new + k[len(old):] for old, new in renames.items() if k.startswith(old)), None)
                if ours is not None:
                    self.stored[ours] = k
                    weight_map[ours] = weight_map.pop(k)
                elif k.startswith(dropped):  # the vision tower, the projector
                    del weight_map[k]
        self.weight_map: dict[str, str] = weight_map
        self.fp8_block = fp8_block(raw) if raw else None
        # int4 checkpoints: a quantized linear X stored as X.<parts> is the weight X.weight here
        self.int4 = int4_scheme(raw.get("quantization_config") or {}) if raw else None
        self.packed: dict[str, str] = {}  # X.weight -> X
        if self.int4 is not None:
            first = "." + stored_parts(self.int4)[0]
            self.packed = {k[: -len(first)] + ".weight": k[: -len(first)] for k in weight_map if k.endswith(first)}
        self._handles: dict[str, object] = {}
        self._checked = checked
        self._stack = contextlib.ExitStack()
        self._check_quantization_claim(raw.get("quantization_config") or {} if raw else {})

    def _check_quantization_claim(self, q: dict) -> None:
        """A checkpoint whose config claims a quantization its tensors do not have is refused: served, its plain
        weights would be requantized or read as what they are not."""
        experts = [n for n in self.weight_map if EXPERT_WEIGHT.search(n)]
        plain = experts[:3]
        if self.int4 is not None and (plain or not self.packed):
            parts = ", ".join(p.lstrip("?") for p in stored_parts(self.int4))
            where = f"its routed experts are stored as plain weights ({', '.join(plain)})" if plain else \
                "no tensor is stored as one"
            example = plain[0][: -len(".weight")] if plain else "a linear layer"
            raise ModelConfigError(f"{self.dir}: config.json's quantization_config claims {self.int4.method}, but "
                                   f"{where}: {example}.{{{parts}}} are missing")
        if self.fp8_block is not None and not any(n.endswith(SCALE_SUFFIX) for n in self.weight_map):
            raise ModelConfigError(f"{self.dir}: config.json's quantization_config claims fp8, but no tensor has its "
                                   f"{SCALE_SUFFIX} scales beside it ({(experts or sorted(self.weight_map))[0]} has none)")

    def _handle(self, fname: str):
        if fname not in self._handles:
            path = self.dir / fname
            if not path.exists():
                raise ModelConfigError(f"shard {path} named in the index is missing")
            if fname not in self._checked:
                safetensors_check.check(path)
                self._checked.add(fname)
            self._handles[fname] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[fname]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map or name in self.packed

    def tensors(self) -> list[str]:
        """Every tensor stored, scale companions included (the fingerprint hashes them all)."""
        return sorted(self.weight_map)

    def names(self, keep: Callable[[str], bool] = lambda n: True) -> Iterator[str]:
        """The model's weights (an FP8 weight's scale_inv is folded into it by get(); an int4 linear's stored
        parts are its one weight)."""
        every = sorted([n for n in self.weight_map if not self._is_part(n)] + list(self.packed))
        return (n for n in every if keep(n))

    def _is_part(self, name: str) -> bool:
        if self.fp8_block is not None and name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in self.weight_map:
            return True
        if self.packed:
            base, _, suffix = name.rpartition(".")
            return base + ".weight" in self.packed and any(p.lstrip("?") == suffix for p in stored_parts(self.int4))
        return False

    def _raw(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ModelConfigError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        return self._handle(self.weight_map[name]).get_tensor(self.stored.get(name, name))

    def get(self, name: str, fp8_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor as stored, an FP8 one dequantized to fp8_dtype, an int4 one dequantized to float32."""
        if name in self.packed:
            return self._unpacked(name).dequantize()
        t = self._raw(name)
        if t.dtype == torch.int8 and name + SCALE_SUFFIX in self.weight_map:  # DeepSeek-V4's FP4 experts
            return self._fp4(name, t).dequantize()
        if t.dtype not in FP8_DTYPES:
            return t
        return dequantize_fp8(t, self._raw(self._scale_of(name)), self.fp8_block, fp8_dtype)

    def _scale_of(self, name: str) -> str:
        """The scale_inv beside an FP8 tensor (errors where the checkpoint does not say how to read it)."""
        if self.fp8_block is None:
            raise ModelConfigError(f"tensor {name!r} is float8 but config.json has no fp8 quantization_config")
        if name + SCALE_SUFFIX not in self.weight_map:
            raise ModelConfigError(f"fp8 tensor {name!r} has no {name + SCALE_SUFFIX!r} beside it")
        return name + SCALE_SUFFIX

    def get_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An FP8 weight as published: (e4m3 values, float32 scale_inv per block); None for any other tensor (told
        from its header: callers read those with get(), once)."""
        if name not in self.weight_map or self.meta(name)[1] != "F8_E4M3":
            return None
        return self._raw(name), self._raw(self._scale_of(name)).float()

    def get_published(self, name: str, fmt: str):
        """An int4 weight as published where expert format `fmt` keeps it: int4g32 symmetric groups (packing.Int4),
        uint4g32 groups with zero points (packing.UInt4); None for any other tensor or format, or where act-order
        groups need the dequantized weight."""
        if fmt == "mxfp4" and name in self.weight_map and self.meta(name)[1] == "I8" and \
                name + SCALE_SUFFIX in self.weight_map:
            return self._fp4(name, self._raw(name))
        if name not in self.packed or fmt not in ("int4g32", "uint4g32"):
            return None
        u = self._unpacked(name)
        return u.symmetric_int4(self.int4.group) if fmt == "int4g32" else u.uint4(self.int4.group)

    def _fp4(self, name: str, t: torch.Tensor) -> Mx4:
        """DeepSeek-V4's FP4 weight: [rows, K/2] bytes of two e2m1 codes (the even element's low) and an e8m0 scale
        [rows, K/32] -> Mx4 (MXFP4's own numbers)."""
        s = self._raw(name + SCALE_SUFFIX)
        rows, half = t.shape
        if half % 16 or tuple(s.shape) != (rows, half // 16):
            raise ModelConfigError(f"fp4 tensor {name!r} of shape {list(t.shape)} needs a scale of shape "
                                   f"{[rows, half // 16]} (one per 32 values), got {list(s.shape)}")
        return Mx4.from_blocks(t.view(torch.uint8).view(rows, half // 16, 16), s.view(torch.uint8))

    def _unpacked(self, name: str):
        base = self.packed[name]
        return unpack(self.int4, lambda s: self._raw(f"{base}.{s}") if f"{base}.{s}" in self.weight_map else None, base)

    def get_row(self, name: str, i: int) -> torch.Tensor:
        """t[i] of a stored (not FP8) tensor t, reading only that slice (one expert of a fused tensor)."""
        if name not in self.weight_map:
            raise ModelConfigError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        return self._handle(self.weight_map[name]).get_slice(self.stored.get(name, name))[i]

    def meta(self, name: str) -> tuple[list[int], str]:
        s = self._handle(self.weight_map[name]).get_slice(self.stored.get(name, name))
        return list(s.get_shape()), s.get_dtype()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()
