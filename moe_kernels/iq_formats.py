"""GGUF's grid types as stored (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): the file's bit fields (grid
indices, signs, sub-scales, the fp16 d) kept as the file has them, each field moved into the row-blocked order of the
other super-blocked formats (moe_kernels.row_blocks), so the resident bytes are the file's. native/kernels/gemm_iq.h
reads them: each 8 weights one grid entry (8 bytes, or two of 4), its signs, an odd integer sub-scale per 16 or 32 and
d per 256. The numbers are a matrix's blocks as the file has them (IqBlocks); what the kernels multiply is exactly the
gguf package's dequantization of those blocks (unpack rebuilds the blocks from the packed fields and dequantizes them
with it). No quantizer: these formats hold files, they are not made here (moe_core.gguf_model's covering formats
requantize where a user asks for another).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize

from moe_kernels.row_blocks import _deinterleave_rows, _interleave_rows

QK = 256  # a block's weights (GGUF's QK_K)
SUBS = 8  # the 32-weight groups a block's per-32 fields hold


class Spec(NamedTuple):
    """One type's block: its GGUF name, bytes a block, its per-32 fields (offset in the block, stride per 32, bytes)
    and its per-256 fields (offset, bytes), in the order the packed layout stores them (native/kernels/gemm_iq.h's
    IqLayout, which must agree)."""
    qtype: str
    size: int
    per32: tuple[tuple[int, int, int], ...]
    per256: tuple[tuple[int, int], ...]

    @property
    def data_bytes(self) -> int:  # packed data bytes a row's 256 weights
        return SUBS * sum(b for _, _, b in self.per32)

    @property
    def scale_bytes(self) -> int:  # packed scale bytes a row's 256 weights
        return sum(b for _, b in self.per256)


# ggml's block structs (ggml-common.h): d is the block's fp16 (IQ1_M: spread over its scales' top nibbles)
SPECS = {
    "iq2xxs": Spec("IQ2_XXS", 66, ((2, 8, 4), (6, 8, 4)), ((0, 2),)),  # 4 grid bytes; 4x7 sign bits + 4-bit scale
    "iq2xs": Spec("IQ2_XS", 74, ((2, 8, 8), (66, 1, 1)), ((0, 2),)),  # 4 uint16: 9-bit index + 7 sign bits; 2 scales
    "iq2s": Spec("IQ2_S", 82, ((2, 4, 4), (34, 4, 4), (66, 1, 1), (74, 1, 1)), ((0, 2),)),  # index low bytes, signs,
    # the indices' 2 high bits, 2 scales
    "iq3xxs": Spec("IQ3_XXS", 98, ((2, 8, 8), (66, 4, 4)), ((0, 2),)),  # 8 grid bytes (4 weights each); signs + scale
    "iq3s": Spec("IQ3_S", 110, ((2, 8, 8), (66, 1, 1), (74, 4, 4)), ((0, 2), (106, 4))),  # index low bytes, high bits,
    # signs; per 256 d and a 4-bit scale per 32
    "iq1s": Spec("IQ1_S", 50, ((2, 4, 4), (34, 2, 2)), ((0, 2),)),  # index low bytes; uint16: 4x3 high bits, scale, delta
    "iq1m": Spec("IQ1_M", 56, ((0, 4, 4), (32, 2, 2)), ((48, 8),)),  # index low bytes; 4 nibbles (3 high bits, delta
    # sign); per 256 the 16 3-bit scales and d
}
BY_QTYPE = {s.qtype: name for name, s in SPECS.items()}


class IqBlocks(NamedTuple):
    """A matrix [rows, K] of one grid type as the file stores it: blocks [rows, K / 256, the type's block bytes] uint8
    (each subclass is one type: its SPEC)."""
    blocks: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.blocks.shape[1] * QK))

    def dequantize(self) -> torch.Tensor:
        return _dequantize(self.blocks, type(self).SPEC)

    def rows(self, r0: int, r1: int) -> "IqBlocks":
        return type(self)(self.blocks[r0:r1])

    @classmethod
    def cat(cls, parts: list["IqBlocks"]) -> "IqBlocks":
        return cls(torch.cat([p.blocks for p in parts]))


def _dequantize(blocks: torch.Tensor, spec: Spec) -> torch.Tensor:
    """[..., n, size] blocks -> [..., n x 256] fp32 by the gguf package (ggml's dequantize_row_* in numpy)."""
    lead = blocks.shape[:-2]
    raw = np.ascontiguousarray(blocks.reshape(-1, blocks.shape[-2] * spec.size).cpu().numpy())
    out = dequantize(raw, GGMLQuantizationType[spec.qtype])
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(*lead, -1)


def _numbers_type(name: str) -> type:
    cls = type("".join(p.capitalize() for p in (name[:3], name[3:])), (IqBlocks,), {"__slots__": (), "SPEC": SPECS[name]})
    cls.__doc__ = f"GGUF's {SPECS[name].qtype} blocks as stored (IqBlocks)."
    return cls


NUMBERS = {name: _numbers_type(name) for name in SPECS}  # format name -> its numbers' type


def _positions(spec: Spec) -> list[torch.Tensor]:
    """Each per-32 field's byte positions in a block: [8, bytes]."""
    return [o + st * torch.arange(SUBS)[:, None] + torch.arange(b) for o, st, b in spec.per32]


def pack(w: IqBlocks, Kp: int) -> tuple:
    """A matrix's blocks -> (data, scale, None, None) in row blocks: per 256 the per-32 fields (each 8 chunks of the
    rows' bytes side by side), and apart the per-256 ones. The bytes are the file's, moved."""
    spec = type(w).SPEC
    R, n, size = w.blocks.shape
    if size != spec.size or n * QK != Kp:
        raise ValueError(f"{spec.qtype} matrix of {n} blocks of {size} bytes: this format needs rows of {Kp // QK} "
                         f"blocks of {spec.size} bytes (rows a multiple of {QK} wide)")
    b = w.blocks.to(torch.uint8)
    data = [b[:, :, pos] for pos in _positions(spec)]  # [R, n, 8, bytes]
    scale = [b[:, :, o:o + nb].unsqueeze(2) for o, nb in spec.per256]  # [R, n, 1, bytes]
    return _interleave_rows(*data), _interleave_rows(*scale), None, None


def blocks_of(packed: tuple, name: str) -> torch.Tensor:
    """pack undone: packed experts' (data, scale) [E, rows, ...] -> their blocks [E, rows, n, size]."""
    spec = SPECS[name]
    data, scale = packed[:2]
    n = data.shape[-1] // spec.data_bytes
    out = torch.zeros(*data.shape[:-1], n, spec.size, dtype=torch.uint8, device=data.device)
    fields = _deinterleave_rows(data, n, *((SUBS, b) for _, _, b in spec.per32))
    for pos, f in zip(_positions(spec), fields):
        out[..., pos.to(data.device)] = f
    for (o, nb), f in zip(spec.per256, _deinterleave_rows(scale, n, *((1, nb) for _, nb in spec.per256))):
        out[..., o:o + nb] = f[..., 0, :]
    return out


def unpacker(name: str):
    def unpack(packed: tuple, K: int) -> torch.Tensor:
        return _dequantize(blocks_of(packed, name).cpu(), SPECS[name])[..., :K].to(packed[0].device)
    return unpack


def layout(name: str):
    spec = SPECS[name]

    def lay(E: int, rows: int, Kp: int) -> tuple:
        n = Kp // QK
        return ((E, rows, n * spec.data_bytes), torch.uint8), ((E, rows, n * spec.scale_bytes), torch.uint8), None, None
    return lay


def quantizer(name: str):
    def refuse(w: torch.Tensor):
        raise ValueError(f"the {name} format holds GGUF {SPECS[name].qtype} matrices as stored; it does not quantize "
                         f"float weights (a {list(w.shape)} matrix of {w.dtype}): choose another --weight-format")
    return refuse


def bits(name: str) -> float:
    spec = SPECS[name]
    return 8 * (spec.data_bytes + spec.scale_bytes) / QK


def random_blocks(name: str, rows: int, n: int, gen: torch.Generator, d_scale: float = 1e-3) -> IqBlocks:
    """Random valid blocks (any grid index, sign and sub-scale; a finite positive d): what the tests feed the kernels
    (the gguf package dequantizes these types but does not quantize them)."""
    spec = SPECS[name]
    b = torch.randint(0, 256, (rows, n, spec.size), dtype=torch.uint8, generator=gen)
    d = (torch.rand(rows, n, generator=gen) * d_scale + d_scale / 4).to(torch.float16).view(torch.int16).to(torch.int32)
    if name == "iq1m":  # d's 16 bits in the top nibbles of the 4 uint16 scales
        sc = b[..., 48:56].clone().view(torch.int16).to(torch.int32) & 0x0FFF
        sc |= torch.stack([((d >> (4 * i)) & 15) << 12 for i in range(4)], -1)
        b[..., 48:56] = sc.to(torch.int16).view(torch.uint8).view(rows, n, 8)
    else:
        b[..., 0:2] = d.to(torch.int16).view(torch.uint8).view(rows, n, 2)
    return NUMBERS[name](b)
