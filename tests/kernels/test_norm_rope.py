"""moe_kernels.norm_rope against gpu_service.model.layers' torch versions (the reference): rotary embeddings bit
for bit, RMSNorm within one rounding step of the output dtype (the sum of squares is summed in another
order), for bf16 and fp32 inputs and weights and awkward sizes."""
from __future__ import annotations

import pytest
import torch

from gpu_service.model.layers import apply_rope, rms_norm, rope_cos_sin
from moe_kernels import norm_rope

DT = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("xdt", DT)
@pytest.mark.parametrize("wdt", DT)
# the last three: a prefill's rows, sliced over the native pool
@pytest.mark.parametrize("shape", [(1, 2048), (3, 7), (1, 32, 128), (2, 4, 72), (16, 5), (300, 257), (37, 32, 128), (513, 2048)])
def test_rms_norm_matches_torch(xdt, wdt, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(xdt)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(wdt)
    want = rms_norm(x, w, 1e-6)
    got = rms_norm(x, w, 1e-6, native=True)
    assert got.dtype == want.dtype and got.shape == want.shape
    # the same up to the last bit of the normalized value: one rounding step of its dtype, times w
    tol = (2 ** -7 if want.dtype == torch.bfloat16 or xdt == torch.bfloat16 else 1e-6) * w.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= tol * (1 + x.float().abs().max() / x.float().pow(2).mean().sqrt())
    if xdt == torch.bfloat16:  # rounded to bf16 after the norm: almost every element bit-equal
        assert (got == want).float().mean() > 0.97
    else:  # fp32 all along: the order of the sum shows in the last bits
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-6, atol=1e-6)


def test_rms_norm_falls_back_where_the_native_one_does_not_apply():
    x = torch.randn(5, 64)
    w = torch.ones(64)
    assert torch.equal(rms_norm(x.half(), w.half(), 1e-6, native=True), rms_norm(x.half(), w.half(), 1e-6))
    assert torch.equal(rms_norm(x[:2], w, 1e-6, offset=True, native=True), rms_norm(x[:2], w, 1e-6, offset=True))


@pytest.mark.parametrize("dt", DT)
@pytest.mark.parametrize("T, heads, dim", [(1, 32, 128), (1, 4, 128), (3, 2, 64), (2, 3, 6), (1, 128, 64), (37, 32, 64),
                                          (513, 4, 128)])  # the last two sliced over the native pool
@pytest.mark.parametrize("interleave", [False, True])  # True: DeepSeek's pairs, returned evens then odds
def test_rope_is_torch_bit_for_bit(dt, T, heads, dim, interleave):
    g = torch.Generator().manual_seed(T * heads * dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    cos, sin = rope_cos_sin(inv_freq, 1.0, torch.arange(300, 300 + T), dt)
    x = torch.randn(T, heads, 2 * dim, generator=g).to(dt)[:, :, :dim]  # a non-contiguous view, as q is
    want = apply_rope(x, cos, sin, interleave)
    got = apply_rope(x, cos, sin, interleave, native=True)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_rope_supported_only_where_every_dim_turns_by_halves():
    x = torch.randn(1, 2, 64)
    cos = torch.randn(1, 16)  # partial rotary: torch's path
    assert not norm_rope.rope_supported(x, cos)
    assert not norm_rope.rope_supported(x.to(torch.bfloat16), torch.randn(1, 32))  # dtypes differ
    assert norm_rope.rope_supported(x, torch.randn(1, 32))


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("half", [16, 20, 32, 40, 64])
def test_cos_sin_of_a_position_do_not_depend_on_its_neighbours(dt, half):
    """What Model.rope's table relies on: rope_cos_sin's rows for a window of positions, computed alone, equal the
    same rows of the whole table (elementwise ops, whatever the vector tails), at the table's growth sizes too."""
    inv_freq = 1.0 / (1000000 ** (torch.arange(half).float() / half))
    table = rope_cos_sin(inv_freq, 0.7, torch.arange(4100), dt)
    for start, n in [(0, 1), (5, 1), (1023, 2), (2047, 3), (4095, 5), (777, 64), (10, 7)]:
        cos, sin = rope_cos_sin(inv_freq, 0.7, torch.arange(start, start + n), dt)
        assert torch.equal(cos, table[0][start:start + n]) and torch.equal(sin, table[1][start:start + n])


def test_interleaved_rope_of_a_decode_step_goes_native(monkeypatch):
    """DeepSeek's interleaved rope takes the native halves kernel too (on the de-interleaved pairs)."""
    calls = []
    real = norm_rope.rope
    monkeypatch.setattr(norm_rope, "rope", lambda x, c, s: calls.append(x.shape) or real(x, c, s))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = rope_cos_sin(inv_freq, 1.0, torch.arange(7, 8), torch.float32)
    x = torch.randn(1, 128, 64)
    assert torch.equal(apply_rope(x, cos, sin, True, native=True), apply_rope(x, cos, sin, True))
    assert calls == [(1, 128, 64)]


def _head_rope_f64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float | None) -> torch.Tensor:
    """DeepSeek-V4's head norm and trailing interleaved rope in float64 (the reference)."""
    y = x.double()
    if eps is not None:
        y = y / (y.square().mean(-1, keepdim=True) + eps).sqrt()
    rd = 2 * cos.shape[-1]
    a, b = y[..., -rd::2], y[..., -rd + 1::2]
    c, s = cos.double()[:, None], sin.double()[:, None]
    out = y.clone()
    out[..., -rd::2], out[..., -rd + 1::2] = a * c - b * s, a * s + b * c
    return out


