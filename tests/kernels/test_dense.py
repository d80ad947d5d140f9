"""Dense layers on the native kernels (moe_kernels.dense, gpu-service --dense-format): against a plain
fp32 reference on the same (dequantized) weights, on every isa this CPU runs; and the GPU-side model
with its dense layers packed against the same model on torch's matmuls."""

import pytest
import torch

import moe_kernels
from moe_kernels import native
from moe_kernels.dense import NativeLinear
from moe_kernels.packing import unpack

from harness import ROOT

ISAS = [p for p in moe_kernels.ISAS if native.isa_supported(p)]
if native.isa_supported("avx512"):  # the tile packing and epilogue, tiles emulated (as tests/kernels/test_kernels.py)
    ISAS.append("amx-emulated")


@pytest.fixture(autouse=True)
def no_amx_emulation_left_on():
    yield
    native.set_amx_emulation(False)
TOL = {"bf16": 1e-2, "int8": 3e-2, "int4": 3e-2}  # relative to the output's norm: activation rounding only


def dequantized(lin: NativeLinear) -> torch.Tensor:
    """The weight as the kernels see it, fp32 [rows, K]."""
    return unpack(lin.parts, lin.fmt, lin.K)[0]


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("rows, K", [(96, 128), (70, 200), (1100, 64)])
def test_linear_matches_reference(fmt, isa, T, rows, K):
    torch.manual_seed(0)
    w = torch.randn(rows, K) * 0.05
    if isa == "amx-emulated":
        native.set_amx_emulation(True)
        isa = "amx"
    lin = NativeLinear(w, fmt, isa=isa)
    x = torch.randn(T, K)
    got = lin(x)
    want = x @ dequantized(lin).T
    assert got.shape == (T, rows) and got.dtype == torch.float32
    assert ((got - want).norm() / want.norm()).item() < TOL[fmt]
    assert ((lin(x.bfloat16()).float() - want).norm() / want.norm()).item() < TOL[fmt] + 1e-2


# the formats whose one-token path is a kernel of its own (a row at a time, or one row-block stream) beside the tiles
ONE_TOKEN = ["bf16", "int8", "fp8", "int4", "q4k", "q5k", "q6k", "q2k", "mxfp4", "int8g32"]


# (AVX2's fp8 row at a time sums in four chains, its tiles in one or two: equal up to rounding only)
@pytest.mark.parametrize("fmt, isa", [(f, i) for f in ONE_TOKEN for i in ISAS
                                      if not (f == "fp8" and i in ("avx2", "avxvnni"))])
def test_one_token_gets_the_bits_it_gets_among_a_few(fmt, isa):
    """A decode step's sequence alone computes its rows as the same token does beside others (a batch of 3 takes
    the tiles): alone or batched, a request's tokens do not depend on its neighbours. 100 rows: whole 16-row blocks,
    a short one, and a 4-row tile's remainder; K 512: two 256s of the super-blocked formats."""
    torch.manual_seed(0)
    if isa == "amx-emulated":
        native.set_amx_emulation(True)
        isa = "amx"
    lin = NativeLinear((torch.randn(100, 512) * 0.05).bfloat16(), fmt, isa=isa)
    x = torch.randn(3, 512).bfloat16().float()  # fp32 rows: fp32 outputs, every last bit seen
    batched = lin(x)
    for i in range(3):
        assert torch.equal(lin(x[i:i + 1]), batched[i:i + 1]), i


@pytest.mark.parametrize("path", ["amx", "avx512"])
def test_bf16_prefill_goes_to_torch_on_the_packed_rows(monkeypatch, path):
    """bf16 weights on the isas with bf16 arithmetic: from dense.TORCH_FROM_TOKENS bf16 tokens on, torch's matmul
    runs on a view of the packed rows (no second copy of the weight); fewer tokens, or fp32 ones, stay ours."""
    import moe_kernels.dense as dense
    torch.manual_seed(0)
    w = torch.randn(96, 200) * 0.05  # K = 200: padded rows, so the view is strided
    calls = []

    class Recorder:  # the native matrix, on any CPU (amx need not run here): records the token counts
        def __init__(self, *a, **kw):
            pass

        def forward(self, x, y, T, round_bf16=False):
            calls.append(T)

    monkeypatch.setattr(dense.native, "Linear", Recorder)
    lin = NativeLinear(w, "bf16", isa=path)
    assert lin._torch_weight.data_ptr() == lin.parts[0].data_ptr()
    x = torch.randn(dense.TORCH_FROM_TOKENS, 200)
    want = x @ dequantized(lin).T
    got = lin(x.bfloat16())
    assert calls == [] and got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 2e-2
    lin(x[:-1].bfloat16())
    lin(x)
    assert calls == [dense.TORCH_FROM_TOKENS - 1, dense.TORCH_FROM_TOKENS]
    assert NativeLinear(w, "bf16", isa="avx2")._torch_weight is None  # (no bf16 arithmetic: torch converts)
    assert NativeLinear(w, "int8", isa=path)._torch_weight is None


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "fp8"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T", [1, 3, 20])  # 20: AMX's tile chunks of 16 tokens, a short second one
def test_grouped_linear_is_each_group_on_its_own(fmt, isa, T):
    """linear_groups (DeepSeek-V4's grouped output projection in one native call): each group's rows the same bits as
    its own NativeLinear call."""
    from moe_kernels.dense import linear_groups
    torch.manual_seed(1)
    if isa == "amx-emulated":
        native.set_amx_emulation(True)
        isa = "amx"
    parts = [NativeLinear(torch.randn(200, 256) * 0.05, fmt, isa=isa) for _ in range(3)]
    x = torch.randn(T, 3, 256)
    got = linear_groups(parts, x)
    assert got.shape == (T, 3, 200) and got.dtype == torch.float32
    assert all(torch.equal(got[:, g], p(x[:, g].contiguous())) for g, p in enumerate(parts))
    xb = x.bfloat16()
    assert all(torch.equal(linear_groups(parts, xb)[:, g], p(xb[:, g].contiguous())) for g, p in enumerate(parts))
    with pytest.raises(ValueError, match="does not fit"):
        linear_groups(parts, torch.randn(T, 2, 256))
    with pytest.raises(ValueError, match="formats or kernel paths differ"):
        native.linear_groups([parts[0].native, NativeLinear(torch.randn(200, 256), "int8" if fmt != "int8" else "int4",
                                                             isa=isa).native], x.data_ptr(), x.data_ptr(), T)


