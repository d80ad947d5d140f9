"""Decode attention on the native kernels (native/kernels/attention.cpp): one new query per head against a
sequence's KV cache (bf16, fp16 or fp32, or 8-bit rows: int8 / fp8 codes and a scale byte each, kv_quant.py, read
in place), fp32 scores and sums. For the GPU service's layers when it computes
on the CPU, where torch's small matmuls and softmax make this a large part of a decode step."""
from __future__ import annotations

import torch

from . import ISA, SIMD_ISAS, native
from .kv_quant import values

VECTOR_DIMS = (64, 128, 256, 512)  # head dims (keys' = values') with a vector kernel; others run its plain loops
VECTOR_PAIRS = ((192, 128),)  # (keys', values' dims) of unequal width with one: MiMo-V2-Flash's
# native/moe.h KvType; a pool of the last two holds 8-bit rows (kv_quant.py): its last dim is a row's values + 1
KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3, torch.float8_e4m3fn: 4}
DTYPES = tuple(KV_CODES)
INDEX_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)  # dsa_scores' keys


def vector_kernel(d: int, dv: int) -> bool:
    """Whether heads of d-wide keys and dv-wide values have a vector kernel (else the plain loops)."""
    return (d == dv and d in VECTOR_DIMS) or (d, dv) in VECTOR_PAIRS


def rounds_query(kv_dtype: torch.dtype, d: int, isa: str = ISA, dv: int | None = None) -> bool:
    """Whether decode attention over an int8 cache rounds each query head to int8 for its scores (the VNNI kernel of
    the AVX-512 paths, native/kernels/attention.cpp I8Query): then not the bits of a cache holding the values."""
    return (kv_dtype == torch.int8 and isa in ("avx512", "amx") and vector_kernel(d, d if dv is None else dv)
            and d != 512)  # (512: the AVX2-shape kernel)


def int8_query(q: torch.Tensor) -> torch.Tensor:
    """q [heads, d] as those scores read it: each head's codes round(q / s) at s = amax / 127, times s (fp32)."""
    qf = q.float()
    s = qf.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(qf * (1 / s)).clamp(-127, 127) * s


def supported(K: torch.Tensor, isa: str = ISA, V: torch.Tensor | None = None) -> bool:
    """Whether the native kernel takes this cache ([kv heads, positions, dim], or a paged pool layer [kv heads,
    blocks, block, dim]; V: its values where they are of another width) fast on this isa."""
    d = values(K.dtype, K.shape[-1])
    return (isa in SIMD_ISAS and K.dtype in DTYPES and K.device.type == "cpu" and K.stride(-1) == 1
            and vector_kernel(d, d if V is None else values(V.dtype, V.shape[-1])))


def _sinks(sinks: torch.Tensor | None, nh: int) -> tuple[torch.Tensor | None, int]:
    """Attention sinks as the kernel reads them: (the fp32 tensor to keep alive, its address or 0)."""
    if sinks is None:
        return None, 0
    s = sinks.float().contiguous()
    if tuple(s.shape) != (nh,):
        raise ValueError(f"attention sinks: one per query head ({nh}), got {list(sinks.shape)}")
    return s, s.data_ptr()


def any_dims(K: torch.Tensor, isa: str = ISA) -> bool:
    """Whether the native kernel takes this cache on this isa at all (its plain loops where no vector kernel has its
    head dims: supported() says where it is fast)."""
    return isa in SIMD_ISAS and K.dtype in DTYPES and K.device.type == "cpu" and K.stride(-1) == 1


