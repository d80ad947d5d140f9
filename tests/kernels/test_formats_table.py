"""The weight format table (moe_kernels/formats.py): every entry's quantize -> pack -> unpack gives back its numbers
bit for bit, the numbers it keeps pass through as published, its bits a weight are what its layout stores, every
entry has a native kernel, and the names the CLIs and the GGUF reader use are the table's."""
import pytest
import torch

pytest.importorskip("moe_kernels._native", reason="native extension not built")
from moe_kernels import formats, packing  # noqa: E402
from moe_kernels.formats import FORMATS, NAMES, format_of  # noqa: E402

E, ROWS, K = 2, 40, 300  # two row blocks and a shorter one; K pads to a row unit


def weights(seed: int, rows: int = ROWS, k: int = K) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * 0.1
    w[3, :40] = 0  # a zero group
    return w.bfloat16()


def reference(q) -> torch.Tensor:
    """A format's numbers as floats, by the numbers' own dequantize (not the packed layout's reader)."""
    return (q if isinstance(q, torch.Tensor) else q.dequantize()).float()


def round_trip(q, fmt: str, k: int) -> torch.Tensor:
    """One matrix's numbers packed as expert 1 of two (expert 0 other weights) and read back."""
    f = format_of(fmt)
    Kp = packing.row_len(k, fmt)
    other = f.pack(published(fmt, 99, q.shape[0], k) if f.exact_only else f.quantize(weights(99, q.shape[0], k).float()), Kp)
    packed = [None if a is None else torch.stack([a, b]) for a, b in zip(other, f.pack(q, Kp))]
    return f.unpack(packed, k)[1]


def published(fmt: str, seed: int, rows: int, k: int):
    """Numbers an exact-only format keeps (the IQ grid types: random valid blocks, rows of k // 256 blocks)."""
    from moe_kernels import iq_formats
    return iq_formats.random_blocks(fmt, rows, k // 256, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", [n for n in NAMES if FORMATS[n].exact_only])
def test_exact_only_formats_pack_their_numbers_and_refuse_floats(fmt):
    f = FORMATS[fmt]
    with pytest.raises(ValueError, match=f"the {fmt} format holds GGUF .* as stored; it does not quantize"):
        f.quantize(weights(0).float())
    q = published(fmt, 0, ROWS, 512)
    assert packing.quantize(q, fmt) is q and torch.equal(round_trip(q, fmt, 512), reference(q))
    both = packing.stack_rows([q, q], fmt)
    assert type(both) is type(q) and both.shape == (2 * ROWS, 512)


@pytest.mark.parametrize("fmt", [n for n in NAMES if not FORMATS[n].exact_only])
def test_quantize_pack_unpack_gives_the_numbers_back(fmt):
    f = FORMATS[fmt]
    w = weights(0)
    q = f.quantize(w.float())
    assert type(q) in f.keeps or not f.keeps
    got = round_trip(q, fmt, K)
    assert got.shape == (ROWS, K) and got.dtype == torch.float32
    assert torch.equal(got, reference(q)[:, :K])
    assert torch.equal(got, packing.format_values(w, fmt))  # packing's functions read the same entry
    assert (got - w.float()).abs().max() < 0.5 * w.float().abs().max()  # and they are the weights, roughly


@pytest.mark.parametrize("fmt", [n for n in NAMES if FORMATS[n].keeps and not FORMATS[n].exact_only])
def test_published_numbers_pass_through_bit_for_bit(fmt):
    """Every type the format keeps (made by whichever entry quantizes to it) is packed as it is, not requantized."""
    f = FORMATS[fmt]
    makers = [g for g in FORMATS.values() if not g.exact_only and type(g.quantize(weights(1, 16, 256).float())) in f.keeps]
    assert {type(g.quantize(weights(1, 16, 256).float())) for g in makers} == set(f.keeps)
    for g in makers:
        q = g.quantize(weights(2, 128, 512).float())  # (fp8: whole 128-row blocks, to be stacked)
        assert packing.quantize(q, fmt) is q
        assert torch.equal(round_trip(q, fmt, 512), reference(q))
        both = packing.stack_rows([q, q], fmt)
        assert type(both) is type(q) and both.shape == (256, 512)


@pytest.mark.parametrize("fmt", NAMES)
def test_bits_a_weight_are_what_the_layout_stores(fmt):
    f = FORMATS[fmt]
    rows, Kp = 48, packing.row_len(4096, fmt)
    assert Kp % f.row_unit == 0 and f.super_blocked == (f.row_unit == formats.QK)
    parts = [p for p in packing.layout(fmt, 1, rows, Kp) if p is not None]
    nbytes = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in parts)
    real = [p for p in packing.alloc(fmt, 3, rows, Kp) if p is not None]
    assert sum(p.nelement() * p.element_size() for p in real) == 3 * nbytes
    extra = 8 * nbytes / (rows * Kp) - f.bits
    if f.row_blocked:  # every scale is a group's: counted in bits
        assert extra == 0, (fmt, extra)
    else:  # int8's scale and sum a row, fp8's scale a block: not counted
        assert 0 <= extra <= 64 / Kp, (fmt, extra)


@pytest.mark.parametrize("call", [
    lambda n: format_of(n), lambda n: packing.row_len(100, n), lambda n: packing.layout(n, 1, 16, 64),
    lambda n: packing.quantize(torch.zeros(16, 64), n), lambda n: packing.pack_expert(torch.zeros(16, 64), n, 64),
    lambda n: packing.unpack((torch.zeros(1, 16, 64), None, None, None), n, 64)])
def test_an_unknown_format_is_named_with_the_known_ones(call):
    with pytest.raises(ValueError, match=r"'q9z'") as e:
        call("q9z")
    assert all(n in str(e.value) for n in NAMES)


def test_the_names_everyone_lists_are_the_tables():
    from moe_core import config, gguf_model
    from moe_experts import kernels
    assert NAMES[0] == "bf16"  # the CLIs list bf16 first, then NAMES[1:]
    assert packing.FORMATS == kernels.NATIVE_FORMATS == NAMES
    assert config.FP8_BLOCK == formats.FP8_BLOCK
    assert set(packing.ROW_BLOCKED) == {n for n, f in FORMATS.items() if f.row_blocked}
    for qtype, stored in gguf_model.AS_STORED.items():  # the GGUF reader's "as stored" formats are entries
        assert stored.kept_by and set(stored.kept_by) <= set(NAMES), qtype
        assert gguf_model.KEEPS[qtype] == tuple(stored.kept_by)


@pytest.mark.parametrize("fmt", NAMES)
def test_every_entry_has_a_native_kernel(fmt):
    from moe_experts.kernels.native_moe import NativeMoELayer
    g = torch.Generator().manual_seed(3)
    if FORMATS[fmt].exact_only:  # its numbers as published, rows of 256
        parts = [tuple(published(fmt, 3 * e + i, 256, 256) for i in range(3)) for e in range(2)]
        op = NativeMoELayer.from_experts(2, 256, 256, lambda e: parts[e], fmt=fmt, threads=1)
    else:
        gate, up, down = ((torch.randn(*s, generator=g) * 0.1).bfloat16() for s in ((2, 32, 64), (2, 32, 64), (2, 64, 32)))
        op = NativeMoELayer(gate, up, down, fmt=fmt, threads=1)
    H = op.hidden
    out = op.forward(torch.randn(3, H, generator=g), torch.tensor([[0, 1]] * 3, dtype=torch.int32), torch.ones(3, 2))
    assert out.shape == (3, H) and bool(out.isfinite().all()) and bool(out.abs().sum() > 0)
