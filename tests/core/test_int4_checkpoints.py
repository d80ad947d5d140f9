"""int4 checkpoints as published: compressed-tensors pack-quantized (symmetric like Kimi-K2-Thinking, and with
zero points), GPTQ (symmetric; asymmetric with act-order g_idx) and AWQ (GEMM packing, zero points), written
here from the tiny Qwen3-MoE checkpoint's routed experts (compressed-tensors with that library's own packer).
On the exact path (fp32) each generates transformers' greedy tokens on the dequantized weights; by default the
symmetric ones start on the int4g32 kernels and those with zero points (consecutive groups) on uint4g32, their
codes, scales and zero points kept, and stay close to the exact logits; act-order ones are dequantized."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from harness import greedy
from moe_exchange import codec
from moe_core.checkpoint import Checkpoint
from protos import generate_pb2
from tiers import some

pytest.importorskip("moe_kernels._native", reason="native extension not built")

GROUP = 32
AWQ_PACK = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble n of a word holds column AWQ_PACK[n]


def quantize(w: torch.Tensor, sym: bool, g: torch.Generator):
    """w [out, in] -> codes q (0-15), zero points and scales [out, groups] (scales rounded as stored: fp16)."""
    out, n = w.shape
    v = w.view(out, n // GROUP, GROUP)
    if sym:
        scale = v.abs().amax(-1) / 7
        zero = torch.full(scale.shape, 8.0)
    else:
        lo, hi = v.amin(-1), v.amax(-1)
        scale = (hi - lo) / 15
        zero = torch.round(-lo / scale).clamp(0, 15)
    scale = scale.half().float()
    q = torch.round(v / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.view(out, n).to(torch.uint8), zero.to(torch.uint8), scale


def pack_along_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, cols] -> int32 [rows / 8, cols]: word (i, c) holds rows 8i..8i+7, nibble j = row 8i + j."""
    c = codes.to(torch.int64).view(-1, 8, codes.shape[1])
    words = sum(c[:, j] << (4 * j) for j in range(8))
    return words.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else words.to(torch.int32)