def decode_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scale: float,
                     isa: str = ISA, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [nh, d] (any float dtype), K [nkv, L, d] and V [nkv, L, dv] fp32, bf16 or fp16 (unit stride along the head
    dim), or 8-bit rows [nkv, L, d + 1], [nkv, L, dv + 1] -> [nh, dv] fp32. sinks [nh]: each head's attention sink (a
    logit whose share is dropped), or None."""
    nh, d = q.shape
    nkv, L, _ = K.shape
    if K.dtype not in DTYPES or V.dtype != K.dtype or K.stride(-1) != 1 or V.stride(-1) != 1:
        raise ValueError("decode_attention: K and V must be of one of fp32, bf16, fp16, int8, fp8, unit stride along "
                         "the head dim")
    if V.shape[:2] != K.shape[:2] or nh % nkv or q.shape[1] != values(K.dtype, K.shape[2]):
        raise ValueError(f"decode_attention: q {list(q.shape)}, K {list(K.shape)}, V {list(V.shape)} do not fit")
    dv = values(V.dtype, V.shape[2])
    qf = q.float().contiguous()
    out = torch.empty(nh, dv)
    keep, sp = _sinks(sinks, nh)
    native.decode_attention(isa, qf.data_ptr(), nh, nkv, d, dv, K.data_ptr(), KV_CODES[K.dtype], K.stride(0),
                            K.stride(1), V.data_ptr(), V.stride(0), V.stride(1), L, scale, out.data_ptr(), sinks=sp)
    return out


# the paths whose prefill kernel beats torch's SDPA (bench_attention.py --prefill, Zen 5: avx512 bf16 2.5-4x, fp32
# 2-3x; Zen 3's avx2 (fp32) 1.8x at 512 positions, 1.0-1.1x at 2048-6000): the model prefills on it there
PREFILL_PATHS = ("avx512", "amx", "avx2", "avxvnni")


def prefill_supported(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, isa: str = ISA) -> bool:
    """Whether prefill_attention takes these on this isa: fp32, or bf16 on the AVX-512 paths (whose bf16 dot products
    it uses) and the portable loops, head dims multiples of 16, on the CPU."""
    dt = q.dtype
    return (q.device.type == "cpu" and K.dtype == dt and V.dtype == dt
            and (dt == torch.float32 or (dt == torch.bfloat16 and isa in ("avx512", "amx", "portable")))
            and q.shape[-1] % 16 == 0 and V.shape[-1] % 16 == 0)


def prefill_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, start: int, scale: float,
                      isa: str = ISA, window: int = 0, sinks: torch.Tensor | None = None, lo: int = 0) -> torch.Tensor:
    """Causal attention of a chunk's queries q [t, nh, d] at positions start .. start + t - 1 over K [nkv, start + t -
    lo, d] and V [nkv, start + t - lo, dv], the keys and values of positions lo .. (each query sees the keys up to its
    own position; window > 0: the last `window` of them, itself included, none before lo) -> [t, nh, dv] fp32. fp32 or
    bf16 (all three one dtype, prefill_supported). sinks: as decode_attention's."""
    t, nh, d = q.shape
    nkv, L, dv = V.shape
    if K.shape[:2] != (nkv, L) or K.shape[2] != d or L != start + t - lo or nh % nkv or window < 0 or \
            not 0 <= lo <= (max(0, start - window + 1) if window else 0):
        raise ValueError(f"prefill_attention: q {list(q.shape)}, K {list(K.shape)}, V {list(V.shape)} at start "
                         f"{start} from position {lo} (window {window}) do not fit")
    if not prefill_supported(q, K, V, isa):
        raise ValueError(f"prefill_attention: {q.dtype} with head dims {d}, {dv} on {isa} is not taken")
    q = q if q.stride(-1) == 1 else q.contiguous()
    K = K if K.stride(-1) == 1 else K.contiguous()
    V = V if V.stride(-1) == 1 else V.contiguous()
    out = torch.empty(t, nh, dv)
    keep, sp = _sinks(sinks, nh)
    native.prefill_attention(isa, q.data_ptr(), q.dtype == torch.bfloat16, t, nh, nkv, d, dv, q.stride(0),
                             q.stride(1), K.data_ptr(), K.stride(0), K.stride(1), V.data_ptr(), V.stride(0), V.stride(1),
                             start, scale, out.data_ptr(), lo, window, sp)
    return out


