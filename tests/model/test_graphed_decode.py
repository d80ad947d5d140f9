"""The graphed decode step (gpu_service/model/cuda_graphs.py) on the CPU: its segments run eagerly, or under a recording
stand-in for torch.cuda.CUDAGraph that checks each replay would read what the capture read. Against Model.forward's
per-op path (itself checked against transformers in test_e2e_families), several sequences of different lengths in
padded buckets, across context buckets, with deferral. What needs CUDA (the capture itself, its speed) runs in
scripts/gpu_check.sh."""
from __future__ import annotations

import concurrent.futures

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import tiny_models
from moe_experts.store import load_expert_layers
from gpu_service.model import cuda_graphs
from gpu_service.experts.local import LocalExperts
from gpu_service.engine.kv_pool import BLOCK
from gpu_service.model.model import Model, Segment
from moe_core.checkpoint import Checkpoint
from moe_core.config import load_config
from moe_core.routing import split_deferred
from tiers import some

FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "minimax_m2", "deepseek_v3", "deepseek_v2"]

# ops a captured graph cannot hold: a host synchronization, a shape that depends on values, a tensor made from Python
# values at capture (its host copy would be baked in)
FORBIDDEN = {"aten._local_scalar_dense.default", "aten.item.default", "aten.tolist.default", "aten.nonzero.default", "aten.masked_select.default",
             "aten.lift_fresh.default", "aten.lift_fresh_copy.default", "aten._unique2.default"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("graphed")
    return {f: tiny_models.build(f, base / f, seed=5) for f in FAMILIES + ["gpt_oss", "qwen3_next"]}


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MIN_CONTEXT", 16)  # the tests' contexts cross buckets: 16, 32, 64


def load(d, dtype=torch.float32, device="cpu"):
    """The model, its pool's never-written rows NaN (as memory a pool takes may hold anything: the positions a
    row's gather reads past its own length must not reach its answer), and fp32 experts in this process."""
    cfg = load_config(d)
    model = Model(cfg, Checkpoint(d), torch.device(device), dtype)
    for bufs in model.kv_pool().bufs:
        for b in bufs or ():
            b.fill_(float("nan"))
    return model, LocalExperts(load_expert_layers(cfg, Checkpoint(d), "fp32", 1))


class Trace(TorchDispatchMode):
    """Each op of a segment with what it reads: tensors made before the segment (weights, the pool, the bucket's
    buffers) by address, shape, strides and dtype; tensors the segment made by shape and dtype; every other argument
    as it is."""

    def __init__(self):
        super().__init__()
        self.ops, self.made = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        assert name not in FORBIDDEN, f"{name} in a segment"
        inputs, sig = set(), []
        for a in pytree.tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor):
                ptr = a.untyped_storage().data_ptr()
                inputs.add(ptr)
                sig.append(("made", tuple(a.shape), a.dtype) if ptr in self.made else
                           ("held", ptr, a.storage_offset(), tuple(a.shape), a.stride(), a.dtype))
            else:
                sig.append(a)
        out = func(*args, **kwargs)
        for o in pytree.tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                self.made.add(o.untyped_storage().data_ptr())
        self.ops.append((name, sig))
        return out


class Recorder:
    """A capture function for Model.graphs: each segment's trace at capture; each replay runs the segment again and
    asserts the same trace (what a CUDA graph would replay is what was captured)."""

    def __init__(self):
        self.captured = self.replayed = 0

    def __call__(self, fn):
        trace = Trace()
        with trace:
            fn()
        self.captured += 1
        recorder = self

        class Replay:
            def replay(self):
                again = Trace()
                with again:
                    fn()
                assert again.ops == trace.ops, "a replay would read other tensors or arguments than the capture"
                recorder.replayed += 1
        return Replay()


