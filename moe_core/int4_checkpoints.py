"""int4 checkpoints as they are published: compressed-tensors `pack-quantized` (Kimi-K2-Thinking's routed
experts: symmetric, groups of 32), GPTQ (groups, symmetric or not, `desc_act` with its `g_idx`) and AWQ
(GEMM packing, zero points, groups of 128). A quantized linear `X` is stored as several tensors (X.weight_packed
+ X.weight_scale + ...; X.qweight + X.qzeros + X.scales + ...); Checkpoint shows it as one weight `X.weight`.

Each is read into one form, Unpacked: the 4-bit codes q (0-15) [out, in], the zero point of each group
[out, groups] (8 for symmetric schemes), the scale of each group [out, groups] and the group of each input
column (g_idx; consecutive groups unless GPTQ's act-order). w = (q - zero) x scale. Consecutive groups run as
published: symmetric schemes on the int4g32 kernels (packing.Int4), zero points on the uint4g32 kernels
(packing.UInt4: w = scale x q - scale x zero); act-order groups are dequantized exactly.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from moe_core.errors import ModelConfigError

METHODS = ("compressed-tensors", "gptq", "awq")
# what a quantized linear X is stored as: its tensors' suffixes (the first names it), optional ones after "?"
PARTS = {"compressed-tensors": ("weight_packed", "weight_scale", "weight_shape", "?weight_zero_point", "?weight_g_idx"),
         "gptq": ("qweight", "qzeros", "scales", "?g_idx"),
         "awq": ("qweight", "qzeros", "scales")}
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ's GEMM packing: column j of 8 in an int32 sits at nibble AWQ_ORDER[j]


@dataclasses.dataclass(frozen=True)
class Int4Scheme:
    method: str
    group: int             # consecutive input columns per scale (-1: one group a row)
    symmetric: bool
    act_order: bool = False
    gptq_v1: bool = True   # GPTQ's original format stores zero points minus one


def _cfg_error(msg: str) -> ModelConfigError:
    return ModelConfigError(f"quantization_config: {msg}")


def int4_scheme(q: dict) -> Int4Scheme | None:
    """The int4 scheme a quantization_config describes (None: not one of METHODS); the variants not supported
    are refused here, naming them."""
    method = str(q.get("quant_method"))
    if method not in METHODS:
        return None
    if method == "compressed-tensors":
        if q.get("format") != "pack-quantized":
            raise _cfg_error(f"compressed-tensors format {q.get('format')!r} is not supported (pack-quantized int4)")
        groups = list((q.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if not weights or any(w != weights[0] for w in weights):
            raise _cfg_error("compressed-tensors: one weight scheme for every config group is supported")
        w = weights[0]
        if any(g.get("input_activations") for g in groups):
            raise _cfg_error("compressed-tensors with quantized input activations is not supported (weight-only)")
        if w.get("num_bits") != 4 or w.get("type", "int") != "int" or w.get("strategy") != "group":
            raise _cfg_error(f"compressed-tensors weights {w}: 4-bit int with strategy 'group' is supported")
        return Int4Scheme(method, int(w["group_size"]), bool(w.get("symmetric", True)),
                          act_order=w.get("actorder") not in (None, "static"))
    if int(q.get("bits", 0)) != 4:
        raise _cfg_error(f"{method} with bits {q.get('bits')!r} is not supported (4)")
    group = int(q.get("group_size", 128))
    if method == "awq":
        if str(q.get("version", "gemm")).lower() != "gemm":
            raise _cfg_error(f"awq version {q.get('version')!r} is not supported (gemm)")
        return Int4Scheme(method, group, symmetric=not q.get("zero_point", True))
    fmt = q.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _cfg_error(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return Int4Scheme(method, group, symmetric=bool(q.get("sym", True)), act_order=bool(q.get("desc_act", False)),
                      gptq_v1=fmt == "gptq")


def stored_parts(scheme: Int4Scheme) -> tuple[str, ...]:
    return PARTS[scheme.method]


def published_format(scheme: Int4Scheme) -> str | None:
    """The expert format that runs the scheme's weights as published: int4g32 (symmetric) or uint4g32 (zero
    points), for consecutive groups of a multiple of 32; None where they must be dequantized (act-order groups)."""
    if scheme.act_order or not (scheme.group <= 0 or scheme.group % 32 == 0):
        return None
    return "int4g32" if scheme.symmetric else "uint4g32"


@dataclasses.dataclass
class Unpacked:
    q: torch.Tensor       # uint8 [out, in], 0-15
    zero: torch.Tensor    # uint8 [out, groups]
    scale: torch.Tensor   # float32 [out, groups]
    g_idx: torch.Tensor   # int64 [in]: the group of each input column

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx
        return (self.q.float() - self.zero[:, g].float()) * self.scale[:, g]

    def symmetric_int4(self, group: int):  # group <= 0: one a row
        """As moe_kernels.formats.Int4 (values q - 8, a scale per group) where that is exact: every zero point 8,
        groups consecutive and a multiple of 32 long; else None."""
        from moe_kernels.formats import G32, Int4  # imported here: moe_kernels loads the native library
        n_in = self.q.shape[1]
        group = group if group > 0 else n_in
        if group % G32 or not bool((self.zero == 8).all()) or \
                not torch.equal(self.g_idx, torch.arange(n_in) // group):
            return None
        return Int4((self.q.to(torch.int16) - 8).to(torch.int8), self.scale, group)

    def uint4(self, group: int):  # group <= 0: one a row
        """As moe_kernels.formats.UInt4 (q, a scale and min = scale x zero per group: exact in fp32) where groups are
        consecutive and a multiple of 32 long; else None."""
        from moe_kernels.formats import G32, UInt4  # (as above)
        n_in = self.q.shape[1]
        group = group if group > 0 else n_in
        if group % G32 or not torch.equal(self.g_idx, torch.arange(n_in) // group):
            return None
        return UInt4(self.q, self.scale, self.scale * self.zero.float(), group)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> uint8 [..., 8n]: nibble j of each word at position 8i + j (little-endian)."""
    b = words.contiguous().view(torch.uint8)  # little-endian hosts
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(*words.shape[:-1], -1)