def test_linear_keeps_leading_dims_and_checks_width():
    lin = NativeLinear(torch.randn(32, 64), "bf16")
    assert lin(torch.randn(2, 3, 64)).shape == (2, 3, 32)
    assert lin(torch.randn(0, 64)).shape == (0, 32)
    with pytest.raises(ValueError, match="features"):
        lin(torch.randn(1, 65))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_float_output_is_the_rounded_output_as_float(dtype):
    """as_float (the lm_head's logits): the values of y.to(dtype).float(), bit for bit, in one pass."""
    lin = NativeLinear(torch.randn(1000, 64), "int8")
    x = torch.randn(3, 64).to(dtype)
    got = lin(x, as_float=True)
    assert got.dtype == torch.float32 and torch.equal(got, lin(x).float())
    # rounded to bf16 for a bf16 input only
    assert torch.equal(got, got.to(torch.bfloat16).float()) == (dtype == torch.bfloat16)


def test_packing_goes_in_chunks_with_the_same_result(monkeypatch):
    import moe_kernels.dense as dense
    w = torch.randn(300, 128)
    whole = NativeLinear(w, "int4")
    monkeypatch.setattr(dense, "PACK_ROWS", 64)
    chunked = NativeLinear(w, "int4")
    assert all(torch.equal(a, b) for a, b in zip(whole.parts, chunked.parts) if a is not None)


# measured: bf16 0.2% off, every argmax equal; int8 3.0%, every argmax equal (int4: 7%, half of them)
@pytest.mark.parametrize("fmt, tol, agree", [("bf16", 0.01, 1.0), ("int8", 0.06, 0.75)])
def test_model_with_native_dense_layers_matches_torch_dense(fmt, tol, agree):
    """The embedded (bf16) model in one process: logits with every projection, dense MLP and lm_head on
    the native kernels against the same model on torch's matmuls."""
    from moe_experts.store import load_expert_layers
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import DTYPES, Model, Segment
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config

    d = ROOT / "models" / "default"
    cfg = load_config(d)
    experts = LocalExperts(load_expert_layers(cfg, Checkpoint(d), "bf16", 2))
    prompt = torch.tensor([5, 17, 300, 41, 7, 99, 1000, 12])

    def logits(dense):
        model = Model(cfg, Checkpoint(d), torch.device("cpu"), DTYPES["bf16"], dense_format=dense)
        return model.forward([Segment(model.new_cache(), prompt, 0, all_logits=True)], experts)

    ref, got = logits(None), logits(fmt)
    assert ((got - ref).norm() / ref.norm()).item() < tol
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= agree


@pytest.mark.parametrize("isa, ckpt, want_dtype, want_dense", [
    ("avx512", "bfloat16", torch.bfloat16, "bf16"),   # bf16 arithmetic: the checkpoint's dtype
    ("amx", "bfloat16", torch.bfloat16, "bf16"),
    ("avx2", "bfloat16", torch.float32, "bf16"),      # none: fp32 compute, the weights still bf16
    ("portable", "bfloat16", torch.float32, None),    # no SIMD kernels: torch for everything
    (None, "bfloat16", torch.float32, None),          # not built
    ("avx2", "float32", torch.float32, None),         # fp32 checkpoints stay exact
])
def test_auto_dtype_and_dense_format_follow_the_cpu(monkeypatch, isa, ckpt, want_dtype, want_dense):
    from types import SimpleNamespace

    from gpu_service.model import model as load
    monkeypatch.setattr(load, "native_isa", lambda: isa)
    cpu = torch.device("cpu")
    cfg = SimpleNamespace(torch_dtype=ckpt)
    assert load.compute_dtype("auto", cfg, cpu) == want_dtype
    assert load.compute_dtype("bf16", cfg, cpu) == torch.bfloat16  # asked for: given
    assert load.dense_format("auto", cpu, load.DTYPES[ckpt]) == want_dense
    assert load.dense_format("torch", cpu, load.DTYPES[ckpt]) is None
    assert load.dense_format("auto", torch.device("cuda"), load.DTYPES[ckpt]) is None
    assert load.dense_format("auto", cpu, load.DTYPES[ckpt], "fp32") is None  # asked for fp32: exact, torch
    assert load.dense_format("auto", cpu, load.DTYPES[ckpt], "bf16") == want_dense


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "glm4_moe",
                                    "minimax_m2", "gpt_oss", "qwen3_next", "qwen3_5_moe"])