def decode_batch(model, experts, prompts, steps, graphs, defer=0, step0=0):
    """Prefill each prompt alone, then `steps` greedy steps of all of them together -> (logits of each step, the
    caches)."""
    caches = [model.new_cache() for _ in prompts]
    model.graphs = "off"
    last = [model.forward([Segment(c, p, 0)], experts)[-1] for c, p in zip(caches, prompts)]
    model.graphs = graphs
    toks, pos, out = torch.stack(last).argmax(-1), [len(p) for p in prompts], []
    for i in range(steps):
        logits = model.forward([Segment(c, toks[j:j + 1], pos[j]) for j, c in enumerate(caches)], experts,
                               step=step0 + i, defer=defer)
        out.append(logits)
        toks, pos = logits.argmax(-1), [p + 1 for p in pos]
    return out, caches


PROMPTS = [torch.arange(3, 3 + n) % tiny_models.VOCAB for n in (5, 14, 30)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("defer", some([0, 1], fast=[1]))
def test_the_segments_decode_as_the_per_op_path(checkpoints, family, defer):
    """Three sequences (a bucket of 4 rows: one padded) over 40 steps (context buckets of 16 to 128 positions), the
    segments replayed under the recorder: the per-op path's logits (within 1e-4 in fp32), its greedy tokens, its KV
    rows; each replay reads what its capture read."""
    model, experts = load(checkpoints[family])
    ref, ref_caches = decode_batch(model, experts, PROMPTS, 40, "off", defer)
    rec = Recorder()
    got, caches = decode_batch(model, experts, PROMPTS, 40, rec, defer)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for c, r in zip(caches, ref_caches):
        assert c.length == r.length and c.tokens == r.tokens
        for layer in range(model.cfg.num_layers):
            for x, y in zip(c.gather(layer, c.length), r.gather(layer, r.length)):
                torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    assert rec.replayed > 30 * model.cfg.num_layers, rec.replayed
    runner = model._graphed[1]
    assert {(B, C) for B, C, _ in runner.buckets} == {(4, 32), (4, 64), (4, 128)}
    assert len({id(b.logits) for b in runner.buckets.values()}) == 1  # (the buckets of 4 rows share their buffers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (scripts/gpu_check.sh)")
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("prepared", [False, True])
def test_captured_cuda_graphs_decode_as_the_per_op_path(checkpoints, family, prepared):
    """On CUDA, the segments captured (by each bucket's first step, or all before the steps as at start-up) and
    replayed: the per-op path's greedy tokens and logits."""
    model, experts = load(checkpoints[family], device="cuda")
    assert model.graphs == "cuda"
    ref, _ = decode_batch(model, experts, PROMPTS, 40, "off", 1)
    if prepared:
        model.graphs = "cuda"
        assert model.prepare_decode_graphs(model.kv_pool(), 3, 128, True)[0] == 12
    got, _ = decode_batch(model, experts, PROMPTS, 40, "cuda", 1)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    buckets = model._graphed[1].buckets.values()
    assert all(g is not None for b in buckets for g in b.graphs)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_buckets_prepared_at_start_up_replay_for_the_steps(checkpoints, family):
    """Buckets prepared before any step (as gpu-service does at start-up): every batch bucket up to the rows asked
    for and every context bucket up to the position, each segment captured once on padded rows, which write only the
    pool's spare block; the steps then replay them (no capture of their own) and decode as the per-op path."""
    model, experts = load(checkpoints[family])
    ref, _ = decode_batch(model, experts, PROMPTS, 24, "off", 1)
    pool = model.kv_pool()
    before = [[b.clone() for b in bufs] for bufs in pool.bufs]
    rec = Recorder()
    model.graphs = rec
    prepared = model.prepare_decode_graphs(pool, 3, 60, True)
    runner = model._graphed[1]
    assert set(runner.buckets) == {(B, C, True) for B in (1, 2, 4) for C in (16, 32, 64)}
    assert prepared == (9, 9 * len(runner.buckets[4, 16, True].segments)) and rec.captured == prepared[1]
    for bufs, old in zip(pool.bufs, before):
        for b, o in zip(bufs, old):
            others = torch.arange(b.shape[-3]) != pool.spare
            torch.testing.assert_close(b[..., others, :, :], o[..., others, :, :], rtol=0, atol=0, equal_nan=True)
            assert o[..., pool.spare, 0, :].isnan().all() and not b[..., pool.spare, 0, :].isnan().any()
    captured = rec.captured
    got, _ = decode_batch(model, experts, PROMPTS, 24, rec, 1)
    assert rec.captured == captured  # every step (positions 31 to 53, 3 rows) in a prepared bucket
    assert rec.replayed >= 24 * model.cfg.num_layers
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_nothing_to_prepare_without_graphs(checkpoints):
    model, _ = load(checkpoints["mixtral"])
    assert model.graphs == "off" and model.prepare_decode_graphs(model.kv_pool(), 8, 1024, False) == (0, 0)
    model.graphs = "eager"
    assert model.prepare_decode_graphs(model.kv_pool(), 1, 0, False) == (0, 0)
    assert model.prepare_decode_graphs(model.kv_pool(), 100, 1, False) == (7, 0)  # every batch bucket (eager: no graphs), 16 positions


class LazyExperts(LocalExperts):
    """Experts that keep the tensors handed over and compute each part when it is asked for (a deferred one a layer
    later), as hot experts do on a CPU GPU side."""

    def __init__(self, layers):
        super().__init__(layers)
        self.held = {}

    def submit(self, step, layer, x, ids, w, defer):
        self.held[layer] = (x, ids, w, defer)

    def result(self, layer, deferred):
        x, ids, w, defer = self.held[layer]
        if defer:
            i_ids, i_w, d_ids, d_w = split_deferred(ids, w, defer)
            ids, w = (d_ids, d_w) if deferred else (i_ids, i_w)
        return self.layers[layer].forward(x.clone(), ids.clone(), w.clone())


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_what_was_handed_over_stays_until_its_deferred_part_is_in(checkpoints, family):
    """The experts may read x, ids and w when their results are asked for, a layer later for a deferred part: the
    bucket's hand-over buffers alternate between MoE layers, so the tokens are the per-op path's."""
    model, experts = load(checkpoints[family])
    lazy = LazyExperts(experts.layers)
    ref, _ = decode_batch(model, experts, PROMPTS, 12, "off", 1)
    got, _ = decode_batch(model, lazy, PROMPTS, 12, "eager", 1)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_bf16_and_one_sequence(checkpoints):
    """A bf16 model, one sequence (a bucket of its own), eager segments: the per-op path's greedy tokens."""
    model, experts = load(checkpoints["qwen3_moe"], torch.bfloat16)
    ref, _ = decode_batch(model, experts, PROMPTS[1:2], 24, "off")
    got, _ = decode_batch(model, experts, PROMPTS[1:2], 24, "eager")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0.05)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_padded_rows_write_only_the_pools_spare_block(checkpoints):
    """Three sequences in a bucket of four rows, a fourth sequence waiting: the padded row's keys go to the pool's
    spare block (never given to a sequence), never into the waiting sequence's blocks."""
    model, experts = load(checkpoints["qwen3_moe"])
    model.graphs = "eager"
    caches = [model.new_cache() for _ in range(4)]
    for c in caches:
        model.forward([Segment(c, PROMPTS[0], 0)], experts)
    n = len(PROMPTS[0])
    waiting = caches[3]
    before = [[t.clone() for t in waiting.gather(L, n)] for L in range(model.cfg.num_layers)]
    spare_before = [b[:, model.kv_pool().spare].clone() for b in model.kv_pool().bufs[0]]
    for i in range(3):
        model.forward([Segment(c, torch.tensor([7 + j]), n + i) for j, c in enumerate(caches[:3])], experts)
    assert {(B, C) for B, C, _ in model._graphed[1].buckets} == {(4, 16)}
    for L in range(model.cfg.num_layers):
        for x, y in zip(before[L], waiting.gather(L, n)):
            assert torch.equal(x, y)
    pool = model.kv_pool()
    # (a padded row is at position 0)
    assert all(a.isnan().all() and not b[:, pool.spare, 0].isnan().any() for a, b in zip(spare_before, pool.bufs[0]))
    assert pool.spare not in pool.allocate(pool.available())


