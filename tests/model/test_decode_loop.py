"""The native decode loop (gpu_service/model/native_loop.py, native/decode/decode_loop.cpp): a decode step's every layer in one
call, against the layer loop it replaces (Model.forward with the native attention blocks, the reference, itself
checked against the torch path in test_decode_step.py): the same logits and KV rows bit for bit, one sequence
and several, experts in this process or behind the shared-memory ring of a real expert service, the step's end
(final norm and lm_head) in the same call; its errors, timeouts and spans; and the steps and models it leaves to
the layer loop."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
import torch

import tiny_models
from moe_experts.store import load_expert_layers
from gpu_service.model import native_loop
from moe_exchange.dispatch import ExpertServiceError, RemoteExperts
from gpu_service.experts.local import LocalExperts
from gpu_service.engine.kv_pool import BLOCK
from gpu_service.model.model import Model, Segment
from harness import Services
from moe_exchange import shm
from moe_core.checkpoint import Checkpoint
from moe_core.config import load_config
from moe_kernels import ISA, SIMD_ISAS
from protos import expert_pb2, expert_pb2_grpc

pytestmark = pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the native step runs on the vector kernel paths")

# heads of a vector kernel's width. Every layer MoE with a softmax router (qwen3_moe, mixtral); with Qwen2-MoE's
# gated shared expert (qwen2_moe_all: no dense layer); GLM-4.5's shape (glm4_moe: a dense first layer, a shared
# expert, a sigmoid router with a correction bias choosing within 2 of 4 groups, scaled weights, partial rotary,
# QK-norm and biases)
LOOPED = {"qwen3_moe": ("qwen3_moe", dict(head_dim=64, num_experts_per_tok=4)),
          "mixtral": ("mixtral", dict(head_dim=64)),
          "qwen2_moe_all": ("qwen2_moe", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                              mlp_only_layers=[])),
          "glm4_moe": ("glm4_moe", dict(head_dim=64)),
          # DeepSeek-V3's MLA (its latent and rotary widths) with its sigmoid router, a dense first layer and a
          # shared expert
          "deepseek_v3": ("deepseek_v3", dict(kv_lora_rank=512, qk_rope_head_dim=64)),
          # DeepSeek-V2's: q_proj alone, a softmax router on fp32 logits within the best 2 of 4 groups
          "deepseek_v2": ("deepseek_v2", {}),
          # MiMo-V2-Flash's keys of 192 and values of 128 (each layer's own pool strides), sliding layers with their
          # own rope base and twice the KV heads, sinks, a dense first layer, a sigmoid router
          "mimo_v2_flash": ("mimo_v2_flash", dict(head_dim=192, v_head_dim=128))}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("loop")
    made = {name: tiny_models.build(f, base / name, seed=5, **kw) for name, (f, kw) in LOOPED.items()}
    # a dense layer between MoE layers (mlp_only_layers=[1])
    made["qwen2_moe"] = tiny_models.build("qwen2_moe", base / "qwen2_moe", seed=5, hidden_size=128,
                                          num_attention_heads=2, num_key_value_heads=1)
    return made


def load(d, dtype=torch.bfloat16, fmt="bf16", experts="bf16", kv_dtype=None):
    cfg = load_config(d)
    model = Model(cfg, Checkpoint(d), torch.device("cpu"), dtype, dense_format=fmt, kv_dtype=kv_dtype)
    return cfg, model, load_expert_layers(cfg, Checkpoint(d), experts, 1)


class Counting(LocalExperts):
    """Local experts that count the layer loop's submits and the decode loop's calls."""

    def __init__(self, layers):
        super().__init__(layers)
        self.submits = self.loops = 0

    def submit(self, step, layer, x, ids, w, defer):
        self.submits += 1
        super().submit(step, layer, x, ids, w, defer)

    def decode_layers(self, *a):
        done = super().decode_layers(*a)
        self.loops += done
        return done


def step(model, experts, segments, looped: bool, **kw):
    """One forward with the decode loop where it applies, or the layer loop (the reference)."""
    if looped:
        return model.forward(segments, experts, **kw)
    keep = model.native_loop
    model.native_loop = lambda pool: None
    try:
        return model.forward(segments, experts, **kw)
    finally:
        model.native_loop = keep


def kv_rows(cache, layer, n):
    """The layer's rows below n that the pool still holds (a window layer's: its last window's blocks)."""
    return [b.clone() for b in cache.gather(layer, n, cache.held_from(layer))]


