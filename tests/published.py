"""Published configurations at toy width: tools/synth_checkpoint.py's presets narrowed to a few dozen units (every
field the preset's attention and routing read kept as published), for the tests that start them."""
from __future__ import annotations

import json
import pathlib
import sys

import torch
from safetensors.torch import save_file

from harness import ROOT
from moe_core.checkpoint import Checkpoint
from moe_core.config import TEXT_IN_WRAPPER
from moe_kernels.packing import Mx4

sys.path.insert(0, str(ROOT / "tools"))
import synth_checkpoint  # noqa: E402

NARROW = {
    "deepseek-v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16, n_group=4,
                        topk_group=2, num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=4,
                        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "kimi-k2": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
                    num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                    q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "glm-4.5-air": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
                        num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "gpt-oss-20b": dict(hidden_size=64, intermediate_size=64, num_local_experts=8, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, sliding_window=32),  # a 70-token prompt crosses it
    "minimax-m2": dict(hidden_size=64, intermediate_size=32, num_local_experts=16, num_experts_per_tok=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8),
    "qwen3-30b-a3b": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=16,
                          num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "qwen3-next-80b-a3b": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=16,
                               num_experts_per_tok=4, shared_expert_intermediate_size=32, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=16, linear_value_head_dim=16),
    "qwen3.5-35b-a3b": dict(hidden_size=64, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                            shared_expert_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16,
                            vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, out_hidden_size=64)),
}
# DeepSeek-V3.2: eight indexer heads (a key every head's relu zeroes ties at 0: rare with eight) picking 16 keys of a
# 70-token prompt
NARROW["deepseek-v3.2"] = dict(NARROW["deepseek-v3"], index_n_heads=8, index_head_dim=16, index_topk=16)
# GLM-5: the same at GLM's head shapes (nope 12 against a value of 24), no expert groups, the middle layer reusing the
# first's selection
NARROW["glm-5"] = dict(NARROW["deepseek-v3.2"], n_group=1, topk_group=1, qk_nope_head_dim=12, v_head_dim=24,
                       indexer_types=["full", "shared", "full"])
# MiMo-V2-Flash: windows of 8 + the query (a 70-token prompt crosses them), GQA 4 / 1 (2 on sliding layers), a value
# head of 16 beside query and key heads of 24
NARROW["mimo-v2-flash"] = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
                               num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                               v_head_dim=16, sliding_window_size=8)
# MiniMax-M3: blocks of 4 keys, 3 kept per KV group (a 70-token prompt has 18), a dense first layer
NARROW["minimax-m3"] = dict(hidden_size=64, intermediate_size=32, dense_intermediate_size=48, shared_intermediate_size=24,
                            num_local_experts=16, num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, rotary_dim=8, sparse_attention_config=dict(
                                sparse_attention_freq=[0, 1, 1], sparse_num_index_heads=2, sparse_index_dim=16,
                                sparse_block_size=4, sparse_topk_blocks=3, sparse_local_block=1),
                            vision_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2))
NARROW["kimi-k2.6"] = dict(NARROW["kimi-k2"], vision_config=dict(hidden_size=32, intermediate_size=32,
                                                                 num_hidden_layers=1))


def synth(arch: str, out: pathlib.Path, layers: int, **extra) -> pathlib.Path:
    c = synth_checkpoint.config_of(arch, layers, {**NARROW[arch], **extra})
    return synth_checkpoint.write(c, out, std=0.1, seed=0, shard_mb=8)
# DeepSeek-V4-Flash: a window of 8 (a 70-token prompt crosses it), a window-only layer, CSA (entries of 4, the indexer's
# eight heads keeping 4 of a 70-token prompt's 17) and HCA at a rate of 16 (DeepSeek's legacy fields as published)
NARROW["deepseek-v4-flash"] = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                                   num_attention_heads=4, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2,
                                   o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=4, sliding_window=8,
                                   compress_ratios=[0, 4, 128], compress_rate_hca=16, num_hash_layers=1)


def dequantized_copy(src: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The same model with every weight as float32 (FP8 ones dequantized; MXFP4 experts as the fused
    [E, K, rows] tensors transformers' gpt-oss keeps), for transformers."""
    ck = Checkpoint(src)
    out.mkdir()
    tensors = {}
    cfg = json.loads((src / "config.json").read_text())
    # MiniMax-M3, GLM-5.3-Flash: transformers has no causal LM of the text model alone: the wrapper's, which reads the
    # stored names
    renames = TEXT_IN_WRAPPER[cfg["model_type"]][0] if cfg["model_type"] in ("minimax_m3_vl", "glm5_next") else {}
    stored = lambda n: next((old + n[len(new):] for old, new in renames.items() if n.startswith(new)), n)  # noqa: E731
    for n in ck.names():
        if n.endswith("_blocks"):
            base = n[: -len("_blocks")]
            w = torch.stack([Mx4.from_blocks(b, s).dequantize() for b, s in zip(ck.get(n), ck.get(base + "_scales"))])
            tensors[base] = w.transpose(1, 2).contiguous()
        elif not n.endswith("_scales"):
            tensors[stored(n)] = ck.get(n).float().contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    cfg.pop("quantization_config", None)
    cfg.pop("expert_dtype", None)  # DeepSeek-V4's FP4 experts, dequantized here
    cfg.pop("use_mtp", None)  # MiniMax-M2's: transformers' generate() would look for MTP weights to draft with
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg))
    return out
# GLM-5.3-Flash: KDA in layers 0-2 (as many heads as attention's, as llama.cpp's converter requires), DSA on a NoPE MLA
# in layer 3 keeping 2 pools of 4 keys of a 70-token prompt's 17, three dense layers
NARROW["glm-5.3-flash"] = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
                               num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                               q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=8, index_head_dim=16,
                               index_kpool=4, index_topk=8, linear_attn_config=dict(
                                   num_heads=4, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0),
                               vision_config=dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64,
                                                  intermediate_size=32, projection_intermediate_size=32))
