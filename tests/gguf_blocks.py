"""Quantizers for the GGUF block types the gguf package can read but not write (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; the grid types as random valid blocks), so the tests
can write files of them: float rows [R, K] -> the raw blocks [R, K / block * bytes], laid out as llama.cpp writes
them. Simple first guesses of the scales (no search): the tests need the layout, not llama.cpp's error. Each
is checked against the gguf package's dequantizer (tests/core/test_gguf.py), which is what makes the layout right."""
from __future__ import annotations

import numpy as np

IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _f16(x: np.ndarray) -> np.ndarray:
    """[...] -> [..., 2] bytes of fp16."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def _pack_halves(q: np.ndarray) -> np.ndarray:
    """[..., 2n] codes -> [..., n] bytes: the first n in the low nibbles, the next n in the high ones."""
    n = q.shape[-1] // 2
    return (q[..., :n] | (q[..., n:] << 4)).astype(np.uint8)


def _nearest_code(v: np.ndarray) -> np.ndarray:
    return np.abs(v[..., None] - IQ4NL).argmin(-1).astype(np.uint8)


def _grid_scale(x: np.ndarray) -> np.ndarray:
    """Per row of x [..., 32]: the scale putting its largest magnitude on the grid's end (-127)."""
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    return peak / -127.0


def _min_quant(sub: np.ndarray, top: int, smax: int) -> tuple:
    """Sub-blocks [R, n, subs, size] on 0..top with a min <= 0, their scales and mins on 0..smax under each super-block's
    fp16 d and dmin -> d, dmin [R, n] (fp16), sc, mn [R, n, subs] and q [R, n, subs, size] (uint8)."""
    lo = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - lo) / top, -lo
    d = (scale.max(-1) / smax).astype(np.float16)
    dmin = (mins.max(-1) / smax).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[..., None] > 0, np.round(scale / d.astype(np.float32)[..., None]), 0).clip(0, smax).astype(np.uint8)
        mn = np.where(dmin[..., None] > 0, np.round(mins / dmin.astype(np.float32)[..., None]), 0).clip(0, smax).astype(np.uint8)
        s = d.astype(np.float32)[..., None] * sc
        m = dmin.astype(np.float32)[..., None] * mn
        q = np.where(s[..., None] > 0, np.round((sub + m[..., None]) / s[..., None]), 0).clip(0, top).astype(np.uint8)
    return d, dmin, sc, mn, q


