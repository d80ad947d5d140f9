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
