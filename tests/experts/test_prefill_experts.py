"""Prefill on the GPU side (gpu-service --gpu-prefill-tokens): long steps computed from the expert service's
packed cache, mapped. The unpacking the GPU path multiplies with equals the kernel tests' reference for every
format; the chunked torch path (CUDA's) agrees with the kernels; both services on one host give the same greedy
tokens with and without it, with deferral; what cannot work is refused at start, naming why."""
from __future__ import annotations

import pytest
import torch

from moe_experts.store import load_expert_layers
from gpu_service.experts.gpu_prefill import MappedLayer, PrefillExperts
from moe_core.checkpoint import Checkpoint
from moe_core.config import load_config
from moe_kernels.packing import unpack
from harness import Services, free_port, greedy, refused_at_start, scrape
from unpacked import dequantized
from tiers import some

pytest.importorskip("moe_kernels._native", reason="native extension not built")
FORMATS = ["bf16", "int8", "int4", "fp8", "int4g32", "mxfp4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_unpack_is_the_packed_weights(fmt, checkpoints):
    d = checkpoints["qwen3_moe"]
    cfg, ckpt = load_config(d), Checkpoint(d)
    op = load_expert_layers(cfg, ckpt, fmt, 1)[cfg.moe_layers[0]]
    gate, up, down = dequantized(op)
    I, H = op.intermediate, op.hidden
    gu, dn = unpack(op.gu, fmt, H), unpack(op.dn, fmt, I)
    if fmt == "fp8":  # the reference multiplies as the kernels do (Fp8Rows: activations scaled, rounded to bf16)
        x = torch.randn(H, generator=torch.Generator().manual_seed(0))
        for e in range(op.num_experts):
            for mine, ref in ((gu[e, :I] @ x, gate[e](x)), (gu[e, I:] @ x, up[e](x))):
                assert float((mine - ref).norm() / ref.norm()) < 0.01
        return
    assert torch.equal(gu[:, :I], gate) and torch.equal(gu[:, I:], up) and torch.equal(dn, down)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8"])
def test_streamed_path_agrees_with_the_kernels(fmt, checkpoints, monkeypatch):
    """CUDA's path (copy a chunk of experts, unpack to bf16, torch) run on the CPU, chunks of 3 experts so a
    layer takes several: within the kernels' activation rounding of their output; deferral splits as they do."""
    import gpu_service.experts.gpu_prefill as pe
    monkeypatch.setattr(pe, "CHUNK_EXPERTS", 3)
    d = checkpoints["glm4_moe"]
    cfg, ckpt = load_config(d), Checkpoint(d)
    L = cfg.moe_layers[0]
    op = load_expert_layers(cfg, ckpt, fmt, 1)[L]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, cfg.hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[:cfg.top_k] for _ in range(40)]).int()
    w = torch.rand(40, cfg.top_k, generator=gen)
    want = op.forward(x, ids, w)
    got = MappedLayer(op, torch.device("cpu"), streamed=True).forward(x, ids, w)
    assert float((got - want).norm() / want.norm()) < (0.01 if fmt != "int8" else 0.03)

    class Never:
        def submit(self, *a):
            raise AssertionError("a long step went to the expert service")

        def drain_spans(self):
            return []

    pre = PrefillExperts(Never(), {L: MappedLayer(op, torch.device("cpu"))}, threshold=16, device=torch.device("cpu"))
    pre.submit(0, L, x, ids, w, 1)
    imm, dfr = pre.result(L, False), pre.result(L, True)
    torch.testing.assert_close(imm + dfr, want, rtol=1e-4, atol=1e-4)
    assert not pre.local and [s.name for s in pre.drain_spans()] == ["prefill_experts"]


@pytest.mark.slow
def test_services_prefill_on_the_gpu_side(checkpoints, tmp_path):
    """Both services on one host, bf16 experts: with --gpu-prefill-tokens 8 the 20-token prompt's experts run on
    the GPU side (the metric counts them), decode stays remote, and the greedy tokens are those without."""
    d = checkpoints["deepseek_v3"]
    cache = tmp_path / "cache"
    common = ("--defer", "1", "--dtype", "fp32")
    expert = ("--weight-format", "bf16", "--cache-dir", str(cache))
    prompt = [(i * 37) % 300 + 2 for i in range(20)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = Services(d, tmp_path / "a", gpu_args=common, expert_args=expert)
    try:
        want = greedy(plain.stub, prompt, 16)
    finally:
        plain.stop()
    port = free_port()
    s = Services(d, tmp_path / "b", expert_args=expert,
                 gpu_args=common + ("--gpu-prefill-tokens", "8", "--gpu-prefill-cache-dir", str(cache),
                                    "--metrics-port", str(port)))
    try:
        assert greedy(s.stub, prompt, 16) == want
        tokens = scrape(port)["moe_gpu_prefill_expert_tokens"].samples[0].value
        assert tokens == 20 * len(load_config(d).moe_layers)  # the prompt's step, every MoE layer; no decode step
        assert "Traceback" not in s.logs()
    finally:
        s.stop()


@pytest.mark.parametrize("args, message", some([
    (("--gpu-prefill-tokens", "-1"), "--gpu-prefill-tokens must be >= 0"),
    (("--gpu-prefill-tokens", "64", "--experts", "local"), "--experts local computes every routed expert"),
    (("--gpu-prefill-tokens", "64", "--experts", "127.0.0.1:1,127.0.0.1:2"), "not shards"),
], fast=[(("--gpu-prefill-tokens", "-1"), "--gpu-prefill-tokens must be >= 0")]))
def test_bad_options_are_refused(args, message, checkpoints):
    err = refused_at_start("gpu_service", "--model", str(checkpoints["qwen3_moe"]), *args)
    assert message in err, err[-2000:]


@pytest.mark.slow
def test_without_the_expert_services_cache_it_is_refused(checkpoints, tmp_path):
    """The expert service's cache elsewhere (or a format without one): the GPU side stops at start, naming it."""
    d = checkpoints["qwen3_moe"]
    for expert, message in ((("--weight-format", "bf16", "--cache-dir", str(tmp_path / "theirs")),
                             "no packed-weight cache of MoE layer"),
                            (("--weight-format", "fp32"), "has no packed-weight cache")):
        sub = tmp_path / expert[1]
        sub.mkdir()
        s = Services(d, sub, expert_args=expert, gpu=False,
                     gpu_args=("--gpu-prefill-tokens", "8", "--gpu-prefill-cache-dir", str(tmp_path / "ours")))
        try:
            s.gpu = s.start_gpu()
            assert s.gpu.wait(120) != 0
            assert message in s.logs(), s.logs()
        finally:
            s.stop()
