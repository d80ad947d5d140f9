"""Routed-expert operators against a plain fp32 torch reference: every path this machine can run,
awkward sizes, repeated ids, zero weights, async submit/wait, thread counts."""
import pytest
import torch
import torch.nn.functional as F

from expert_service.kernels import TorchMoELayer

native = pytest.importorskip("expert_service._moe_native", reason="native extension not built")
from expert_service.kernels.native_moe import NativeMoELayer  # noqa: E402

PATHS = [p for p in ("portable", "avx512_bf16", "amx") if native.path_supported(p) and p != "amx"]


def reference(x, gate, up, down, ids, w):
    """fp32, one token and one expert at a time."""
    out = torch.zeros(x.shape[0], gate.shape[2])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            a = F.silu(gate[e].float() @ x[t].float()) * (up[e].float() @ x[t].float())
            out[t] += w[t, j].float() * (down[e].float() @ a)
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


# bf16 rounding of x, gate/up outputs and the activation: ~3 significant digits each -> 2% of the
# output's range is a safe bound; fp32 accumulation throughout.
BF16_TOL = 2e-2


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T", [1, 2, 7, 64])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("E, I, H", [(8, 80, 96), (16, 64, 128), (9, 33, 70)])
def test_native_matches_reference(path, T, k, E, I, H):
    if k > E:
        pytest.skip("k > E")
    gate, up, down = make(E, I, H)
    ids, w = routing(T, k, E)
    x = torch.randn(T, H)
    op = NativeMoELayer(gate, up, down, threads=2, path=path)
    close(op.forward(x, ids, w), reference(x, gate, up, down, ids, w), BF16_TOL)


@pytest.mark.parametrize("path", PATHS)
def test_large_T_repeated_ids_and_zero_weights(path):
    E, I, H, T, k = 8, 48, 96, 300, 2
    gate, up, down = make(E, I, H)
    ids = torch.randint(0, E, (T, k), dtype=torch.int32)
    ids[:, 1] = ids[:, 0]  # the same expert twice in one token
    w = torch.rand(T, k)
    w[::3] = 0.0
    x = torch.randn(T, H)
    op = NativeMoELayer(gate, up, down, threads=2, path=path)
    got = op.forward(x, ids, w)
    close(got, reference(x, gate, up, down, ids, w), BF16_TOL)
    assert torch.all(got[::3] == 0)


def test_paths_agree_and_async_matches_forward():
    gate, up, down = make(8, 80, 96)
    ids, w = routing(5, 3, 8)
    x = torch.randn(5, 96)
    outs = [NativeMoELayer(gate, up, down, path=p).forward(x, ids, w) for p in PATHS]
    for o in outs[1:]:
        close(o, outs[0], 1e-3)
    op = NativeMoELayer(gate, up, down)
    op.submit(x, ids, w)
    assert torch.equal(op.wait(), op.forward(x, ids, w))
    assert op.forward(x.bfloat16(), ids, w).dtype == torch.bfloat16


def test_torch_operator_matches_reference():
    gate, up, down = make(8, 80, 96)
    ids, w = routing(7, 2, 8)
    x = torch.randn(7, 96)
    op = TorchMoELayer(gate.float(), up.float(), down.float(), fmt="fp32")
    close(op.forward(x, ids, w), reference(x, gate, up, down, ids, w), 1e-5)


def test_bad_ids_raise_not_abort():
    gate, up, down = make(4, 32, 64)
    op = NativeMoELayer(gate, up, down)
    with pytest.raises(ValueError, match="out of range"):
        op.forward(torch.randn(1, 64), torch.tensor([[4]], dtype=torch.int32), torch.ones(1, 1))


@pytest.mark.parametrize("path", PATHS)
def test_one_and_two_threads_agree_bitwise(path):
    gate, up, down = make(8, 80, 96)
    ids, w = routing(64, 4, 8)
    x = torch.randn(64, 96)
    op = NativeMoELayer(gate, up, down, path=path)
    try:
        native.set_threads(1)
        one = op.forward(x, ids, w)
        native.set_threads(2)
        two = op.forward(x, ids, w)
    finally:
        native.set_threads(2)
    assert torch.equal(one, two)