def decode_both(model, cfg, experts_mine, experts_ref, n=24, prompt=(5, 17, 300, 41, 7, 99, 12, 3, 250), defer=0):
    """Prompt, then n fed tokens through the loop (mine) and the layer loop (ref), `defer` experts a token
    deferred: logits and KV rows equal."""
    prompt = torch.tensor(prompt)
    feed = torch.randint(2, tiny_models.VOCAB, (n,), generator=torch.Generator().manual_seed(1))
    mine, ref = model.new_cache(), model.new_cache()
    model.forward([Segment(mine, prompt, 0)], experts_mine)
    model.forward([Segment(ref, prompt, 0)], experts_ref)
    pos = len(prompt)
    for tok in feed:  # across block boundaries (16 positions a block)
        got = step(model, experts_mine, [Segment(mine, tok[None], pos)], True, defer=defer)
        want = step(model, experts_ref, [Segment(ref, tok[None], pos)], False, defer=defer)
        assert torch.equal(got, want), f"position {pos}"
        pos += 1
    for layer in range(cfg.num_layers):
        for a, b in zip(kv_rows(mine, layer, pos), kv_rows(ref, layer, pos)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("family", list(LOOPED))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt, experts", [("bf16", "bf16"), ("int8", "int4")])
def test_local_experts_the_layer_loop_bit_for_bit(ckpts, family, dtype, fmt, experts):
    cfg, model, layers = load(ckpts[family], dtype, fmt, experts)
    assert model.native_loop(model.kv_pool()).has_head  # the lm_head packed: the loop ends the step too
    dense = [L for L in range(cfg.num_layers) if not cfg.is_moe_layer(L)]
    assert sorted(model.decode_mlps) == (list(range(cfg.num_layers)) if cfg.shared_intermediate_size else dense)
    moe = cfg.num_layers - len(dense)
    mine, ref = Counting(layers), Counting(layers)
    decode_both(model, cfg, mine, ref)
    assert mine.loops == 24 and mine.submits == moe  # the prompt only
    assert ref.loops == 0 and ref.submits == 25 * moe


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "deepseek_v3", "mimo_v2_flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kv", [torch.float16, torch.int8, torch.float8_e4m3fn], ids=["fp16", "int8", "fp8"])
def test_a_narrower_cache_the_layer_loop_bit_for_bit(ckpts, family, dtype, kv):
    """--kv-cache-dtype fp16: the loop stores each new K/V row as torch's .to() does and reads the fp16 pool; int8 /
    fp8: it stores each row's codes and scale as kv_quant.quantize does and reads them in place."""
    cfg, model, layers = load(ckpts[family], dtype, kv_dtype=kv)
    assert model.kv_pool().bufs[0][0].dtype == kv
    mine, ref = Counting(layers), Counting(layers)
    decode_both(model, cfg, mine, ref)
    assert mine.loops == 24 and ref.loops == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("most", [False, True], ids=["one", "all-but-one"])
def test_deferral_as_the_layer_loop_defers(ckpts, family, dtype, most):
    """Each MoE layer's `defer` lowest-weighted experts added one layer later (the last layer's at once; none into
    a dense layer): the layer loop's logits bit for bit, and deferral did change them."""
    cfg, model, layers = load(ckpts[family], dtype)
    defer = cfg.top_k - 1 if most else 1
    mine, ref = Counting(layers), Counting(layers)
    decode_both(model, cfg, mine, ref, n=12, defer=defer)
    assert mine.loops == 12 and ref.loops == 0
    c0, c1 = model.new_cache(), model.new_cache()
    prompt = torch.tensor([5, 17, 300, 41])
    model.forward([Segment(c0, prompt, 0)], mine)
    model.forward([Segment(c1, prompt, 0)], mine)
    tok = torch.tensor([9])
    assert not torch.equal(model.forward([Segment(c0, tok, 4)], mine, defer=defer),
                           model.forward([Segment(c1, tok, 4)], mine))


