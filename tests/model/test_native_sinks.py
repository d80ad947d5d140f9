"""Decode attention with attention sinks and sliding windows on the native kernel (gpt-oss: windows of 4 on every
other layer, a sink per head everywhere): the torch path's logits, two sequences of different lengths in each step,
teacher-forced, their prompts longer than the window; the kernel's own sinks against float64:
tests/kernels/test_attention.py."""
from __future__ import annotations

import pytest
import torch

from engine_runs import N_NEW, prompt_of, teacher_forced
from moe_kernels import ISA, SIMD_ISAS


@pytest.mark.skipif(ISA not in SIMD_ISAS, reason="the native decode attention runs on the vector kernel paths")
def test_gpt_oss_windows_and_sinks_decode_natively_as_torch(checkpoints, monkeypatch):
    import moe_kernels.attention as kernels
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import Model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    from moe_experts.store import load_expert_layers

    d = checkpoints["gpt_oss"]
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
    assert sum(calls) == windowed * 2 * N_NEW  # (past the window from the first step: both prompts exceed 4)
    for a, b in zip(torch_path, native_path):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