def write(src: pathlib.Path, out: pathlib.Path, method: str, sym: bool, act_order: bool = False) -> tuple:
    """(the quantized checkpoint, its dequantized fp32 twin for transformers)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    g = torch.Generator().manual_seed(0)
    tensors = load_file(str(src / "model.safetensors"))
    quant, exact = {}, {}
    for name, w in tensors.items():
        if ".mlp.experts." not in name:
            quant[name] = exact[name] = w
            continue
        base = name[: -len(".weight")]
        q, zero, scale = quantize(w.float(), sym, g)
        n_in = w.shape[1]
        g_idx = torch.arange(n_in) // GROUP
        if act_order:  # GPTQ's desc_act: columns quantized in another order, so groups are not consecutive
            perm = torch.randperm(n_in, generator=g)
            g_idx = g_idx[perm.argsort()]
            q, zero, scale = quantize(w.float()[:, perm], sym, g)   # groups of the permuted columns
            q = q[:, perm.argsort()]
        exact[name] = (q.float() - zero[:, g_idx].float()) * scale[:, g_idx]
        if method == "compressed-tensors":
            quant[base + ".weight_packed"] = pack_to_int32((q.to(torch.int16) - 8).to(torch.int8), 4)
            quant[base + ".weight_scale"] = scale.half()
            quant[base + ".weight_shape"] = torch.tensor(list(w.shape))
            if not sym:
                quant[base + ".weight_zero_point"] = pack_to_int32((zero.to(torch.int16) - 8).to(torch.int8), 4,
                                                                    packed_dim=0)
        elif method == "gptq":  # v1: zero points stored minus one
            quant[base + ".qweight"] = pack_along_rows(q.T.contiguous())
            quant[base + ".qzeros"] = pack_along_rows((zero.to(torch.int16) - 1).to(torch.uint8)).T.contiguous()
            quant[base + ".scales"] = scale.T.contiguous().half()
            quant[base + ".g_idx"] = g_idx.to(torch.int32)
        else:  # awq
            order = torch.tensor(AWQ_PACK)
            cols = torch.arange(w.shape[0]).view(-1, 8)[:, order].reshape(-1)   # word k nibble n: column AWQ_PACK
            quant[base + ".qweight"] = pack_along_rows(q[cols].contiguous()).T.contiguous()
            quant[base + ".qzeros"] = pack_along_rows(zero[cols].contiguous()).T.contiguous()
            quant[base + ".scales"] = scale.T.contiguous().half()
    cfg = json.loads((src / "config.json").read_text())
    qc = {"compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                 "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                                               "weights": {"num_bits": 4, "type": "int",
                                                                           "symmetric": sym, "strategy": "group",
                                                                           "group_size": GROUP, "actorder": None}}},
                                 "ignore": ["lm_head"]},
          "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": sym, "desc_act": act_order},
          "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}}[method]
    outs = []
    for d, t, qcfg in ((out, quant, qc), (out.with_name(out.name + "-exact"), exact, None)):
        d.mkdir()
        save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qcfg} if qcfg else {})}))
        outs.append(d)
    return tuple(outs)


CASES = [("compressed-tensors", True, False), ("compressed-tensors", False, False), ("gptq", True, False),
         ("gptq", False, True), ("awq", False, False)]


@pytest.mark.slow
@pytest.mark.parametrize("method,sym,act_order", CASES,
                         ids=["ct-sym", "ct-zero-points", "gptq-sym", "gptq-asym-act-order", "awq"])
def test_int4_checkpoint_matches_transformers_on_its_dequantized_weights(method, sym, act_order, checkpoints, tmp_path,
                                                                         services_factory):
    d, exact = write(pathlib.Path(checkpoints["qwen3_moe"]), tmp_path / "q", method, sym, act_order)
    ck = Checkpoint(d)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert name in ck and name in list(ck.names()) and not any(n.endswith(("qweight", "weight_packed")) for n in ck.names())
    assert torch.equal(ck.get(name), load_file(str(exact / "model.safetensors"))[name])  # our unpacking
    ref = transformers.AutoModelForCausalLM.from_pretrained(exact, dtype=torch.float32).eval()
    torch.manual_seed(1)
    prompt = torch.randint(2, 200, (20,)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        exact_logits = ref(torch.tensor([prompt])).logits[0].double()
    s = services_factory(d, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    assert greedy(s.stub, prompt, 12) == want, s.logs()
    s.stop()
    # default format: int4g32 (symmetric), uint4g32 (zero points) where groups are consecutive, else dequantized
    fmt = None if act_order else "int4g32" if sym else "uint4g32"
    s = services_factory(d, gpu_args=("--dtype", "fp32"))
    assert (f"as {fmt}" in s.logs()) == (fmt is not None), s.logs()
    if fmt:  # int8 activations on the exact int4 weights
        r = s.stub.Score(generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=prompt)), timeout=60)
        got = codec.decode(r.logits, "logits").double()
        err = float((got - exact_logits).norm() / exact_logits.norm())
        assert err < 0.02, err
        kept = ck.get_published(name, fmt)  # the published numbers, which dequantize to the exact weights
        torch.testing.assert_close(kept.dequantize(), ck.get(name), rtol=0, atol=1e-6)


@pytest.mark.parametrize("method,sym,act_order,fmt,hint", some([("awq", False, False, "int4g32", "uint4g32"),
                                                                 ("gptq", False, True, "uint4g32", "bf16")],
                                                                fast=[("gptq", False, True, "uint4g32", "bf16")]))
def test_a_4bit_format_is_refused_where_it_would_requantize(method, sym, act_order, fmt, hint, checkpoints, tmp_path):
    from harness import free_port, start
    d, _ = write(pathlib.Path(checkpoints["qwen3_moe"]), tmp_path / "q", method, sym, act_order)
    log = tmp_path / "expert.log"
    p = start("expert_service", "--model", str(d), "--listen", f"127.0.0.1:{free_port()}",
              "--weight-format", fmt, log=log)
    assert p.wait(120) == 2
    text = log.read_text()
    assert ("zero points" if fmt == "int4g32" else "act-order") in text and f"--weight-format {hint}" in text and \
        "Traceback" not in text, text