@pytest.mark.parametrize("dt", DT)
@pytest.mark.parametrize("T, heads, D, pairs", [(1, 64, 512, 32), (3, 1, 512, 32), (5, 4, 128, 32), (2, 3, 10, 2),
                                                (2, 2, 64, 32), (300, 8, 64, 16)])  # the last sliced over the pool
@pytest.mark.parametrize("norm", [False, True])
def test_head_rope_against_float64_and_the_torch_path(dt, T, heads, D, pairs, norm):
    """moe_kernels.norm_rope.head_rope (DeepSeek-V4's q, k, o and indexer heads) against a float64 reference within
    its roundings, and against compressed_attention's torch ops: the rope alone bit for bit where torch's complex
    products run vectorized (pairs a multiple of 8, as DeepSeek-V4's 32: each product rounded before its sum; its
    scalar tail fuses them), with the norm within one rounding step (the sum of squares in another order)."""
    from gpu_service.model.compressed_attention import rope_tail

    g = torch.Generator().manual_seed(T * heads * D + pairs)
    x = (torch.randn(T, heads, D, generator=g) * 2).to(dt)
    ang = torch.rand(T, pairs, generator=g) * 20
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    eps = 1e-6 if norm else None
    got = norm_rope.head_rope(x, cos, sin, eps)
    assert got.dtype == dt and got.shape == x.shape
    want = _head_rope_f64(x, cos, sin, eps)
    step = 2 ** -7 if dt == torch.bfloat16 else 2 ** -22
    assert (got.double() - want).abs().max() <= 3 * step * want.abs().max()
    torch_path = rope_tail(x, cos, sin, native=False, eps=eps)
    assert torch.equal(rope_tail(x, cos, sin, native=True, eps=eps), got)
    if not norm and pairs % 8 == 0:
        assert torch.equal(got, torch_path)
    else:
        assert (got.double() - torch_path.double()).abs().max() <= 2 * step * want.abs().max()
        if dt == torch.bfloat16:  # (fp32: every element of a head moves with its factor's last bit)
            assert (got == torch_path).float().mean() > 0.95


def test_head_rope_turns_back_with_negated_sines():
    """The output's rotation taken back (rope_tail(o, cos, -sin)): the heads' trailing dims return within fp32's
    rounding, the rest untouched."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, 96, generator=g)
    ang = torch.rand(4, 16, generator=g) * 50
    y = norm_rope.head_rope(norm_rope.head_rope(x, ang.cos(), ang.sin()), ang.cos(), -ang.sin())
    assert torch.equal(y[..., :64], x[..., :64])
    torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