def unpack(scheme: Int4Scheme, get: Callable[[str], torch.Tensor | None], base: str) -> Unpacked:
    """The quantized linear `base` (its stored tensors read with get(suffix), None where absent)."""
    need = lambda s: _need(get, base, s)  # noqa: E731
    if scheme.method == "compressed-tensors":
        out, n_in = (int(v) for v in need("weight_shape").tolist())
        q = _nibbles(need("weight_packed").to(torch.int32))[:, :n_in]  # values + 8
        scale = need("weight_scale").float()
        zp = get("weight_zero_point")  # signed int4 + 8 too, packed along the output dimension
        zero = (_nibbles(zp.to(torch.int32).T.contiguous()).T[:out].contiguous() if zp is not None
                else torch.full(scale.shape, 8, dtype=torch.uint8))
        gi = get("weight_g_idx")
    elif scheme.method == "gptq":
        q = _nibbles(need("qweight").to(torch.int32).T.contiguous())  # [out, in]: packed along the input
        scale = need("scales").float().T.contiguous()                  # [out, groups]
        zero = _nibbles(need("qzeros").to(torch.int32)).T.contiguous()[:scale.shape[0]]
        zero = (zero.to(torch.int16) + (1 if scheme.gptq_v1 else 0)).to(torch.uint8)  # v1 stores zero - 1
        gi = get("g_idx")
    else:  # awq: packed along the output, columns in AWQ_ORDER within each word
        order = torch.tensor(AWQ_ORDER)
        raw = _nibbles(need("qweight").to(torch.int32))                 # [in, out] in packed order
        undo = (torch.arange(raw.shape[1]).view(-1, 8)[:, order]).reshape(-1)
        q = raw[:, undo].T.contiguous()
        zero = _nibbles(need("qzeros").to(torch.int32))[:, undo].T.contiguous()
        scale = need("scales").float().T.contiguous()
        gi = None
    n_in = q.shape[1]
    group = scheme.group if scheme.group > 0 else n_in
    g_idx = gi.long() if gi is not None else torch.arange(n_in) // group
    if scale.shape[0] != q.shape[0] or g_idx.shape != (n_in,) or int(g_idx.max()) >= scale.shape[1]:
        raise ModelConfigError(f"{base}: {scheme.method} tensors disagree (codes {list(q.shape)}, scales "
                               f"{list(scale.shape)}, groups of {group})")
    return Unpacked(q, zero, scale, g_idx)


def _need(get, base: str, suffix: str) -> torch.Tensor:
    t = get(suffix)
    if t is None:
        raise ModelConfigError(f"quantized weight {base!r} has no {base}.{suffix} beside it")
    return t
