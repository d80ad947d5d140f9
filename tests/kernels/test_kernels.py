"""Routed-expert operators against a plain fp32 torch reference: every isa this machine can run,
awkward sizes, repeated ids, zero weights, async submit/wait, thread counts."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moe_experts.kernels import TorchMoELayer

native = pytest.importorskip("moe_kernels._native", reason="native extension not built")
import moe_kernels  # noqa: E402
from moe_experts.kernels.native_moe import NativeMoELayer  # noqa: E402
from tiers import cases  # noqa: E402
from unpacked import dequantized  # noqa: E402

# every isa this CPU can run; and the AMX isa with its tile instructions emulated in C++ (the
# packing, blocking, edges and epilogue around them), wherever the AVX-512 isa runs
ISAS = [p for p in moe_kernels.ISAS if native.isa_supported(p)]
if native.isa_supported("avx512"):
    ISAS.append("amx-emulated")


def layer(gate, up, down, fmt="bf16", isa=None, **kw):
    if isa == "amx-emulated":
        native.set_amx_emulation(True)  # switched off again by the fixture below
        isa = "amx"
    return NativeMoELayer(gate, up, down, fmt=fmt, isa=isa, **kw)


@pytest.fixture(autouse=True)
def no_amx_emulation_left_on():
    yield
    native.set_amx_emulation(False)
FORMATS = ["bf16", "int8", "int4", "mxfp4", "fp8", "int4g32", "iq4nl", "uint4g32", "int8g32", "q4k", "q5k", "q6k",
           "q3k", "q2k", "iq4xs"]


def reference(x, gate, up, down, ids, w, fmt=None, act=None, bias=(None, None), down_fmt=None):
    """fp32, one token and one expert at a time. With fmt, the activations go through the same
    rounding as the kernels' (bf16, or symmetric int8 per vector; fp8: Fp8Rows) so only summation order
    differs; down_fmt: down's, where it differs. act / bias: gpt-oss's clamped SwiGLU (ExpertAct) and expert
    biases ([E, 2I] gate then up, [E, H])."""
    mv = lambda m, v: m(v) if callable(m) else m.float() @ v  # noqa: E731

    def act_q(v, fmt=fmt):
        if fmt is None or fmt == "fp8":
            return v
        if fmt == "bf16":
            return v.bfloat16().float()
        s = v.abs().max() / 127
        return v if s == 0 else torch.round(v / s) * s
    bf = lambda v: v.bfloat16().float() if fmt else v  # noqa: E731  (kernels round gate/up/silu/product to bf16)
    out = torch.zeros(x.shape[0], gate.shape[2])
    for t in range(x.shape[0]):
        xt = act_q(x[t].float())
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = mv(gate[e], xt), mv(up[e], xt)
            if bias[0] is not None:
                g, u = g + bias[0][e, :g.shape[0]], u + bias[0][e, g.shape[0]:]
            g, u = bf(g), bf(u)
            if act is None:
                a = act_q(bf(bf(F.silu(g)) * u), down_fmt or fmt)
            elif act.kind == "clamped_silu":
                g, u = g.clamp(max=act.limit), u.clamp(-act.limit, act.limit)
                a = act_q(bf(bf(F.silu(g)) * u), down_fmt or fmt)
            else:  # each step rounded as the kernels (and a bf16 model) do
                g, u = g.clamp(max=act.limit), u.clamp(-act.limit, act.limit)
                a = act_q(bf(bf(u + 1) * bf(g * bf(torch.sigmoid(bf(g * act.alpha))))), down_fmt or fmt)
            y = mv(down[e], a)
            out[t] += w[t, j].float() * (y if bias[1] is None else y + bias[1][e])
    return out


def make(E, I, H, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(torch.bfloat16)  # noqa: E731
    return mk(E, I, H), mk(E, I, H), mk(E, H, I)


def routing(T, k, E, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    return ids, torch.rand(T, k, generator=g)


def close(got, want, tol):
    err = (got.float() - want).abs().max().item()
    scale = want.abs().max().item() + 1e-6
    assert err <= tol * scale, f"max err {err} vs scale {scale}"


# Tolerances, as a share of the output's largest magnitude (fp32 accumulation throughout):
# bf16: x, gate/up outputs and the activation are rounded to bf16 (8 mantissa bits, ~0.4% each);
# int8: per-channel weights and per-token activations at 8 bits (~0.4% each, errors average out);
# int4: 15 levels per 64-group of weights: ~10% error per weight against the original weights, so
# the kernel is checked against the dequantized weights (the same activation error as int8), and
# against the original ones only loosely.
# Against the reference that rounds like the kernels: sum order differs, which now and then moves an
# activation across an int8 rounding boundary (one quantum, 1/127 of the vector's max).
# fp8: e4m3 keeps 3 mantissa bits (up to 6% error per weight against the original bf16 weights).
# q2k: 4 levels per 16 weights (~33% error per weight): against the original weights only the output's magnitude is
# checked; the dequantized weights are the kernels' test.
TOL = {"bf16": 2e-3, "int8": 6e-3, "int4": 6e-3, "mxfp4": 6e-3, "fp8": 2e-3, "int4g32": 6e-3, "iq4nl": 6e-3,
       "uint4g32": 6e-3, "int8g32": 6e-3, "q4k": 6e-3, "q5k": 6e-3, "q6k": 6e-3, "q3k": 6e-3, "q2k": 6e-3, "iq4xs": 6e-3}
IQ_FORMATS = ["iq2xxs", "iq2xs", "iq2s", "iq3xxs", "iq3s", "iq1s", "iq1m"]  # GGUF's grid types: exact only (no quantizer)
TOL.update({f: 6e-3 for f in IQ_FORMATS})
TOL_ORIGINAL = {"bf16": 2e-2, "int8": 4e-2, "int4": 3.5e-1, "mxfp4": 3.5e-1, "fp8": 1.5e-1, "int4g32": 3.5e-1,
                "iq4nl": 3.5e-1, "uint4g32": 3.5e-1, "int8g32": 4e-2, "q4k": 3.5e-1, "q5k": 1.5e-1, "q6k": 8e-2,
                "q3k": 6e-1, "q2k": 1.5, "iq4xs": 3.5e-1}


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


# the fast tier: every format on every path at one awkward shape, for decode (1), a few tokens (7) and prefill (64)
@pytest.mark.parametrize("fmt, isa, T, k, E, I, H", cases(FORMATS, ISAS, [1, 2, 7, 64], [1, 2, 8],
                                                           [(8, 80, 96), (16, 64, 128), (9, 33, 70)],
                                                           fast=lambda f, i, T, k, *shape: k == 2 and T != 2
                                                           and shape == (9, 33, 70)))
def test_native_matches_reference(fmt, isa, T, k, E, I, H):
    gate, up, down = make(E, I, H)
    ids, w = routing(T, k, E)
    x = torch.randn(T, H)
    op = layer(gate, up, down, fmt=fmt, threads=2, isa=isa)
    got = op.forward(x, ids, w)
    close(got, reference(x, *dequantized(op), ids, w, fmt=fmt), TOL[fmt])
    close(got, reference(x, gate, up, down, ids, w), TOL_ORIGINAL[fmt])


# gate/up and down in different formats (a GGUF Q4_K_M layer's Q4_K gate/up beside its Q6_K down): each phase on its
# own kernels and activations; tiles on AMX in one phase and not the other, either way round
@pytest.mark.parametrize("fmt, down_fmt", [("q4k", "q6k"), ("q6k", "q4k"), ("q5k", "q6k"), ("q3k", "q5k"),
                                           ("q2k", "q3k"), ("iq4xs", "int8g32"),
                                           ("int4g32", "bf16"), ("bf16", "int4")])
@pytest.mark.parametrize("isa, T", cases(ISAS, [1, 7, 64], fast=lambda i, T: (i, T) == (moe_kernels.ISA, 1)))
def test_mixed_formats_match_reference(fmt, down_fmt, isa, T):
    E, I, H, k = 8, 256, 512, 4  # rows of 256: the super-blocked formats' K
    gate, up, down = make(E, I, H)
    ids, w = routing(T, k, E)
    x = torch.randn(T, H)
    op = layer(gate, up, down, fmt=fmt, threads=2, isa=isa, down_fmt=down_fmt)
    assert (op.fmt, op.down_fmt) == (fmt, down_fmt)
    got = op.forward(x, ids, w)
    close(got, reference(x, *dequantized(op), ids, w, fmt=fmt, down_fmt=down_fmt), max(TOL[fmt], TOL[down_fmt]))
    # each phase's numbers are its own format's: down unpacked as fmt would not be the same weights
    same = layer(gate, up, down, fmt=fmt, threads=2, isa=isa)
    assert not torch.equal(unpack_down(same), unpack_down(op))


def unpack_down(op):
    from moe_kernels.packing import unpack
    return unpack(op.dn, op.down_fmt, op.intermediate)


@pytest.mark.parametrize("fmt, isa", cases(FORMATS, ISAS, fast=lambda f, i: i == moe_kernels.ISA))
def test_large_T_repeated_ids_and_zero_weights(fmt, isa):
    E, I, H, T, k = 8, 56, 96, 300, 2  # 2I = 112 rows: a lone 16-row tile after the pairs (AMX)
    gate, up, down = make(E, I, H)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)
    ids[:, 1] = ids[:, 0]  # the same expert twice in one token
    w = torch.rand(T, k)
    w[::3] = 0.0
    x = torch.randn(T, H)
    op = layer(gate, up, down, fmt=fmt, threads=2, isa=isa)
    got = op.forward(x, ids, w)
    close(got, reference(x, *dequantized(op), ids, w, fmt=fmt), TOL[fmt])
    assert torch.all(got[::3] == 0)


@pytest.mark.parametrize("fmt, isa, T", cases(["int4g32", "iq4nl", "uint4g32", "int8g32", "q5k", "q6k", "q3k", "q2k",
                                                "iq4xs"], ISAS, [1, 5], fast=lambda f, i, T: (f, i, T) == ("uint4g32", moe_kernels.ISA, 1)))
def test_rows_of_many_groups(fmt, isa, T):
    """Rows of 44 and 66 groups of 32 (K = 1408, 2112): the kernels' per-group vectors whole and in part (uint4g32's
    mins go 16 and 8 groups a step)."""
    E, I, H, k = 4, 1408, 2112, 2
    gate, up, down = make(E, I, H)
    ids, w = routing(T, k, E)
    x = torch.randn(T, H)
    op = layer(gate, up, down, fmt=fmt, threads=2, isa=isa)
    close(op.forward(x, ids, w), reference(x, *dequantized(op), ids, w, fmt=fmt), TOL[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_isas_agree(fmt):
    gate, up, down = make(8, 80, 96)
    ids, w = routing(5, 3, 8)
    x = torch.randn(5, 96)
    outs = [layer(gate, up, down, fmt=fmt, isa=p).forward(x, ids, w) for p in ISAS]
    for o in outs[1:]:
        close(o, outs[0], 1e-3)
    assert NativeMoELayer(gate, up, down, fmt=fmt).forward(x.bfloat16(), ids, w).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", ISAS)
def test_gpt_oss_experts_bias_and_clamped_swiglu(fmt, isa):
    """gpt-oss: biases on gate/up and down, and the clamped SwiGLU, its limit low enough to clamp."""
    from moe_core.config import ExpertAct
    E, I, H, T, k = 8, 40, 96, 6, 4
    gate, up, down = make(E, I, H)
    ids, w = routing(T, k, E)
    x = torch.randn(T, H) * 3
    act = ExpertAct("clamped_swiglu", alpha=1.702, limit=0.5)
    bias = (torch.randn(E, 2 * I) * 0.3, torch.randn(E, H) * 0.1)
    op = layer(gate, up, down, fmt=fmt, threads=2, isa=isa).set_extras(act, *bias)
    got = op.forward(x, ids, w)
    want = reference(x, *dequantized(op), ids, w, fmt=fmt, act=act, bias=bias)
    close(got, want, TOL[fmt])
    plain = reference(x, *dequantized(op), ids, w, fmt=fmt)
    assert (want - plain).abs().max() > 0.1 * want.abs().max()  # the extras change the answer
    ref = TorchMoELayer(gate.float(), up.float(), down.float(), fmt="fp32").set_extras(act, *bias)
    close(ref.forward(x, ids, w), reference(x, gate, up, down, ids, w, act=act, bias=bias), 1e-5)
    # and through the exchange's entry (deferral split, bf16 in and out)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    xb, ids32 = x.bfloat16(), ids.contiguous()
    op.forward_part(xb.data_ptr(), True, ids32.data_ptr(), w.data_ptr(), out.data_ptr(), True, T, k, 0, 0)
    close(out, op.forward(xb, ids, w).float(), 1e-2)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", ISAS)
def test_deepseek_v4_clamped_silu(fmt, isa):
    """DeepSeek-V4's experts: silu(min(gate, limit)) * clamp(up, -limit, limit), the limit low enough to clamp; the
    torch operator (the fallback and the GPU side's) the same."""
    from moe_core.config import ExpertAct
    E, I, H, T, k = 8, 40, 96, 6, 4
    gate, up, down = make(E, I, H)
    ids, w = routing(T, k, E)
    x = torch.randn(T, H) * 3
    act = ExpertAct("clamped_silu", alpha=1.0, limit=0.5)
    op = layer(gate, up, down, fmt=fmt, threads=2, isa=isa).set_extras(act)
    got = op.forward(x, ids, w)
    want = reference(x, *dequantized(op), ids, w, fmt=fmt, act=act)
    close(got, want, TOL[fmt])
    plain = reference(x, *dequantized(op), ids, w, fmt=fmt)
    assert (want - plain).abs().max() > 0.1 * want.abs().max()  # the clamps change the answer
    ref = TorchMoELayer(gate.float(), up.float(), down.float(), fmt="fp32").set_extras(act)
    close(ref.forward(x, ids, w), reference(x, gate, up, down, ids, w, act=act), 1e-5)


def published_layer(parts, I, H, fmt, isa):
    """A layer packed from experts as a checkpoint publishes them (parts[e] = gate, up, down), on isa."""
    if isa == "amx-emulated":
        native.set_amx_emulation(True)
    return NativeMoELayer.from_experts(len(parts), I, H, lambda e: parts[e], fmt=fmt, threads=2,
                                       isa="amx" if isa == "amx-emulated" else isa)


def assert_kept_and_multiplied(op, parts, T, k):
    """The packed weights are the published ones exactly, and the kernels multiply exactly those."""
    gate, up, down = dequantized(op)
    for e, (pg, pu, pd) in enumerate(parts):
        assert torch.equal(gate[e], pg.dequantize()) and torch.equal(up[e], pu.dequantize())
        assert torch.equal(down[e], pd.dequantize())
    ids, w = routing(T, k, len(parts))
    x = torch.randn(T, op.hidden)
    close(op.forward(x, ids, w), reference(x, gate, up, down, ids, w, fmt=op.fmt), TOL[op.fmt])


@pytest.mark.parametrize("isa", ISAS)
def test_mxfp4_published_weights_are_kept_bit_for_bit(isa):
    """gpt-oss's experts as published (e2m1 codes, e8m0 exponents): packed exactly (rows padded from 96 and
    160 to whole 64-groups), and the kernels multiply exactly those values."""
    from moe_kernels.packing import Mx4
    E, I, H, T, k = 4, 96, 160, 5, 2
    g = torch.Generator().manual_seed(3)
    mx = lambda r, c: Mx4(torch.randint(0, 16, (r, c), dtype=torch.uint8, generator=g),  # noqa: E731
                          torch.randint(120, 126, (r, c // 32), dtype=torch.uint8, generator=g))
    parts = [(mx(I, H), mx(I, H), mx(H, I)) for _ in range(E)]
    assert_kept_and_multiplied(published_layer(parts, I, H, "mxfp4", isa), parts, T, k)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_published_groups_are_kept_bit_for_bit(isa, group):
    """Symmetric int4 checkpoints (compressed-tensors, GPTQ) in groups of 32, 64 or 128: values and scales packed
    exactly (a scale repeated per 32), rows padded (H = 160 to 192), and the kernels multiply exactly those."""
    from moe_kernels.packing import Int4
    E, I, H, T, k = 3, 96, 160, 5, 2
    g = torch.Generator().manual_seed(7)
    i4 = lambda r, c: Int4(torch.randint(-8, 8, (r, c), dtype=torch.int8, generator=g),  # noqa: E731
                           torch.rand(r, -(-c // group), generator=g) * 0.02 + 1e-3, group)
    parts = [(i4(I, H), i4(I, H), i4(H, I)) for _ in range(E)]
    assert_kept_and_multiplied(published_layer(parts, I, H, "int4g32", isa), parts, T, k)


def published_with_mins(kind, r, c, g, top, smax, subs, extreme_m=None):
    """A published Q5_K / Q2_K weight [r, c] (kind: packing.Q5K or Q2K): fp16 d and dmin per 256, `subs` sc and m per
    256 in 0..smax, values in 0..top; with extreme_m every value top, every sc smax and every m extreme_m."""
    n = -(-c // 256)
    rnd = lambda hi, *s: torch.randint(0, hi, s, dtype=torch.uint8, generator=g)  # noqa: E731
    full = lambda v, *s: torch.full(s, v, dtype=torch.uint8)  # noqa: E731
    d = (torch.rand(r, n, generator=g) * 1e-3 + 1e-4).half().float()
    dmin = (torch.rand(r, n, generator=g) * 1e-3).half().float()
    if extreme_m is not None:
        return kind(full(top, r, c), d, dmin, full(smax, r, subs * n), full(extreme_m, r, subs * n))
    return kind(rnd(top + 1, r, c), d, dmin, rnd(smax + 1, r, subs * n), rnd(smax + 1, r, subs * n))


def assert_expert_0_exact_on_one_signed_activations(op, T):
    """Expert 0 alone against activations of one sign: every product of its gate and up at its largest."""
    gate, up, down = dequantized(op)
    x = torch.rand(T, op.hidden) + 0.5
    ids, w = torch.zeros(T, 1, dtype=torch.int32), torch.ones(T, 1)
    close(op.forward(x, ids, w), reference(x, gate, up, down, ids, w, fmt=op.fmt), TOL[op.fmt])


@pytest.mark.parametrize("isa", ISAS)
def test_q5k_published_weights_are_kept_bit_for_bit(isa):
    """GGUF's Q5_K numbers as stored (5-bit q, 6-bit sc and m, d and dmin per 256; rows of 320 padded to 512): packed
    exactly, and multiplied exactly on every path. Expert 0 is all q = 31 with sc = 63 and no min, against activations
    of one sign: the largest sums a 32's products make, which AVX2's int16 pairs must not saturate (summing 8 chunks
    before widening, as the 4-bit formats do, would: 8 x 2 x 31 x 127 > 2^15)."""
    from moe_kernels.packing import Q5K
    E, I, H, T, k = 3, 256, 320, 5, 2
    g = torch.Generator().manual_seed(11)
    q5 = lambda r, c, extreme=False: published_with_mins(Q5K, r, c, g, 31, 63, 8, 0 if extreme else None)  # noqa: E731
    parts = [(q5(I, H, e == 0), q5(I, H), q5(H, I)) for e in range(E)]
    op = published_layer(parts, I, H, "q5k", isa)
    assert_kept_and_multiplied(op, parts, T, k)
    assert_expert_0_exact_on_one_signed_activations(op, T)


@pytest.mark.parametrize("isa", ISAS)
def test_q3k_published_weights_are_kept_bit_for_bit_and_by_q6k_too(isa):
    """GGUF's Q3_K numbers as stored (3-bit u - 4, an sc of -32..31 per 16, d per 256; rows of 320 padded to 512):
    packed exactly in q3k and in q6k, and multiplied exactly on every path."""
    from moe_kernels.packing import Q3K
    E, I, H, T, k = 3, 256, 320, 5, 2
    g = torch.Generator().manual_seed(12)

    def q3(r, c):
        n = -(-c // 256)
        return Q3K(torch.randint(-4, 4, (r, c), dtype=torch.int8, generator=g),
                   (torch.rand(r, n, generator=g) * 1e-3 + 1e-4).half().float(),
                   torch.randint(-32, 32, (r, 16 * n), dtype=torch.int8, generator=g))
    parts = [(q3(I, H), q3(I, H), q3(H, I)) for _ in range(E)]
    for fmt in ("q3k", "q6k"):
        assert_kept_and_multiplied(published_layer(parts, I, H, fmt, isa), parts, T, k)


@pytest.mark.parametrize("isa", ISAS)
def test_q2k_published_weights_are_kept_bit_for_bit(isa):
    """GGUF's Q2_K numbers as stored (2-bit q, a 4-bit sc and m per 16, d and dmin per 256; rows of 320 padded to 512):
    packed exactly, and multiplied exactly on every path. Expert 0 is all q = 3 with sc = m = 15, against activations
    of one sign: the largest sums a 16's products and mins make."""
    from moe_kernels.packing import Q2K
    E, I, H, T, k = 3, 256, 320, 5, 2
    g = torch.Generator().manual_seed(13)
    q2 = lambda r, c, extreme=False: published_with_mins(Q2K, r, c, g, 3, 15, 16, 15 if extreme else None)  # noqa: E731
    parts = [(q2(I, H, e == 0), q2(I, H), q2(H, I)) for e in range(E)]
    op = published_layer(parts, I, H, "q2k", isa)
    assert_kept_and_multiplied(op, parts, T, k)
    assert_expert_0_exact_on_one_signed_activations(op, T)


@pytest.mark.parametrize("fmt", IQ_FORMATS)
@pytest.mark.parametrize("isa", ISAS)
def test_iq_published_weights_are_kept_bit_for_bit(fmt, isa):
    """GGUF's grid types as stored (random valid blocks: any grid index, sign and sub-scale): packed as the file's own
    bytes (the resident experts are exactly the file's size), unpacked to the gguf package's dequantized values bit for
    bit, and multiplied as those on every path."""
    from moe_kernels import iq_formats
    E, I, H, T, k = 3, 256, 512, 5, 2
    g = torch.Generator().manual_seed(17)
    blocks = lambda r, c: iq_formats.random_blocks(fmt, r, c // 256, g)  # noqa: E731
    parts = [(blocks(I, H), blocks(I, H), blocks(H, I)) for _ in range(E)]
    op = published_layer(parts, I, H, fmt, isa)
    assert_kept_and_multiplied(op, parts, T, k)
    resident = sum(p.nbytes for p in (*op.gu, *op.dn) if p is not None)
    assert resident == E * 3 * I * H // 256 * iq_formats.SPECS[fmt].size


def every_path_as_portable(w, fmt: str, x: torch.Tensor) -> torch.Tensor:
    """w [out, in] in fmt times x on every ISA path this CPU has, each asserted bit for bit equal to the portable
    reference's product, which is returned."""
    from moe_kernels.dense import NativeLinear
    want = NativeLinear(w, fmt, isa="portable")(x)
    for isa in ISAS:
        if isa == "amx-emulated":
            native.set_amx_emulation(True)
            isa = "amx"
        assert torch.equal(NativeLinear(w, fmt, isa=isa)(x), want), isa
    return want


@pytest.mark.parametrize("fmt", IQ_FORMATS)
@pytest.mark.parametrize("T", [1, 5, 40])
def test_iq_formats_are_the_reference_on_every_path_bitwise(fmt, T):
    """The grid types sum each 256's m x dot products in int32 (exact) and apply d with one FMA on every path, as the
    portable reference does: the paths agree to the bit (1041 rows: 65 whole row blocks and a lone row, so partial
    halves and quarters; rows of 5 blocks), and against the gguf package's dequantized weights only the activations'
    int8 rounding is left."""
    from moe_kernels import iq_formats
    w = iq_formats.random_blocks(fmt, 1041, 5, torch.Generator().manual_seed(3))
    x = torch.randn(T, 1280)
    want = every_path_as_portable(w, fmt, x)
    exact = x @ w.dequantize().T
    assert ((want - exact).norm() / exact.norm()).item() < 1.5e-2


@pytest.mark.parametrize("fmt", IQ_FORMATS)
def test_iq_prefill_on_activations_at_full_scale(fmt):
    """Every activation at the int8 extreme (+-1 scale each: q = +-127, u8 1 or 255): the prefill kernels' int16 pair
    sums (vpmaddubsw) at their largest; summing more of them before widening than a type's grid allows overflows here
    and no longer matches the portable reference."""
    from moe_kernels import iq_formats
    g = torch.Generator().manual_seed(5)
    w = iq_formats.random_blocks(fmt, 64, 4, g)
    signs = torch.where(torch.rand(40, 1024, generator=g) < 0.5, -1.0, 1.0)
    for x in (torch.ones(40, 1024), signs, -torch.ones(40, 1024)):
        every_path_as_portable(w, fmt, x)


def test_iq_formats_refuse_float_weights():
    from moe_kernels.packing import quantize
    with pytest.raises(ValueError, match="the iq2xxs format holds GGUF IQ2_XXS matrices as stored; it does not quantize"):
        quantize(torch.randn(4, 256), "iq2xxs")


def published_fp8(rows, cols, gen):
    """A random FP8 weight as a checkpoint publishes it: any finite e4m3 byte, a scale per 128 x 128 block."""
    from moe_kernels.packing import Fp8
    b = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=gen)
    b[(b & 0x7F) == 0x7F] = 0x3F  # no NaN
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=gen) * 1e-3 + 1e-4
    return Fp8(b.view(torch.float8_e4m3fn), scale)


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_published_weights_are_kept_bit_for_bit(isa):
    """DeepSeek-style FP8 experts as published (e4m3 bytes, subnormals included, a scale per 128 x 128 block;
    gate and up of 128 rows each stacked, H = 200 padded): packed exactly, and the kernels multiply exactly
    those values, decode (few tokens, widened in registers) and prefill (a bf16 scratch, AMX tiles)."""
    E, I, H = 3, 128, 200
    g = torch.Generator().manual_seed(4)
    parts = [(published_fp8(I, H, g), published_fp8(I, H, g), published_fp8(H, I, g)) for _ in range(E)]
    op = published_layer(parts, I, H, "fp8", isa)
    data, scale = op.gu[0], op.gu[1]
    for e, (pg, pu, pd) in enumerate(parts):
        assert torch.equal(data[e, :I, :H], pg.values.view(torch.uint8)) and torch.equal(data[e, I:, :H], pu.values.view(torch.uint8))
        assert torch.equal(scale[e, :, :2], torch.cat([pg.scale, pu.scale]) * 256)
        assert torch.equal(op.dn[0][e, :, :I], pd.values.view(torch.uint8))
        assert not data[e, :, H:].any()  # padding is +0
    for T in (1, 3, 40):
        ids, w = routing(T, 2, E)
        x = torch.randn(T, H)
        close(op.forward(x, ids, w), reference(x, *dequantized(op), ids, w, fmt="fp8"), TOL["fp8"])


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_decode_scales_by_powers_of_two_exactly(isa):
    """Decode's activations times 2^k give the outputs times 2^k, bit for bit, on every path. On AVX2 an activation
    past 2^16 after its block scale sends the block row from the x 2^-120 widening (scale_rows_e112_avx2) back to
    the fp16 one, so the two routes are checked against each other too; e4m3's subnormal codes included."""
    from moe_kernels.dense import NativeLinear
    torch.manual_seed(0)
    w = torch.randn(300, 1000) * 0.05
    w[:, :7] *= 1e-4
    if isa == "amx-emulated":
        native.set_amx_emulation(True)
        isa = "amx"
    lin = NativeLinear(w, "fp8", isa=isa)
    for T in (1, 2, 4):
        x = torch.randn(T, 1000)
        base = lin(x)
        for k in (24, -24):
            assert torch.equal(lin(x * 2.0 ** k), base * 2.0 ** k), (T, k)


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_prefill_with_many_tokens_an_expert_computes_the_bf16_formats_numbers(isa):
    """From 128 tokens an expert (FOLD_SLOTS) the block scales go onto the widened weights: bf16(value x scale)
    is what the bf16 format holds for the same published weights, and the activations are rounded alike, so the
    two formats agree up to summation order (which can move an activation across a bf16 rounding boundary:
    TOL["bf16"])."""
    E, I, H, T = 2, 128, 256, 300
    g = torch.Generator().manual_seed(6)
    parts = [(published_fp8(I, H, g), published_fp8(I, H, g), published_fp8(H, I, g)) for _ in range(E)]
    ops = [layer(*(torch.stack([p[j].dequantize() for p in parts]) for j in range(3)), fmt="bf16", isa=isa),
           published_layer(parts, I, H, "fp8", isa)]
    ids = torch.tensor([[0, 1]] * T, dtype=torch.int32)
    w = torch.rand(T, 2, generator=g)
    x = torch.randn(T, H, generator=g)
    bf16, fp8 = (op.forward(x, ids, w) for op in ops)
    close(fp8, bf16, TOL["bf16"])


def test_fp8_error_is_below_bf16s_on_fp8_weights():
    """On weights that are exactly FP8 (a published checkpoint), the fp8 format keeps them exact and rounds
    only its activations; bf16 rounds both: fp8's output error against the exact weights is the smaller."""
    E, I, H, T = 4, 256, 384, 16
    g = torch.Generator().manual_seed(5)
    parts = [(published_fp8(I, H, g), published_fp8(I, H, g), published_fp8(H, I, g)) for _ in range(E)]
    exact = [tuple(p.dequantize() for p in ps) for ps in parts]
    ids, w = routing(T, 2, E)
    x = torch.randn(T, H)
    want = reference(x, *(torch.stack([ex[i] for ex in exact]) for i in range(3)), ids, w).double()
    err = {}
    for fmt in ("fp8", "bf16"):
        op = NativeMoELayer.from_experts(E, I, H, lambda e: parts[e], fmt=fmt, threads=2)
        err[fmt] = float((op.forward(x, ids, w).double() - want).norm() / want.norm())
    assert err["fp8"] < err["bf16"] < 1e-2, err


def test_torch_operator_matches_reference():
    gate, up, down = make(8, 80, 96)
    ids, w = routing(7, 2, 8)
    x = torch.randn(7, 96)
    op = TorchMoELayer(gate.float(), up.float(), down.float(), fmt="fp32")
    close(op.forward(x, ids, w), reference(x, gate, up, down, ids, w), 1e-5)


@pytest.mark.parametrize("isa", ["avxvnni", "amx"])
def test_paths_are_refused_where_the_cpu_lacks_them(isa, monkeypatch):
    f = native.cpu_features()
    needs = {"avxvnni": f["avxvnni"] and native.isa_supported("avx2"),
             "amx": f["amx_tile"] and f["amx_bf16"] and f["amx_int8"] and f["os_amx"]}
    assert native.isa_supported(isa) == needs[isa]
    # the best isa: AMX over AVX-512 over AVX-VNNI over AVX2
    order = [p for p in moe_kernels.ISAS if native.isa_supported(p)]
    assert native.best_isa() == order[-1]
    if not native.isa_supported(isa):
        monkeypatch.setenv("MOE_KERNEL_PATH", isa)
        with pytest.raises(RuntimeError, match="cannot run"):
            moe_kernels.choose_isa()


PAIRED = """
import sys, torch
from moe_experts.kernels.native_moe import NativeMoELayer
torch.manual_seed(0)
gate, up, down = (torch.randn(3, 40, 256) * 0.1, torch.randn(3, 40, 256) * 0.1, torch.randn(3, 256, 40) * 0.1)
op = NativeMoELayer(gate, up, down, fmt=sys.argv[1], threads=2, isa="avx2")
x, ids, w = torch.randn(1, 256), torch.tensor([[0, 2]], dtype=torch.int32), torch.rand(1, 2)
torch.save(op.forward(x, ids, w), sys.argv[2])
"""


@pytest.mark.skipif(not native.isa_supported("avx2"), reason="no AVX2 on this CPU")
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "int4g32", "uint4g32"])
def test_avx2_paired_halves_are_two_halves_bitwise(fmt, tmp_path):
    """One token's whole blocks on AVX2 run both 8-row halves in one pass (each broadcast activation chunk serves
    16 rows); MOE_AVX2_PAIR=0 runs them one half at a time: the same integer sums, so the same floats. 40 rows:
    two whole blocks and a partial one (always by halves)."""
    out = {}
    for v in ("1", "0"):
        out[v] = tmp_path / f"{v}.pt"
        subprocess.run([sys.executable, "-c", PAIRED, fmt, str(out[v])], check=True,
                       env={**os.environ, "MOE_AVX2_PAIR": v})
    assert torch.equal(torch.load(out["1"]), torch.load(out["0"]))


@pytest.mark.skipif(not native.isa_supported("avxvnni"), reason="no AVX-VNNI on this CPU")
@pytest.mark.parametrize("fmt", ["int8", "int4", "mxfp4", "int4g32", "q5k", "q6k", "q3k", "q2k", "iq4xs"])
def test_avxvnni_is_avx2_bitwise(fmt):
    """vpdpbusd on (q + 128) minus 128 x the row sums and AVX2's signed pairs give the same integers, so
    the same floats after the same scaling: any difference is a bug in one of them."""
    gate, up, down = make(8, 96, 128)
    ids, w = routing(9, 3, 8)
    x = torch.randn(9, 128)
    ops = {p: layer(gate, up, down, fmt=fmt, isa=p) for p in ("avx2", "avxvnni")}
    assert torch.equal(ops["avx2"].forward(x, ids, w), ops["avxvnni"].forward(x, ids, w))


@pytest.mark.parametrize("fmt", ["q6k", "q3k", "q2k", "iq4xs"])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_int_scaled_formats_are_the_reference_on_every_path_bitwise(fmt, T):
    """q6k, q3k, q2k and iq4xs sum each 256's sc x dot products (q2k: and m x activation sums) in int32 (exact) and apply
    its d (and dmin) with one FMA each on every path, as the portable reference does: the paths agree to the bit (rows of 5 super-blocks, the last one padded; 65 row blocks,
    pairs and a lone one), and against the dequantized weights only the activations' int8 rounding is left."""
    from moe_kernels.dense import NativeLinear
    from moe_kernels.packing import unpack
    torch.manual_seed(0)
    w, x = torch.randn(1040, 1100) * 0.05, torch.randn(T, 1100)
    ref = NativeLinear(w, fmt, isa="portable")
    want = ref(x)
    for isa in ISAS:
        if isa == "amx-emulated":
            native.set_amx_emulation(True)
            isa = "amx"
        assert torch.equal(NativeLinear(w, fmt, isa=isa)(x), want), isa
    exact = x @ unpack(ref.parts, fmt, 1100)[0].T
    assert ((want - exact).norm() / exact.norm()).item() < 1.5e-2


@pytest.mark.parametrize("T", [1, 3])
def test_int8_one_token_rows_are_the_reference_bitwise(T):
    """int8 sums q x w in int32 on every path (exact) and scales it the same way: one token (AVX2 and AVX-512 read
    a row at a time there) and a few (the 4-row tiles) give the portable reference's bits, with K not a multiple
    of the one-token loops' 128 or 256 and rows not of the tiles' 4."""
    from moe_kernels.dense import NativeLinear
    torch.manual_seed(0)
    w, x = torch.randn(1041, 1060) * 0.05, torch.randn(T, 1060)  # rows of 1088 packed: 8 x 128 + 64
    want = NativeLinear(w, "int8", isa="portable")(x)
    for isa in ISAS:
        if isa == "amx-emulated":
            native.set_amx_emulation(True)
            isa = "amx"
        assert torch.equal(NativeLinear(w, "int8", isa=isa)(x), want), isa


def test_bad_ids_raise_not_abort():
    gate, up, down = make(4, 32, 64)
    op = NativeMoELayer(gate, up, down)
    with pytest.raises(ValueError, match="out of range"):
        op.forward(torch.randn(1, 64), torch.tensor([[4]], dtype=torch.int32), torch.ones(1, 1))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", ISAS)
def test_one_and_two_threads_agree_bitwise(fmt, isa):
    gate, up, down = make(8, 80, 96)
    ids, w = routing(64, 4, 8)
    x = torch.randn(64, 96)
    op = layer(gate, up, down, fmt=fmt, isa=isa)
    try:
        native.set_threads(1)
        one = op.forward(x, ids, w)
        native.set_threads(2)
        two = op.forward(x, ids, w)
    finally:
        native.set_threads(2)
    assert torch.equal(one, two)


@pytest.mark.skipif(not native.isa_supported("avx512"), reason="the AMX path (real or emulated) needs AVX-512")
@pytest.mark.parametrize("fmt", ["int4", "int4g32", "iq4nl", "mxfp4", "int8g32", "q6k", "iq4xs"])
@pytest.mark.parametrize("isa", [i for i in ISAS if i in ("amx", "amx-emulated")])
@pytest.mark.parametrize("T", [40, 150])
def test_amx_signed_tiles_are_the_avx512_kernel_bitwise(fmt, isa, T):
    """Prefill of the row-blocked signed formats on AMX (gemm_blocked.h's blocked_tiles: a block's scale groups decoded
    into s8 tiles, the tokens the A operand, K = 64, 32 or q6k's 16 a product) computes the AVX-512 kernel's integers and FMAs
    in its order: the same bits. 2I = 80 and H = 72 rows: whole blocks and a shorter last one (left to AVX-512);
    token counts not a multiple of 16; K = 72 and 40 pad to several groups' tiles."""
    gate, up, down = make(4, 40, 72)
    ids, w = routing(T, 2, 4)
    x = torch.randn(T, 72)
    got = layer(gate, up, down, fmt=fmt, isa=isa, threads=2).forward(x, ids, w)
    want = layer(gate, up, down, fmt=fmt, isa="avx512", threads=2).forward(x, ids, w)
    assert torch.equal(got, want)


def test_loading_shows_progress_per_expert(checkpoints, capsys):
    """Quantizing a large model takes minutes: a progress bar counts experts (on a terminal; forced here)."""
    from moe_experts.store import load_expert_layers
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config

    d = checkpoints["qwen3_moe"]
    cfg = load_config(d)
    layers = load_expert_layers(cfg, Checkpoint(d), "int8", 1, progress=True)
    err = capsys.readouterr().err
    total = len(cfg.moe_layers) * cfg.n_routed_experts
    assert f"{total}/{total}" in err and "experts -> int8" in err
    assert sorted(layers) == list(cfg.moe_layers)


@pytest.mark.slow
def test_numa_grouping_gives_the_same_answer(tmp_path):
    """Experts on (pretend) NUMA nodes, tasks taken node-first: bitwise the same output."""
    import subprocess
    import sys

    script = tmp_path / "numa.py"
    script.write_text(
        "import sys, torch\n"
        "from moe_kernels import native as n\n"
        "from moe_experts.kernels.native_moe import NativeMoELayer\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w = [(torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((9, 40, 96), (9, 40, 96), (9, 96, 40))]\n"
        "x = torch.randn(33, 96, generator=g)\n"
        "ids = torch.stack([torch.randperm(9, generator=g)[:3] for _ in range(33)]).to(torch.int32)\n"
        "wt = torch.rand(33, 3, generator=g)\n"
        "outs = {f: NativeMoELayer(*w, fmt=f, threads=2).forward(x, ids, wt) for f in ('bf16', 'int8', 'int4')}\n"
        "torch.save((n.numa_topology(), n.numa_place(0, 0, 1), outs), sys.argv[1])\n")
    got = {}
    for fake in ("1", "2"):
        out = tmp_path / f"out{fake}.pt"
        subprocess.run([sys.executable, str(script), str(out)], check=True, env={**__import__("os").environ,
                       "MOE_NUMA_FAKE": fake})
        got[fake] = torch.load(out)
    assert got["2"][0].startswith("2 pretend node(s)") and got["1"][0].startswith("1 node")
    assert got["2"][1] == 0  # pretend nodes bind no memory
    for f in ("bf16", "int8", "int4"):
        assert torch.equal(got["1"][2][f], got["2"][2][f]), f


def under_tunings(op, args, tunings):
    """op.forward(*args) under each native.set_tuning(*t) in turn, the defaults restored after."""
    default = native.get_tuning()
    try:
        outs = []
        for t in tunings:
            native.set_tuning(*t)
            outs.append(op.forward(*args))
        return outs
    finally:
        native.set_tuning(*default)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", ISAS)
def test_paired_blocks_at_prefill_do_not_change_the_answer(fmt, isa):
    """AVX-512's prefill pairs 16-row blocks from tuning's pair_from tokens on (the formats with a scale per group):
    never, from 8 and from 1 token give the same bits, on rows of whole and short blocks, many tokens per expert."""
    # 400 gate/up rows: 25 blocks (one unpaired); 308 down rows: 19 whole blocks and a short one (the last pair)
    gate, up, down = make(3, 200, 308)
    ids, w = routing(40, 2, 3)
    x = torch.randn(40, 308)
    op = layer(gate, up, down, fmt=fmt, isa=isa)
    default = native.get_tuning()
    # (paired first: a row a kernel skipped would keep a scratch buffer's old value)
    outs = under_tunings(op, (x, ids, w), [(*default[:3], pair_from) for pair_from in (8, 1, 0)])
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    close(outs[0], reference(x, *dequantized(op), ids, w, fmt), TOL[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("isa", ISAS)
def test_task_size_and_prefetch_distance_do_not_change_the_answer(fmt, isa):
    """Each expert's rows cut into many 64-row tasks (the smallest) or one task, prefetching near or
    far: the same bits, and the reference's answer."""
    gate, up, down = make(4, 200, 300)
    ids, w = routing(7, 2, 4)
    x = torch.randn(7, 300)
    op = layer(gate, up, down, fmt=fmt, isa=isa)
    outs = under_tunings(op, (x, ids, w), [(0, 1), (65536, 1), (8192, 4096)])
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    close(outs[0], reference(x, *dequantized(op), ids, w, fmt), TOL[fmt])


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_rows_longer_than_one_k_chunk(isa):
    """Hidden size above the bf16 kernel's K chunk (8192): partial sums carried across chunks."""
    gate, up, down = make(2, 16, 8300)
    ids, w = routing(9, 2, 2)
    x = torch.randn(9, 8300)
    op = layer(gate, up, down, fmt="bf16", isa=isa)
    close(op.forward(x, ids, w), reference(x, *dequantized(op), ids, w, "bf16"), TOL["bf16"])


def test_bandwidth_probe_checks_the_cpu():
    """Every probe variant the CPU and OS allow runs; the others are refused with a message, never an
    illegal instruction (auto picks the widest available)."""
    f = native.cpu_features()
    buf = torch.ones(1 << 22)
    allowed = {"scalar": True, "avx2": f["avx2"] and f["os_avx"], "avx512": f["avx512f"] and f["os_avx512"]}
    assert native.read_bandwidth(buf.data_ptr(), buf.numel()) > 0
    for variant, ok in allowed.items():
        if ok:
            assert native.read_bandwidth(buf.data_ptr(), buf.numel(), variant) > 0
        else:
            with pytest.raises(ValueError, match="not available"):
                native.read_bandwidth(buf.data_ptr(), buf.numel(), variant)


def test_portable_only_machines_run_bf16_on_torch(monkeypatch):
    """Where only plain C++ runs, torch's bf16 code is faster: bf16 goes there unless a isa was forced;
    the int formats have no torch operator and stay native."""
    import moe_experts.kernels as k
    monkeypatch.setattr(k, "NATIVE_ISA", "portable")
    monkeypatch.delenv("MOE_KERNEL_PATH", raising=False)
    assert k.kernel_path("bf16") == "torch" and k.kernel_path("int8") == "portable"
    gate, up, down = make(4, 32, 64)
    assert isinstance(k.MoELayer(gate, up, down, fmt="bf16"), TorchMoELayer)
    monkeypatch.setenv("MOE_KERNEL_PATH", "portable")
    assert k.kernel_path("bf16") == "portable"
    monkeypatch.setattr(k, "NATIVE_ISA", "avx2")
    monkeypatch.delenv("MOE_KERNEL_PATH")
    assert k.kernel_path("bf16") == "avx2"


@pytest.mark.parametrize("isa", ISAS + ["torch"])
def test_id_minus_one_is_no_expert(isa):
    """A sharded expert service gets -1 for the pairs other shards hold: the same output as leaving
    those pairs out (weight 0), whatever their weight; a token of only -1 gets zeros."""
    E, I, H = 8, 64, 128
    gate, up, down = torch.randn(E, I, H) * 0.1, torch.randn(E, I, H) * 0.1, torch.randn(E, H, I) * 0.1
    op = TorchMoELayer(gate, up, down) if isa == "torch" else layer(gate, up, down, fmt="bf16", isa=isa)
    x, ids, w = torch.randn(6, H), torch.randint(0, E, (6, 4), dtype=torch.int32), torch.rand(6, 4)
    none = torch.rand(6, 4) < 0.4
    none[5] = True
    got = op.forward(x, torch.where(none, torch.full_like(ids, -1), ids), w)
    want = op.forward(x, ids, torch.where(none, torch.zeros_like(w), w))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[5].abs().max() == 0
    assert want.abs().max() > 0.1


def test_the_bound_layer_keeps_its_weights_alive():
    """native.MoELayer holds the packed buffers it points into: it outlives the Python layer that built it (the
    shared-memory ring keeps only the bound object), and an ISA this CPU lacks is refused when it is built."""
    import gc

    gate, up, down = make(4, 64, 64)
    ids, w = routing(3, 2, 4)
    x = torch.randn(3, 64)
    op = NativeMoELayer(gate, up, down, fmt="int8")
    want = op.forward(x, ids, w)
    bound = op.native
    del op
    gc.collect()
    for _ in range(3):  # reuse the freed Python objects' memory, if anything had been freed
        NativeMoELayer(*make(4, 64, 64), fmt="int8")
    got = torch.empty(3, 64)
    bound.forward(x.contiguous().data_ptr(), ids.to(torch.int32).contiguous().data_ptr(),
                  w.float().contiguous().data_ptr(), got.data_ptr(), 3, 2)
    assert torch.equal(got, want) and bound.isa == moe_kernels.ISA
    missing = [i for i in moe_kernels.ISAS if not moe_kernels.native.isa_supported(i) and i != "amx"]
    for isa in missing:
        with pytest.raises(ValueError, match="not supported here"):
            NativeMoELayer(gate, up, down, fmt="int8", isa=isa)
