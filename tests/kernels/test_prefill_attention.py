"""Causal prefill attention (native/kernels/prefill_attention.cpp through moe_kernels.attention.prefill_attention)
against a float64 reference on every path this CPU runs and the portable loops: chunks at the sequence's start and
after earlier positions, key tiles cut anywhere, query groups of 1 to 8 heads, value dims other than the key dims."""
import pytest
import torch

from moe_kernels import attention as A

native = pytest.importorskip("moe_kernels._native", reason="native extension not built")

PATHS = [p for p in ("portable", "avx2", "avx512") if native.isa_supported(p)]


def causal_reference(q, K, V, start, scale):
    """float64: query i (position start + i) attends to keys 0 .. start + i of its kv head."""
    t, nh, d = q.shape
    nkv, L, dv = V.shape
    g = nh // nkv
    Kd, Vd = K.double().repeat_interleave(g, 0), V.double().repeat_interleave(g, 0)
    s = torch.einsum("thd,hld->htl", q.double(), Kd) * scale
    seen = torch.arange(L)[None, :] <= (start + torch.arange(t))[:, None]
    return torch.einsum("htl,hld->thd", s.masked_fill(~seen, float("-inf")).softmax(-1), Vd)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, start", [(1, 0), (5, 0), (64, 0), (70, 3), (130, 100), (33, 190)])
@pytest.mark.parametrize("nh, nkv, d, dv", [(4, 4, 64, 64), (8, 2, 128, 128), (6, 3, 192, 128), (8, 1, 16, 32)])
def test_prefill_attention_matches_reference(isa, dtype, t, start, nh, nkv, d, dv):
    g = torch.Generator().manual_seed(t * 1000 + start + nh)
    q = torch.randn(t, nh, d, generator=g).to(dtype)
    K = (torch.randn(nkv, start + t, d, generator=g) * 2).to(dtype)  # (scores of a few units: peaked softmaxes)
    V = torch.randn(nkv, start + t, dv, generator=g).to(dtype)
    if not A.prefill_supported(q, K, V, isa):
        assert dtype == torch.bfloat16 and isa == "avx2"
        with pytest.raises(ValueError, match="not taken"):
            A.prefill_attention(q, K, V, start, d ** -0.5, isa)
        return
    out = A.prefill_attention(q, K, V, start, d ** -0.5, isa)
    ref = causal_reference(q, K, V, start, d ** -0.5)
    # bf16: the softmax's weights rounded to bf16 before the weighted sums (as torch's CPU flash attention)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("isa", PATHS)
def test_prefill_attention_reads_strided_queries_and_caches(isa):
    """q as a view of a fused projection (heads not adjacent to tokens) and K/V as slices of longer buffers."""
    g = torch.Generator().manual_seed(7)
    t, nh, nkv, d, start = 20, 4, 2, 64, 11
    qkv = torch.randn(t, nh + 2 * nkv, d, generator=g)
    q = qkv[:, :nh]
    Kb, Vb = torch.randn(nkv, 64, d, generator=g), torch.randn(nkv, 64, d, generator=g)
    K, V = Kb[:, :start + t], Vb[:, :start + t]
    out = A.prefill_attention(q, K, V, start, 0.1, isa)
    torch.testing.assert_close(out.double(), causal_reference(q, K, V, start, 0.1), rtol=1e-5, atol=1e-5)


def test_prefill_attention_refuses_what_does_not_fit():
    q, K = torch.randn(4, 4, 64), torch.randn(2, 9, 64)
    with pytest.raises(ValueError, match="do not fit"):
        A.prefill_attention(q, K, K, 4, 0.1)  # 9 keys for queries at 4..7: 8
    with pytest.raises(ValueError, match="do not fit"):
        A.prefill_attention(torch.randn(4, 3, 64), K[:, :8], K[:, :8], 4, 0.1)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError, match="not taken"):
        A.prefill_attention(q[..., :40], K[:, :8, :40], K[:, :8, :40], 4, 0.1)  # head dims not multiples of 16
