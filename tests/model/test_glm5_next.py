"""GLM-5.3-Flash (glm5_next, its text model inside the vision-language wrapper): KDA linear attention in layers 0 and
3 (per-channel decay, a state per sequence), DeepSeek Sparse Attention on a NoPE MLA in layers 1, 2 and 4 whose
indexer scores pools of 4 keys and keeps 2 of them and the query's unfinished pool (layer 2 reusing layer 1's pick), 2
hyper-connected streams with a mean head, a dense first layer, the clamped SiLU. transformers' tokens and logits for
prompts shorter and far longer than the kept pools, whole, in chunks that end inside pools, batched, after a
prefix-cache hit (linear attention's rule: a state kept at a prompt's last block boundary), deferral in one process
as through the two services."""
from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from engine_runs import (N_NEW, collect, deferred_both_ways, native_against_torch, prompt_of, reference, submit,
                         twice_with_a_prefix_cache)
from gpu_service.engine.kv_pool import BLOCK, KVPool
from gpu_service.model.attention import kind
from harness import greedy, local_engine
from moe_core.config import ModelConfigError, load_config, parse_config
from moe_kernels import ISA, SIMD_ISAS


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    d = tiny_models.build("glm5_next", tmp_path_factory.mktemp("glm53"), seed=2)
    return d, {n: (p, *reference(d, p)) for n, p in ((3, prompt_of(3, 5)), (21, prompt_of(21, 6)),
                                                       (70, prompt_of(70, 7)))}


def test_the_config_and_the_pool(glm):
    cfg = load_config(glm[0])
    assert [kind(cfg, L) for L in range(5)] == ["linear", "dsa", "dsa", "linear", "dsa"]
    assert cfg.index_kpool == 4 and cfg.index_topk == 8 and cfg.index_shared == (2,) and cfg.qk_rope_head_dim == 0
    assert cfg.linear_attn.k_heads == 2 and cfg.linear_attn.k_dim == 16 and cfg.linear_bound == -5.0
    assert cfg.hc_mult == 2 and cfg.moe_layers == (1, 2, 3, 4) and cfg.expert_act.kind == "clamped_silu"
    pool = KVPool(cfg, torch.float32, torch.device("cpu"), 4)
    # linear layers: no blocks; a full DSA layer: latent, (no) rotary key, indexer key, pool gate logits, pool keys
    assert [None if b is None else [x.shape[-1] for x in b] for b in pool.bufs] == [
        None, [32, 0, 16, 16, 16], [32, 0], None, [32, 0, 16, 16, 16]]
    assert pool.block_bytes == BLOCK * 4 * (2 * (32 + 3 * 16) + 32)


def test_refusals(glm):
    raw = json.loads((glm[0] / "config.json").read_text())
    text = raw["text_config"]
    for bad in ({"indexer_types": ["full", "full", "full", "shared", "full"]},  # shared after a KDA layer
                {"index_topk": 6}, {"qk_rope_head_dim": 8}, {"linear_lower_bound": None}):
        with pytest.raises(ModelConfigError, match="glm5_next"):
            parse_config({**raw, "text_config": {**text, **bad}})


def test_tokens_and_logits_are_transformers_whole_chunked_and_batched(glm):
    d, refs = glm
    for step_tokens in (0, 5):  # 5: chunks that end inside pools and blocks
        e = local_engine(d, step_tokens=step_tokens)
        try:
            for n, (prompt, want, logits) in refs.items():
                assert collect(submit(e, prompt))[0] == want, (n, step_tokens)
                assert (collect(submit(e, prompt, score=True)) - logits).abs().max().item() < 2e-4, (n, step_tokens)
            qs = [submit(e, p) for p, _, _ in refs.values()]
            assert [collect(q)[0] for q in qs] == [want for _, want, _ in refs.values()]
        finally:
            e.stop()


def test_a_prefix_cache_hit_takes_the_kept_state(glm):
    d, refs = glm
    prompt, want, _ = refs[70]
    assert twice_with_a_prefix_cache(d, prompt) == [(want, 0), (want, (len(prompt) - 1) // BLOCK * BLOCK)]


@pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the native decode attention runs on the vector kernel paths")
def test_native_decode_is_the_torch_path(glm, monkeypatch):
    """Decode on the native kernels (the indexer's scores over the pools' keys, the top k pools, the NoPE latent
    attention over the selection and the query's unfinished pool; the shared layer on its full layer's pick) gives the
    torch path's logits, two sequences of different lengths in each step (engine_runs.native_against_torch)."""
    d, refs = glm
    cfg = load_config(d)
    torch_path, native_path, calls = native_against_torch(d, refs, ("dsa_scores", "mla_paged_attention"), monkeypatch)
    dsa = [L for L in range(cfg.num_layers) if kind(cfg, L) == "dsa"]
    assert calls.count("dsa_scores") == sum(cfg.has_indexer(L) for L in dsa) * 2 * N_NEW
    assert calls.count("mla_paged_attention") == len(dsa) * 2 * N_NEW
    for a, b in zip(torch_path, native_path):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t", [1, 9, 16, 40])
def test_kda_is_transformers_recurrence(t):
    """The KDA layer's rule (per-channel decay, the delta rule; a decode's token by the recurrence, a prefill's in
    chunks of 16) against transformers' own recurrent_kimi_delta_attention, its state carried across any split."""
    from transformers.models.glm5_next.modeling_glm5_next import recurrent_kimi_delta_attention

    from gpu_service.model import linear_attention

    g = torch.Generator().manual_seed(t)
    H, dk = 3, 8
    q, k, v = (torch.randn(1, t, H, dk, generator=g) for _ in range(3))
    gate = -5 * torch.sigmoid(torch.randn(1, t, H, dk, generator=g))
    beta = torch.rand(1, t, H, generator=g)
    want, S = recurrent_kimi_delta_attention(q, k, v, gate, beta, None, True, use_qk_l2norm_in_kernel=True)
    got, S1 = linear_attention.kda_rule(q[0], k[0], v[0], gate[0], beta[0], torch.zeros(H, dk, dk))
    torch.testing.assert_close(got, want[0])
    torch.testing.assert_close(S1, S[0])
    for cut in {t // 2, 1, t - 1} - {0, t}:
        a, s = linear_attention.kda_rule(q[0, :cut], k[0, :cut], v[0, :cut], gate[0, :cut], beta[0, :cut],
                                         torch.zeros(H, dk, dk))
        b, s = linear_attention.kda_rule(q[0, cut:], k[0, cut:], v[0, cut:], gate[0, cut:], beta[0, cut:], s)
        torch.testing.assert_close(torch.cat([a, b]), want[0])
        torch.testing.assert_close(s, S[0])


@pytest.mark.slow
def test_deferral_in_one_process_equals_the_two_services(glm, services_factory):
    d, refs = glm
    local, services, s = deferred_both_ways(d, refs[21][0], services_factory)
    assert services == local
    assert greedy(s.stub, refs[21][0], 24) == refs[21][1]  # and without deferral, transformers' tokens
