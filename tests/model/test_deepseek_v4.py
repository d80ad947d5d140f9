"""DeepSeek-V4 (deepseek_v4): every layer a window of 6 keys, beside (layer 1, 3) compressed sparse attention, entries
of 4 positions in two overlapping series behind a lightning indexer keeping 3, or (layer 2) heavily compressed
attention, entries of 8; sinks; the grouped output projection; 3 hyper-connected residual streams; hash-routed first
layers, sqrtsoftplus scores, the clamped SiLU. transformers' tokens and logits for prompts shorter than a window and far
longer than the indexer keeps, prefilled whole or in chunks that end inside windows, batched, after a prefix-cache hit,
deferral in one process as through the two services."""
from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from engine_runs import (N_NEW, collect, deferred_both_ways, native_against_torch, prompt_of, reference, submit,
                         twice_with_a_prefix_cache)
from gpu_service.engine.kv_pool import BLOCK, KVPool
from gpu_service.model import compressed_attention, hyper_connections
from gpu_service.model.attention import kind
from gpu_service.model.layers import route
from harness import greedy, local_engine
from moe_core.config import ModelConfigError, load_config, parse_config
from moe_kernels import ISA, SIMD_ISAS


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    d = tiny_models.build("deepseek_v4", tmp_path_factory.mktemp("v4"), seed=2)
    return d, {n: (p, *reference(d, p)) for n, p in ((3, prompt_of(3, 5)), (21, prompt_of(21, 6)),
                                                       (70, prompt_of(70, 7)))}


def test_the_config_and_the_pool(v4):
    cfg = load_config(v4[0])
    assert [kind(cfg, L) for L in range(4)] == ["compressed"] * 4
    assert cfg.compress_rates == (0, 4, 8, 4) and [cfg.csa(L) for L in range(4)] == [False, True, False, True]
    assert [cfg.sliding_rope(L) for L in range(4)] == [True, False, False, False]
    assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.rotary_dim, cfg.head_dim) == (160000.0, 10000.0, 16, 32)
    assert (cfg.hc_mult, cfg.hc_iters, cfg.o_groups, cfg.o_lora_rank, cfg.hash_layers) == (3, 20, 2, 16, (0, 1))
    assert (cfg.index_heads, cfg.index_dim, cfg.index_topk, cfg.sliding_window) == (16, 16, 3, 6)
    assert cfg.expert_act.kind == "clamped_silu" and cfg.expert_act.limit == 0.5 and cfg.mlp_act == cfg.expert_act
    assert cfg.moe_layers == (0, 1, 2, 3) and cfg.shared_intermediate_size == 32 and cfg.ffn(0) == "ffn"
    assert cfg.expert_tensor_names(2, 5) == tuple(f"model.layers.2.ffn.experts.5.{w}.weight" for w in ("w1", "w3", "w2"))
    pool = KVPool(cfg, torch.float32, torch.device("cpu"), 4)
    # only the entries a block's positions close (CSA: 4 a block, the indexer's too; HCA: 2); no per-position rows
    assert [[tuple(b.shape) for b in bufs] for bufs in pool.bufs] == [
        [], [(1, 5, 4, 32), (1, 5, 4, 16)], [(1, 5, 2, 32)], [(1, 5, 4, 32), (1, 5, 4, 16)]]
    assert pool.block_bytes == 4 * (2 * 4 * (32 + 16) + 2 * 32) and pool.stateful


