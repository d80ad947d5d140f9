"""Published configurations, at reduced width (tools/synth_checkpoint.py): DeepSeek-V3 as published
(FP8 block-quantized weights with float32 scale_inv, YaRN, 163840 positions, 129280 ids),
Qwen3-30B-A3B (151936 ids, 40960 positions), GLM-4.5-Air, gpt-oss-20b (MXFP4 experts, 201088 ids,
131072 positions), MiniMax-M2 (FP8 as published, 200064 ids, 196608 positions), Qwen3-Next-80B-A3B (DeltaNet layers, 262144 positions, its mtp.* layer beside) and
Qwen3.5-35B-A3B (the same inside a vision-language wrapper, experts stacked, 248320 ids), DeepSeek-V4-Flash (DeepSeek's own
tensor names, FP8 projections with ue8m0 scales, FP4 routed experts served as mxfp4). Each starts with default flags, and generates exactly transformers' greedy tokens
on the same (dequantized) weights in fp32, past the first 64 positions.
Other quantization methods and variants are refused at start by both services, naming them (int4 checkpoints:
tests/core/test_int4_checkpoints.py)."""
from __future__ import annotations

import json
import pathlib
import struct

import grpc
import pytest
import torch
from safetensors.torch import save_file

import tiny_models
from harness import free_port, greedy, refused_at_start, start
from published import dequantized_copy, synth, synth_checkpoint
from moe_exchange import codec
from moe_core.checkpoint import Checkpoint, dequantize_fp8
from moe_core.config import ModelConfigError
from moe_kernels.packing import Mx4
from protos import generate_pb2
from tiers import some