def test_several_sequences_in_one_step(ckpts):
    """Three sequences, blocks interleaved in the pool: the loop's batched step equals the layer loop's."""
    cfg, model, layers = load(ckpts["qwen3_moe"])
    experts = Counting(layers)
    prompts = [torch.arange(3, 3 + n) % tiny_models.VOCAB for n in (5, 18, 33)]
    mine = [model.new_cache() for _ in prompts]
    ref = [model.new_cache() for _ in prompts]
    for cs in (mine, ref):
        for c, p in zip(cs, prompts):
            model.forward([Segment(c, p, 0)], experts)
    pos = [len(p) for p in prompts]
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        toks = torch.randint(2, tiny_models.VOCAB, (3,), generator=g)
        got = step(model, experts, [Segment(c, toks[i:i + 1], pos[i]) for i, c in enumerate(mine)], True)
        want = step(model, experts, [Segment(c, toks[i:i + 1], pos[i]) for i, c in enumerate(ref)], False)
        assert torch.equal(got, want)
        pos = [p + 1 for p in pos]
    assert experts.loops == 20 and any(not c.consecutive() for c in mine) and max(pos) > 2 * BLOCK


@pytest.mark.parametrize("family", ["mixtral", "glm4_moe"])
def test_spans_cover_every_layer_in_order(ckpts, family):
    cfg, model, layers = load(ckpts[family])
    experts = Counting(layers)
    c = model.new_cache()
    model.forward([Segment(c, torch.tensor([4, 5, 6]), 0)], experts)
    spans: list = []
    model.forward([Segment(c, torch.tensor([7]), 3)], experts, step=9, spans=spans)
    assert experts.loops == 1
    per_layer = [s for s in spans if s.layer >= 0]
    moe = ("attention", "router", "expert_submit") + (("shared_experts",) if cfg.shared_intermediate_size else ()) \
        + ("expert_wait",)
    assert [(s.name, s.layer) for s in per_layer] == [
        (n, L) for L in range(cfg.num_layers) for n in (moe if cfg.is_moe_layer(L) else ("attention", "dense_mlp"))]
    assert all(s.step == 9 and s.start_ns <= s.end_ns for s in spans)
    assert all(a.end_ns == b.start_ns for a, b in zip(per_layer, per_layer[1:]))  # one after another, no gap
    assert spans[0].name == "embed" and spans[-1].name == "lm_head" and spans[0].end_ns == per_layer[0].start_ns
    assert spans[-1].start_ns == per_layer[-1].end_ns and spans[-1].end_ns > spans[-1].start_ns  # the loop's head


def test_the_head_where_the_layer_loop_ends_natively_only(ckpts):
    """The loop's head ends a decode step (its record says so); a logprobs segment's step ends in the layer loop's
    code (it scores every row); logits asked of a loop without a head are refused."""
    cfg, model, layers = load(ckpts["qwen3_moe"], torch.float32)
    experts = Counting(layers)
    c, ref = model.new_cache(), model.new_cache()
    prompt = torch.tensor([4, 5, 6, 7])
    for cache in (c, ref):
        model.forward([Segment(cache, prompt, 0)], experts)
    recs: list = []
    got = model.forward([Segment(c, torch.tensor([8]), 4)], experts, records=recs)
    assert recs[-1].head_end and torch.equal(got, step(model, experts, [Segment(ref, torch.tensor([8]), 4)], False))
    scored = Segment(c, torch.tensor([9]), 5, logprobs=True, targets=torch.tensor([], dtype=torch.long))
    model.forward([scored], experts, records=recs)
    assert experts.loops == 2 and not recs[-1].head_end and scored.scored is not None
    bare = native_loop.build(cfg, model.decode_blocks, model.decode_mlps, model.kv_pool())
    assert not bare.has_head
    h = torch.zeros(1, cfg.hidden_size)
    with pytest.raises(ValueError, match="no head set"):
        bare.run(1, h.data_ptr(), 0, 0, 0, 0, 0, False, 0, None, torch.empty(1, 8).data_ptr())