def test_published_legacy_fields_and_refusals(v4):
    """The fields DeepSeek's own config.json writes (compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling
    beside rope_theta and compress_rope_theta) read as transformers reads them; shapes the attention cannot take are
    refused at start."""
    raw = json.loads((v4[0] / "config.json").read_text())
    new = load_config(v4[0])
    legacy = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "compress_rates",
                                                      "rope_parameters", "partial_rotary_factor")}
    legacy.update(compress_ratios=[0, 4, 128, 4], num_hash_layers=2, qk_rope_head_dim=16,
                  rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                                "beta_fast": 32, "beta_slow": 1})
    cfg = parse_config(legacy)
    assert cfg.compress_rates == (0, 4, 128, 4) and cfg.hash_layers == (0, 1) and cfg.rotary_dim == 16
    assert cfg.rope_type == "yarn" and cfg.rope_params["attention_factor"] == 1.0 and cfg.rope_theta == 160000.0
    assert cfg.sliding_rope_theta == new.sliding_rope_theta == 10000.0
    for bad in ({"o_groups": 3}, {"layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
                {"scoring_func": "sigmoid"}, {"index_head_dim": 8}, {"mlp_layer_types": ["moe", "dense", "moe", "moe"]}):
        with pytest.raises(ModelConfigError, match="deepseek_v4"):
            parse_config({**raw, **bad})


def test_tokens_and_logits_are_transformers_whole_chunked_and_batched(v4):
    d, refs = v4
    for step_tokens in (0, 5):  # 5: chunks that end inside windows and compression windows
        e = local_engine(d, step_tokens=step_tokens)
        try:
            for n, (prompt, want, logits) in refs.items():
                assert collect(submit(e, prompt))[0] == want, (n, step_tokens)
                assert (collect(submit(e, prompt, score=True)) - logits).abs().max().item() < 1e-4, (n, step_tokens)
            qs = [submit(e, p) for p, _, _ in refs.values()]
            assert [collect(q)[0] for q in qs] == [want for _, want, _ in refs.values()]
        finally:
            e.stop()


def test_a_long_prompts_queries_go_in_row_groups(v4, monkeypatch):
    """A long prompt's queries attend (and score the indexer's entries) a group of rows at a time: the same logits as
    all rows at once."""
    d, refs = v4
    prompt, _, logits = refs[70]
    monkeypatch.setattr(compressed_attention, "SCORE_BYTES", 4 * 90 * 4 * 3)  # about three query rows a group
    e = local_engine(d)
    try:
        assert (collect(submit(e, prompt, score=True)) - logits).abs().max().item() < 1e-4
    finally:
        e.stop()


def test_prompt_rows_gather_their_own_entries(v4, monkeypatch):
    """A prompt's CSA rows over many more entries than the indexer keeps attend to their own picks, gathered (the
    70-token prompt: 17 entries, 3 kept): transformers' logits, as the rows over every entry masked give them."""
    d, refs = v4
    prompt, _, logits = refs[70]
    attend, calls = compressed_attention._attend, []
    monkeypatch.setattr(compressed_attention, "_attend",
                        lambda *a, **k: calls.append(a[-1] is not None) or attend(*a, **k))
    for sparse in (2, 1000):  # 1000: never gathered
        monkeypatch.setattr(compressed_attention, "SPARSE_ENTRIES", sparse)
        calls.clear()
        e = local_engine(d)
        try:
            assert (collect(submit(e, prompt, score=True)) - logits).abs().max().item() < 1e-4, sparse
        finally:
            e.stop()
        assert any(calls) == (sparse == 2)


def test_a_prefix_cache_hit_reads_the_cached_entries(v4):
    d, refs = v4
    prompt, want, _ = refs[70]
    assert twice_with_a_prefix_cache(d, prompt) == [(want, 0), (want, (len(prompt) - 1) // BLOCK * BLOCK)]


@pytest.fixture(scope="module")
def v4_odd_rates(tmp_path_factory):
    """CSA entries of 6 positions (3 a block, the indexer on torch) and HCA of 24 (one every 1.5 blocks, a window
    open at most block boundaries)."""
    d = tiny_models.build("deepseek_v4", tmp_path_factory.mktemp("v4odd"), seed=3,
                          compress_rates={"compressed_sparse_attention": 6, "heavily_compressed_attention": 24})
    return d, {n: (p, *reference(d, p)) for n, p in ((45, prompt_of(45, 8)), (70, prompt_of(70, 9)))}


def test_rates_that_do_not_divide_a_block_and_a_hit_inside_an_open_window(v4_odd_rates):
    """Entries at their own slots of the blocks (3 CSA entries a block, an HCA one in some blocks only), transformers'
    tokens whole, chunked (steps of 5 tokens) and after a prefix-cache hit at 32 (HCA's window 24..47 open: its rows
    come from the kept state)."""
    d, refs = v4_odd_rates
    cfg = load_config(d)
    pool = KVPool(cfg, torch.float32, torch.device("cpu"), 4)
    assert [[tuple(b.shape) for b in bufs] for bufs in pool.bufs] == [
        [], [(1, 5, 3, 32), (1, 5, 3, 16)], [(1, 5, 1, 32)], [(1, 5, 3, 32), (1, 5, 3, 16)]]
    for step_tokens in (0, 5):
        e = local_engine(d, step_tokens=step_tokens)
        try:
            for n, (prompt, want, logits) in refs.items():
                assert collect(submit(e, prompt))[0] == want, (n, step_tokens)
                assert (collect(submit(e, prompt, score=True)) - logits).abs().max().item() < 1e-4, (n, step_tokens)
        finally:
            e.stop()
    prompt, want, _ = refs[45]
    assert twice_with_a_prefix_cache(d, prompt) == [(want, 0), (want, 32)]


def test_a_sequences_state_stays_within_its_windows(v4):
    """Each layer's state holds the window's last 5 keys and the compressor rows of the open window (CSA: and the last
    closed one), however long the sequence; the pool only the entries."""
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import Model, Segment
    from moe_core.checkpoint import Checkpoint
    from moe_experts.store import load_expert_layers

    d, refs = v4
    cfg, ckpt = load_config(d), Checkpoint(d)
    model = Model(cfg, ckpt, torch.device("cpu"), torch.float32)
    experts = LocalExperts(load_expert_layers(cfg, ckpt, "fp32", 1))
    cache, prompt = model.new_cache(), refs[70][0]
    model.forward([Segment(cache, torch.tensor(prompt), 0)], experts)
    rows = lambda: [[tuple(t.shape) for t in s] for s in cache.states]  # noqa: E731
    # 70 positions: CSA (rate 4; kv and gate of two series of 32, the indexer's of 16) rows 64..69, HCA (8) 64..69
    assert rows() == [[(5, 32)], [(5, 32), (6, 64), (6, 64), (6, 32), (6, 32)], [(5, 32), (6, 32), (6, 32)],
                      [(5, 32), (6, 64), (6, 64), (6, 32), (6, 32)]]
    # copies, not views holding the whole prompt's rows alive (a prefix snapshot would keep them)
    assert all(t.untyped_storage().nbytes() == t.nbytes for st in cache.states for t in st)
    for i, tok in enumerate(prompt_of(3, 4)):
        model.forward([Segment(cache, torch.tensor([tok]), len(prompt) + i)], experts)
    # 73: CSA rows 68..72 (window 17 closed at 71, window 16's first series no longer needed), HCA 72
    assert rows() == [[(5, 32)], [(5, 32), (5, 64), (5, 64), (5, 32), (5, 32)], [(5, 32), (1, 32), (1, 32)],
                      [(5, 32), (5, 64), (5, 64), (5, 32), (5, 32)]]
    assert cache.length == 73 and len(cache.blocks) * BLOCK >= 73


def test_hash_layers_take_the_tokens_experts():
    """A hash-routed layer's experts are its table's row of each token; the weights its scores of those, normalised
    and scaled; the other layers choose by score plus the correction bias."""
    cfg = parse_config(_cfg())
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(5, 64, generator=g), torch.randn(8, 64, generator=g), torch.randn(8, generator=g)
    table = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(5)])
    scores = torch.nn.functional.softplus(x @ w.T).sqrt()
    ids, wts = route(cfg, x, w, bias, table)
    assert torch.equal(ids.long(), table)
    want = scores.gather(1, table)
    torch.testing.assert_close(wts, want / want.sum(-1, keepdim=True) * cfg.routed_scaling_factor)
    ids, _ = route(cfg, x, w, bias)
    assert torch.equal(ids.long().sort(-1).values, (scores + bias).topk(2, -1).indices.sort(-1).values)


def _cfg():
    _, _, kw = tiny_models.FAMILIES["deepseek_v4"]
    return {**kw, "model_type": "deepseek_v4", "routed_scaling_factor": 1.5}


def test_hyper_connection_against_a_plain_loop():
    """hc.mix and hc.expand against a row-by-row loop of the paper's equations (Sinkhorn to a doubly stochastic comb)."""
    cfg = parse_config(_cfg())
    g = torch.Generator().manual_seed(1)
    hcm, H = cfg.hc_mult, cfg.hidden_size
    W = {"p.fn": torch.randn((2 + hcm) * hcm, hcm * H, generator=g) * 0.1, "p.base": torch.randn((2 + hcm) * hcm, generator=g),
         "p.scale": torch.rand(3, generator=g) + 0.5}
    h, y = torch.randn(4, hcm, H, generator=g), torch.randn(4, H, generator=g)
    post, comb, x = hyper_connections.mix(cfg, W, "p.", h)
    for r in range(4):
        f = h[r].flatten()
        m = W["p.fn"] @ (f / (f.square().mean() + cfg.rms_norm_eps).sqrt())
        s, b = W["p.scale"], W["p.base"]
        pre = torch.sigmoid(m[:hcm] * s[0] + b[:hcm]) + cfg.hc_eps
        torch.testing.assert_close(x[r], (pre[:, None] * h[r]).sum(0))
        torch.testing.assert_close(post[r], 2 * torch.sigmoid(m[hcm:2 * hcm] * s[1] + b[hcm:2 * hcm]))
        c = torch.softmax((m[2 * hcm:] * s[2] + b[2 * hcm:]).view(hcm, hcm), -1) + cfg.hc_eps
        c = c / (c.sum(0) + cfg.hc_eps)
        for _ in range(cfg.hc_iters - 1):
            c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
            c = c / (c.sum(0) + cfg.hc_eps)
        torch.testing.assert_close(comb[r], c)
        torch.testing.assert_close(c.sum(0), torch.ones(hcm), atol=1e-4, rtol=0)  # columns stochastic
    out = hyper_connections.expand(hyper_connections.Streams(h, post, comb), y)
    for r in range(4):
        torch.testing.assert_close(out[r], post[r][:, None] * y[r] + comb[r].T @ h[r])


@pytest.mark.slow
def test_deferral_in_one_process_equals_the_two_services(v4, services_factory):
    d, refs = v4
    local, services, s = deferred_both_ways(d, refs[21][0], services_factory)
    assert services == local
    assert greedy(s.stub, refs[21][0], 24) == refs[21][1]  # and without deferral, transformers' tokens


@pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the native indexer runs on the vector kernel paths")
def test_native_decode_indexer_is_the_torch_path(v4, monkeypatch):
    """Decode's CSA indexer on DeepSeek Sparse Attention's native kernels (its scores over the pool's entry rows, the
    top k) and every layer's window + entries attention on the native decode attention (with its sinks) give the torch
    path's logits, two sequences of different lengths in each step, teacher-forced."""
    d, refs = v4
    cfg = load_config(d)
    torch_path, native_path, calls = native_against_torch(d, refs, ("dsa_scores", "dsa_top_k", "decode_attention"),
                                                          monkeypatch)
    csa = sum(cfg.csa(L) for L in range(cfg.num_layers))
    # (the 21-token prompt's first steps see at most index_topk entries: no indexer)
    assert calls.count("dsa_scores") == calls.count("dsa_top_k") >= csa * (N_NEW + N_NEW - 3)
    assert calls.count("decode_attention") == cfg.num_layers * 2 * N_NEW
    for a, b in zip(torch_path, native_path):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the packed dense kernels run on the vector kernel paths")
def test_the_grouped_output_projection_packed_one_group_at_a_time():
    """wo_a packed per group (--dense-format) gives the einsum's product (bf16 values, so exactly up to the sums'
    order); a model packed so starts and answers."""
    from gpu_service.model.compressed_attention import PackedGroups, grouped
    from moe_kernels.dense import NativeLinear
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3 * 16, 64, generator=g).bfloat16().float()
    o = torch.randn(5, 3, 64, generator=g).bfloat16().float()
    packed = PackedGroups([NativeLinear(w[i * 16:(i + 1) * 16], "bf16") for i in range(3)])
    torch.testing.assert_close(grouped(o, packed), grouped(o, w), rtol=1e-5, atol=1e-5)
    assert packed.nbytes == 3 * 16 * 64 * 2
