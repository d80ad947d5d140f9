"""GGUF files: the tiny Qwen3-MoE checkpoint written as llama.cpp names and lays it out (the gguf package's
writer and quantizers: Q8_0 or Q4_0 routed experts, the rest F32), served with `--model FILE.gguf`. On the exact
path the greedy tokens are transformers' own on the same file (its GGUF loader dequantizes it); Q4_0 experts
start on the int4g32 kernels by default, their scales and values equal to what the gguf package dequantizes."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

import tiny_models
from harness import free_port, greedy, start
from moe_core import codec
from protos import generate_pb2

gguf = pytest.importorskip("gguf")
pytest.importorskip("moe_kernels._native", reason="native extension not built")

# transformers' GGUF config mapping for qwen3_moe has no expert_feed_forward_length and keeps its default 768:
# the reference needs that width
MOE_I = 768
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def write_gguf(src: pathlib.Path, out: pathlib.Path, expert_type, arch: str = "qwen3moe") -> pathlib.Path:
    cfg = json.loads((src / "config.json").read_text())
    t = load_file(str(src / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    E = cfg["num_local_experts"]
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    tok = json.loads((src / "tokenizer.json").read_text())
    added = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    vocab = {i: s for s, i in tok["model"]["vocab"].items()}
    n = cfg["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([added.get(i, vocab.get(i, f"[UNUSED{i}]")) for i in range(n)])
    w.add_token_types([3 if i in added else 1 for i in range(n)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(cfg.get("eos_token_id") or 1)
    w.add_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")

    def add(name, x, qtype=None):
        a = x.float().numpy()
        if qtype is None:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("output_norm.weight", t["model.norm.weight"])
    if "lm_head.weight" in t:
        add("output.weight", t["lm_head.weight"])
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        for ours, theirs in LAYER.items():
            add(f"blk.{L}.{theirs}.weight", t[p + ours + ".weight"])
        for ours, theirs in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            add(f"blk.{L}.{theirs}.weight", torch.stack([t[p + f"mlp.experts.{e}.{ours}.weight"] for e in range(E)]),
                expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return tiny_models.build("qwen3_moe", tmp_path_factory.mktemp("src") / "q", moe_intermediate_size=MOE_I)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_serves_transformers_greedy_tokens_on_the_same_file(qtype, source, tmp_path, services_factory,
                                                                  monkeypatch):
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    f = write_gguf(source, tmp_path / f"tiny-{qtype}.gguf", getattr(gguf.GGMLQuantizationType, qtype))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f.name,
                                                            dtype=torch.float32).eval()
    torch.manual_seed(1)
    prompt = torch.randint(2, 200, (20,)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        exact = ref(torch.tensor([prompt])).logits[0].double()
    s = services_factory(f, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    assert greedy(s.stub, prompt, 12) == want, s.logs()
    s.stop()
    s = services_factory(f, gpu_args=("--dtype", "fp32"))  # default formats
    assert ("as int4g32" in s.logs()) == (qtype == "Q4_0"), s.logs()
    r = s.stub.Score(generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=prompt)), timeout=60)
    got = codec.decode(r.logits, "logits").double()
    # int4g32's int8 activations cost this random model ~6% of the logits (the int8 format measures the same);
    # the weights themselves are exact: test_q4_0_experts_are_kept_bit_for_bit
    assert float((got - exact).norm() / exact.norm()) < (0.08 if qtype == "Q4_0" else 0.02)


def test_q4_0_experts_are_kept_bit_for_bit(source, tmp_path):
    from moe_core import gguf_model
    f = write_gguf(source, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q4_0)
    d = gguf_model.prepare(f, tmp_path / "cache")
    assert json.loads((d / "config.json").read_text())["moe_intermediate_size"] == MOE_I
    ck = gguf_model.open_checkpoint(d)
    for name in ("model.layers.1.mlp.experts.5.down_proj.weight", "model.layers.0.mlp.experts.0.gate_proj.weight"):
        i4 = ck.get_int4(name)
        assert i4.group == 32 and torch.equal(i4.dequantize(), ck.get(name))  # = the gguf package's dequantizer
    assert ck.get_int4("model.layers.0.self_attn.q_proj.weight") is None  # F32
    assert np.allclose(ck.get("model.embed_tokens.weight").numpy(), load_file(str(source / "model.safetensors"))[
        "model.embed_tokens.weight"].numpy())


def test_other_gguf_architectures_are_refused_by_name(source, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    f = write_gguf(source, tmp_path / "other.gguf", None, arch="llama")
    log = tmp_path / "expert.log"
    p = start("expert_service", "--model", str(f), "--listen", f"127.0.0.1:{free_port()}", log=log)
    assert p.wait(120) == 2
    text = log.read_text()
    assert "GGUF architecture 'llama' is not supported yet" in text and "Traceback" not in text, text