def test_what_it_leaves_to_the_layer_loop(ckpts):
    """Skipped (not deferred) experts, deferral in some layers only (the accuracy harness's), a prompt, experts
    without native kernels (torch's fp32 operator) and a model with a dense layer between MoE layers take the layer
    loop."""
    cfg, model, layers = load(ckpts["qwen3_moe"])
    experts = Counting(layers)
    c = model.new_cache()
    model.forward([Segment(c, torch.tensor([4, 5, 6, 7]), 0)], experts)  # a prompt
    model.forward([Segment(c, torch.tensor([8]), 4)], experts, defer=1, skip=True)
    model.forward([Segment(c, torch.tensor([8]), 4)], experts, defer=1, defer_layers=range(1))
    assert experts.loops == 0 and experts.submits == 3 * cfg.num_layers
    torch_ops = Counting(load_expert_layers(cfg, Checkpoint(ckpts["qwen3_moe"]), "fp32", 1))
    model.forward([Segment(c, torch.tensor([9]), 5)], torch_ops)
    assert torch_ops.loops == 0 and torch_ops.submits == cfg.num_layers
    model.forward([Segment(c, torch.tensor([9]), 6)], experts)
    assert experts.loops == 1
    between_cfg, between, _ = load(ckpts["qwen2_moe"])
    assert between_cfg.moe_layers == (0, 2) and len(between.decode_blocks) == 3 and len(between.decode_mlps) == 3
    assert between.native_loop(between.kv_pool()) is None


def test_non_finite_rows_are_refused_and_the_next_step_runs(ckpts):
    cfg, model, layers = load(ckpts["qwen3_moe"], torch.float32)
    experts = Counting(layers)
    c = model.new_cache()
    model.forward([Segment(c, torch.tensor([4, 5, 6]), 0)], experts)
    emb = model.W["model.embed_tokens.weight"]
    keep = emb[7].clone()
    emb[7] = float("nan")
    try:
        with pytest.raises(ValueError, match="non-finite"):
            model.forward([Segment(c, torch.tensor([7]), 3)], experts)
    finally:
        emb[7] = keep
    assert torch.isfinite(model.forward([Segment(c, torch.tensor([7]), 3)], experts)).all()


def test_a_token_outside_the_embedding_is_refused_and_the_next_step_runs(ckpts):
    """The loop's call takes each sequence's embedding row itself: an id past the table is refused before anything
    is computed or committed (the API refuses such ids before they reach the engine; this is the loop's own check)."""
    cfg, model, layers = load(ckpts["qwen3_moe"])
    experts = Counting(layers)
    c = model.new_cache()
    model.forward([Segment(c, torch.tensor([4, 5, 6]), 0)], experts)
    for bad in (cfg.vocab_size, -1):
        with pytest.raises(ValueError, match="outside the embedding"):
            model.forward([Segment(c, torch.tensor([bad]), 3)], experts)
    assert c.length == 3 and experts.loops == 0
    assert torch.isfinite(model.forward([Segment(c, torch.tensor([7]), 3)], experts)).all() and experts.loops == 1


def layers_of(ckpts, family="qwen3_moe", fmt="bf16"):
    d = ckpts[family]
    return load_expert_layers(load_config(d), Checkpoint(d), fmt, 1)


# -- behind the ring of a real expert service ---------------------------------------------------------
needs_shm = pytest.mark.skipif(not shm.shm_available(), reason="needs /dev/shm")


