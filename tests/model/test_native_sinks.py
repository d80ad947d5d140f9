"""Decode attention with attention sinks and sliding windows on the native kernel (gpt-oss: windows of 4 on every
other layer, a sink per head everywhere): the torch path's logits, two sequences of different lengths in each step,
teacher-forced, their prompts longer than the window; the kernel's own sinks against float64:
tests/kernels/test_attention.py."""
from __future__ import annotations

import pytest
import torch

from engine_runs import N_NEW, prompt_of, teacher_forced
from moe_kernels import ISA, SIMD_ISAS


def decodes_natively_as_torch(d, monkeypatch) -> None:
    """Two sequences teacher-forced through the model at d on the torch path and with the native decode attention:
    every layer's every step on the kernel (the windowed layers' past their window: a selection), the same logits."""
    import moe_kernels.attention as kernels
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import Model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    from moe_experts.store import load_expert_layers

    cfg = load_config(d)
    model = Model(cfg, Checkpoint(d), torch.device("cpu"), torch.float32)
    experts = LocalExperts(load_expert_layers(cfg, Checkpoint(d), "fp32", 1))
    calls = []
    monkeypatch.setattr(kernels, "paged_decode_attention", lambda *a, f=kernels.paged_decode_attention, **k:
                        calls.append(k.get("selected") is not None) or f(*a, **k))
    prompts, feed = [prompt_of(13, 3), prompt_of(6, 4)], prompt_of(N_NEW, 5)
    torch_path = teacher_forced(model, experts, prompts, feed, False)
    assert not calls
    native_path = teacher_forced(model, experts, prompts, feed, True)
    assert len(calls) == cfg.num_layers * 2 * N_NEW
    windowed = sum(bool(cfg.window(L)) for L in range(cfg.num_layers))
    assert sum(calls) == windowed * 2 * N_NEW  # (past the window from the first step: both prompts exceed it)
    for a, b in zip(torch_path, native_path):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the native decode attention runs on the vector kernel paths")
def test_gpt_oss_windows_and_sinks_decode_natively_as_torch(checkpoints, monkeypatch):
    decodes_natively_as_torch(checkpoints["gpt_oss"], monkeypatch)


@pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the native decode attention runs on the vector kernel paths")
def test_mimo_heads_decode_natively_as_torch(tmp_path, monkeypatch):
    """MiMo-V2-Flash at its own head dims (keys 192, values 128: the vector kernel's pair): its sliding layers (a
    window of 5, sinks, twice the KV heads) and full layers."""
    import tiny_models
    decodes_natively_as_torch(tiny_models.build("mimo_v2_flash", tmp_path / "mimo", head_dim=192, v_head_dim=128,
                                                seed=3), monkeypatch)


@pytest.mark.skipif(ISA not in ("avx512", "amx"), reason="the model prefills on the native kernel on the AVX-512 paths")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mimo_prefills_windows_and_sinks_natively_as_torch(tmp_path, monkeypatch, dtype, tol):
    """MiMo-V2-Flash (keys 192, values 128) with packed dense layers prefills every layer on the native flash kernel,
    its sliding ones with their window of 5 and sinks, whole and in chunks after cached positions: each call's output
    on the model's own queries, keys and values is the torch path's (windowed_attention). (Logits are not compared:
    a tiny model's routing near-ties turn 1e-7 into different experts.)"""
    import tiny_models
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model import attention
    from gpu_service.model.model import Model, Segment
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    from moe_experts.store import load_expert_layers

    d = tiny_models.build("mimo_v2_flash", tmp_path / "mimo", head_dim=192, v_head_dim=128, seed=3)
    cfg = load_config(d)
    model = Model(cfg, Checkpoint(d), torch.device("cpu"), dtype, dense_format="bf16")
    experts = LocalExperts(load_expert_layers(cfg, Checkpoint(d), "fp32", 1))
    real, calls = attention.native_attention.prefill_attention, []

    def checked(q, K, V, start, scale, *a, window=0, sinks=None, lo=0, **k):
        out = real(q, K, V, start, scale, *a, window=window, sinks=sinks, lo=lo, **k)
        ref = attention.windowed_attention(q.float(), K.float(), V.float(), start, window, sinks, scale, lo)
        calls.append((start, window, sinks is not None, (out - ref).abs().max().item()))
        return out

    monkeypatch.setattr(attention.native_attention, "prefill_attention", checked)
    tokens = torch.randint(3, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    for chunks in ([30], [13, 17]):
        c, at = model.new_cache(), 0
        for n in chunks:
            c.reserve(at + n)
            model.forward([Segment(c, tokens[at:at + n], at)], experts)
            at += n
    assert len(calls) == 3 * cfg.num_layers and {s for s, *_ in calls} == {0, 13}
    assert sorted({(w, s) for _, w, s, _ in calls}) == [(0, False), (5, True)]
    assert max(e for *_, e in calls) < tol, calls