def _k_quant(x: np.ndarray, top: int) -> tuple:
    """Q4_K's and Q5_K's numbers: per 256 fp16 d, dmin and their 12 bytes of 6-bit scales and mins (16 bytes), and q
    [R, n, 8, 32] in 0..top."""
    R, K = x.shape
    d, dmin, sc, mn, q = _min_quant(x.astype(np.float32).reshape(R, K // 256, 8, 32), top, 63)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1).astype(np.uint8)
    return np.concatenate([_f16(d), _f16(dmin), packed], axis=-1), q


def q4_k(x: np.ndarray) -> np.ndarray:
    """144 bytes per 256: fp16 d, dmin; 12 bytes of 6-bit scales and mins; 128 bytes of nibbles."""
    R, K = x.shape
    head, q = _k_quant(x, 15)
    qs = _pack_halves(q.reshape(R, K // 256, 4, 64)).reshape(R, K // 256, 128)
    return np.concatenate([head, qs], axis=-1).reshape(R, -1)


def q5_k(x: np.ndarray) -> np.ndarray:
    """176 bytes per 256: Q4_K's 16 bytes of d, dmin, scales and mins; 32 bytes of high bits (bit s of byte l: the 5th
    bit of sub-block s's weight l); Q4_K's 128 bytes of low nibbles."""
    R, K = x.shape
    head, q = _k_quant(x, 31)
    qh = sum(((q[..., s, :] >> 4) & 1) << s for s in range(8)).astype(np.uint8)  # [R, n, 32]
    qs = _pack_halves((q & 15).reshape(R, K // 256, 4, 64)).reshape(R, K // 256, 128)
    return np.concatenate([head, qh, qs], axis=-1).reshape(R, -1)


def iq4_nl(x: np.ndarray) -> np.ndarray:
    """18 bytes per 32: fp16 d, 16 bytes of grid codes."""
    R, K = x.shape
    blocks = x.astype(np.float32).reshape(R, K // 32, 32)
    d = _grid_scale(blocks).astype(np.float16)
    df = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = _nearest_code(np.where(df[..., None] != 0, blocks / df[..., None], 0))
    return np.concatenate([_f16(d), _pack_halves(codes)], axis=-1).reshape(R, -1)


def iq4_xs(x: np.ndarray) -> np.ndarray:
    """136 bytes per 256: fp16 d, uint16 of the 8 sub-scales' high 2 bits, 4 bytes of their low 4 bits, 128 bytes of
    grid codes (16 per sub-block of 32); sub-block j's scale is d (ls_j - 32)."""
    R, K = x.shape
    sub = x.astype(np.float32).reshape(R, K // 256, 8, 32)
    want = _grid_scale(sub)                                     # [R, n, 8]
    d = (np.abs(want).max(-1) / 32).astype(np.float16)
    df = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = (np.where(df[..., None] > 0, np.round(want / df[..., None]), 0).clip(-32, 31) + 32).astype(np.uint16)
        s = df[..., None] * (ls.astype(np.float32) - 32)
        codes = _nearest_code(np.where(s[..., None] != 0, sub / s[..., None], 0))
    high = np.zeros(ls.shape[:-1], dtype=np.uint16)
    for j in range(8):
        high |= (ls[..., j] >> 4) << (2 * j)
    low = ((ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)).astype(np.uint8)
    high_b = np.ascontiguousarray(high).view(np.uint8).reshape(*high.shape, 2)
    qs = _pack_halves(codes).reshape(R, K // 256, 128)
    return np.concatenate([_f16(d), high_b, low, qs], axis=-1).reshape(R, -1)


def q6_k(x: np.ndarray) -> np.ndarray:
    """210 bytes per 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sub-scales, fp16 d. Per 128 weights
    (32k + l: k < 4, l < 32): nibble byte l (k = 0, 2) or 32 + l (k = 1, 3), low (k < 2) or high; pair k of byte l."""
    R, K = x.shape
    sub = x.astype(np.float32).reshape(R, K // 256, 16, 16)
    want = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0] / -32.0  # each 16's peak on -32
    d = (np.abs(want).max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df[..., None] > 0, np.round(want / df[..., None]), 0).clip(-128, 127).astype(np.int8)
        s = df[..., None] * sc.astype(np.float32)
        q = np.where(s[..., None] != 0, np.round(sub / s[..., None]), 0).clip(-32, 31)
    u = (q + 32).astype(np.uint8).reshape(R, K // 256, 2, 4, 32)  # [.., half, k, l]
    ql = np.concatenate([u[..., 0, :] & 15 | (u[..., 2, :] & 15) << 4, u[..., 1, :] & 15 | (u[..., 3, :] & 15) << 4], -1)
    qh = sum((u[..., k, :] >> 4) << (2 * k) for k in range(4)).astype(np.uint8)
    return np.concatenate([ql.reshape(R, K // 256, 128), qh.reshape(R, K // 256, 64), sc.view(np.uint8), _f16(d)],
                          axis=-1).reshape(R, -1)


def q2_k(x: np.ndarray) -> np.ndarray:
    """84 bytes per 256: 16 bytes of sc | m << 4 (4 bits each, one per 16), 64 of bit pairs, fp16 d, fp16 dmin. Weight
    128 h + 32 j + l (h < 2, j < 4, l < 32): pair j of byte 32 h + l; w = d sc q - dmin m with its 16's sc and m."""
    R, K = x.shape
    d, dmin, sc, mn, q = _min_quant(x.astype(np.float32).reshape(R, K // 256, 16, 16), 3, 15)
    u = q.reshape(R, K // 256, 2, 4, 32)  # [.., h, j, l]
    qs = sum(u[..., j, :] << (2 * j) for j in range(4)).astype(np.uint8).reshape(R, K // 256, 64)
    return np.concatenate([sc | (mn << 4), qs, _f16(d), _f16(dmin)], axis=-1).reshape(R, -1)


def q3_k(x: np.ndarray) -> np.ndarray:
    """110 bytes per 256: 32 bytes of high bits, 64 of low bit pairs, 12 of the 16 6-bit scales, fp16 d. Weight
    128 h + 32 j + l (h < 2, j < 4, l < 32): pair j of byte 32 h + l, high bit 4 h + j of byte l; its 16's scale
    d (sc - 32); sc j < 8 in byte j's low nibble, j >= 8 in byte j - 8's high one, its top 2 bits in byte 8 + j % 4."""
    R, K = x.shape
    sub = x.astype(np.float32).reshape(R, K // 256, 16, 16)
    want = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0] / -4.0  # each 16's peak on -4
    d = (np.abs(want).max(-1) / 32).astype(np.float16)
    df = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df[..., None] > 0, np.round(want / df[..., None]), 0).clip(-32, 31)
        s = df[..., None] * sc
        q = np.where(s[..., None] != 0, np.round(sub / s[..., None]), 0).clip(-4, 3)
    u = (q + 4).astype(np.uint8).reshape(R, K // 256, 2, 4, 32)  # [.., h, j, l]
    qs = sum((u[..., j, :] & 3) << (2 * j) for j in range(4)).astype(np.uint8).reshape(R, K // 256, 64)
    hm = sum(((u[:, :, h, j, :] >> 2) & 1) << (4 * h + j) for h in range(2) for j in range(4)).astype(np.uint8)
    sv = (sc + 32).astype(np.uint8)  # [R, n, 16]
    packed = np.concatenate([(sv[..., 0:8] & 15) | ((sv[..., 8:16] & 15) << 4),
                             sum((sv[..., 4 * k:4 * k + 4] >> 4) << (2 * k) for k in range(4)).astype(np.uint8)], -1)
    return np.concatenate([hm, qs, packed.astype(np.uint8), _f16(d)], axis=-1).reshape(R, -1)


def random_iq(qtype: str):
    """The grid types (IQ1_S ... IQ3_S): nothing here quantizes them (llama-quantize searches their grids with an
    importance matrix), so x [R, K] becomes random valid blocks of its shape, seeded by its values, d scaled so that
    the weights have x's spread."""
    import torch
    from moe_kernels import iq_formats

    def encode(x: np.ndarray) -> np.ndarray:
        name, (R, K) = iq_formats.BY_QTYPE[qtype], x.shape
        seed = int(np.abs(x).sum() * 1e4) % (2**31)
        one = iq_formats.random_blocks(name, R, K // 256, torch.Generator().manual_seed(seed), d_scale=1.0)
        scale = float(np.std(x)) / float(one.dequantize().std())
        w = iq_formats.random_blocks(name, R, K // 256, torch.Generator().manual_seed(seed), d_scale=scale)
        return w.blocks.reshape(R, -1).numpy()
    return encode


ENCODERS = {"Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k, "IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs,
            **{t: random_iq(t) for t in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")}}


def quantize(x: np.ndarray, qtype) -> np.ndarray:
    """gguf.quants.quantize for every type: ours where the package has no quantizer. x [..., K] -> raw bytes."""
    import gguf
    name = qtype.name if hasattr(qtype, "name") else str(qtype)
    if name not in ENCODERS:
        return gguf.quants.quantize(x, qtype)
    lead = x.shape[:-1]
    return ENCODERS[name](x.reshape(-1, x.shape[-1])).reshape(*lead, -1)