def test_every_family_runs_with_native_dense_layers(family, checkpoints):
    """GQA's q/k/v fused into one packed matrix (qwen2_moe: with biases), gate/up of dense MLPs and shared
    experts into another, MLA's projections one by one: logits close to the same weights on torch's fp32
    matmuls."""
    from moe_experts.store import load_expert_layers
    from gpu_service.model.attention import QKV
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import Model, Segment
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config

    d = checkpoints[family]
    cfg = load_config(d)
    experts = LocalExperts(load_expert_layers(cfg, Checkpoint(d), "fp32", 2))
    # a top-k choice whose scores tie within bf16's rounding can flip, and a flip of a heavy expert changes
    # everything after it (17-25% here for deepseek_v3 and qwen3_5_moe on some of five prompts tried, with
    # torch's own bf16 weights too): on this prompt no family has such a tie
    prompt = torch.tensor([200, 17, 3, 41, 77, 9])

    def run(dense):
        model = Model(cfg, Checkpoint(d), torch.device("cpu"), torch.float32, dense_format=dense)
        return model, model.forward([Segment(model.new_cache(), prompt, 0, all_logits=True)], experts)

    _, ref = run(None)
    model, got = run("bf16")
    assert any(k.endswith(QKV) for k in model.W) == (cfg.attention != "mla")
    assert not any(k.endswith((".gate_proj.weight", ".up_proj.weight")) for k in model.W)  # fused into gate_up
    if cfg.linear_attn:  # Qwen3-Next's (Qwen3.5's) DeltaNet projections are packed too
        packed = [w for k, w in model.W.items()
                  if k.endswith(("in_proj_qkvz.weight", "in_proj_qkv.weight", "linear_attn.out_proj.weight"))]
        assert len(packed) == 2 * cfg.layer_types.count("linear_attention")
        assert not any(isinstance(w, torch.Tensor) for w in packed)
    # bf16 weights and activations against fp32: measured 0.4-1.6% (qwen3_next the most)
    assert ((got - ref).norm() / ref.norm()).item() < 0.03


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("kv_b_dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_runs_its_absorbed_products_natively(family, kv_b_dtype, checkpoints, monkeypatch):
    """MLA's decode steps with the native dense layers take kv_b_proj's absorbed products to the native kernels
    (moe_kernels.attention.mla_absorb_*), prefill keeps torch's batched matmuls; the logits match the same model
    with torch's einsums (fp32 sums both, in another order), for kv_b_proj kept in fp32 and in bf16 (what an fp32
    model keeps of a bf16 checkpoint: model._stored_dtype)."""
    from moe_experts.store import load_expert_layers
    from gpu_service.model import model as load
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import Model, Segment
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    from moe_kernels import attention as native_attention

    d = checkpoints[family]
    cfg = load_config(d)
    experts = LocalExperts(load_expert_layers(cfg, Checkpoint(d), "fp32", 2))
    model = Model(cfg, Checkpoint(d), torch.device("cpu"), torch.float32, dense_format="bf16")
    model.decode_blocks = {}  # the layer loop's mla_attention (the native blocks call the same kernels: test_decode_step)
    for k in [k for k in model.W if k.endswith("kv_b_proj.weight")]:
        model.W[k] = model.W[k].to(kv_b_dtype)
    calls = []
    real, supports = native_attention.mla_absorb_q, native_attention.supports_kv_b
    monkeypatch.setattr(native_attention, "mla_absorb_q", lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))

    def decode(native: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(native_attention, "supports_kv_b", supports if native else lambda w: False)
        cache, out = model.new_cache(), []
        prompt = torch.tensor([200, 17, 3, 41, 77, 9, 12, 300, 5, 61])  # 10 tokens: above NATIVE_ABSORB_TOKENS
        out.append(model.forward([Segment(cache, prompt, 0)], experts))
        for i, tok in enumerate([8, 90, 33]):
            out.append(model.forward([Segment(cache, torch.tensor([tok]), len(prompt) + i)], experts))
        return out

    want, got = decode(False), decode(True)
    assert calls == [1] * (3 * cfg.num_layers)  # the decode steps' layers, not the prefill's 10 tokens
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert load._stored_dtype(cfg, "model.layers.0.self_attn.kv_b_proj.weight", torch.float32, torch.device("cpu"),
                              "bf16") == (torch.bfloat16 if cfg.torch_dtype in ("bfloat16", "bf16") else torch.float32)
