"""DeepSeek Sparse Attention's decode kernels (native/kernels/dsa.cpp and the selection in attention.cpp, through
moe_kernels.attention) against float64 references on every vector path this CPU runs and the portable loops: the
lightning indexer's scores over a paged pool, the top k with its ties, the latent attention over the selected
positions; MiniMax-M3's block indexer, each head's scores by the same kernel."""
import pytest
import torch

native = pytest.importorskip("moe_kernels._native", reason="native extension not built")

from moe_kernels.attention import dsa_scores, dsa_top_k, head_scores, mla_paged_attention  # noqa: E402

PATHS = [p for p in ("portable", "avx2", "avx512") if native.isa_supported(p)]
B = 16  # the pool's block


def paged(x: torch.Tensor, spare: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [L, d] laid out in a pool's blocks through a scattered table -> (pool [blocks, B, d], table)."""
    L, d = x.shape
    n = -(-L // B)
    pool = torch.randn(n + spare, B, d).to(x.dtype)
    table = torch.randperm(n + spare)[:n].to(torch.int32)
    flat = pool[table.long()].reshape(-1, d)
    flat[:L] = x
    pool[table.long()] = flat.view(n, B, d)
    return pool, table


def scores_reference(q, w, K, scale):
    """float64: sum over heads of w * relu(scale * q . k) (transformers' DeepseekV32Indexer)."""
    return (w.double()[:, None] * torch.relu(q.double() @ K.double().T * scale)).sum(0)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H, D", [(64, 128), (8, 16), (3, 40)])  # 40: a tail past the 16 lanes
@pytest.mark.parametrize("L", [1, 5, 300])                      # 5, 300: a short tail of the four keys a pass
def test_indexer_scores_match_reference(isa, dtype, H, D, L):
    torch.manual_seed(L * 7 + D)
    K = torch.randn(L, D).to(dtype)
    pool, table = paged(K)
    q, w = torch.randn(H, D), torch.randn(H)
    got = dsa_scores(q, w, pool, table, L, D ** -0.5, isa)
    assert got.shape == (L,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), scores_reference(q, w, K, D ** -0.5), rtol=1e-5, atol=1e-4)


def test_every_path_scores_the_same_bits():
    """Lane-wise sums: a prompt picks the same keys on every kernel path."""
    torch.manual_seed(0)
    pool, table = paged(torch.randn(1000, 128).bfloat16())
    q, w = torch.randn(64, 128), torch.randn(64)
    outs = [dsa_scores(q, w, pool, table, 1000, 128 ** -0.5, isa) for isa in PATHS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def top_k_reference(scores: list[float], k: int) -> list[int]:
    """The k first in (score descending, position ascending), ascending."""
    return sorted(sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:k])


@pytest.mark.parametrize("L, k", [(1, 4), (4, 4), (5, 4), (300, 16), (2000, 2048), (5000, 2048)])
def test_top_k_keeps_the_best_and_breaks_ties_towards_earlier_positions(L, k):
    torch.manual_seed(L)
    # few distinct values: ties everywhere, across the cut too; zeros as every head's relu leaves them
    scores = torch.randint(-3, 4, (L,)).float().clamp(min=0)
    got = dsa_top_k(scores, k)
    assert got.dtype == torch.int32 and got.tolist() == top_k_reference(scores.tolist(), k)
    distinct = torch.randn(L)
    assert dsa_top_k(distinct, k).tolist() == top_k_reference(distinct.tolist(), k)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nh, r, dr", [(16, 512, 64), (4, 64, 16),  # DeepSeek's dims (vector kernel), a toy's,
                                       (16, 512, 0), (4, 64, 0)])  # NoPE latents (GLM-5.3-Flash's: vector kernel)
def test_latent_attention_over_a_selection_matches_reference(isa, dtype, nh, r, dr):
    torch.manual_seed(nh)
    L = 300
    C, KPE = torch.randn(L, r).to(dtype), torch.randn(L, dr).to(dtype)
    Cp, table = paged(C)
    KPEp = torch.empty(Cp.shape[0], B, dr).to(dtype)
    KPEp[table.long()] = torch.cat([KPE, torch.zeros(-(-L // B) * B - L, dr).to(dtype)]).view(-(-L // B), B, dr)
    sel = torch.tensor(sorted(torch.randperm(L)[:37].tolist()), dtype=torch.int32)
    q = (torch.randn(nh, r + dr) * 0.1).to(dtype)
    scale = (128 + dr) ** -0.5
    got = mla_paged_attention(q, Cp, KPEp, table, L, scale, isa, selected=sel)
    keys = torch.cat([C, KPE], dim=-1).double()[sel.long()]
    want = torch.softmax(q.double() @ keys.T * scale, dim=-1) @ C.double()[sel.long()]
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_the_indexer_and_selection_refuse_what_does_not_fit():
    pool, table = paged(torch.randn(20, 16))
    with pytest.raises(ValueError, match="do not fit"):
        dsa_scores(torch.randn(4, 32), torch.randn(4), pool, table, 20, 0.25)  # q wider than the keys
    with pytest.raises(ValueError, match="do not hold"):
        dsa_scores(torch.randn(4, 16), torch.randn(4), pool, table, 40, 0.25)  # past the table
    C, KPE = torch.randn(4, B, 64), torch.randn(4, B, 16)
    t = torch.tensor([0, 1], dtype=torch.int32)
    for sel in (torch.tensor([0, 20], dtype=torch.int32), torch.tensor([-1], dtype=torch.int32),
                torch.tensor([0, 1]), torch.zeros(0, dtype=torch.int32)):
        with pytest.raises(ValueError, match="selected"):
            mla_paged_attention(torch.randn(2, 80), C, KPE, t, 20, 0.1, selected=sel)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("H, D", [(4, 128), (2, 16), (7, 64), (3, 40), (12, 32)])  # 40 wide, 12 heads: the packed kernel
@pytest.mark.parametrize("L", [1, 5, 300])
def test_each_heads_scores_match_reference(isa, dtype, H, D, L):
    """MiniMax-M3's block indexer (head_scores: the kernel without weights or relu): each head's q . k, [H, L]; an
    8-bit pool's keys read in place as their dequantized values."""
    from moe_kernels import kv_quant

    torch.manual_seed(L * 5 + D)
    x = torch.randn(L, D)
    stored = kv_quant.quantize(x, dtype) if kv_quant.quantized(dtype) else x.to(dtype)
    pool, table = paged(stored.view(torch.uint8) if kv_quant.quantized(dtype) else stored)
    pool = pool.view(dtype) if kv_quant.quantized(dtype) else pool
    keys = kv_quant.dequantize(stored.view(torch.uint8), dtype, torch.float32) if kv_quant.quantized(dtype) \
        else stored.float()
    q = torch.randn(H, D)
    got = head_scores(q, pool, table, L, isa)
    assert got.shape == (H, L) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), q.double() @ keys.double().T, rtol=1e-5, atol=1e-4)
