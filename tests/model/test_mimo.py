"""MiMo-V2-Flash (mimo_v2_flash): sliding-window layers of 5 positions (twice the KV heads, attention sinks, a rope base
of their own) beside full-attention layers, a value head narrower than the key's and values scaled before they are
cached: transformers' tokens and logits for prompts shorter and far longer than the window, prefilled whole or in
chunks, batched, after a prefix-cache hit, and deferral in one process as through the two services."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from engine_runs import collect, deferred_both_ways, prompt_of, reference, submit, twice_with_a_prefix_cache
from gpu_service.engine.kv_pool import BLOCK, KVPool
from harness import local_engine
from moe_core.config import load_config


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    d = tiny_models.build("mimo_v2_flash", tmp_path_factory.mktemp("mimo"), seed=2)
    return d, {n: (p, *reference(d, p)) for n, p in ((3, prompt_of(3, 5)), (21, prompt_of(21, 6)),
                                                       (70, prompt_of(70, 7)))}


def test_the_layers_shapes_are_each_their_own(mimo):
    cfg = load_config(mimo[0])
    assert [cfg.kv_heads(L) for L in range(4)] == [1, 2, 2, 1] and [cfg.window(L) for L in range(4)] == [0, 5, 5, 0]
    assert cfg.value_dim == 16 and cfg.rotary_dim == 8 and cfg.value_scale == 0.7
    assert cfg.rope_theta == 5e6 and cfg.sliding_rope_theta == 1e4 and cfg.moe_layers == (1, 2, 3)
    pool = KVPool(cfg, torch.float32, torch.device("cpu"), 4)
    assert [tuple(b.shape[0] for b in bufs) for bufs in pool.bufs] == [(1, 1), (2, 2), (2, 2), (1, 1)]
    assert [bufs[1].shape[-1] for bufs in pool.bufs] == [16] * 4
    # the sliding layers' rows are the window pool's: the main pool's blocks hold only the full layers'
    assert pool.block_bytes == BLOCK * (1 + 1) * (24 + 16) * 4
    assert pool.window.block_bytes == BLOCK * (2 + 2) * (24 + 16) * 4 and pool.windowed == [False, True, True, False]
    assert pool.bufs[1][0].data_ptr() == pool.window.bufs[1][0].data_ptr() and pool.own[1] is None


def test_tokens_and_logits_are_transformers_whole_chunked_and_batched(mimo):
    d, refs = mimo
    for step_tokens in (0, 4):  # 4: chunks shorter than the window
        e = local_engine(d, step_tokens=step_tokens)
        try:
            for n, (prompt, want, logits) in refs.items():
                assert collect(submit(e, prompt))[0] == want, (n, step_tokens)
                assert (collect(submit(e, prompt, score=True)) - logits).abs().max().item() < 1e-4, (n, step_tokens)
            qs = [submit(e, p) for p, _, _ in refs.values()]
            assert [collect(q)[0] for q in qs] == [want for _, want, _ in refs.values()]
        finally:
            e.stop()


def test_a_prefix_cache_hit(mimo):
    d, refs = mimo
    prompt, want, _ = refs[70]
    assert twice_with_a_prefix_cache(d, prompt) == [(want, 0), (want, (len(prompt) - 1) // BLOCK * BLOCK)]


@pytest.mark.slow
def test_deferral_in_one_process_equals_the_two_services(mimo, services_factory):
    d, refs = mimo
    local, services, _ = deferred_both_ways(d, refs[21][0], services_factory)
    assert services == local
