"""FP8 releases served as published: a DeepSeek-V3-shape checkpoint whose experts are e4m3 with 128 x 128 block
scales (tools/synth_checkpoint.py, widths that fill whole blocks) starts with its experts in the fp8 format by
default, and its logits are closer to the exact (dequantized, fp32) model's than with the experts in bf16:
the fp8 kernels keep the weights exact and round only their activations. On the CPU its dense FP8 weights stay
FP8 too (--dense-format fp8, the default there). A checkpoint whose blocks the format cannot keep is refused for
--weight-format fp8, naming what to use instead."""
from __future__ import annotations

import pytest
import torch

from harness import free_port, start
from moe_exchange import codec
from protos import generate_pb2
from published import synth

pytest.importorskip("moe_kernels._native", reason="native extension not built")

# experts of 128 x 128 (moe_intermediate_size and hidden_size whole blocks), the rest as test_real_configs'
WIDE = dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=256)


def logits(s, ids) -> torch.Tensor:
    r = s.stub.Score(generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=ids)), timeout=300)
    return codec.decode(r.logits, "logits").double()


@pytest.mark.slow
def test_fp8_checkpoint_defaults_to_fp8_experts_closer_to_exact_than_bf16(tmp_path, services_factory):
    d = synth("deepseek-v3", tmp_path / "ckpt", layers=2, **WIDE)
    torch.manual_seed(0)
    prompt = torch.randint(2, 4000, (40,)).tolist()
    got = {}
    for fmt in ("auto", "bf16", "fp32"):
        s = services_factory(d, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", fmt))
        got[fmt] = logits(s, prompt)
        if fmt == "auto":
            assert "as fp8" in s.logs(), s.logs()
        s.stop()
    exact = got["fp32"]
    err = {f: float((got[f] - exact).norm() / exact.norm()) for f in ("auto", "bf16")}
    assert 0 < err["auto"] < err["bf16"] < 0.05, err
    # and the same answer, greedily, on the argmax of almost every position
    agree = (got["auto"].argmax(-1) == exact.argmax(-1)).double().mean()
    assert agree >= 0.95, agree


@pytest.mark.slow
def test_fp8_dense_layers_by_default_on_the_cpu(tmp_path, services_factory):
    """The GPU side on the CPU packs the checkpoint's FP8 projections as published (MLA's q_a_proj of 48 rows: a
    partial block) and everything else bf16; its logits stay as close to the exact model's as bf16 dense
    layers' (both compute in bf16)."""
    d = synth("deepseek-v3", tmp_path / "ckpt", layers=2, **WIDE)
    torch.manual_seed(0)
    prompt = torch.randint(2, 4000, (40,)).tolist()
    got = {}
    for name, gpu_args, expert_args in (("exact", ("--dtype", "fp32"), ("--weight-format", "fp32")),
                                        ("auto", (), ()), ("bf16", ("--dense-format", "bf16"), ())):
        s = services_factory(d, gpu_args=gpu_args, expert_args=expert_args)
        got[name] = logits(s, prompt)
        if name == "auto":
            assert "dense layers: native kernels, fp8 weights" in s.logs(), s.logs()
        s.stop()
    err = {f: float((got[f] - got["exact"]).norm() / got["exact"].norm()) for f in ("auto", "bf16")}
    assert err["auto"] < 1.25 * err["bf16"] and err["auto"] < 0.05, err


def test_fp8_dense_stacks_parts_on_block_boundaries_exactly():
    """Fused parts (q/k/v, gate/up) keep their FP8 scales when each starts on a 128-row block; otherwise the
    stacked matrix is requantized as one (never misaligned scales)."""
    from moe_kernels.dense import NativeLinear
    from moe_kernels.packing import fp8_quantize
    g = torch.Generator().manual_seed(3)
    a, b = (fp8_quantize(torch.randn(r, 200, generator=g)) for r in (256, 100))
    x = torch.randn(5, 200, generator=g)
    exact = torch.cat([a.dequantize(), b.dequantize()])
    aligned = NativeLinear([a, b], "fp8")
    assert torch.equal(aligned.parts[0][0, :356, :200], torch.cat([a.values, b.values]).view(torch.uint8))
    assert torch.equal(aligned.parts[1][0, :, :2], torch.cat([a.scale, b.scale]) * 256)
    rel = lambda got, ref: float((got - ref).norm() / ref.norm())  # noqa: E731
    assert rel(aligned(x), x @ exact.T) < 5e-3  # bf16 activations on the exact weights
    shifted = NativeLinear([b, a], "fp8")       # b's 100 rows put a off its blocks: requantized, e4m3 error again
    assert 5e-3 < rel(shifted(x), x @ torch.cat([b.dequantize(), a.dequantize()]).T) < 5e-2


def test_fp8_format_refuses_blocks_it_cannot_keep(tmp_path):
    """MiniMax-M2-style 16 x 16 blocks: --weight-format fp8 would requantize; refused at start, naming the
    alternatives (auto picks bf16 there: test_real_configs serves it)."""
    d = synth("minimax-m2", tmp_path / "ckpt", layers=1,
              quantization_config={"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                   "weight_block_size": [16, 16]})
    log = tmp_path / "expert.log"
    p = start("expert_service", "--model", str(d), "--listen", f"127.0.0.1:{free_port()}", "--weight-format", "fp8",
              log=log)
    assert p.wait(120) == 2
    text = log.read_text()
    assert "[16, 16] blocks" in text and "--weight-format bf16" in text and "Traceback" not in text, text
