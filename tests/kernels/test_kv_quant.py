"""The 8-bit KV cache (--kv-cache-dtype int8 / fp8; moe_kernels/kv_quant.py): its rows against what they hold, the
native store's bytes against the torch codec's, and the native decode kernels reading the rows in place against the
same kernels over the dequantized values (the same bits: a row's scale is a power of two) and a float64 reference,
on every vector path this CPU runs and the portable loops."""
import pytest
import torch

from moe_kernels import kv_quant
from moe_kernels.attention import int8_query, rounds_query

native = pytest.importorskip("moe_kernels._native", reason="native extension not built")

PATHS = [p for p in ("portable", "avx2", "avx512") if native.isa_supported(p)]
Q8 = [torch.int8, torch.float8_e4m3fn]


def rows_of_every_kind(n: int, d: int) -> torch.Tensor:
    """Rows whose magnitudes span fp32's range, zero rows, rows whose amax / top is a power of two exactly, and
    rows with exact rounding ties once scaled."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(n, d, generator=g) * torch.logspace(-30, 30, n)[:, None]
    x[0] = 0
    x[1, :] = 0.5
    x[1, 0] = 127 * 2.0 ** -3           # amax / 127 a power of two: the scale is that, the code 127
    x[2] = torch.arange(d) * 0.5 - d / 4  # ties: x / scale = k + 0.5
    x[2, 0] = 127 * 0.5
    x[3] = torch.randn(d, generator=g) * 1e-3
    x[3, 0] = 448 * 2.0 ** -12            # fp8: many subnormal codes beside a top one
    return x


@pytest.mark.parametrize("dtype", Q8)
def test_rows_hold_the_values(dtype):
    x = rows_of_every_kind(64, 96)
    rows = kv_quant.quantize(x, dtype)
    assert rows.dtype == torch.uint8 and rows.shape == (64, 97)
    e = rows[:, -1].int() - 127
    top = kv_quant.TOP[dtype]
    amax = x.abs().amax(-1)
    scale = torch.ldexp(torch.ones(64), e)
    nz = amax > 0
    # the least power of two with amax / scale <= top: the codes use the upper half of their range at least
    assert (amax[nz] / scale[nz] <= top).all() and (amax[nz] / scale[nz] > top / 2).all()
    back = kv_quant.dequantize(rows, dtype, torch.float32)
    assert (back[0] == 0).all() and (dtype != torch.int8 or back[1, 0] == x[1, 0])  # (127 is no fp8 value)
    err = (back - x).abs()
    if dtype == torch.int8:  # half a step of the scale
        assert (err <= scale[:, None] / 2).all()
    else:  # e4m3: 3 mantissa bits, subnormals below 2^-6 of the scale
        assert (err <= torch.maximum(x.abs() / 16, scale[:, None] * 2.0 ** -10)).all()
    # exact in bf16: what torch's paths compute with is what the native kernels read
    assert torch.equal(kv_quant.dequantize(rows, dtype, torch.bfloat16).float(), back)
    # a row's bytes depend on it alone (a prefill in chunks stores what one whole stores)
    assert torch.equal(torch.cat([kv_quant.quantize(x[:10], dtype), kv_quant.quantize(x[10:], dtype)]), rows)


@pytest.mark.parametrize("dtype", Q8)
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [96, 16, 5])
def test_native_store_is_the_codec(dtype, src, d):
    """The native decode step's store (attention.cpp store_kv) writes kv_quant.quantize's bytes, row by row."""
    from moe_kernels.attention import store_kv

    x = rows_of_every_kind(64, d).to(src)
    want = kv_quant.quantize(x, dtype)
    for i in range(x.shape[0]):
        got = torch.empty(d + 1, dtype=dtype)
        store_kv(x[i].contiguous(), got)
        assert torch.equal(got.view(torch.uint8), want[i]), i
    with pytest.raises(ValueError, match="store_kv"):
        store_kv(x[0].contiguous(), torch.empty(d, dtype=dtype))  # no room for the scale


def pool(dtype, shape):
    """A pool buffer of random values, as `dtype`'s rows (8-bit: codes and scales, shape[-1] + 1 wide), and those
    values dequantized (fp32)."""
    x = torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 4
    if dtype in kv_quant.TOP:
        rows = kv_quant.quantize(x, dtype).view(dtype)
        return rows, kv_quant.dequantize(rows, dtype, torch.float32)
    return x.to(dtype), x.to(dtype).float()


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", Q8)
@pytest.mark.parametrize("d, nh, nkv", [(64, 24, 4), (128, 12, 1), (256, 4, 2), (80, 4, 2)])  # 80: the plain loops
@pytest.mark.parametrize("L", [1, 17, 301])
def test_paged_decode_attention_reads_8bit_rows(isa, dtype, d, nh, nkv, L):
    from moe_kernels.attention import paged_decode_attention
    from tests.kernels.test_attention import attention_reference

    B = 16
    nblocks = -(-L // B)
    torch.manual_seed(L * 31 + d + nh)  # (random rows: the same each run)
    K, Kv = pool(dtype, (nkv, nblocks + 5, B, d))
    V, Vv = pool(dtype, (nkv, nblocks + 5, B, d))
    table = torch.randperm(nblocks + 5)[:nblocks].to(torch.int32)
    q = torch.randn(nh, d) * 2
    got = paged_decode_attention(q, K, V, table, L, d ** -0.5, isa)
    seq = lambda P: P[:, table.long()].reshape(nkv, -1, d)[:, :L]  # noqa: E731
    if rounds_query(dtype, d, isa):  # int8 on the VNNI scores: the query rounded to int8 a head, exact integer sums
        qr = int8_query(q)
        torch.testing.assert_close(got.double(), attention_reference(qr, seq(Kv), seq(Vv), d ** -0.5),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, paged_decode_attention(qr, Kv, Vv, table, L, d ** -0.5, isa),
                                   rtol=1e-4, atol=1e-5)
        assert L == 1 or not torch.equal(got, paged_decode_attention(q, Kv, Vv, table, L, d ** -0.5, isa))  # (it rounds)
        got2 = paged_decode_attention(q, K, V, table, L, d ** -0.5, isa, first=2)  # consecutive blocks, no table
        torch.testing.assert_close(got2, paged_decode_attention(qr, Kv, Vv, table, L, d ** -0.5, isa, first=2),
                                   rtol=1e-4, atol=1e-5)
        return
    # the same bits as the kernel over the values themselves
    assert torch.equal(got, paged_decode_attention(q, Kv, Vv, table, L, d ** -0.5, isa))
    torch.testing.assert_close(got.double(), attention_reference(q, seq(Kv), seq(Vv), d ** -0.5), rtol=1e-4, atol=1e-5)
    got = paged_decode_attention(q, K, V, table, L, d ** -0.5, isa, first=2)  # consecutive blocks, no table
    assert torch.equal(got, paged_decode_attention(q, Kv, Vv, table, L, d ** -0.5, isa, first=2))


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", Q8)
@pytest.mark.parametrize("nh, r, dr", [(16, 512, 64), (13, 512, 64), (4, 64, 16)])
@pytest.mark.parametrize("L", [1, 2, 37, 300])
def test_mla_paged_attention_reads_8bit_rows(isa, dtype, nh, r, dr, L):
    """The latent and the rotary key have a scale each: a position's score is the two rows' sums at their scales."""
    from moe_kernels.attention import mla_paged_attention
    from tests.kernels.test_attention import mla_reference

    B = 16
    nblocks = -(-L // B)
    torch.manual_seed(L * 31 + r + nh)
    C, Cv = pool(dtype, (nblocks + 5, B, r))
    KPE, Pv = pool(dtype, (nblocks + 5, B, dr))
    KPE[..., -1].view(torch.uint8)[:] -= torch.randint(0, 5, KPE.shape[:2], dtype=torch.uint8)  # scales unlike C's
    Pv = kv_quant.dequantize(KPE, dtype, torch.float32)
    table = torch.randperm(nblocks + 5)[:nblocks].to(torch.int32)
    q = torch.randn(nh, r + dr) * 0.1
    scale = (128 + dr) ** -0.5
    got = mla_paged_attention(q, C, KPE, table, L, scale, isa)
    assert torch.equal(got, mla_paged_attention(q, Cv, Pv, table, L, scale, isa))
    want = mla_reference(q, Cv[table.long()].reshape(-1, r)[:L], Pv[table.long()].reshape(-1, dr)[:L], scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    sel = torch.tensor(sorted(torch.randperm(L)[:max(1, L // 3)].tolist()), dtype=torch.int32)
    assert torch.equal(mla_paged_attention(q, C, KPE, table, L, scale, isa, selected=sel),
                       mla_paged_attention(q, Cv, Pv, table, L, scale, isa, selected=sel))


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", Q8)
@pytest.mark.parametrize("H, D, L", [(8, 128, 301), (5, 24, 40)])
def test_dsa_scores_read_8bit_keys(isa, dtype, H, D, L):
    """The indexer's scores over 8-bit keys: each key's sum times its scale, the bits of its values' sum."""
    from moe_kernels.attention import dsa_scores

    B = 16
    nblocks = -(-L // B)
    K, Kv = pool(dtype, (nblocks + 3, B, D))
    table = torch.randperm(nblocks + 3)[:nblocks].to(torch.int32)
    q, w = torch.randn(H, D), torch.rand(H)
    got = dsa_scores(q, w, K, table, L, D ** -0.5, isa)
    assert torch.equal(got, dsa_scores(q, w, Kv, table, L, D ** -0.5, isa))
    keys = Kv[table.long()].reshape(-1, D)[:L].double()
    want = (torch.relu(q.double() @ keys.T * D ** -0.5) * w.double()[:, None]).sum(0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