def test_fp8_dequantization_matches_transformers_and_handles_partial_blocks():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    w = (torch.randn(256, 384) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3) + 0.01
    assert torch.equal(dequantize_fp8(w, s, (128, 128)), Fp8Dequantize(None)._dequantize_one(w, s, torch.float32))
    # partial edge blocks (transformers' loader refuses these shapes): against a plain loop
    w = (torch.randn(40, 70) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(3, 5) + 0.01
    want = torch.empty(40, 70)
    for i in range(40):
        for j in range(70):
            want[i, j] = w[i, j].float() * s[i // 16, j // 16]
    assert torch.equal(dequantize_fp8(w, s, (16, 16)), want)
    q, scale = synth_checkpoint.quantize_fp8(torch.randn(40, 70), (16, 16))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 5)


def test_mxfp4_reads_as_transformers_dequantizes():
    """gpt-oss's published experts: our reading of _blocks/_scales equals transformers' own dequantization."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 40, 4), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    got = torch.stack([Mx4.from_blocks(b, s).dequantize() for b, s in zip(blocks, scales)])
    assert torch.equal(got.transpose(1, 2), want)


@pytest.mark.slow
@pytest.mark.parametrize("arch,block", [("deepseek-v3", None), ("deepseek-v3", [16, 16]), ("deepseek-v3.2", [16, 16]),
                                        ("glm-5", [16, 16]), ("mimo-v2-flash", [16, 16]), ("qwen3-30b-a3b", None),
                                        ("glm-4.5-air", None), ("gpt-oss-20b", None), ("qwen3-next-80b-a3b", None),
                                        ("qwen3.5-35b-a3b", None), ("minimax-m2", [16, 16]), ("minimax-m3", [16, 16]),
                                        ("deepseek-v4-flash", [16, 16]), ("glm-5.3-flash", [16, 16])],
                         ids=["deepseek-v3-fp8", "deepseek-v3-fp8-16x16-blocks", "deepseek-v3.2-fp8", "glm-5-fp8", "mimo-v2-flash-fp8", "qwen3-30b-a3b", "glm-4.5-air",
                              "gpt-oss-20b-mxfp4", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b", "minimax-m2-fp8",
                              "minimax-m3-fp8", "deepseek-v4-flash-fp8-fp4", "glm-5.3-flash-fp8"])
def test_published_config_matches_transformers(arch, block, tmp_path, services_factory):
    extra = {}
    if block:
        extra["quantization_config"] = {**synth_checkpoint.PRESETS[arch]["quantization_config"],
                                        "weight_block_size": block}
    hybrid = arch.startswith(("qwen3-next", "qwen3.5", "glm-5.3"))
    d = synth(arch, tmp_path / "ckpt", layers=4 if hybrid else 3, **extra)  # hybrid: 3 DeltaNet + 1 full attention
    cfg = json.loads((d / "config.json").read_text())
    # default flags: starts (message limits from the real vocabulary and context) and serves
    s = services_factory(d)
    info = s.stub.Info(generate_pb2.ServerInfoRequest(), timeout=10)
    text = cfg.get("text_config", cfg)  # Qwen3.5: inside its vision-language wrapper
    assert info.max_context == text["max_position_embeddings"] and info.vocab_size == text["vocab_size"]
    assert len(greedy(s.stub, [5, 9, 17], 4)) == 4
    if arch.startswith(("gpt-oss", "deepseek-v4")):  # its experts served as published
        assert "as mxfp4" in s.logs()
    s.stop()
    # fp32 on the dequantized weights: transformers' greedy tokens, past the first 64 positions
    ref = tiny_models.reference_model(dequantized_copy(d, tmp_path / "ref"))
    torch.manual_seed(1)
    prompt = torch.randint(2, 4000, (70,)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    s = services_factory(d, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    assert greedy(s.stub, prompt, 24) == want, s.logs()


@pytest.mark.parametrize("arch", ["kimi-k2", "kimi-k2.6"])
def test_kimi_as_published_starts_and_serves(arch, tmp_path, services_factory):
    """Kimi-K2 (kimi_k2, FP8; at this width its experts are not whole 128-row blocks, so bf16) and K2.6 (kimi_k25: the
    text model in its wrapper, int4 experts) at their published vocabulary and context, a few layers: both services
    start with default flags, K2.6's experts kept as published (int4g32), its vision tower and projector left out."""
    d = synth(arch, tmp_path / "ckpt", layers=2)
    cfg = json.loads((d / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    s = services_factory(d)
    info = s.stub.Info(generate_pb2.ServerInfoRequest(), timeout=10)
    assert info.architecture == cfg["model_type"] and info.vocab_size == text["vocab_size"] == 163840
    assert info.max_context == text["max_position_embeddings"]
    assert len(greedy(s.stub, [5, 9, 17], 4)) == 4
    if arch == "kimi-k2.6":
        assert "format int4g32" in s.logs() and "vision tower and projector are not loaded" in s.logs()


def claiming(src: pathlib.Path, d: pathlib.Path, qc: dict) -> pathlib.Path:
    """src's plain weights under a config that claims qc."""
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return d


@pytest.mark.parametrize("qc,says", some([
    ({"quant_method": "bitsandbytes", "bits": 4}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "mxfp4"}, "quant_method 'mxfp4' is not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with bits 8 is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version 'gemv' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"},
     "compressed-tensors format 'float-quantized' is not supported")],
    fast=[({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq with bits 8 is not supported")]),
    ids=["bnb", "mxfp4", "gptq8", "awq-gemv", "ct-fp"])
def test_other_quantization_is_refused_at_start(qc, says, checkpoints, tmp_path):
    d = claiming(pathlib.Path(checkpoints["qwen3_moe"]), tmp_path / "q", qc)
    for module, extra in (("expert_service", ()), ("gpu_service", ("--experts", f"127.0.0.1:{free_port()}"))):
        log = tmp_path / f"{module}.log"
        p = start(module, "--model", str(d), "--listen", f"127.0.0.1:{free_port()}", *extra, log=log)
        assert p.wait(120) == 2
        text = log.read_text()
        assert says in text, text
        assert "Traceback" not in text, text


# -- limits from what is really sent ---------------------------------------------------------------
@pytest.mark.slow
def test_score_long_contexts_as_logprobs(tmp_path, services_factory):
    """Full logits past gRPC's 2 GiB message limit are refused, naming logprobs_only; logprobs_only answers
    them, and on short prompts agrees with the full logits."""
    d = synth("qwen3-30b-a3b", tmp_path / "ckpt", layers=2)
    s = services_factory(d, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    score = lambda ids, **kw: s.stub.Score(generate_pb2.ScoreRequest(  # noqa: E731
        token_ids=generate_pb2.TokenIds(ids=ids), **kw), timeout=300)
    torch.manual_seed(0)
    short = torch.randint(2, 4000, (40,)).tolist()
    logits = codec.decode(score(short).logits, "logits")
    r = score(short, logprobs_only=True)
    want = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(short[1:])[:, None])[:, 0]
    assert len(r.token_logprobs) == len(short) - 1 and not r.HasField("logits")
    torch.testing.assert_close(torch.tensor(list(r.token_logprobs)), want, rtol=1e-4, atol=1e-4)
    assert list(r.argmax_ids) == logits.argmax(-1).tolist()
    long = torch.randint(2, 4000, (3600,)).tolist()  # 3600 x 151936 x 4 bytes = 2.04 GiB of logits
    with pytest.raises(grpc.RpcError) as e:
        score(long)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs_only" in e.value.details()
    r = score(long, logprobs_only=True)
    assert len(r.token_logprobs) == len(long) - 1 and len(r.argmax_ids) == len(long)
    assert all(lp <= 0 for lp in r.token_logprobs)


CLAIMS = {  # quantization_config -> what a checkpoint that has it must store, as the refusal names it
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
             "claims gptq, but its routed experts are stored as plain weights"),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
            "claims awq, but its routed experts are stored as plain weights"),
    "compressed-tensors": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 32}}}},
        "claims compressed-tensors, but its routed experts are stored as plain weights"),
    "fp8": ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
            "claims fp8, but no tensor has its _scale_inv scales beside it"),
}


