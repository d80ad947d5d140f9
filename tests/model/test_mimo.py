"""MiMo-V2-Flash (mimo_v2_flash): sliding-window layers of 5 positions (twice the KV heads, attention sinks, a rope base
of their own) beside full-attention layers, a value head narrower than the key's and values scaled before they are
cached: transformers' tokens and logits for prompts shorter and far longer than the window, prefilled whole or in
chunks, batched, after a prefix-cache hit, and deferral in one process as through the two services."""
from __future__ import annotations

import heapq

import pytest
import torch

import tiny_models
from engine_runs import collect, deferred_both_ways, prompt_of, reference, submit, twice_with_a_prefix_cache
from gpu_service.engine.kv_pool import BLOCK, GROW, KVPool, pool_block_bytes, window_pool_blocks
from gpu_service.model.model import Model, Segment
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


def test_a_sequence_holds_only_its_last_window_of_the_sliding_layers_rows(tmp_path):
    """The window pool gives a sequence's blocks below the window back after each step: through a 70-token prompt
    and 40 decode steps (the native loop's and torch's alike) a sequence holds the window's blocks there (and a
    growing sequence's GROW at most), every block in the main pool."""
    from gpu_service.experts.local import LocalExperts
    from moe_core.checkpoint import Checkpoint
    from moe_experts.store import load_expert_layers

    d = tiny_models.build("mimo_v2_flash", tmp_path, seed=5, head_dim=192, v_head_dim=128)  # the native step's heads
    cfg, ckpt = load_config(d), Checkpoint(d)
    model = Model(cfg, ckpt, torch.device("cpu"), torch.bfloat16, dense_format="bf16")
    experts = LocalExperts(load_expert_layers(cfg, ckpt, "bf16", 1))
    prompt = prompt_of(70, 7)
    blocks = model.decode_blocks
    assert len(blocks) == cfg.num_layers  # (the loop runs on every layer)
    for native in (True, False):
        model.decode_blocks = blocks if native else {}
        cache = model.new_cache()
        model.forward([Segment(cache, torch.tensor(prompt), 0)], experts)
        assert cache.held_from(1) == 64 and cache.held_from(0) == 0 and sum(b >= 0 for b in cache.wblocks) == 1
        for n in range(70, 110):
            model.forward([Segment(cache, torch.tensor([7]), n)], experts)
            assert cache.held_from(1) == (n + 1 - 5 + 1) // BLOCK * BLOCK, n
            assert sum(b >= 0 for b in cache.wblocks) <= 2 + GROW and len(cache.blocks) * BLOCK >= n + 1
        assert model.kv_pool().window.used() == sum(b >= 0 for b in cache.wblocks)
        with pytest.raises(ValueError, match="below its window"):
            cache.gather(1, 110, 0)
        cache.release()
        assert model.kv_pool().window.used() == 0 and model.kv_pool().used() == 0


def test_a_prefix_hit_needs_the_last_windows_blocks(mimo):
    """A hit ends at the longest boundary whose last window the window pool still has: all of it cached, the
    previous boundary's where the last one's block was evicted, none where no window block is left; the same tokens
    each way."""
    d, refs = mimo
    prompt, want, _ = refs[70]
    pool = KVPool(load_config(d), torch.float32, torch.device("cpu"), 64, 1 << 30)
    e = local_engine(d, kv_pool=pool)
    try:
        assert collect(submit(e, prompt)) == (want, 0)
        assert collect(submit(e, prompt)) == (want, 64)
        # the window block the hit at 64 reads (positions 60..63: block 3) evicted; the one at 48 reads block 2
        b = pool.window.lookup(pool.hash_of[3])
        pool.window.cached.move_to_end(b, last=False)
        heapq.heappush(pool.window.free, pool.window._evict_block())
        assert pool.lookup(pool.hash_of[3]) is not None  # (the main pool still has it)
        assert collect(submit(e, prompt)) == (want, 48)
        pool.window.clear()
        assert collect(submit(e, prompt)) == (want, 0)
    finally:
        e.stop()


def test_the_service_sizes_the_window_pool_by_its_sequences(tmp_path):
    """The published config at full width: the sliding layers are nearly all of a position's bytes; the service's
    pool gives them only what --max-batch sequences' windows and a step's tokens need."""
    import json

    from gpu_service import cli
    from published import synth_checkpoint

    (tmp_path / "config.json").write_text(json.dumps(synth_checkpoint.config_of("mimo-v2-flash", None, {})))
    cfg = load_config(tmp_path)
    main, ring = pool_block_bytes(cfg, torch.bfloat16)
    assert ring > 8 * main  # the 39 sliding layers' rows beside the 9 full layers'
    args = cli.parse_args(["--model", "x", "--max-batch", "4", "--max-step-tokens", "512", "--kv-cache-gb", "1",
                           "--prefix-cache-gb", "0"])
    pool, ctx = cli.kv_pool(args, cfg, torch.device("cpu"), torch.bfloat16, 4096)
    assert pool.window.num_blocks == window_pool_blocks(cfg, 4, 512, False) == 4 * (8 + 2) + 32
    assert pool.num_blocks == (2**30 - pool.window.num_blocks * ring) // main and ctx == 4096


@pytest.mark.slow
def test_deferral_in_one_process_equals_the_two_services(mimo, services_factory):
    d, refs = mimo
    local, services, _ = deferred_both_ways(d, refs[21][0], services_factory)
    assert services == local