def test_buckets():
    cfg = type("Cfg", (), dict(attention="gqa", num_kv_heads=4, head_dim=128, kv_lora_rank=0, qk_rope_head_dim=0))
    assert cuda_graphs.bucket(cfg, torch.bfloat16, 3, 17) == (4, 32)
    assert cuda_graphs.bucket(cfg, torch.bfloat16, 1, 1) == (1, 16)
    assert cuda_graphs.bucket(cfg, torch.bfloat16, 64, 100) == (64, 128)
    assert cuda_graphs.bucket(cfg, torch.bfloat16, 65, 100) is None  # more rows than the largest bucket
    # 2 KB of keys and values a position: 64 rows x 8192 positions is 1 GiB to gather, over GATHER_BYTES
    assert cuda_graphs.bucket(cfg, torch.bfloat16, 64, 8000) is None
    assert cuda_graphs.bucket(cfg, torch.bfloat16, 8, 8000) == (8, 8192)


def test_which_models_and_devices_take_graphs(checkpoints):
    """On the CPU the service never graphs (the native decode loop is its step); sinks, windows and linear attention
    keep the per-op path; a step the buckets do not take runs per op."""
    assert not cuda_graphs.eligible(load_config(checkpoints["gpt_oss"]))
    assert not cuda_graphs.eligible(load_config(checkpoints["qwen3_next"]))
    assert all(cuda_graphs.eligible(load_config(checkpoints[f])) for f in FAMILIES)
    model, experts = load(checkpoints["mixtral"])
    assert model.graphs == "off"
    model.graphs = "eager"
    caches = [model.new_cache() for _ in range(cuda_graphs.BATCHES[-1] + 1)]
    for c in caches:
        model.forward([Segment(c, PROMPTS[0][:2], 0)], experts)
    model.forward([Segment(c, torch.tensor([5]), 2) for c in caches], experts)
    assert not model._graphed[1].buckets  # 65 rows: the per-op path
    assert all(c.length == 3 for c in caches)
    assert BLOCK == 16


