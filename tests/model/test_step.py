"""The step defined once (gpu_service/model/step.py): which runner a model and a step take is decided in one place
(step.choose) and said at start (step.describe, logged by Model); every attention kind is one function that both a
sequence's cache and a CUDA-graph bucket drive; the stages compose into the per-op runner's logits whichever runner
takes the step."""
from __future__ import annotations

import logging

import pytest
import torch

import tiny_models
from gpu_service.experts.local import LocalExperts
from gpu_service.model import attention, step
from gpu_service.model.model import Model, Segment
from moe_core.checkpoint import Checkpoint
from moe_core.config import load_config
from moe_experts.store import load_expert_layers
from moe_kernels import ISA, SIMD_ISAS

native = pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the native stages run on the vector kernel paths")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("step")
    return {"qwen3_moe": tiny_models.build("qwen3_moe", base / "q", seed=3, head_dim=64, num_experts_per_tok=4),
            "qwen3_next": tiny_models.build("qwen3_next", base / "n", seed=3)}


def load(d, dtype=torch.float32, fmt=None):
    cfg = load_config(d)
    return cfg, Model(cfg, Checkpoint(d), torch.device("cpu"), dtype, dense_format=fmt), \
        LocalExperts(load_expert_layers(cfg, Checkpoint(d), "fp32", 1))


def decode(model, n=2, logprobs=False):
    segs = []
    for i in range(n):
        c = model.new_cache()
        c.reserve(4 + i)
        segs.append(Segment(c, torch.tensor([5 + i]), 3 + i, logprobs=logprobs,
                            targets=torch.zeros(0, dtype=torch.long) if logprobs else None))
    return segs


def test_the_runner_is_chosen_in_one_place_and_said_at_start(ckpts, caplog):
    with caplog.at_level(logging.INFO, logger="gpu_service.model"):
        cfg, model, experts = load(ckpts["qwen3_moe"])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode steps: ")]
    assert said == ["decode steps: " + step.describe(model)]
    assert step.describe(model).startswith(step.PER_OP)  # torch's dense layers: nothing native, no graphs on a CPU
    assert step.choose(model, decode(model), False, 0, None) == step.PER_OP
    model.graphs = "eager"  # (the CUDA-graph runner's segments, run eagerly)
    assert step.describe(model).startswith(step.GRAPHS)
    assert step.choose(model, decode(model), False, 1, None) == step.GRAPHS
    assert step.choose(model, decode(model, logprobs=True), False, 0, None) == step.PER_OP  # graphs give no logprobs
    assert step.choose(model, decode(model), True, 1, None) == step.PER_OP  # the accuracy harness's skipping
    assert step.choose(model, decode(model), False, 1, range(0)) == step.PER_OP  # a depth study
    prefill = [Segment(model.new_cache(), torch.tensor([1, 2, 3]), 0)]
    assert step.choose(model, prefill, False, 0, None) == step.PER_OP


@native
def test_the_native_loop_where_every_layer_has_its_native_stages(ckpts):
    cfg, model, _ = load(ckpts["qwen3_moe"], torch.bfloat16, "bf16")
    assert step.describe(model).startswith(step.NATIVE_LOOP)
    assert step.choose(model, decode(model), False, 1, None) == step.NATIVE_LOOP
    assert step.choose(model, decode(model, logprobs=True), False, 0, None) == step.NATIVE_LOOP  # (its head: not)
    assert step.choose(model, decode(model), True, 1, None) == step.PER_OP
    # a layer without its native block: the per-op runner, the other layers' blocks native in it
    cfg, partial, _ = load(ckpts["qwen3_moe"], torch.bfloat16, "bf16")
    del partial.decode_blocks[1]
    said = step.describe(partial)
    assert said.startswith(step.PER_OP) and "torch's: layers [1]" in said, said
    assert step.choose(partial, decode(partial), False, 0, None) == step.PER_OP
    # a hybrid model: DeltaNet layers and gated attention (no native block for either)
    cfg, hybrid, _ = load(ckpts["qwen3_next"], torch.bfloat16, "bf16")
    assert {attention.kind(cfg, L) for L in range(cfg.num_layers)} == {"linear", "gqa"} <= set(attention.KINDS)
    assert step.describe(hybrid).startswith(step.PER_OP)
    assert step.choose(hybrid, decode(hybrid), False, 0, None) == step.PER_OP