@pytest.fixture
def service(ckpts, tmp_path, request):
    s = Services(ckpts[getattr(request, "param", "qwen3_moe")], tmp_path, gpu=False,
                 expert_args=("--weight-format", "bf16"))
    with grpc.insecure_channel(f"127.0.0.1:{s.expert_port}") as ch:
        fp = expert_pb2_grpc.ExpertServiceStub(ch).Info(expert_pb2.ExpertInfoRequest(), timeout=10).model_fingerprint
    remotes = []

    def connect(**kw):
        r = RemoteExperts(f"127.0.0.1:{s.expert_port}", fp, 64 << 20, transport="shm", **kw)
        assert r.start_transport() == "shm"
        remotes.append(r)
        return r
    yield s, connect
    for r in remotes:
        r.close()
    s.stop()


@needs_shm
def test_through_the_ring_as_the_layer_loop_and_local_kernels(ckpts, service):
    """The loop over the ring: the layer loop's logits over the same ring, and the local kernels' (the expert
    service runs the same bf16 kernels); the ring's counters stay true and every layer's timing comes back."""
    s, connect = service
    cfg, model, _ = load(ckpts["qwen3_moe"])
    remote = connect()
    ran, through = [], remote.decode_layers
    remote.decode_layers = lambda *a: ran.append(through(*a)) or ran[-1]
    decode_both(model, cfg, remote, remote, n=20)
    assert ran == [True] * 20
    assert remote.shm.posted == remote.shm.consumed == (2 + 2 * 20) * cfg.num_layers and not remote.shm.expect
    assert len(remote.drain_timings()) == (2 + 20) * cfg.num_layers  # the layer loop's; the loop's are in its record
    c = model.new_cache()
    model.forward([Segment(c, torch.tensor([4, 5, 6]), 0)], remote)
    records, spans = [], []
    model.forward([Segment(c, torch.tensor([7]), 3)], remote, spans=spans, records=records)
    t = records[0].times
    assert t.shape == (cfg.num_layers, native_loop.TIMES) and not [s for s in spans if s.layer >= 0]
    assert (t[:, native_loop.EXPERT_START] > t[:, native_loop.SUBMIT_END] - 10**9).all()  # the expert side's clock
    assert (t[:, native_loop.EXPERT_END] >= t[:, native_loop.EXPERT_START]).all()
    assert (t[:, native_loop.WAIT_END] >= t[:, native_loop.EXPERT_END] - 10**6).all()
    fig = native_loop.figures(records)
    assert fig.layers.tolist() == list(range(cfg.num_layers)) and (fig.waits >= 0).all()
    assert len(fig.immediate) == len(fig.overhead) == cfg.num_layers and (fig.overhead >= 0).all()
    assert len(fig.deferred) == 0
    profiled = native_loop.spans_of(records[0])
    assert [s.name for s in profiled if s.layer == 0] == ["attention", "router", "expert_submit", "expert_wait",
                                                          "experts_immediate"]
    decode_both(model, cfg, remote, Counting(layers_of(ckpts)), n=8)
    decode_both(model, cfg, remote, remote, n=8, defer=2)  # the previous layer's deferred part read first
    assert remote.shm.consumed - remote.shm.posted == 2 * 8 * (cfg.num_layers - 1) and not remote.shm.expect
    c = model.new_cache()
    model.forward([Segment(c, torch.tensor([4, 5, 6]), 0)], remote)
    spans = []
    model.forward([Segment(c, torch.tensor([7]), 3)], remote, spans=spans, defer=2)
    deferred = [s.layer for s in spans if s.name == "experts_deferred"]
    assert deferred == list(range(cfg.num_layers - 1))


