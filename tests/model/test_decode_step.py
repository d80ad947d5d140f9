"""The native decode step of attention blocks (gpu_service/model/native_stages.py, native/decode/decode_step.cpp) against the torch
path it replaces (attention.gqa_attention / mla_attention and the model's norms, the reference): one sequence's
logits and KV rows bit for bit, several sequences in one step (their projections batched) to the last bits, for the
GQA and MLA families it takes, bf16 and fp32, packed bf16 and int8 dense layers; and the layers it must leave to
torch."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tiny_models
from harness import ROOT, TESTS
from moe_experts.store import load_expert_layers
from gpu_service.model import native_stages
from gpu_service.experts.local import LocalExperts
from gpu_service.engine.kv_pool import BLOCK
from gpu_service.model.model import Model, Segment
from moe_core.checkpoint import Checkpoint
from moe_core.config import load_config
from moe_kernels import ISA, SIMD_ISAS

pytestmark = pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the native step runs on the vector kernel paths")

# the tiny families with heads of a vector kernel's width (64); qwen2_moe has q/k/v biases, qwen3_moe QK-norm,
# glm4_moe all three and partial rotary (half of each head) and a sigmoid router; qwen2_moe and glm4_moe dense MLP
# layers and shared experts (which the decode steps run natively too: native_stages.mlps)
SHAPES = {"qwen3_moe": dict(head_dim=64), "mixtral": dict(head_dim=64),
          "qwen2_moe": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
          "glm4_moe": dict(head_dim=64),
          # MLA: DeepSeek's latent and rotary widths (the latent attention's vector kernel), q through q_a/q_b and a
          # sigmoid router; V2's q_proj alone, small widths (its plain loops), a softmax router on fp32 logits
          # choosing within the best 2 of 4 groups
          "deepseek_v3": dict(kv_lora_rank=512, qk_rope_head_dim=64), "deepseek_v2": {},
          # sliding windows (4, 5) beside full layers, attention sinks; MiMo-V2-Flash's keys of 192 and values of 128
          # (scaled, twice the KV heads on its sliding layers, their own rope base), a dense first layer, a sigmoid
          # router; gpt-oss's biases everywhere (its router runs in route())
          "mimo_v2_flash": dict(head_dim=192, v_head_dim=128), "gpt_oss": dict(head_dim=64)}
ROUTED = ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3", "deepseek_v2", "mimo_v2_flash"]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    base = tmp_path_factory.mktemp("wide")
    return {f: tiny_models.build(f, base / f, seed=3, **kw) for f, kw in SHAPES.items()}


def load(d, dtype, fmt, router=True, experts="fp32", kv_dtype=None):
    """router=False: the native blocks without the router (route() chooses, as on the torch path). experts: the
    routed experts' format (fp32 runs torch, whose GEMM rounds a row differently with the batch's size on some
    CPUs; the native formats give a token the same bits whatever else the batch holds). kv_dtype: the pool's."""
    cfg = load_config(d)
    model = Model(cfg, Checkpoint(d), torch.device("cpu"), dtype, dense_format=fmt, kv_dtype=kv_dtype)
    if not router:
        model.decode_blocks = {L: _without_router(b, L, model) for L, b in model.decode_blocks.items()}
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # norms start at 1 and biases at 0: make them matter (in place: the blocks hold them)
        for n, w in model.W.items():
            if isinstance(w, torch.Tensor) and (n.endswith("norm.weight") or n.endswith(".bias")):
                w.add_((torch.randn(w.shape, generator=g) * 0.3).to(w.dtype))
    return cfg, model, LocalExperts(load_expert_layers(cfg, Checkpoint(d), experts, 1))


def _without_router(block, layer, model):
    original = native_stages._router
    native_stages._router = lambda *a: {}
    try:
        return native_stages.blocks(model.cfg, model.W, model.dtype, True)[layer]
    finally:
        native_stages._router = original


class Recording(LocalExperts):
    """The experts, keeping each layer's routing as submitted."""

    def __init__(self, layers):
        super().__init__(layers)
        self.routes = []

    def submit(self, step, layer, x, ids, w, defer):
        self.routes.append((layer, ids.clone(), w.clone()))
        super().submit(step, layer, x, ids, w, defer)


