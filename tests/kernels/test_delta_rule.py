"""The delta rule's recurrence (native/kernels/delta_rule.cpp through moe_kernels.delta_rule) against a float64
reference on every path this CPU runs: KDA's decay per key channel and gated DeltaNet's one per head, head widths of
the vector loops and others, one token and several, the old state left as it was."""
import pytest
import torch

from moe_kernels import delta_rule

native = pytest.importorskip("moe_kernels._native", reason="native extension not built")

PATHS = [p for p in ("portable", "avx2", "avx512") if native.isa_supported(p)]


def reference(q, k, v, e, beta, S):
    """float64, a token at a time: the decayed state e S, delta = beta (v - k^T e S), o = q^T (e S + k delta^T), the new
    state."""
    q, k, v, e, beta, S = (x.double() for x in (q, k, v, e, beta, S))
    out = []
    for i in range(q.shape[0]):
        Se = S * e[i][..., None]
        delta = (v[i] - torch.einsum("hk,hkv->hv", k[i], Se)) * beta[i][:, None]
        S = Se + k[i][..., None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[i], S))
    return torch.stack(out), S


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("H, dk, dv", [(4, 128, 128), (3, 16, 32), (2, 24, 40), (32, 128, 128)])
@pytest.mark.parametrize("per_channel", [True, False])  # KDA's decay per key channel, gated DeltaNet's per head
@pytest.mark.parametrize("t", [1, 2, 7])  # a decode's token; a prefill's, the state kept between them
def test_the_recurrence_matches_reference(isa, H, dk, dv, per_channel, t):
    g = torch.Generator().manual_seed(H * dk + dv + t)
    q = torch.nn.functional.normalize(torch.randn(t, H, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, H, dk, generator=g), dim=-1)
    v = torch.randn(t, H, dv, generator=g)
    logdecay = -torch.rand(t, H, dk if per_channel else 1, generator=g) * 3
    e = logdecay.exp().expand(t, H, dk)
    beta = torch.rand(t, H, generator=g)
    S = torch.randn(H, dk, dv, generator=g)
    before = S.clone()
    # gated DeltaNet's decay handed over as it is, one a head ([t, H]), the kernel spreading it over the channels
    o, Sn = delta_rule.step(q, k, v, e if per_channel else logdecay.exp()[..., 0], beta, S, isa)
    want_o, want_S = reference(q, k, v, e, beta, S)
    assert torch.equal(S, before)  # (a retried step reads the old state)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(Sn.double(), want_S, rtol=1e-5, atol=1e-5)


def test_what_does_not_fit_is_refused():
    S = torch.zeros(2, 8, 4)
    with pytest.raises(ValueError, match="do not fit"):
        delta_rule.step(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 4), torch.ones(1, 2, 8),
                        torch.ones(1, 3), S)
    with pytest.raises(ValueError, match="do not fit"):
        delta_rule.step(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 4), torch.ones(1, 2, 8),
                        torch.ones(1, 2), S.double())
