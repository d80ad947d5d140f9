"""Decode attention kernels (native/kernels/attention.cpp through moe_kernels.attention) against float64 references: every
vector path this CPU runs and the portable loops; contiguous and paged caches, MLA's latent attention and its absorbed
products, each kv head's selection (MiniMax-M3's block-sparse layers), the K/V stores' rounding."""
import pytest
import torch

native = pytest.importorskip("moe_kernels._native", reason="native extension not built")

ATTN_PATHS = [p for p in ("portable", "avx2", "avx512") if native.isa_supported(p)]


def attention_reference(q, K, V, scale, sinks=None):
    """float64: softmax(q K^T scale) V per kv head's query group; sinks [nh]: one more logit per head in its softmax,
    whose share is dropped (transformers' eager attention with s_aux)."""
    nkv, L, d = K.shape
    qg = q.double().view(nkv, -1, d)
    s = qg @ K.double().transpose(1, 2) * scale
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(nkv, -1, 1)], dim=-1)
    s = torch.softmax(s, dim=-1)[..., :L]
    return (s @ V.double()).reshape(q.shape[0], V.shape[-1])


@pytest.mark.parametrize("isa", ATTN_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256, 80])  # 80: no vector kernel, the plain loops on every isa
@pytest.mark.parametrize("nh, nkv", [(4, 4), (24, 4), (12, 1), (20, 2)])  # groups of 1, 6, 12, 10 query heads
@pytest.mark.parametrize("L", [1, 17, 301])
def test_decode_attention_matches_reference(isa, dtype, d, nh, nkv, L):
    from moe_kernels.attention import decode_attention

    # K and V as the KV cache holds them: views of the first L positions of a larger buffer
    K = torch.randn(nkv, L + 37, d).to(dtype)[:, :L]
    V = torch.randn(nkv, L + 37, d).to(dtype)[:, :L]
    q = (torch.randn(nh, d) * 2).to(dtype)  # sharp enough that the softmax is not flat
    got = decode_attention(q, K, V, d ** -0.5, isa)
    want = attention_reference(q, K, V, d ** -0.5)
    assert got.dtype == torch.float32 and got.shape == (nh, d)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", ATTN_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("d, nh, nkv", [(64, 8, 1), (512, 12, 1), (128, 20, 2), (80, 6, 3)])