def decode(model, experts, segments, native: bool):
    """One step with the native blocks or without them (the torch reference)."""
    blocks = model.decode_blocks
    if not native:
        model.decode_blocks = {}
    try:
        return model.forward(segments, experts)
    finally:
        model.decode_blocks = blocks


def kv_rows(cache, layer, n):
    """The layer's rows as stored (an 8-bit pool's as bytes: codes and scales)."""
    return [b.clone().view(torch.uint8) if b.element_size() == 1 else b.clone()
            for b in cache.gather(layer, n, cache.held_from(layer))]


@pytest.mark.parametrize("family", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt, kv", [("bf16", None), ("int8", None), ("bf16", torch.float16), ("bf16", torch.int8),
                                     ("bf16", torch.float8_e4m3fn)],
                         ids=["bf16", "int8", "bf16-kv16", "bf16-kvint8", "bf16-kvfp8"])
def test_one_sequence_is_the_torch_path_bit_for_bit(wide, family, dtype, fmt, kv):
    """The attention blocks (route() choosing the experts on both sides): logits and KV rows bit for bit; with an
    fp16 pool (--kv-cache-dtype) its rows stored as torch's .to() stores them, with an 8-bit one its codes and
    scales as kv_quant.quantize stores them, read in place (the torch path reads them dequantized)."""
    cfg, model, experts = load(wide[family], dtype, fmt, router=False, kv_dtype=kv)
    assert model.kv_pool().bufs[0][0].dtype == (kv or dtype)
    assert set(model.decode_blocks) == set(range(cfg.num_layers))
    assert not any(b.routes for b in model.decode_blocks.values())
    dense = [L for L in range(cfg.num_layers) if not cfg.is_moe_layer(L)]
    assert sorted(model.decode_mlps) == (list(range(cfg.num_layers)) if cfg.shared_intermediate_size else dense)
    prompt = torch.tensor([5, 17, 300, 41, 7, 99, 12, 3, 250])
    feed = torch.randint(2, tiny_models.VOCAB, (24,), generator=torch.Generator().manual_seed(1))
    mine, ref = model.new_cache(), model.new_cache()
    for c in (mine, ref):
        model.forward([Segment(c, prompt, 0)], experts)
    pos = len(prompt)
    for tok in feed:  # across a block boundary (16) and into a third block
        got = decode(model, experts, [Segment(mine, tok[None], pos)], True)
        want = decode(model, experts, [Segment(ref, tok[None], pos)], False)
        assert torch.equal(got, want), f"position {pos}"
        pos += 1
    for layer in range(cfg.num_layers):
        for a, b in zip(kv_rows(mine, layer, pos), kv_rows(ref, layer, pos)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("family", ROUTED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_native_router_chooses_as_route_does(wide, family, dtype):
    """With the router in the step: the same experts at every MoE layer and step (softmax: in the same order;
    sigmoid and DeepSeek-V2's: torch's unsorted topk has no order to keep); the softmax routers' weights and the
    logits bit for bit (torch's softmax arithmetic in its order), the fp32-logit routers' (sigmoid, V2's softmax)
    to the last bits (their logits are summed in another order than torch's matmul)."""
    c = load_config(wide[family])
    unsorted = c.scoring == "sigmoid" or c.model_type == "deepseek_v2"
    exact = not unsorted
    cfg, model, _ = load(wide[family], dtype, "bf16")
    moe = [L for L in range(cfg.num_layers) if cfg.is_moe_layer(L)]
    assert moe and all(model.decode_blocks[L].routes for L in moe)
    assert not any(model.decode_blocks[L].routes for L in range(cfg.num_layers) if L not in moe)
    layers = load_expert_layers(cfg, Checkpoint(wide[family]), "fp32", 1)
    mine, ref = Recording(layers), Recording(layers)
    prompt = torch.tensor([5, 17, 300, 41, 7, 99, 12, 3, 250])
    cm, cr = model.new_cache(), model.new_cache()
    model.forward([Segment(cm, prompt, 0)], mine)
    model.forward([Segment(cr, prompt, 0)], ref)
    feed = torch.randint(2, tiny_models.VOCAB, (12,), generator=torch.Generator().manual_seed(4))
    for i, tok in enumerate(feed):
        got = decode(model, mine, [Segment(cm, tok[None], len(prompt) + i)], True)
        want = decode(model, ref, [Segment(cr, tok[None], len(prompt) + i)], False)
        if exact:
            assert torch.equal(got, want), f"step {i}"
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 if dtype == torch.bfloat16 else 1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert len(mine.routes) == len(ref.routes) == len(moe) * (1 + len(feed))
    for (la, ia, wa), (lb, ib, wb) in zip(mine.routes, ref.routes):
        if unsorted:  # each row by id
            ia, order = ia.sort(dim=-1)
            wa = wa.gather(1, order)
            ib, order = ib.sort(dim=-1)
            wb = wb.gather(1, order)
        assert la == lb and torch.equal(ia, ib)
        if exact:
            assert torch.equal(wa, wb)
        torch.testing.assert_close(wa, wb, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5, atol=0)


@pytest.mark.parametrize("norm, round_bf16", [(True, True), (False, False), (True, False)])
# torch's topk selects (nth_element) below 64 k experts, sorts above; 12 and 60: torch's softmax sums a tail
@pytest.mark.parametrize("E", [128, 512, 12, 60])
def test_softmax_topk_is_routes_softmax(norm, round_bf16, E):
    """native softmax_topk against layers.route's softmax branch on the same logits: ids and their order equal
    (ties of bf16 logits included), weights bit for bit (torch's vector exp, its sum's order)."""
    from types import SimpleNamespace

    from gpu_service.model.layers import route
    from moe_kernels import native

    k, B = 8, 256
    logits = (torch.randn(B, E, generator=torch.Generator().manual_seed(5)) * 2).to(
        torch.bfloat16 if round_bf16 else torch.float32)
    cfg = SimpleNamespace(top_k=k, n_routed_experts=E, scoring="softmax", model_type="qwen3_moe" if round_bf16
                          else "mixtral", norm_topk_prob=norm)
    want_ids, want_w = route(cfg, logits, lambda x: x, None)  # the "weight" passes the logits through
    lf = logits.float().contiguous()
    ids, w = torch.empty(B, k, dtype=torch.int32), torch.empty(B, k)
    native.softmax_topk(lf.data_ptr(), B, E, k, norm, round_bf16, ids.data_ptr(), w.data_ptr())
    assert torch.equal(ids, want_ids)
    assert torch.equal(w, want_w)


@pytest.mark.parametrize("method, groups, topk_group", [("greedy", 1, 1), ("group_limited_greedy", 8, 3),
                                                       ("group_limited_greedy", 4, 4)])
@pytest.mark.parametrize("B, E", [(256, 160), (3, 64)])
def test_softmax_topk_in_groups_is_deepseek_v2s_route(method, groups, topk_group, B, E):
    """DeepSeek-V2's router (route()'s deepseek_v2 branch: softmax of fp32 logits, the experts of the topk_group
    groups with the highest maxima, unsorted top-k, times routed_scaling_factor) against native softmax_topk with
    groups and scaling on the same logits (an identity weight passes them through exactly): the same experts,
    weights bit for bit."""
    from types import SimpleNamespace

    from gpu_service.model.layers import route
    from moe_kernels import native

    k = 6
    logits = torch.randn(B, E, generator=torch.Generator().manual_seed(6)) * 2
    cfg = SimpleNamespace(top_k=k, n_routed_experts=E, scoring="softmax", model_type="deepseek_v2",
                          topk_method=method, n_group=groups, topk_group=topk_group, routed_scaling_factor=16.0)
    want_ids, want_w = route(cfg, logits, torch.eye(E), None)
    ids, w = torch.empty(B, k, dtype=torch.int32), torch.empty(B, k)
    native.softmax_topk(logits.data_ptr(), B, E, k, False, False, ids.data_ptr(), w.data_ptr(),
                        groups if method != "greedy" else 1, topk_group if method != "greedy" else 1, 16.0)
    want_ids, order = want_ids.sort(dim=-1)
    ids, mine = ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    assert torch.equal(w.gather(1, mine), want_w.gather(1, order))


@pytest.mark.parametrize("groups, topk_group, bias", [(1, 1, False), (8, 3, True), (4, 4, True)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("B, E", [(256, 128), (3, 40)])  # 3 x 40: torch's sigmoid ends in its scalar loop
def test_sigmoid_topk_is_routes_sigmoid(groups, topk_group, bias, norm, B, E):
    """native sigmoid_topk against layers.route's sigmoid branch (DeepSeek-V3 / GLM-4.5 noaux_tc) on the same
    logits: the same experts (by id: torch's topk leaves them unsorted), the same weights bit for bit (torch's
    sigmoid, its sum in another order: to an ulp)."""
    from types import SimpleNamespace

    from gpu_service.model.layers import route
    from moe_kernels import native

    k = 8
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(B, E, generator=g) * 2
    b = torch.rand(E, generator=g) * 0.1 if bias else None
    cfg = SimpleNamespace(top_k=k, n_routed_experts=E, scoring="sigmoid", n_group=groups, topk_group=topk_group,
                          norm_topk_prob=norm, routed_scaling_factor=2.5)
    want_ids, want_w = route(cfg, logits, torch.eye(E), b)  # F.linear(logits, I) is logits
    ids, w = torch.empty(B, k, dtype=torch.int32), torch.empty(B, k)
    native.sigmoid_topk(logits.data_ptr(), b.data_ptr() if bias else 0, B, E, k, groups, topk_group, norm, 2.5,
                        ids.data_ptr(), w.data_ptr())
    choice = logits.sigmoid() + (b if bias else 0)
    assert (choice.gather(1, ids.long())[:, :-1] >= choice.gather(1, ids.long())[:, 1:]).all()  # descending
    ids, order = ids.sort(dim=-1)
    want_ids, want_order = want_ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w.gather(1, order), want_w.gather(1, want_order), rtol=4e-7 if norm else 0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("I", [48, 40, 20])
@pytest.mark.parametrize("B", [1, 3, 17, 40])
def test_native_mlp_is_the_torch_path_across_torchs_vector_loop_and_its_tail(dtype, I, B):
    """A gated SwiGLU MLP (Qwen2-MoE's shared expert: the gate's sigmoid a run of B values) natively against
    step.mlp's torch ops on the same packed matrices, bit for bit: torch's silu and sigmoid take Sleef's
    exp two vectors at a time and libm's for the rest of a run (a row's last I % 16 or 32 gate values, every value
    of a short run), and the native MLP must do the same (native/kernels/torch_rounding.h)."""
    import torch.nn.functional as F

    from gpu_service.model.layers import linear
    from moe_kernels import native
    from moe_kernels.dense import NativeLinear

    H = 64
    g = torch.Generator().manual_seed(I * 100 + B)
    gate_up = NativeLinear([torch.randn(I, H, generator=g), torch.randn(I, H, generator=g)], "bf16")
    down = NativeLinear(torch.randn(H, I, generator=g) * 0.2, "bf16")
    gate = NativeLinear(torch.randn(1, H, generator=g), "bf16")
    x = (torch.randn(B, H, generator=g) * 0.5).to(dtype)
    m = native.Mlp(dtype == torch.bfloat16, gate_up.native, down.native, gate.native, owner=(gate_up, down, gate))
    a, b = linear(x, gate_up).chunk(2, dim=-1)
    want = F.sigmoid(linear(x, gate)) * linear(F.silu(a) * b, down)
    assert torch.equal(native_stages.mlp(m, x), want)


@pytest.mark.slow
def test_native_mlp_and_softmax_follow_torch_limited_to_its_default_capability():
    """ATEN_CPU_CAPABILITY=default: torch's vector exp is libm's everywhere, its sums lane by lane; decode_step
    tells the native side."""
    import os
    import pathlib
    import subprocess
    import sys

    code = ("import torch, test_decode_step as t; from moe_kernels import native; "
            "assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT' and native.torch_vector_bytes() == 0; "
            "[t.test_native_mlp_is_the_torch_path_across_torchs_vector_loop_and_its_tail(d, I, B) "
            "for d in (torch.bfloat16, torch.float32) for I in (48, 20) for B in (1, 40)]; "
            "[t.test_softmax_topk_is_routes_softmax(n, r, E) for n, r in ((True, True), (False, False)) "
            "for E in (12, 128)]")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default",
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(__file__).parent), str(TESTS), str(ROOT),
                                           os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3", "mimo_v2_flash", "gpt_oss"])
@pytest.mark.parametrize("dtype, kv", [(torch.bfloat16, None), (torch.float32, None), (torch.float32, torch.float16)],
                         ids=["bf16", "fp32", "fp32-kv16"])
def test_several_sequences_in_one_step(wide, family, dtype, kv):
    """Three sequences of different lengths, their blocks interleaved in the pool (read through the table), decode
    together: each as the torch path decodes it alone, up to the batched projections' last bits."""
    # native experts: torch's fp32 ones round a token's rows differently at 3 tokens than at 1 (MKL on AVX2), and
    # the dense layers' bf16 activations can turn such a last bit into a visible one (as the native router's
    # softmax did while its exp was libm's: 0.011 in an fp32 qwen2_moe logit on a Zen 3)
    cfg, model, experts = load(wide[family], dtype, "bf16", experts="bf16", kv_dtype=kv)
    prompts = [torch.arange(3, 3 + n) % tiny_models.VOCAB for n in (5, 18, 33)]
    mine = [model.new_cache() for _ in prompts]
    ref = [model.new_cache() for _ in prompts]
    for cs in (mine, ref):
        for c, p in zip(cs, prompts):
            model.forward([Segment(c, p, 0)], experts)
    pos = [len(p) for p in prompts]
    g = torch.Generator().manual_seed(2)
    for step in range(20):
        toks = torch.randint(2, tiny_models.VOCAB, (3,), generator=g)
        got = decode(model, experts, [Segment(c, toks[i:i + 1], pos[i]) for i, c in enumerate(mine)], True)
        want = torch.cat([decode(model, experts, [Segment(c, toks[i:i + 1], pos[i])], False)
                          for i, c in enumerate(ref)])
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 if dtype == torch.bfloat16 else 1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        pos = [p + 1 for p in pos]
    assert any(not c.consecutive() for c in mine)  # the table path ran
    assert max(pos) > 2 * BLOCK


def test_sequences_of_different_pools_are_refused(wide):
    _, model, _ = load(wide["qwen3_moe"], torch.float32, "bf16")
    from gpu_service.engine.kv_pool import KVPool, SeqCache
    other = SeqCache(KVPool(model.cfg, model.dtype, model.device, 8))
    with pytest.raises(ValueError, match="different KV pools"):
        native_stages.sequences([model.new_cache(), other], [0, 0])


def test_only_the_layers_it_can_run(checkpoints, wide):
    """Output gates, zero-centred norms, one norm over all heads, GQA heads without a vector kernel, fp16, torch's
    dense matmuls: the torch path (partial rotary, MLA, sinks and windows are taken: glm4_moe, deepseek, gpt_oss and
    mimo_v2_flash above)."""
    cfg = load_config(wide["qwen3_moe"])
    assert native_stages.eligible(cfg, torch.bfloat16, True)
    assert not native_stages.eligible(cfg, torch.bfloat16, False)
    assert not native_stages.eligible(cfg, torch.float16, True)
    assert native_stages.eligible(dataclasses.replace(cfg, attn_sinks=True), torch.bfloat16, True)
    for change in (dict(attn_output_gate=True), dict(norm_offset=True), dict(qk_norm_full=True), dict(head_dim=16),
                   dict(v_head_dim=96)):
        assert not native_stages.eligible(dataclasses.replace(cfg, **change), torch.bfloat16, True), change
    assert native_stages.eligible(dataclasses.replace(cfg, rotary_dim=32), torch.bfloat16, True)
    assert native_stages.eligible(dataclasses.replace(cfg, attention="mla", head_dim=16), torch.bfloat16, True)
    for family in ("gpt_oss", "minimax_m2", "qwen3_next", "glm4_moe"):  # (glm4_moe: 16-dim heads)
        d = checkpoints[family]
        model = Model(load_config(d), Checkpoint(d), torch.device("cpu"), torch.float32, dense_format="bf16")
        assert model.decode_blocks == {}, family


def test_cos_sin_rows_from_the_models_table_are_rope_cos_sins(wide):
    """The step's cos/sin come from a table of every position so far (Model.rope), grown on demand: the same
    numbers as rope_cos_sin of the step's positions, before and after the table grows."""
    from gpu_service.model.layers import rope_cos_sin
    _, model, _ = load(wide["qwen3_moe"], torch.bfloat16, "bf16")
    for positions in ([0], [3, 900], [1023, 1024], [1500], [5000, 7, 5000]):
        p = torch.tensor(positions)
        got = model.rope(p, max(positions) + 1)
        want = rope_cos_sin(model.inv_freq, model.rope_scaling, p, model.dtype)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), positions
    assert model.rope_table[0].shape[0] >= 5001