def paged_decode_attention(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, table: torch.Tensor, L: int,
                           scale: float, isa: str = ISA, first: int = -1,
                           selected: tuple[torch.Tensor, torch.Tensor] | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The same over a paged cache: K/V one layer of the pool, [nkv, blocks, block, d or dv] (gpu_service/engine/kv_pool.py),
    the sequence's positions 0..L-1 in blocks table[0], table[1], ... (int32, contiguous) -> [nh, dv] fp32. first >= 0:
    the blocks are first, first + 1, ... (a head's rows are then one strided matrix: read without the table).
    selected: (positions [nkv, n] int32, lengths [nkv] int32): kv head h reads positions[h, :lengths[h]] (ascending,
    below L) instead of all L (MiniMax-M3's block-sparse layers). sinks: as decode_attention's."""
    nh, d = q.shape
    nkv, _, B, _ = K.shape
    _check_pools("paged_decode_attention: K and V", K, V)
    if V.shape[:3] != K.shape[:3] or nh % nkv or d != values(K.dtype, K.shape[3]) or B & (B - 1):
        raise ValueError(f"paged_decode_attention: q {list(q.shape)}, K {list(K.shape)}, V {list(V.shape)} do not fit")
    _check_table("paged_decode_attention", table, B, L, first, K.shape[1])
    dv = values(V.dtype, V.shape[3])
    qf = q.float().contiguous()
    out = torch.empty(nh, dv)
    keep, sp = _sinks(sinks, nh)
    if selected is not None:
        pos, n = selected
        if pos.dtype != torch.int32 or n.dtype != torch.int32 or pos.dim() != 2 or pos.shape[0] != nkv or \
                tuple(n.shape) != (nkv,) or not pos.is_contiguous() or not n.is_contiguous() or \
                int(n.min()) < 1 or int(n.max()) > pos.shape[1] or int(pos.min()) < 0 or int(pos.max()) >= L:
            raise ValueError(f"paged_decode_attention: a selection is int32 positions [{nkv}, n] below {L} and "
                             f"1..n of them a kv head")
        native.decode_attention(isa, qf.data_ptr(), nh, nkv, d, dv, K.data_ptr(), KV_CODES[K.dtype], K.stride(0),
                                K.stride(2), V.data_ptr(), V.stride(0), V.stride(2), L, scale, out.data_ptr(),
                                table.data_ptr(), B.bit_length() - 1, K.stride(1), V.stride(1), pos.data_ptr(),
                                n.data_ptr(), pos.shape[1], sinks=sp)
        return out
    if first >= 0:
        size = K.element_size()
        native.decode_attention(isa, qf.data_ptr(), nh, nkv, d, dv, K.data_ptr() + first * K.stride(1) * size,
                                KV_CODES[K.dtype], K.stride(0), K.stride(2),
                                V.data_ptr() + first * V.stride(1) * size, V.stride(0), V.stride(2), L, scale,
                                out.data_ptr(), sinks=sp)
        return out
    native.decode_attention(isa, qf.data_ptr(), nh, nkv, d, dv, K.data_ptr(), KV_CODES[K.dtype], K.stride(0),
                            K.stride(2), V.data_ptr(), V.stride(0), V.stride(2), L, scale, out.data_ptr(),
                            table.data_ptr(), B.bit_length() - 1, K.stride(1), V.stride(1), sinks=sp)
    return out


def mla_supported(C: torch.Tensor, KPE: torch.Tensor, isa: str = ISA) -> bool:
    """Whether mla_paged_attention takes this layer of an MLA pool on this isa: a vector kernel for DeepSeek's dims
    (latent 512, rotary 64: V2, V3, Kimi K2), the plain loops for others (the small test and default models)."""
    return (isa in SIMD_ISAS and C.dtype in DTYPES and KPE.dtype == C.dtype and C.device.type == "cpu"
            and C.is_contiguous() and KPE.is_contiguous())


def mla_paged_attention(q: torch.Tensor, C: torch.Tensor, KPE: torch.Tensor, table: torch.Tensor, L: int, scale: float,
                        isa: str = ISA, first: int = -1, selected: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's decode attention in the latent space: q [nh, r + dr] (each head's absorbed latent query, then its rotary
    query; any float dtype) against one layer of an MLA pool, the latents C [blocks, block, r] and rotary keys KPE
    [blocks, block, dr] (fp32, bf16 or fp16, contiguous; gpu_service/engine/kv_pool.py), the sequence's positions 0..L-1 in
    blocks table[0], table[1], ... -> the heads' latent outputs [nh, r] fp32. first >= 0: the blocks are first,
    first + 1, ... (read without the table). selected: the positions (< L, int32) read instead of all L, DeepSeek
    Sparse Attention's (dsa_select)."""
    nh = q.shape[0]
    _, B, r = C.shape
    r, dr = values(C.dtype, r), values(KPE.dtype, KPE.shape[-1])
    _check_pools("mla_paged_attention: C and KPE", C, KPE)
    if q.dim() != 2 or q.shape[1] != r + dr or KPE.shape[:2] != C.shape[:2] or B & (B - 1):
        raise ValueError(f"mla_paged_attention: q {list(q.shape)}, C {list(C.shape)}, KPE {list(KPE.shape)} do not fit")
    _check_table("mla_paged_attention", table, B, L, first, C.shape[0])
    qf = q.float().contiguous()
    out = torch.empty(nh, r)
    if selected is not None:
        if selected.dtype != torch.int32 or selected.dim() != 1 or not selected.is_contiguous() or \
                not 0 < selected.numel() <= L or int(selected.min()) < 0 or int(selected.max()) >= L:
            raise ValueError(f"mla_paged_attention: selected must be 1..{L} int32 positions below {L}")
        native.mla_decode_attention(isa, qf.data_ptr(), nh, r, dr, C.data_ptr(), KPE.data_ptr(), KV_CODES[C.dtype],
                                    C.stride(1), KPE.stride(1), selected.numel(), scale, out.data_ptr(),
                                    table.data_ptr(), B.bit_length() - 1, C.stride(0), KPE.stride(0),
                                    selected.data_ptr())
        return out
    if first >= 0:
        native.mla_decode_attention(isa, qf.data_ptr(), nh, r, dr, C[first].data_ptr(), KPE[first].data_ptr(),
                                    KV_CODES[C.dtype], C.stride(1), KPE.stride(1), L, scale, out.data_ptr())
        return out
    native.mla_decode_attention(isa, qf.data_ptr(), nh, r, dr, C.data_ptr(), KPE.data_ptr(), KV_CODES[C.dtype],
                                C.stride(1), KPE.stride(1), L, scale, out.data_ptr(), table.data_ptr(),
                                B.bit_length() - 1, C.stride(0), KPE.stride(0))
    return out


def dsa_supported(K: torch.Tensor, isa: str = ISA) -> bool:
    """Whether dsa_select takes this layer's indexer keys (a pool buffer [blocks, block, D]) on this isa."""
    return (isa in SIMD_ISAS and K.dtype in INDEX_DTYPES and K.device.type == "cpu"
            and K.is_contiguous() and values(K.dtype, K.shape[-1]) <= 512)


def dsa_scores(q: torch.Tensor, w: torch.Tensor, K: torch.Tensor, table: torch.Tensor, L: int, scale: float,
               isa: str = ISA) -> torch.Tensor:
    """DeepSeek Sparse Attention's indexer scores at decode: q [H, D] (the indexer's rotated query heads), w [H] (their
    weights), K one layer's cached indexer keys [blocks, block, D] (fp32 or bf16, or 8-bit rows [.., D + 1]; each row
    contiguous, rows and blocks at any stride; DeepSeek-V4's CSA entries: its entry buffer of 4 rows a block), the
    sequence's positions (entries) 0..L-1 in blocks table[0], ... -> [L] fp32, sum over heads of
    w * relu(scale * q . k)."""
    H, D = q.shape
    _, B, _ = K.shape
    if K.dtype not in INDEX_DTYPES or K.stride(-1) != 1 or values(K.dtype, K.shape[-1]) != D or \
            tuple(w.shape) != (H,) or B & (B - 1):
        raise ValueError(f"dsa_scores: q {list(q.shape)}, w {list(w.shape)}, K {K.dtype} {list(K.shape)} do not fit")
    _check_table("dsa_scores", table, B, L, -1, K.shape[0])
    qf, wf = q.float().contiguous(), w.float().contiguous()
    out = torch.empty(L)
    native.dsa_index_scores(isa, qf.data_ptr(), wf.data_ptr(), H, D, scale, K.data_ptr(), KV_CODES[K.dtype],
                            K.stride(1), L, out.data_ptr(), table.data_ptr(), B.bit_length() - 1, K.stride(0))
    return out


def head_scores(q: torch.Tensor, K: torch.Tensor, table: torch.Tensor, L: int, isa: str = ISA) -> torch.Tensor:
    """MiniMax-M3's block indexer at decode: q [H, D] (its rotated query heads, H <= 64), K one layer's cached indexer
    keys [blocks, block, D] (fp32 or bf16, or 8-bit rows [.., D + 1]; contiguous), the sequence's positions 0..L-1 in
    blocks table[0], ... -> each head's q . k [H, L] fp32 (dsa_scores' kernel, without its weights and relu)."""
    H, D = q.shape
    _, B, _ = K.shape
    if K.dtype not in INDEX_DTYPES or not K.is_contiguous() or values(K.dtype, K.shape[-1]) != D or H > 64 or \
            B & (B - 1):
        raise ValueError(f"head_scores: q {list(q.shape)}, K {K.dtype} {list(K.shape)} do not fit")
    _check_table("head_scores", table, B, L, -1, K.shape[0])
    qf = q.float().contiguous()
    out = torch.empty(H, L)
    native.dsa_index_scores(isa, qf.data_ptr(), 0, H, D, 1.0, K.data_ptr(), KV_CODES[K.dtype], K.stride(1), L,
                            out.data_ptr(), table.data_ptr(), B.bit_length() - 1, K.stride(0))
    return out


def block_sparse_supported(K: torch.Tensor, keys: torch.Tensor, isa: str = ISA) -> bool:
    """Whether a MiniMax-M3 sparse layer's decode takes the native kernels: its K (or V) pool buffer and its indexer
    keys [blocks, block, D] on this isa (any head dims: the kernel's plain loops where it has no vector one)."""
    return (isa in SIMD_ISAS and K.dtype in DTYPES and K.is_contiguous() and K.device.type == "cpu"
            and dsa_supported(keys, isa))


def dsa_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The min(k, L) positions of scores [L] (fp32) first by score, ties to the earlier position, ascending (int32)."""
    s = scores.float().contiguous()
    if s.dim() != 1 or k < 1:
        raise ValueError(f"dsa_top_k: scores {list(s.shape)}, k {k}")
    out = torch.empty(min(k, s.numel()), dtype=torch.int32)
    n = native.dsa_top_k(s.data_ptr(), s.numel(), k, out.data_ptr())
    return out[:n]


def _check_pools(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype not in DTYPES or b.dtype != a.dtype or not a.is_contiguous() or not b.is_contiguous():
        raise ValueError(f"{what} must be pools of one of fp32, bf16, fp16, int8, fp8, contiguous")


def _check_table(what: str, table: torch.Tensor, B: int, L: int, first: int, blocks: int) -> None:
    """The sequence's L positions in its table's blocks of B, or (first >= 0) in the pool's blocks first.."""
    if table.dtype != torch.int32 or not table.is_contiguous() or table.numel() * B < L or L < 1:
        raise ValueError(f"{what}: {table.numel()} blocks of {B} do not hold {L} positions")
    if first >= 0 and first + -(-L // B) > blocks:
        raise ValueError(f"{what}: blocks {first}.. do not hold {L} positions")


def store_kv(x: torch.Tensor, out: torch.Tensor) -> None:
    """x, one row (bf16 or fp32, contiguous), into out (contiguous) as the native decode step stores a new K/V row:
    fp32, bf16 or fp16 (as many values) rounded as torch's .to(out.dtype), or int8 / fp8 (one more: the row's codes
    and scale byte) as kv_quant.quantize."""
    if x.dtype not in (torch.bfloat16, torch.float32) or out.dtype not in KV_CODES \
            or values(out.dtype, out.numel()) != x.numel() or not x.is_contiguous() or not out.is_contiguous():
        raise ValueError(f"store_kv: {x.dtype} {list(x.shape)} into {out.dtype} {list(out.shape)}")
    native.store_kv(KV_CODES[out.dtype], x.data_ptr(), x.dtype == torch.bfloat16, out.data_ptr(), x.numel())


def mla_absorb_q(q_nope: torch.Tensor, wkv: torch.Tensor, nh: int, dn: int, dv: int, isa: str = ISA) -> torch.Tensor:
    """MLA's latent query: q_nope [t, nh, dn] (any float dtype) times each head's W_uk, the first dn of its dn + dv
    rows of kv_b_proj's weight wkv [nh * (dn + dv), r] (bf16 or fp32, contiguous) -> q_lat [nh, t, r] fp32."""
    t = q_nope.shape[0]
    r = wkv.shape[1]
    _check_kv_b(wkv, nh, dn, dv)
    if tuple(q_nope.shape) != (t, nh, dn):
        raise ValueError(f"mla_absorb_q: q_nope {list(q_nope.shape)} is not [t, {nh}, {dn}]")
    qf = q_nope.float().contiguous()
    out = torch.empty(nh, t, r)
    native.mla_absorb_q(isa, wkv.data_ptr(), wkv.dtype == torch.bfloat16, nh, dn, dv, r, qf.data_ptr(), nh * dn, t,
                        out.data_ptr())
    return out


def mla_absorb_o(o_lat: torch.Tensor, wkv: torch.Tensor, nh: int, dn: int, dv: int, isa: str = ISA) -> torch.Tensor:
    """MLA's heads' output: o_lat [nh, t, r] (any float dtype) times each head's W_uv (the last dv of its rows of
    wkv), transposed -> [t, nh * dv] fp32."""
    r = wkv.shape[1]
    _check_kv_b(wkv, nh, dn, dv)
    if o_lat.dim() != 3 or o_lat.shape[0] != nh or o_lat.shape[2] != r:
        raise ValueError(f"mla_absorb_o: o_lat {list(o_lat.shape)} is not [{nh}, t, {r}]")
    t = o_lat.shape[1]
    of = o_lat.float().contiguous()
    out = torch.empty(t, nh * dv)
    native.mla_absorb_o(isa, wkv.data_ptr(), wkv.dtype == torch.bfloat16, nh, dn, dv, r, of.data_ptr(), t,
                        out.data_ptr())
    return out


def supports_kv_b(wkv, isa: str = ISA) -> bool:
    """Whether mla_absorb_* take this kv_b_proj weight (a plain bf16 or fp32 CPU tensor, contiguous)."""
    return isa in SIMD_ISAS and _plain_matrix(wkv)


def _plain_matrix(w) -> bool:
    return (isinstance(w, torch.Tensor) and w.dtype in DTYPES and w.device.type == "cpu" and w.is_contiguous()
            and w.dim() == 2)


def _check_kv_b(wkv: torch.Tensor, nh: int, dn: int, dv: int) -> None:
    if not _plain_matrix(wkv) or wkv.shape[0] != nh * (dn + dv):
        raise ValueError(f"MLA's kv_b_proj weight must be a contiguous bf16 or fp32 [{nh * (dn + dv)}, r] CPU tensor, "
                         f"not {wkv.dtype} {list(wkv.shape)}")