@pytest.mark.parametrize("L", [1, 17, 301])
def test_decode_attention_with_sinks(isa, dtype, d, nh, nkv, L):
    """Each head's attention sink (gpt-oss, MiMo, DeepSeek-V4 with its one 512-wide head): one more logit in its
    softmax whose share is dropped, contiguous and paged through scattered blocks and over a selection, the sinks of
    every size against the scores (one far above them: the values all but vanish)."""
    from moe_kernels import kv_quant
    from moe_kernels.attention import decode_attention, int8_query, paged_decode_attention, rounds_query

    torch.manual_seed(L + d + nh)
    B, nblocks = 16, -(-L // 16)
    x = torch.randn(2, nkv, nblocks + 3, B, d)
    if kv_quant.quantized(dtype):
        pool = kv_quant.quantize(x, dtype).view(dtype)
        x = kv_quant.dequantize(pool.view(torch.uint8), dtype, torch.float32)
    else:
        pool = x = x.to(dtype)
    table = torch.randperm(nblocks + 3)[:nblocks].to(torch.int32)
    K, V = (y[:, table.long()].reshape(nkv, nblocks * B, d)[:, :L] for y in x)
    q = torch.randn(nh, d) * 2
    sinks = torch.randn(nh) * 3
    sinks[0] = 40.0
    qr = int8_query(q) if rounds_query(dtype, d, isa) else q
    want = attention_reference(qr, K.float(), V.float(), d ** -0.5, sinks)
    got = paged_decode_attention(q, pool[0], pool[1], table, L, d ** -0.5, isa, sinks=sinks)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    if not kv_quant.quantized(dtype):
        got = decode_attention(q, K.contiguous(), V.contiguous(), d ** -0.5, isa, sinks=sinks)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    keep = torch.arange(0, L, 3, dtype=torch.int32)
    sel = (keep.expand(nkv, -1).contiguous(), torch.full((nkv,), keep.numel(), dtype=torch.int32))
    got = paged_decode_attention(q, pool[0], pool[1], table, L, d ** -0.5, isa, selected=sel, sinks=sinks)
    want = attention_reference(qr, K.float()[:, keep.long()], V.float()[:, keep.long()], d ** -0.5, sinks)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(q, pool[0], pool[1], table, L, d ** -0.5, isa, sinks=sinks[:-1])


@pytest.mark.parametrize("isa", ATTN_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("d, dv", [(192, 128), (24, 16)])  # MiMo-V2-Flash's (its vector kernel), its tiny model's
@pytest.mark.parametrize("nh, nkv", [(8, 1), (16, 2), (12, 4)])
@pytest.mark.parametrize("L", [1, 17, 301])
def test_values_narrower_than_keys(isa, dtype, d, dv, nh, nkv, L):
    """MiMo-V2-Flash's heads: keys of d, values of dv dims; with and without sinks, paged through scattered blocks,
    consecutive blocks, contiguous, and over a window's selection; 8-bit pools read in place (each row's scale byte
    after its own width)."""
    from moe_kernels import kv_quant
    from moe_kernels.attention import decode_attention, int8_query, paged_decode_attention, rounds_query

    torch.manual_seed(L + d + nh)
    B, nblocks = 16, -(-L // 16)
    xk, xv = torch.randn(nkv, nblocks + 3, B, d), torch.randn(nkv, nblocks + 3, B, dv)
    if kv_quant.quantized(dtype):
        pk, pv = (kv_quant.quantize(x, dtype).view(dtype) for x in (xk, xv))
        xk, xv = (kv_quant.dequantize(p.view(torch.uint8), dtype, torch.float32) for p in (pk, pv))
    else:
        pk, pv = xk, xv = xk.to(dtype), xv.to(dtype)
    table = torch.randperm(nblocks + 3)[:nblocks].to(torch.int32)
    K, V = (x[:, table.long()].reshape(nkv, nblocks * B, -1)[:, :L] for x in (xk, xv))
    q = torch.randn(nh, d) * 2
    qr = int8_query(q) if rounds_query(dtype, d, isa, dv) else q
    for sinks in (None, torch.randn(nh) * 3):
        want = attention_reference(qr, K.float(), V.float(), d ** -0.5, sinks)
        got = paged_decode_attention(q, pk, pv, table, L, d ** -0.5, isa, sinks=sinks)
        assert got.shape == (nh, dv)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
        first = [y[:, 2:2 + nblocks].reshape(nkv, -1, y.shape[-1])[:, :L].float() for y in (xk, xv)]
        got = paged_decode_attention(q, pk, pv, table, L, d ** -0.5, isa, first=2, sinks=sinks)
        torch.testing.assert_close(got.double(), attention_reference(qr, *first, d ** -0.5, sinks), rtol=1e-4, atol=1e-5)
        if not kv_quant.quantized(dtype):
            got = decode_attention(q, K.contiguous(), V.contiguous(), d ** -0.5, isa, sinks=sinks)
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
        keep = torch.arange(max(0, L - 5), L, dtype=torch.int32)  # a window of 5 (MiMo's sliding layers)
        sel = (keep.expand(nkv, -1).contiguous(), torch.full((nkv,), keep.numel(), dtype=torch.int32))
        got = paged_decode_attention(q, pk, pv, table, L, d ** -0.5, isa, selected=sel, sinks=sinks)
        want = attention_reference(qr, K.float()[:, keep.long()], V.float()[:, keep.long()], d ** -0.5, sinks)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", ATTN_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("d, nh, nkv", [(128, 16, 4), (16, 4, 2), (80, 6, 3)])
@pytest.mark.parametrize("L", [1, 40, 301])
def test_paged_decode_attention_over_each_kv_heads_selection(isa, dtype, d, nh, nkv, L):
    """MiniMax-M3's block-sparse decode: kv head h reads only positions[h, :lengths[h]] (its own count each) of a paged
    pool, scattered blocks; an 8-bit pool's rows in place as their dequantized values."""
    from moe_kernels import kv_quant
    from moe_kernels.attention import int8_query, paged_decode_attention, rounds_query

    B, nblocks = 16, -(-L // 16)
    torch.manual_seed(L + d)
    x = torch.randn(2, nkv, nblocks + 5, B, d)
    if kv_quant.quantized(dtype):
        pool = kv_quant.quantize(x, dtype).view(dtype)
        x = kv_quant.dequantize(pool.view(torch.uint8), dtype, torch.float32)
    else:
        pool = x = x.to(dtype)
    table = torch.randperm(nblocks + 5)[:nblocks].to(torch.int32)
    K, V = (y[:, table.long()].reshape(nkv, nblocks * B, d)[:, :L].double() for y in x)   # the sequence's rows
    n = torch.randint(1, L + 1, (nkv,), dtype=torch.int32)
    width = int(n.max())
    pos = torch.stack([torch.sort(torch.randperm(L)[:width]).values for _ in range(nkv)]).to(torch.int32)
    q = torch.randn(nh, d) * 2
    got = paged_decode_attention(q, pool[0], pool[1], table, L, d ** -0.5, isa, selected=(pos, n))
    if rounds_query(dtype, d, isa):  # (int8 on the VNNI scores: each query head rounded to int8)
        q = int8_query(q)
    g = nh // nkv
    for h in range(nkv):
        keep = pos[h, :n[h]].long()
        want = attention_reference(q[h * g:(h + 1) * g], K[h:h + 1, keep], V[h:h + 1, keep], d ** -0.5)
        torch.testing.assert_close(got[h * g:(h + 1) * g].double(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="selection"):
        paged_decode_attention(q, pool[0], pool[1], table, L, d ** -0.5, isa, selected=(pos + L, n))


@pytest.mark.parametrize("isa", ATTN_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d, nh, nkv", [(64, 24, 4), (128, 12, 1), (80, 4, 2)])
@pytest.mark.parametrize("L, B", [(1, 16), (16, 16), (301, 16), (77, 4)])
def test_paged_decode_attention_matches_reference(isa, dtype, d, nh, nkv, L, B):
    """Positions in scattered blocks of a pool (gpu_service/engine/kv_pool.py's layout), read through the block table."""
    from moe_kernels.attention import paged_decode_attention

    nblocks = -(-L // B)
    pool_k = torch.randn(nkv, nblocks + 9, B, d).to(dtype)
    pool_v = torch.randn(nkv, nblocks + 9, B, d).to(dtype)
    table = torch.randperm(nblocks + 9)[:nblocks].to(torch.int32)
    # the sequence as one buffer: its blocks in table order, [kv, positions, d]
    K = pool_k[:, table.long()].reshape(nkv, nblocks * B, d)[:, :L]
    V = pool_v[:, table.long()].reshape(nkv, nblocks * B, d)[:, :L]
    q = (torch.randn(nh, d) * 2).to(dtype)
    got = paged_decode_attention(q, pool_k, pool_v, table, L, d ** -0.5, isa)
    torch.testing.assert_close(got.double(), attention_reference(q, K, V, d ** -0.5), rtol=1e-4, atol=1e-5)
    # consecutive blocks, read without the table
    K, V = pool_k[:, 3:3 + nblocks].reshape(nkv, -1, d)[:, :L], pool_v[:, 3:3 + nblocks].reshape(nkv, -1, d)[:, :L]
    got = paged_decode_attention(q, pool_k, pool_v, table, L, d ** -0.5, isa, first=3)
    torch.testing.assert_close(got.double(), attention_reference(q, K, V, d ** -0.5), rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("isa", ATTN_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_attention_bits_do_not_depend_on_the_v_prefetch(isa, dtype):
    """V fetched into L2 during the scores (none, part of it, all of it): the same bits, paged or not."""
    from moe_kernels.attention import decode_attention, paged_decode_attention

    nkv, nh, d, L, B = 4, 32, 128, 301, 16
    nb = -(-L // B)
    pool_k, pool_v = (torch.randn(nkv, nb + 5, B, d).to(dtype) for _ in range(2))
    table = torch.randperm(nb + 5)[:nb].to(torch.int32)
    K, V = (torch.randn(nkv, L, d).to(dtype) for _ in range(2))
    q = (torch.randn(nh, d) * 2).to(dtype)
    default = native.get_tuning()
    outs = []
    try:
        for kb in (0, 8, 1 << 20):
            native.set_tuning(*default[:2], kb)
            outs.append((decode_attention(q, K, V, d ** -0.5, isa),
                         paged_decode_attention(q, pool_k, pool_v, table, L, d ** -0.5, isa)))
    finally:
        native.set_tuning(*default)
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], got))
    torch.testing.assert_close(outs[0][0].double(), attention_reference(q, K, V, d ** -0.5), rtol=1e-4, atol=1e-5)


def mla_reference(q, C, KPE, scale):
    """float64: MLA's absorbed attention, q [nh, r + dr] against keys [C | KPE] [L, r + dr] and values C."""
    keys = torch.cat([C, KPE], dim=-1).double()
    return torch.softmax(q.double() @ keys.T * scale, dim=-1) @ C.double()


@pytest.mark.parametrize("isa", ATTN_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("nh, r, dr", [(16, 512, 64), (13, 512, 64), (4, 64, 16),  # 13: a short last group of heads;
                                       (13, 512, 0), (4, 64, 0)])  # 64/16: no vector kernel; dr 0: a NoPE latent
@pytest.mark.parametrize("L", [1, 2, 37, 300])
def test_mla_paged_attention_matches_reference(isa, dtype, nh, r, dr, L):
    """DeepSeek's latent attention over an MLA pool (gpu_service/engine/kv_pool.py's layout: latents [blocks, 16, r], rotary
    keys [blocks, 16, dr]), through a scattered block table and over consecutive blocks without it; odd lengths
    pair the last position with itself."""
    from moe_kernels.attention import mla_paged_attention

    B = 16
    nblocks = -(-L // B)
    C = torch.randn(nblocks + 5, B, r).to(dtype)
    KPE = torch.randn(nblocks + 5, B, dr).to(dtype)
    table = torch.randperm(nblocks + 5)[:nblocks].to(torch.int32)
    q = (torch.randn(nh, r + dr) * 0.1).to(dtype)  # sharp enough that the softmax is not flat
    scale = (128 + dr) ** -0.5
    got = mla_paged_attention(q, C, KPE, table, L, scale, isa)
    assert got.dtype == torch.float32 and got.shape == (nh, r)
    want = mla_reference(q, C[table.long()].flatten(0, 1)[:L], KPE[table.long()].flatten(0, 1)[:L], scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    got = mla_paged_attention(q, C, KPE, table, L, scale, isa, first=2)
    want = mla_reference(q, C[2:].flatten(0, 1)[:L], KPE[2:].flatten(0, 1)[:L], scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_mla_paged_attention_refuses_what_does_not_fit():
    from moe_kernels.attention import mla_paged_attention

    C, KPE, table = torch.randn(4, 16, 512), torch.randn(4, 16, 64), torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="do not hold"):
        mla_paged_attention(torch.randn(8, 576), C, KPE, table, 33, 0.1)
    with pytest.raises(ValueError, match="do not fit"):
        mla_paged_attention(torch.randn(8, 512), C, KPE, table, 3, 0.1)  # no rotary part
    with pytest.raises(ValueError, match="of one of fp32, bf16, fp16"):
        mla_paged_attention(torch.randn(8, 576), C, KPE.bfloat16(), table, 3, 0.1)

def test_paged_decode_attention_refuses_a_short_table():
    from moe_kernels.attention import paged_decode_attention

    pool = torch.randn(2, 4, 16, 64)
    with pytest.raises(ValueError, match="do not hold"):
        paged_decode_attention(torch.randn(4, 64), pool, pool, torch.tensor([0, 1], dtype=torch.int32), 33, 0.125)
    with pytest.raises(ValueError, match="do not fit"):
        odd = torch.randn(2, 4, 12, 64)  # blocks of 12: not a power of two
        paged_decode_attention(torch.randn(4, 64), odd, odd, torch.tensor([0], dtype=torch.int32), 3, 0.125)


def test_decode_attention_refuses_mixed_or_strided_caches():
    from moe_kernels.attention import decode_attention

    K = torch.randn(2, 8, 64).bfloat16()
    with pytest.raises(ValueError, match="of one of fp32, bf16, fp16"):
        decode_attention(torch.randn(4, 64), K, K.float(), 0.125)
    with pytest.raises(ValueError, match="of one of fp32, bf16, fp16"):
        decode_attention(torch.randn(4, 64), K.double(), K.double(), 0.125)
    with pytest.raises(ValueError, match="unit stride"):
        decode_attention(torch.randn(4, 64), K.transpose(1, 2)[:, :8, :8], K[:, :8, :8], 0.125)
    with pytest.raises(ValueError, match="do not fit"):
        decode_attention(torch.randn(3, 64), K, K, 0.125)


# fp32 bit patterns where a half's rounding is easy to get wrong: ties at both ends of the normal range, the
# subnormals and their ties, the overflow edge (65504, 65519.99, 65520), zero, inf; each also negated
AWKWARD_BITS = [0x33000000, 0x33000001, 0x337fffff, 0x33800000, 0x33c00000, 0x34000000, 0x38000000, 0x387fc000,
                0x387fe000, 0x387ff000, 0x38800000, 0x3f801000, 0x3f803000, 0x3f800fff, 0x477fe000, 0x477fefff,
                0x477ff000, 0x7f7fffff, 0x7f800000, 0x00000001, 0]


def _awkward_floats() -> torch.Tensor:
    """The AWKWARD_BITS values, then their negatives, then random ones."""
    u = torch.tensor(AWKWARD_BITS, dtype=torch.int64)
    special = torch.cat([u, u | 0x80000000]).to(torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(3)
    rand = torch.cat([torch.randn(999, generator=g) * s for s in (1e-6, 1e-3, 1.0, 300.0, 3e4)])
    return torch.cat([special, rand])


@pytest.mark.parametrize("kv", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
def test_store_kv_rounds_as_torch(kv, src):
    """The decode step's K/V store (native/kernels/attention.cpp store_kv) gives torch's .to() bits: the F16C instruction
    on whole vectors of 8, the integer rounding for a tail and alone (n = 1)."""
    from moe_kernels.attention import store_kv

    x = _awkward_floats().to(src)
    want = x.to(kv)
    got = torch.empty(x.numel(), dtype=kv)
    store_kv(x, got)
    bits = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}[kv]
    assert torch.equal(got.view(bits), want.view(bits))
    for i in range(2 * len(AWKWARD_BITS)):  # the awkward ones one at a time: the scalar rounding
        one = torch.empty(1, dtype=kv)
        store_kv(x[i:i + 1].clone(), one)
        assert torch.equal(one.view(bits), want[i:i + 1].view(bits)), (i, x[i].item())
    with pytest.raises(ValueError, match="store_kv"):
        store_kv(x.double(), torch.empty(x.numel(), dtype=kv))


def test_half_widens_exactly_on_every_path():
    """Every finite half (all 65536 bit patterns but infs and NaNs) through the decode kernel's loads: one position
    (its softmax weight 1) gives its V row back, on the plain loops (the integer widening) and the vector paths
    (F16C). Within 3e-7 (the softmax's 1 / sum): a wrong exponent or subnormal would be off by far more."""
    from moe_kernels.attention import decode_attention

    h = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    h = h[torch.isfinite(h)]
    rows = torch.nn.functional.pad(h, (0, -h.numel() % 128)).view(-1, 128)  # rows of 128 halves
    for isa in ATTN_PATHS:
        for d in (128, 80):  # 80: no vector kernel on any path
            got = torch.stack([decode_attention(torch.zeros(1, d), r[:d].view(1, 1, d), r[:d].view(1, 1, d), 1.0, isa)[0]
                               for r in rows])
            torch.testing.assert_close(got, rows[:, :d].float(), rtol=3e-7, atol=0, msg=isa)


# -- MLA's absorbed kv_b_proj (native/kernels/mla.cpp) ------------------------------------------------------
@pytest.mark.parametrize("isa", ATTN_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nh, dn, dv, r, t", [(4, 16, 24, 40, 1), (16, 32, 32, 64, 3), (128, 8, 8, 512, 1)])
def test_mla_absorb_matches_torch_einsum(isa, dtype, nh, dn, dv, r, t):
    """q_lat = q_nope W_uk and o = o_lat W_uv^T per head, against torch's einsums in float64 on the same weight;
    r = 40 leaves a tail after the 16-lane body, 128 heads x 512 take the pool's threads."""
    from moe_kernels.attention import mla_absorb_o, mla_absorb_q

    wkv = (torch.randn(nh * (dn + dv), r) * 0.1).to(dtype)
    w = wkv.double().view(nh, dn + dv, r)
    q_nope = torch.randn(t, nh, dn + 5)[..., :dn]  # strided, as the query's view is
    o_lat = torch.randn(nh, t, r)
    got_q = mla_absorb_q(q_nope, wkv, nh, dn, dv, isa)
    got_o = mla_absorb_o(o_lat, wkv, nh, dn, dv, isa)
    assert got_q.dtype == got_o.dtype == torch.float32 and got_q.shape == (nh, t, r) and got_o.shape == (t, nh * dv)
    torch.testing.assert_close(got_q.double(), torch.einsum("thd,hdr->htr", q_nope.double(), w[:, :dn]),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_o.double(), torch.einsum("htr,hvr->thv", o_lat.double(), w[:, dn:]).reshape(t, -1),
                               rtol=1e-5, atol=1e-5)
    # every build of the loops gives the same bits (lane-wise sums): the portable path's
    if isa != "portable":
        assert torch.equal(got_q, mla_absorb_q(q_nope, wkv, nh, dn, dv, "portable"))
        assert torch.equal(got_o, mla_absorb_o(o_lat, wkv, nh, dn, dv, "portable"))


def test_mla_absorb_refuses_a_weight_that_does_not_fit():
    from moe_kernels.attention import mla_absorb_o, mla_absorb_q

    with pytest.raises(ValueError, match="kv_b_proj weight"):
        mla_absorb_q(torch.randn(1, 4, 8), torch.randn(4 * 15, 32), 4, 8, 8)  # 15 rows a head, not 16
    with pytest.raises(ValueError, match="kv_b_proj weight"):
        mla_absorb_o(torch.randn(4, 1, 32), torch.randn(32, 4 * 16).t(), 4, 8, 8)  # not contiguous
    with pytest.raises(ValueError, match="is not"):
        mla_absorb_q(torch.randn(1, 4, 9), torch.randn(4 * 16, 32), 4, 8, 8)
    with pytest.raises(ValueError, match="is not"):
        mla_absorb_o(torch.randn(4, 1, 31), torch.randn(4 * 16, 32), 4, 8, 8)