def test_a_graph_bucket_and_a_sequence_cache_give_one_attention_kind_the_same_rows(ckpts):
    """The same gqa function over a sequence's cache (SequenceKV) and over a graph bucket's gathered, masked rows
    (never-written positions NaN): the same output for each row."""
    from gpu_service.model import cuda_graphs

    cfg, model, _ = load(ckpts["qwen3_moe"])
    pool = model.kv_pool()
    for bufs in pool.bufs:
        for b in bufs or ():
            b.fill_(float("nan"))
    p, L = "model.layers.0.self_attn.", 0
    torch.manual_seed(0)
    # two sequences with 5 and 9 positions already written
    caches, starts = [model.new_cache(), model.new_cache()], [5, 9]
    for c, n in zip(caches, starts):
        x = torch.randn(n, cfg.hidden_size)
        cos, sin = model.rope(torch.arange(n), n)
        attention.gqa_attention(cfg, model.W, p, x, cos, sin, attention.SequenceKV(c, 0, n), L)
        c.length = n
    x = torch.randn(2, cfg.hidden_size)
    cos, sin = model.rope(torch.tensor(starts), max(starts) + 1)
    bucket = cuda_graphs.GraphedDecode(model, pool, None)._bucket(2, cuda_graphs.MIN_CONTEXT, False)
    meta = bucket.meta_host
    for i, (c, s) in enumerate(zip(caches, starts)):
        c.reserve(s + 1)
        meta[i, 0], meta[i, 1] = 0, s
        t = c.table()
        meta[i, 2:2 + len(t)] = t
        meta[i, 2 + len(t):] = pool.spare
    bucket.meta.copy_(meta)
    bucket._head()  # the bucket's slots, tables and mask from its meta (the embedding it also writes is unused here)
    graphed = attention.gqa_attention(cfg, model.W, p, x, cos, sin, bucket, L)
    for i, (c, s) in enumerate(zip(caches, starts)):
        alone = attention.gqa_attention(cfg, model.W, p, x[i:i + 1], cos[i:i + 1], sin[i:i + 1],
                                        attention.SequenceKV(c, s, 1), L)
        assert torch.isfinite(graphed[i]).all()
        torch.testing.assert_close(graphed[i:i + 1], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(ISA not in attention.native_attention.PREFILL_PATHS,
                    reason="the model prefills on the native kernel on the vector paths (faster than SDPA there)")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_prefill_attention_on_the_native_kernel_gives_torchs_attention(ckpts, monkeypatch, dtype, tol):
    """A CPU model with packed dense layers prefills its GQA layers on the native flash kernel (moe_kernels.attention.
    prefill_attention), whole and in chunks (a chunk after cached positions): each call's output on the model's own
    queries, keys and values is torch's SDPA's with the causal mask of the chunk's positions. (Logits are not compared:
    this tiny model's routing near-ties turn 1e-7 into different experts.) bf16 on the AVX2 paths (whose kernel is
    fp32): SDPA's, the native kernel never called."""
    import torch.nn.functional as F
    cfg, model, experts = load(ckpts["qwen3_moe"], dtype, "bf16")
    tokens = torch.randint(3, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(1))
    real, worst, starts = attention.native_attention.prefill_attention, [], []

    def checked(q, K, V, start, scale, *a, **k):
        out = real(q, K, V, start, scale, *a, **k)
        t, L = q.shape[0], K.shape[1]
        seen = torch.arange(L)[None, :] <= (start + torch.arange(t))[:, None]
        ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], K.float()[None], V.float()[None],
                                             attn_mask=seen, scale=scale, enable_gqa=True)[0].transpose(0, 1)
        worst.append((out - ref).abs().max().item()), starts.append(start)
        return out

    monkeypatch.setattr(attention.native_attention, "prefill_attention", checked)
    for chunks in ([90], [37, 53]):
        c, at = model.new_cache(), 0
        for n in chunks:
            c.reserve(at + n)
            model.forward([Segment(c, tokens[at:at + n], at)], experts)
            at += n
    if dtype == torch.bfloat16 and ISA in ("avx2", "avxvnni"):
        assert worst == []
        return
    assert len(worst) == 3 * cfg.num_layers and sorted(set(starts)) == [0, 37]
    assert max(worst) < tol, worst
