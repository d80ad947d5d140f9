"""A hyper-connection's mix and expand (native/kernels/hyper_mix.cpp through moe_kernels.hyper) against a float64
reference of gpu_service/model/hyper_connections.py's mix (transformers' DeepseekV4HyperConnection) and against the
expand's torch form, on every path this CPU runs: bf16 and fp32 streams, one row and several, DeepSeek-V4's 4 streams
and others."""
import pytest
import torch

from moe_kernels import hyper

native = pytest.importorskip("moe_kernels._native", reason="native extension not built")

PATHS = [p for p in ("portable", "avx2", "avx512") if native.isa_supported(p)]


def reference(h, fn, base, scale, eps, norm_eps, iters):
    """float64: the streams RMS-normed as one vector, m = fn . that, pre / post sigmoids, comb's softmax + eps then
    Sinkhorn (columns, then rows and columns iters - 1 times), the pre-weighted sum of the streams."""
    n, hc, H = h.shape
    hd, fn, base, scale = (x.double() for x in (h, fn, base, scale))
    flat = hd.reshape(n, -1)
    m = (flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)) @ fn.T
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax(m[:, 2 * hc:].view(n, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return post, comb, (pre[..., None] * hd).sum(1)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, hc, H", [(1, 4, 256), (3, 4, 72), (2, 2, 40)])
@pytest.mark.parametrize("iters", [1, 20])
def test_mix_matches_reference(isa, dtype, n, hc, H, iters):
    g = torch.Generator().manual_seed(n * 100 + H + iters)
    M = hc * (2 + hc)
    h = torch.randn(n, hc, H, generator=g).to(dtype)
    fn, base, scale = torch.randn(M, hc * H, generator=g) * 0.05, torch.randn(M, generator=g) * 0.5, \
        torch.rand(3, generator=g) + 0.5
    post, comb, x = hyper.mix(h, fn, base, scale, 1e-6, 1e-6, iters, isa)
    want_post, want_comb, want_x = reference(h, fn, base, scale, 1e-6, 1e-6, iters)
    torch.testing.assert_close(post.double(), want_post, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), want_comb, rtol=1e-5, atol=1e-6)
    assert x.dtype == dtype  # (rounded to the streams' type: bf16's half-ulp)
    torch.testing.assert_close(x.double(), want_x, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)


def test_what_does_not_fit_is_refused():
    h = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="do not fit"):
        hyper.mix(h, torch.zeros(24, 31), torch.zeros(24), torch.ones(3), 1e-6, 1e-6, 20)
    with pytest.raises(ValueError, match="do not fit"):
        hyper.mix(h.half(), torch.zeros(24, 32), torch.zeros(24), torch.ones(3), 1e-6, 1e-6, 20)


def torch_expand(h, y, post, comb):
    """hyper_connections.expand's torch form, the reference the kernel rounds as."""
    dt = h.dtype
    return post.to(dt).unsqueeze(-1) * y.to(dt).unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), h)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, hc, H", [(1, 4, 256), (3, 4, 72), (2, 2, 40)])
def test_expand_matches_the_torch_form(isa, dtype, n, hc, H):
    """Against float64 within the roundings (bf16: each of the two terms and their sum rounded, so an absolute bound
    near a few ulps of the terms, ~6 in magnitude here), and against the torch form: fp32 within float error, bf16
    mostly the same bits (torch's matmul may sum the mixed products in another order)."""
    g = torch.Generator().manual_seed(n * 10 + hc + H)
    h, y = torch.randn(n, hc, H, generator=g).to(dtype), torch.randn(n, H, generator=g).to(dtype)
    post, comb = torch.rand(n, hc, generator=g) * 2, torch.rand(n, hc, hc, generator=g)
    got = hyper.expand(h, y, post, comb, isa)
    assert got.dtype == dtype and got.shape == h.shape
    exact = post.to(dtype).double()[..., None] * y.double()[:, None] + \
        torch.einsum("nij,nic->njc", comb.to(dtype).double(), h.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=4e-2)
    torch.testing.assert_close(got.double(), exact, **tol)
    torch.testing.assert_close(got, torch_expand(h, y, post, comb), **tol)
    if dtype == torch.bfloat16:  # mostly the same bits
        assert (got == torch_expand(h, y, post, comb)).float().mean() > 0.95


def test_expand_refuses_what_does_not_fit():
    h = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="do not fit"):
        hyper.expand(h, torch.zeros(2, 9), torch.zeros(2, 4), torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match="do not fit"):
        hyper.expand(h, torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 4), torch.zeros(2, 4, 4))
