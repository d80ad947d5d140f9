"""MiniMax-M3 (minimax_m3_vl, its text model): block-sparse attention layers whose block lightning indexer keeps 3 blocks
of 4 keys per KV group (the query's own always), beside full GQA layers; zero-centred norms, per-head QK-norm, partial
rotary, the clamped SwiGLU in every MLP, a dense first layer, a shared expert. transformers' tokens and logits for
prompts shorter and far longer than the kept blocks, prefilled whole or in chunks, batched, after a prefix-cache hit,
deferral in one process as through the two services, and decode on the native kernels (the indexer's scores, each KV
head's attention over its blocks) as the torch path."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from engine_runs import (N_NEW, collect, deferred_both_ways, native_against_torch, prompt_of, reference, submit,
                         twice_with_a_prefix_cache)
from gpu_service.engine.kv_pool import BLOCK, KVPool
from gpu_service.model import attention
from gpu_service.model.attention import block_select, kind, selected_positions
from harness import greedy, local_engine
from moe_core.config import ModelConfigError, load_config, parse_config
from moe_kernels import ISA, SIMD_ISAS


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    d = tiny_models.build("minimax_m3_vl", tmp_path_factory.mktemp("m3"), seed=2)
    return d, {n: (p, *reference(d, p)) for n, p in ((3, prompt_of(3, 5)), (21, prompt_of(21, 6)),
                                                       (70, prompt_of(70, 7)))}


def test_the_config_and_the_pool(m3):
    cfg = load_config(m3[0])
    assert [kind(cfg, L) for L in range(4)] == ["gqa", "block_sparse", "block_sparse", "gqa"]
    assert (cfg.index_heads, cfg.index_dim, cfg.index_block, cfg.index_topk_blocks, cfg.index_local_blocks) == \
        (2, 16, 4, 3, 1)
    assert cfg.moe_layers == (1, 2, 3) and cfg.intermediate_size == 48 and cfg.shared_intermediate_size == 24
    assert cfg.rotary_dim == 8 and cfg.norm_offset and cfg.qk_norm and cfg.mlp_act == cfg.expert_act
    assert cfg.expert_act.kind == "clamped_swiglu" and cfg.expert_act.limit == 1.0 and cfg.routed_scaling_factor == 2.0
    assert [cfg.ffn(L) for L in range(4)] == ["mlp"] + ["block_sparse_moe"] * 3
    pool = KVPool(cfg, torch.float32, torch.device("cpu"), 4)
    assert [len(b) for b in pool.bufs] == [2, 3, 3, 2] and tuple(pool.bufs[1][2].shape) == (1, 5, BLOCK, 16)
    assert pool.block_bytes == BLOCK * (4 * 2 * 2 * 16 + 2 * 16) * 4


def test_published_fields_and_refusals(m3):
    """The published config's legacy fields (sparse_attention_config, moe_layer_freq) read as transformers reads
    them; an indexer the attention heads cannot share, or more local than kept blocks, is refused at start."""
    import json
    raw = json.loads((m3[0] / "config.json").read_text())
    text = {k: v for k, v in raw["text_config"].items() if not k.startswith("index_") and
            k not in ("layer_types", "mlp_layer_types")}
    legacy = {**raw, "text_config": {**text, "moe_layer_freq": [0, 1, 1, 1], "sparse_attention_config": {
        "sparse_attention_freq": [0, 1, 1, 0], "sparse_num_index_heads": 2, "sparse_index_dim": 16,
        "sparse_block_size": 4, "sparse_topk_blocks": 3, "sparse_local_block": 1}}}
    assert parse_config(legacy) == load_config(m3[0])
    for bad in ({"index_n_heads": 3}, {"index_local_blocks": 4}, {"index_head_dim": 4}):
        with pytest.raises(ModelConfigError, match="minimax_m3_vl"):
            parse_config({**raw, "text_config": {**raw["text_config"], **bad}})


def test_tokens_and_logits_are_transformers_whole_chunked_and_batched(m3):
    d, refs = m3
    for step_tokens in (0, 5):  # 5: chunks that end inside key blocks
        e = local_engine(d, step_tokens=step_tokens)
        try:
            for n, (prompt, want, logits) in refs.items():
                assert collect(submit(e, prompt))[0] == want, (n, step_tokens)
                assert (collect(submit(e, prompt, score=True)) - logits).abs().max().item() < 1e-4, (n, step_tokens)
            qs = [submit(e, p) for p, _, _ in refs.values()]
            assert [collect(q)[0] for q in qs] == [want for _, want, _ in refs.values()]
        finally:
            e.stop()


def test_a_long_prompts_queries_go_in_row_groups(m3, monkeypatch):
    """A long prompt's queries attend a group of rows at a time (their masks and scores bounded: a 32k prompt's whole
    mask over 64 heads would be tens of GB): the same logits as all rows at once."""
    d, refs = m3
    prompt, _, logits = refs[70]
    monkeypatch.setattr(attention, "SCORE_BYTES", 4 * 74 * 4 * 3)  # about three query rows a group
    e = local_engine(d)
    try:
        assert (collect(submit(e, prompt, score=True)) - logits).abs().max().item() < 1e-4
    finally:
        e.stop()


def test_a_prefix_cache_hit_reads_the_cached_indexer_keys(m3):
    d, refs = m3
    prompt, want, _ = refs[70]
    assert twice_with_a_prefix_cache(d, prompt) == [(want, 0), (want, (len(prompt) - 1) // BLOCK * BLOCK)]


def test_block_selection_against_a_plain_loop(monkeypatch):
    """block_select against a loop over queries and heads (scores, the max over a block's visible keys, the local
    blocks, the best others), in row groups as a long prompt's go, a chunk's queries as a whole prompt's."""
    class Cfg:
        index_block, index_topk_blocks, index_local_blocks = 4, 3, 2
    g = torch.Generator().manual_seed(0)
    q, keys = torch.randn(30, 2, 8, generator=g), torch.randn(37, 8, generator=g)

    def plain(i: int, h: int, pos: int) -> set:
        s = [max((q[i, h] @ keys[j]).item() for j in range(b * 4, min(b * 4 + 4, pos + 1)))
             for b in range(pos // 4 + 1)]
        local = {max(pos // 4 - back, 0) for back in range(2)}
        rest = sorted((b for b in range(len(s)) if b not in local), key=lambda b: -s[b])
        return local | set(rest[:3 - len(local)])

    want = torch.zeros(2, 30, 37, dtype=torch.bool)
    for i in range(30):
        for h in range(2):
            for b in plain(i, h, 7 + i):
                want[h, i, b * 4:min(b * 4 + 4, 8 + i)] = True
    assert torch.equal(block_select(Cfg, q, keys, 7), want)
    assert torch.equal(block_select(Cfg, q[20:], keys, 27), want[:, 20:])  # a later chunk alone
    monkeypatch.setattr(attention, "SCORE_BYTES", 2 * 40 * 4 * 3)  # three rows a group
    assert torch.equal(block_select(Cfg, q, keys, 7), want)


@pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the native decode attention runs on the vector kernel paths")
def test_native_decode_is_the_torch_path(m3, monkeypatch):
    """Decode on the native kernels (each indexer head's scores over the pool, the blocks picked, each KV head's
    attention over its blocks' positions) gives the torch path's logits, two sequences of different lengths in each
    step, teacher-forced."""
    d, refs = m3
    cfg = load_config(d)
    torch_path, native_path, calls = native_against_torch(d, refs, ("head_scores", "paged_decode_attention"),
                                                          monkeypatch)
    sparse = sum(cfg.block_sparse(L) for L in range(cfg.num_layers))
    assert calls.count("head_scores") == sparse * 2 * N_NEW
    assert calls.count("paged_decode_attention") == sparse * 2 * N_NEW  # (head dim 16: full layers on torch)
    for a, b in zip(torch_path, native_path):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_a_decode_rows_selected_positions():
    """selected_positions: each head's kept blocks in order, their positions up to the query's own (the own block's
    rest clamped, not counted)."""
    class Cfg:
        index_block, index_topk_blocks, index_local_blocks = 4, 2, 1
    scores = torch.tensor([[5.0, 0, 0, 0, 1, 1, 1, 1, 0, 0], [0.0, 0, 0, 0, 0, 0, 0, 9, 0, 0]])  # position 9: block 2
    pos, n = selected_positions(Cfg, scores, 9)
    assert pos.tolist() == [[0, 1, 2, 3, 8, 9, 9, 9], [4, 5, 6, 7, 8, 9, 9, 9]] and n.tolist() == [6, 6]


@pytest.mark.slow
def test_deferral_in_one_process_equals_the_two_services(m3, services_factory):
    d, refs = m3
    local, services, s = deferred_both_ways(d, refs[21][0], services_factory)
    assert services == local
    assert greedy(s.stub, refs[21][0], N_NEW) == refs[21][1]  # and without deferral, transformers' tokens
