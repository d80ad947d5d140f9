"""Causal prefill attention (native/kernels/prefill_attention.cpp through moe_kernels.attention.prefill_attention)
against a float64 reference on every path this CPU runs and the portable loops: chunks at the sequence's start and
after earlier positions, key tiles cut anywhere, query groups of 1 to 8 heads, value dims other than the key dims."""
import pytest
import torch

from moe_kernels import attention as A

native = pytest.importorskip("moe_kernels._native", reason="native extension not built")

PATHS = [p for p in ("portable", "avx2", "avx512") if native.isa_supported(p)]


def causal_reference(q, K, V, start, scale, window=0, sinks=None, lo=0):
    """float64: query i (position start + i) attends to keys lo .. start + i of its kv head (K's rows from position
    lo), the last `window` of them where window > 0; sinks [nh]: one more logit per head, its share dropped."""
    t, nh, d = q.shape
    nkv, L, dv = V.shape
    g = nh // nkv
    Kd, Vd = K.double().repeat_interleave(g, 0), V.double().repeat_interleave(g, 0)
    s = torch.einsum("thd,hld->htl", q.double(), Kd) * scale
    j, i = lo + torch.arange(L)[None, :], (start + torch.arange(t))[:, None]
    seen = (j <= i) & (j > i - window) if window else j <= i
    s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(nh, 1, 1).expand(nh, t, 1)], dim=-1)
    return torch.einsum("htl,hld->thd", s.softmax(-1)[..., :L], Vd)


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, start", [(1, 0), (70, 0), (40, 100), (130, 300)])
@pytest.mark.parametrize("window", [5, 64, 129])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("nh, nkv, d, dv", [(8, 2, 64, 64), (6, 3, 192, 128)])
def test_prefill_attention_with_a_window_and_sinks(isa, dtype, t, start, window, sinks, nh, nkv, d, dv):
    """Sliding windows (gpt-oss, MiMo) of fewer, as many and more keys than a tile, the keys given from the first any
    query sees (its own window's first) or from position 0, with and without each head's sink."""
    if dtype == torch.bfloat16 and isa == "avx2":
        return  # (not taken: test_prefill_attention_matches_reference)
    g = torch.Generator().manual_seed(t * 1000 + start + window)
    q = torch.randn(t, nh, d, generator=g).to(dtype)
    K = (torch.randn(nkv, start + t, d, generator=g) * 2).to(dtype)
    V = torch.randn(nkv, start + t, dv, generator=g).to(dtype)
    s = torch.randn(nh, generator=g) * 3 if sinks else None
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    for lo in {0, max(0, start - window + 1)}:
        out = A.prefill_attention(q, K[:, lo:], V[:, lo:], start, d ** -0.5, isa, window=window, sinks=s, lo=lo)
        ref = causal_reference(q, K[:, lo:], V[:, lo:], start, d ** -0.5, window, s, lo)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    if start >= window:  # keys that begin after a query's first visible one are refused
        with pytest.raises(ValueError, match="do not fit"):
            A.prefill_attention(q, K[:, start - window + 2:], V[:, start - window + 2:], start, 0.1, isa, window=window,
                                lo=start - window + 2)


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