def test_a_negative_capture_length_is_refused(checkpoints):
    from harness import refused_at_start
    err = refused_at_start("gpu_service", "--model", str(checkpoints["qwen3_moe"]), "--cuda-graphs-capture", "-1")
    assert "--cuda-graphs-capture must be >= 0 positions, got -1" in err, err[-2000:]


@pytest.mark.slow
def test_through_both_services(checkpoints, tmp_path):
    """gpu-service running the graphed step's segments (MOE_DECODE_GRAPHS=eager: as on CUDA, not captured) with
    deferral, three streams at once: each stream's tokens as the per-op service gives it alone; a profiled request
    has each layer's spans."""
    from harness import Services, greedy, greedy_request
    prompts = ["def fib(n):", "The quick brown fox", "return fib(n - 1) + fib(n - 2)"]
    args = ("--max-batch", "4", "--defer", "1")
    (tmp_path / "graphed").mkdir()
    (tmp_path / "per-op").mkdir()
    s = Services(checkpoints["qwen3_moe"], tmp_path / "graphed", gpu_args=args + ("--cuda-graphs-capture", "20"),
                 gpu_env={"MOE_DECODE_GRAPHS": "eager"})
    try:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
            together = list(ex.map(lambda p: greedy(s.stub, p, 20), prompts))
        spans = list(s.stub.Generate(greedy_request(prompts[0], 4, profile=True), timeout=120))[-1].profile.spans
    finally:
        s.stop()
    # (256 positions in a service) 1, 2 and 4 rows: every step of the streams and the profiled request in them
    assert "decode graphs: 3 buckets (0 graphs) prepared at start-up" in s.logs()
    assert s.logs().count("decode graphs: a bucket of") == 3
    got = {(sp.name, sp.layer) for sp in spans if sp.service == "gpu"}
    for L in range(3):
        assert {("attention", L), ("expert_submit", L), ("shared_experts", L), ("expert_wait", L)} <= got
    s = Services(checkpoints["qwen3_moe"], tmp_path / "per-op", gpu_args=args)
    try:
        solo = [greedy(s.stub, p, 20) for p in prompts]
    finally:
        s.stop()
    assert together == solo