@pytest.mark.parametrize("method", list(CLAIMS))
def test_a_quantization_its_tensors_do_not_have_is_refused(method, checkpoints, tmp_path):
    qc, says = CLAIMS[method]
    d = claiming(pathlib.Path(checkpoints["qwen3_moe"]), tmp_path / "q", qc)
    with pytest.raises(ModelConfigError) as e:
        Checkpoint(d)
    assert says in str(e.value), e.value
    if method != "fp8":  # the parts it lacks, by name
        assert "model.layers.0.mlp.experts.0." in str(e.value) and "are missing" in str(e.value)


@pytest.mark.slow
def test_a_quantization_claim_is_refused_at_start_by_both_services(checkpoints, tmp_path):
    qc, says = CLAIMS["gptq"]
    d = claiming(pathlib.Path(checkpoints["qwen3_moe"]), tmp_path / "q", qc)
    for module, extra in (("expert_service", ()), ("gpu_service", ("--experts", f"127.0.0.1:{free_port()}"))):
        err = refused_at_start(module, "--model", str(d), "--listen", f"127.0.0.1:{free_port()}", *extra)
        assert says in err and "qweight" in err and "Traceback" not in err, err[-2000:]


def header_damaged(src: pathlib.Path, out: pathlib.Path, change) -> pathlib.Path:
    """src's one safetensors file with its header changed by change(header dict) (and re-padded)."""
    raw = (src / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).symlink_to(f)
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return out


def first_expert(h: dict) -> dict:
    return h[next(k for k in sorted(h) if ".experts.0.down_proj" in k)]


@pytest.mark.parametrize("change, says", [
    (lambda h: first_expert(h).update(dtype="F64"), "is {} bytes, but its data_offsets hold"),
    (lambda h: first_expert(h).update(dtype="F16"), "is {} bytes, but its data_offsets hold"),
    (lambda h: first_expert(h).update(dtype="Q4"), "unknown dtype 'Q4'"),
    (lambda h: first_expert(h).update(data_offsets=[0, first_expert(h)["data_offsets"][1] - first_expert(h)["data_offsets"][0]]),
     "overlaps tensor"),
    (lambda h: first_expert(h).update(data_offsets=[2 ** 62, 2 ** 62 + 4]), "runs past the"),
    (lambda h: first_expert(h).update(shape=[-1, 4]), "is not a list of sizes"),
])
def test_a_damaged_safetensors_header_is_refused_naming_the_tensor(checkpoints, tmp_path, change, says):
    src = pathlib.Path(checkpoints["qwen3_moe"])
    d = header_damaged(src, tmp_path / "bad", change)
    with pytest.raises(ModelConfigError) as e:
        Checkpoint(d)
    assert "tensor model.layers.0.mlp.experts.0.down_proj.weight" in str(e.value), e.value
    assert says.split("{}")[-1] in str(e.value), e.value


@pytest.mark.parametrize("name, change", [("model.layers.0.mlp.experts.3.down_proj.weight", lambda t: t.t().contiguous()),
                                          ("model.embed_tokens.weight", lambda t: t[:-5].contiguous()),
                                          ("model.layers.1.input_layernorm.weight", lambda t: t[:-1].contiguous())])
def test_a_tensor_whose_shape_is_not_the_configs_is_refused_naming_it(checkpoints, tmp_path, name, change):
    """Its bytes sound but its shape not what config.json makes it: refused while loading, on the side that holds it."""
    from moe_experts.store import load_expert_layers
    from gpu_service.model.model import Model
    from moe_core.config import load_config
    from safetensors.torch import load_file

    src = pathlib.Path(checkpoints["qwen3_moe"])
    d = tmp_path / "m"
    d.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (d / f.name).symlink_to(f)
    tensors = load_file(src / "model.safetensors")
    tensors[name] = change(tensors[name])
    save_file(tensors, str(d / "model.safetensors"))
    cfg = load_config(d)
    with pytest.raises(ModelConfigError, match=f"tensor {name}: shape"):
        if ".experts." in name:
            load_expert_layers(cfg, Checkpoint(d), "fp32", 1)
        else:
            Model(cfg, Checkpoint(d), torch.device("cpu"), torch.float32)