@needs_shm
@pytest.mark.parametrize("service", ["glm4_moe"], indirect=True)
def test_dense_layers_and_shared_experts_through_the_ring(ckpts, service):
    """GLM-4.5's shape over the ring: the dense first layer stays here, the shared expert runs while the expert
    service computes; the layer loop's logits over the same ring and the local kernels', deferral included."""
    s, connect = service
    cfg, model, _ = load(ckpts["glm4_moe"])
    remote = connect()
    ran, through = [], remote.decode_layers
    remote.decode_layers = lambda *a: ran.append(through(*a)) or ran[-1]
    decode_both(model, cfg, remote, remote, n=12)
    decode_both(model, cfg, remote, Counting(layers_of(ckpts, "glm4_moe")), n=6)
    decode_both(model, cfg, remote, remote, n=6, defer=2)
    assert ran == [True] * 24 and not remote.shm.expect
    c = model.new_cache()
    model.forward([Segment(c, torch.tensor([4, 5, 6]), 0)], remote)
    records = []
    model.forward([Segment(c, torch.tensor([7]), 3)], remote, records=records, defer=2)
    fig = native_loop.figures(records)
    assert fig.layers.tolist() == list(cfg.moe_layers) and (fig.waits >= 0).all()
    assert len(fig.immediate) == len(cfg.moe_layers) and len(fig.deferred) == len(cfg.moe_layers) - 1
    profiled = native_loop.spans_of(records[0])
    assert [s.name for s in profiled if s.layer == 0] == ["attention", "dense_mlp"]
    assert [s.name for s in profiled if s.layer == 1] == ["attention", "router", "expert_submit", "shared_experts",
                                                          "expert_wait", "experts_immediate", "experts_deferred"]


@pytest.mark.slow
@needs_shm
def test_a_stopped_service_times_out_and_a_dead_one_fails_fast(ckpts, service):
    s, connect = service
    cfg, model, _ = load(ckpts["qwen3_moe"])
    remote = connect(timeout_s=1.0)
    c = model.new_cache()
    model.forward([Segment(c, torch.tensor([4, 5, 6]), 0)], remote)
    os.kill(s.expert.pid, signal.SIGSTOP)
    stopped(s.expert.pid)
    try:
        with pytest.raises(ExpertServiceError, match="did not answer layer 0 within") as e:
            model.forward([Segment(c, torch.tensor([7]), 3)], remote)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and not e.value.retry
    finally:
        os.kill(s.expert.pid, signal.SIGCONT)
    assert remote.shm is None  # reset: the next step opens a fresh session
    model.forward([Segment(c, torch.tensor([7]), 3)], remote)
    assert remote.shm is not None and remote.shm.posted == cfg.num_layers
    s.expert.kill()
    s.expert.wait()
    with pytest.raises(ExpertServiceError) as e:
        model.forward([Segment(c, torch.tensor([8]), 4)], remote)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def stopped(pid: int, within_s: float = 10.0) -> None:
    """Wait until a SIGSTOP has taken: the signal is delivered asynchronously, and the service may answer a few
    requests meanwhile."""
    def states():
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                yield f.read().rsplit(")", 1)[1].split()[0]

    until = time.monotonic() + within_s
    while any(st != "T" for st in states()):  # every thread of it
        assert time.monotonic() < until, "the process did not stop"
        time.sleep(0.01)


def test_build_needs_every_layer_native(ckpts):
    """Every layer's block, every MoE layer routing natively, every dense MLP and shared expert native."""
    cfg, model, _ = load(ckpts["qwen3_moe"])
    pool = model.kv_pool()
    blocks = dict(model.decode_blocks)
    assert native_loop.build(cfg, blocks, {}, pool).layers == cfg.num_layers
    del blocks[cfg.num_layers - 1]
    assert native_loop.build(cfg, blocks, {}, pool) is None
    cfg, model, _ = load(ckpts["glm4_moe"])
    pool = model.kv_pool()
    assert native_loop.build(cfg, model.decode_blocks, model.decode_mlps, pool).layers == cfg.num_layers
    for L in (0, cfg.num_layers - 1):  # the dense layer's MLP, a shared expert
        assert native_loop.build(cfg, model.decode_blocks, {k: m for k, m in model.decode_mlps.items() if k != L},
                                 pool) is None
