"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the lightning indexer's selection decides the tokens (index_topk 4,
far below the prompts), and they are transformers' own, token for token and logit for logit, for prompts shorter and
much longer than index_topk, prefilled whole or in chunks, batched with other sequences, after a prefix-cache hit and
with deferral (the same as the two services')."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from engine_runs import (N_NEW, collect, deferred_both_ways, native_against_torch, prompt_of, reference, submit,
                         twice_with_a_prefix_cache)
from gpu_service.engine.kv_pool import BLOCK, KVPool
from harness import greedy, local_engine
from moe_core.config import load_config
from moe_kernels import ISA, SIMD_ISAS

DSA = ["deepseek_v32", "glm_moe_dsa"]
@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    """family -> (checkpoint, {prompt length: (prompt, transformers' tokens, its logits)}): a prompt shorter than
    index_topk (every key kept) and two much longer."""
    out = {}
    for f in DSA:
        d = tiny_models.build(f, tmp_path_factory.mktemp(f), seed=2)
        out[f] = d, {n: (p, *reference(d, p)) for n, p in ((3, prompt_of(3, 5)), (21, prompt_of(21, 6)),
                                                           (70, prompt_of(70, 7)))}
    return out


@pytest.mark.parametrize("family", DSA)
def test_tokens_and_logits_are_transformers_whole_and_in_chunks(dsa, family):
    d, refs = dsa[family]
    for step_tokens in (0, 5):  # 5: every prompt but the shortest crosses chunk boundaries
        e = local_engine(d, step_tokens=step_tokens)
        try:
            for n, (prompt, want, logits) in refs.items():
                assert collect(submit(e, prompt))[0] == want, (n, step_tokens)
                got = collect(submit(e, prompt, score=True))
                assert (got - logits).abs().max().item() < 1e-4, (n, step_tokens)
        finally:
            e.stop()


@pytest.mark.parametrize("family", DSA)
def test_batched_sequences_each_keep_their_own_selection(dsa, family):
    """Three sequences of different lengths in one batch (their decode steps share steps, each row its own keys)."""
    d, refs = dsa[family]
    e = local_engine(d)
    try:
        qs = [submit(e, p) for p, _, _ in refs.values()]
        assert [collect(q)[0] for q in qs] == [want for _, want, _ in refs.values()]
    finally:
        e.stop()


@pytest.mark.parametrize("family", DSA)
def test_a_prefix_cache_hit_reads_the_cached_indexer_keys(dsa, family):
    d, refs = dsa[family]
    prompt, want, _ = refs[70]
    assert twice_with_a_prefix_cache(d, prompt) == [(want, 0), (want, (len(prompt) - 1) // BLOCK * BLOCK)]


@pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the native decode attention runs on the vector kernel paths")
@pytest.mark.parametrize("family", DSA)
def test_native_decode_is_the_torch_path(dsa, family, monkeypatch):
    """Decode on the native kernels (the indexer's scores over the pool, the top k, the latent attention over the
    selection) gives the torch path's logits, two sequences of different lengths in each step, teacher-forced. (The
    dense layers on torch's fp32 matmuls: the native ones round activations to bf16, where a one-ulp flip would
    hide what this compares.)"""
    d, refs = dsa[family]
    cfg = load_config(d)
    torch_path, native_path, calls = native_against_torch(d, refs, ("dsa_scores", "mla_paged_attention"), monkeypatch)
    full = sum(cfg.has_indexer(L) for L in range(cfg.num_layers))
    assert calls.count("dsa_scores") == full * 2 * N_NEW
    assert calls.count("mla_paged_attention") == cfg.num_layers * 2 * N_NEW
    for a, b in zip(torch_path, native_path):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_a_long_prompts_scores_go_in_row_groups_with_the_same_pick(monkeypatch):
    """The torch indexer bounds its [rows, heads, positions] scores (a 32k prompt's would be hundreds of GB): in
    groups of rows the selection is the one of all rows at once, causality and ties (relu's zeros) included."""
    from gpu_service.model import attention

    class Cfg:
        index_dim, index_topk = 16, 5
    g = torch.Generator().manual_seed(0)
    q, w, keys = torch.randn(40, 8, 16, generator=g), torch.randn(40, 8, generator=g), torch.randn(1, 60, 16, generator=g)
    hide = torch.ones(40, 60, dtype=torch.bool).triu(21)  # row i sees positions <= 20 + i
    whole = attention.index_select(Cfg, q, w, keys, hide)
    monkeypatch.setattr(attention, "SCORE_BYTES", 8 * 60 * 4 * 3)  # three rows a group
    assert torch.equal(attention.index_select(Cfg, q, w, keys, hide), whole)
    assert whole.sum(1).tolist() == [5] * 40 and not (whole & hide).any()


def test_shared_layers_cache_no_indexer_keys(dsa):
    """GLM-5's shared layers (indexer_types) reuse the previous full layer's selection: no indexer, no keys cached."""
    cfg = load_config(dsa["glm_moe_dsa"][0])
    assert cfg.index_shared == (1, 3) and cfg.index_rope_interleave
    pool = KVPool(cfg, torch.float32, torch.device("cpu"), 4)
    assert [len(b) for b in pool.bufs] == [3, 2, 3, 2]
    per_pos = 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * cfg.index_dim
    assert pool.block_bytes == BLOCK * per_pos * 4


@pytest.mark.slow
def test_deferral_in_one_process_equals_the_two_services(dsa, services_factory):
    d, refs = dsa["glm_moe_dsa"]
    local, services, s = deferred_both_ways(d, refs[21][0], services_factory)
    assert services == local
    assert greedy(s.stub, refs[21][0], N_NEW) == refs[21][1]  # and without deferral, transformers' tokens
