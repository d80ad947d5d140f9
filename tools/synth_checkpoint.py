"""Write a synthetic checkpoint of a published MoE architecture: config.json exactly as published
(vocabulary, positions, rope scaling, quantization_config), the same tensor names, dtypes and
shard layout (model-0000i-of-0000n.safetensors + index), random weights. For testing and
benchmarking real-size behaviour without the real weights.

    python tools/synth_checkpoint.py --arch deepseek-v3 --layers 4 --out /tmp/dsv3      # 3 dense + 1 MoE, FP8
    python tools/synth_checkpoint.py --arch qwen3-30b-a3b --layers 6 --out /tmp/qwen3
    python tools/synth_checkpoint.py --arch glm-4.5-air --layers 4 --out /tmp/glm   # 1 dense + 3 MoE
    python tools/synth_checkpoint.py --arch gpt-oss-20b --layers 4 --out /tmp/oss   # MXFP4 experts
    python tools/synth_checkpoint.py --arch minimax-m2 --layers 2 --out /tmp/m2     # FP8, as published
    python tools/synth_checkpoint.py --arch qwen3-next-80b-a3b --layers 4 --out /tmp/next  # 3 DeltaNet + 1 full
    python tools/synth_checkpoint.py --arch qwen3.5-35b-a3b --layers 4 --out /tmp/q35  # inside its VL wrapper
    python tools/synth_checkpoint.py --arch minimax-m3 --layers 3 --out /tmp/m3  # FP8, inside its VL wrapper
    python tools/synth_checkpoint.py --arch deepseek-v3 --layers 2 --set hidden_size=64 ... --out DIR  # narrow

Tensors are generated and written one shard at a time (at most --shard-mb in memory). FP8
checkpoints store every attention and MLP projection as e4m3 with a float32 `weight_scale_inv`
per weight_block_size block (partial edge blocks as published); embeddings, lm_head, norms, the
router and its bias stay unquantized. The tokenizer is the embedded default model's (its ids are
a prefix of any vocabulary here)."""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

import torch
from safetensors.torch import save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (run as a script from a checkout that is not installed)
from moe_core.config import SAME_AS, TEXT_IN_WRAPPER, is_routed_expert_tensor  # noqa: E402

TOKENIZER = ROOT / "models" / "default"

PRESETS = {
    # deepseek-ai/DeepSeek-V3 config.json (the R1 releases share it)
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
        "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
        "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
        "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
        "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True,
        "v_head_dim": 128, "vocab_size": 129280,
    },
    # zai-org/GLM-4.5-Air config.json
    "glm-4.5-air": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": [151329, 151336, 151338],
        "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 131072,
        "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46,
        "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "pad_token_id": 151329,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
        "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
        "use_cache": True, "use_qk_norm": False, "vocab_size": 151552,
    },
    # openai/gpt-oss-20b config.json: routed experts in MXFP4 (_blocks, _scales), the rest bf16
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088,
    },
    # MiniMaxAI/MiniMax-M2 config.json as public copies of it give it (not read from the hub here; its
    # bos/eos ids left out, unconfirmed): FP8 block-quantized with fmt written "float8_e4m3fn"; Mixtral's
    # tensor names, sigmoid routing with a correction bias, QK-norm over all heads, half-rotary heads
    # (the services do not build its multi-token-prediction modules)
    "minimax-m2": {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attn_type_list": [1] * 62,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
        "intermediate_size": 1536, "max_position_embeddings": 196608, "mtp_transformer_layers": 1,
        "norm_topk_prob": True, "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62,
        "num_key_value_heads": 8, "num_local_experts": 256, "num_mtp_modules": 3, "output_router_logits": False,
        "partial_rotary_factor": 0.5, "qk_norm_type": "per_layer",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                "weight_block_size": [128, 128],
                                "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
        "rms_norm_eps": 1e-06, "rope_theta": 5000000, "rotary_dim": 64, "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_mtp": True,
        "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064,
    },
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 3 of every 4 layers gated DeltaNet; mtp.* (its
    # multi-token-prediction layer) is published beside the model and not used to decode
    "qwen3-next-80b-a3b": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512,
        "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
        "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": False,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    # Qwen/Qwen3.5-35B-A3B config.json: the text model inside a vision-language wrapper; its weights under
    # model.language_model., experts stacked per layer; the vision tower (model.visual.) beside it
    "qwen3.5-35b-a3b": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "image_token_id": 248056, "model_type": "qwen3_5_moe",
        "text_config": {
            "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": 248044,
            "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
            "hidden_act": "silu", "hidden_size": 2048,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
            "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
            "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16,
            "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2,
            "output_router_logits": False, "pad_token_id": None, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                                "rope_theta": 10000000, "rope_type": "default"},
            "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "use_cache": True,
            "vocab_size": 248320,
        },
        "tie_word_embeddings": False, "video_token_id": 248057,
        "vision_config": {
            "deepstack_visual_indexes": [], "depth": 27, "dtype": "bfloat16", "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1152, "in_channels": 3, "intermediate_size": 4304, "model_type": "qwen3_5_moe_vision",
            "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
        "vision_end_token_id": 248054, "vision_start_token_id": 248053,
    },
}

# moonshotai/Kimi-K2-Instruct config.json as public copies of it give it (not read from the hub here): DeepSeek-V3's
# architecture at 384 experts, 64 heads, one dense layer, no expert groups; FP8 as published
PRESETS["kimi-k2"] = {k: v for k, v in PRESETS["deepseek-v3"].items() if k != "ep_size"} | {
    "model_type": "kimi_k2", "bos_token_id": 163584, "eos_token_id": 163585, "first_k_dense_replace": 1,
    "max_position_embeddings": 131072, "n_group": 1, "n_routed_experts": 384, "num_attention_heads": 64,
    "num_key_value_heads": 64, "num_nextn_predict_layers": 0, "rope_theta": 50000.0, "routed_scaling_factor": 2.827,
    "topk_group": 1, "vocab_size": 163840,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}}

# deepseek-ai/DeepSeek-V3.2 config.json as public copies of it give it (not read from the hub here): DeepSeek-V3's
# with the lightning indexer (64 heads of 128, each query's top 2048 keys); its indexer weights in bf16
PRESETS["deepseek-v3.2"] = {**PRESETS["deepseek-v3"], "architectures": ["DeepseekV32ForCausalLM"],
                            "model_type": "deepseek_v32", "index_head_dim": 128, "index_n_heads": 64,
                            "index_topk": 2048, "num_nextn_predict_layers": 1}

# moonshotai/Kimi-K2.6 (and K2.5) as public copies give it (not read from the hub here): the text model of kimi-k2 under
# a vision-language wrapper (model_type kimi_k25, its weights under language_model.*, a MoonViT tower and projector
# beside it), its routed experts int4 as published (compressed-tensors pack-quantized, symmetric groups of 32, as
# K2-Thinking's), every other weight bf16
KIMI_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                           "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 32, "actorder": None,
                                                       "dynamic": False}}},
             "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}
PRESETS["kimi-k2.6"] = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "text_config": {k: v for k, v in PRESETS["kimi-k2"].items() if k not in ("architectures", "quantization_config")},
    "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "patch_size": 14,
                      "merge_kernel_size": [2, 2], "model_type": "kimi_k25_vision"},
    "projection_hidden_size": 1152, "quantization_config": KIMI_INT4, "tie_word_embeddings": False,
    "media_placeholder_token_id": 163605,
}

# zai-org/GLM-5 (FP8 release) as transformers 5.24's GlmMoeDsaConfig gives its shapes (not read from the hub here):
# V3.2's sparse attention on a 6144-wide MLA of 64 heads (nope 192, value 256), the indexer's 32 heads of 128 with
# its rope interleaved, no expert groups; FP8 blocks as DeepSeek publishes them; every layer's indexer its own
# (indexer_types all full, transformers' default schedule); token ids not checked against the published tokenizer
PRESETS["glm-5"] = {**{k: v for k, v in PRESETS["deepseek-v3"].items() if k not in ("ep_size", "rope_scaling")},
                    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
                    "intermediate_size": 12288, "num_attention_heads": 64, "num_key_value_heads": 64,
                    "q_lora_rank": 2048, "qk_nope_head_dim": 192, "v_head_dim": 256, "n_group": 1, "topk_group": 1,
                    "num_hidden_layers": 78, "max_position_embeddings": 202752, "rms_norm_eps": 1e-05,
                    "vocab_size": 154880, "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048,
                    "eos_token_id": [154820, 154827, 154829], "bos_token_id": None, "num_nextn_predict_layers": 1}

# XiaomiMiMo/MiMo-V2-Flash as transformers 5.24's MiMoV2FlashConfig gives its shapes (not read from the hub here):
# full attention on the first and every sixth layer, sliding windows of 128 + the query elsewhere (twice the KV heads,
# sinks), query/key heads of 192 and value heads of 128, one dense layer, 256 experts top-8 by sigmoid; FP8 blocks
PRESETS["mimo-v2-flash"] = {
    "architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash", "attention_bias": False,
    "attention_value_scale": 0.707, "bos_token_id": 1, "eos_token_id": 151645, "head_dim": 192, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 16384, "max_position_embeddings": 131072,
    "moe_intermediate_size": 2048, "n_group": 1, "n_routed_experts": 256, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "quantization_config": PRESETS["deepseek-v3"]["quantization_config"], "rms_norm_eps": 1e-05,
    "routed_scaling_factor": None, "sliding_window_size": 128, "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 152576,
}


def _mimo_sliding(c: dict, L: int) -> bool:
    """A MiMo-V2-Flash layer with a sliding window (transformers' default pattern where the config lists none)."""
    types = c.get("layer_types")
    return types[L] == "sliding_attention" if types else bool(L) and (L + 1) % 6 != 0


def tensor_specs(c: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor, in the published order; kind: proj (an attention or MLP
    projection: quantized in FP8 checkpoints), norm, embed, router, bias."""
    if "text_config" in c:  # a vision-language wrapper: the text model under its stored names, the tower beside
        text = tensor_specs({**c["text_config"], "model_type": c["model_type"]})
        renames, _ = TEXT_IN_WRAPPER[c["model_type"]]
        stored = lambda n: next((old + n[len(new):] for old, new in renames.items() if n.startswith(new)), n)  # noqa
        tower = {"kimi_k25": _kimi_vision_specs, "minimax_m3_vl": _m3_vision_specs,
                 "glm5_next": _glm_vision_specs}.get(c["model_type"], _vision_specs)
        return [(stored(n), sh, k) for n, sh, k in text] + tower(c["vision_config"], c["text_config"]["hidden_size"])
    if c["model_type"] == "deepseek_v4":
        return _v4_specs(c)
    if c["model_type"] == "glm5_next":
        return _glm5_next_specs(c)
    c = {**c, "model_type": SAME_AS.get(c["model_type"], c["model_type"])}  # (Kimi's layers are DeepSeek-V3's)
    H, V, out = c["hidden_size"], c["vocab_size"], []
    proj = lambda name, rows, cols: out.append((name, (rows, cols), "proj"))  # noqa: E731
    layers = c["num_hidden_layers"] + (c.get("num_nextn_predict_layers") or 0)
    nxt = c["model_type"] in ("qwen3_next", "qwen3_5_moe")
    split = c["model_type"] == "qwen3_5_moe"  # Qwen3.5: DeltaNet projections one per part, experts stacked
    minimax, mimo = c["model_type"] in ("minimax_m2", "minimax_m3_vl"), c["model_type"] == "mimo_v2_flash"
    m3 = c["model_type"] == "minimax_m3_vl"
    out.append(("model.embed_tokens.weight", (V, H), "embed"))
    for L in range(layers + nxt):
        p = f"model.layers.{L}."
        if nxt and L == layers:  # Qwen3-Next's multi-token-prediction module: one full-attention layer
            p = "mtp.layers.0."
            out += [("mtp.fc.weight", (H, 2 * H), "embed"), ("mtp.norm.weight", (H,), "norm"),
                    ("mtp.pre_fc_norm_embedding.weight", (H,), "norm"), ("mtp.pre_fc_norm_hidden.weight", (H,), "norm")]
        if L >= c["num_hidden_layers"] and not nxt:  # DeepSeek's multi-token-prediction layer (not used to decode)
            out += [(p + "embed_tokens.weight", (V, H), "embed"), (p + "enorm.weight", (H,), "norm"),
                    (p + "hnorm.weight", (H,), "norm"), (p + "shared_head.norm.weight", (H,), "norm"),
                    (p + "shared_head.head.weight", (V, H), "embed")]
            proj(p + "eh_proj.weight", H, 2 * H)
        out += [(p + "input_layernorm.weight", (H,), "norm"), (p + "post_attention_layernorm.weight", (H,), "norm")]
        a = p + "self_attn."
        if c["model_type"] == "deepseek_v3":
            nh, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
            proj(a + "q_a_proj.weight", c["q_lora_rank"], H)
            out.append((a + "q_a_layernorm.weight", (c["q_lora_rank"],), "norm"))
            proj(a + "q_b_proj.weight", nh * (nope + rope), c["q_lora_rank"])
            proj(a + "kv_a_proj_with_mqa.weight", c["kv_lora_rank"] + rope, H)
            out.append((a + "kv_a_layernorm.weight", (c["kv_lora_rank"],), "norm"))
            proj(a + "kv_b_proj.weight", nh * (nope + v), c["kv_lora_rank"])
            proj(a + "o_proj.weight", H, nh * v)
            types = c.get("indexer_types") or ()
            if c.get("index_topk") and (L >= len(types) or types[L] == "full"):
                # DeepSeek-V3.2's lightning indexer (GLM-5's shared layers have none)
                ih, idim, ip = c["index_n_heads"], c["index_head_dim"], a + "indexer."
                out += [(ip + "wq_b.weight", (ih * idim, c["q_lora_rank"]), "proj_bias"),
                        (ip + "wk.weight", (idim, H), "proj_bias"), (ip + "k_norm.weight", (idim,), "norm"),
                        (ip + "k_norm.bias", (idim,), "proj_bias"), (ip + "weights_proj.weight", (ih, H), "proj_bias")]
            moe = L >= c["first_k_dense_replace"] and L % c.get("moe_layer_freq", 1) == 0
            E, shared = c["n_routed_experts"], c["moe_intermediate_size"] * c["n_shared_experts"]
        else:
            nh, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
            glm = c["model_type"] == "glm4_moe"
            if nxt and L < layers and _linear_attention(c, L):  # a gated DeltaNet layer
                la, nk, nv = p + "linear_attn.", c["linear_num_key_heads"], c["linear_num_value_heads"]
                dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
                if split:
                    for n, rows in (("in_proj_qkv", 2 * nk * dk + nv * dv), ("in_proj_z", nv * dv), ("in_proj_b", nv),
                                    ("in_proj_a", nv)):
                        proj(la + n + ".weight", rows, H)
                else:
                    proj(la + "in_proj_qkvz.weight", 2 * nk * dk + 2 * nv * dv, H)
                    proj(la + "in_proj_ba.weight", 2 * nv, H)
                out += [(la + "conv1d.weight", (2 * nk * dk + nv * dv, 1, c["linear_conv_kernel_dim"]), "conv"),
                        (la + "dt_bias", (nv,), "norm"), (la + "A_log", (nv,), "log_decay"),
                        (la + "norm.weight", (dv,), "norm")]
                proj(la + "out_proj.weight", H, nv * dv)
            else:  # q_proj: Qwen3-Next's gives each head's query and its output gate
                mimo_swa = mimo and _mimo_sliding(c, L)
                kv, dv = kv * (2 if mimo_swa else 1), c.get("v_head_dim") or hd
                for n, rows in (("q_proj", nh * hd * (2 if nxt else 1)), ("k_proj", kv * hd), ("v_proj", kv * dv)):
                    proj(a + n + ".weight", rows, H)
                    if c.get("attention_bias"):
                        out.append((a + n + ".bias", (rows,), "proj_bias"))
                proj(a + "o_proj.weight", H, nh * dv)
                if mimo_swa:
                    out.append((a + "attention_sink_bias", (nh,), "proj_bias"))
                if c["model_type"] == "gpt_oss":  # o_proj's bias and the sinks; every layer MoE, experts fused
                    out += [(a + "o_proj.bias", (H,), "proj_bias"), (a + "sinks", (nh,), "proj_bias")]
                    E, I, m = c["num_local_experts"], c["intermediate_size"], p + "mlp."
                    out += [(m + "router.weight", (E, H), "router"), (m + "router.bias", (E,), "proj_bias")]
                    for n, rows, k in (("gate_up_proj", 2 * I, H), ("down_proj", H, I)):
                        out += [(m + f"experts.{n}_blocks", (E, rows, k // 32, 16), "mx_blocks"),
                                (m + f"experts.{n}_scales", (E, rows, k // 32), "mx_scales"),
                                (m + f"experts.{n}_bias", (E, rows), "proj_bias")]
                    continue
                if minimax and not m3:  # one norm over all heads' q (k)
                    out += [(a + "q_norm.weight", (nh * hd,), "norm"), (a + "k_norm.weight", (kv * hd,), "norm")]
                elif not (glm or mimo) or c.get("use_qk_norm"):
                    out += [(a + "q_norm.weight", (hd,), "norm"), (a + "k_norm.weight", (hd,), "norm")]
            if m3 and _m3_sparse(c, L):  # its block indexer (left unquantized)
                ih, idim = c["sparse_attention_config"]["sparse_num_index_heads"], c["sparse_attention_config"][
                    "sparse_index_dim"]
                out += [(a + "index_q_proj.weight", (ih * idim, H), "proj_bias"),
                        (a + "index_k_proj.weight", (idim, H), "proj_bias"), (a + "index_q_norm.weight", (idim,), "norm"),
                        (a + "index_k_norm.weight", (idim,), "norm")]
            if m3:  # dense layers (moe_layer_freq), each MoE layer with one shared expert
                moe, E, shared = bool(c["moe_layer_freq"][L]), c["num_local_experts"], c["shared_intermediate_size"]
            elif minimax:  # every layer MoE, Mixtral's names (below)
                moe, E, shared = True, c["num_local_experts"], 0
            elif mimo:  # one dense layer first (mlp_layer_types), DeepSeek-V3's router, no shared experts
                moe = (c.get("mlp_layer_types") or ["dense"] + ["sparse"] * layers)[L] == "sparse"
                E, shared = c["n_routed_experts"], 0
            elif glm:  # DeepSeek-V3's MoE layout
                moe = L >= c["first_k_dense_replace"]
                E, shared = c["n_routed_experts"], c["moe_intermediate_size"] * c["n_shared_experts"]
            else:
                moe = L not in (c.get("mlp_only_layers") or []) and (L + 1) % (c.get("decoder_sparse_step") or 1) == 0
                E, shared = c["num_experts"], (c["shared_expert_intermediate_size"] if nxt else 0)
        m = p + "mlp."
        if not moe:
            inter = c["dense_intermediate_size"] if m3 else c["intermediate_size"]
            for n, (r, k) in (("gate_proj", (inter, H)), ("up_proj", (inter, H)), ("down_proj", (H, inter))):
                proj(m + n + ".weight", r, k)
            continue
        if minimax:
            m, I = p + "block_sparse_moe.", c["intermediate_size"]
            for e in range(E):
                for n, (r, k) in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                    proj(m + f"experts.{e}.{n}.weight", r, k)
            out += [(m + "gate.weight", (E, H), "router"), (m + "e_score_correction_bias", (E,), "bias")]
            for n, (r, k) in (("gate_proj", (shared, H)), ("up_proj", (shared, H)), ("down_proj", (H, shared))):
                if shared:
                    proj(m + f"shared_experts.{n}.weight", r, k)
            continue
        I = c["moe_intermediate_size"]
        if split and p.startswith("model."):  # stacked: gate_up_proj [E, 2I, H] (gate rows, then up), down [E, H, I]
            out += [(m + "experts.gate_up_proj", (E, 2 * I, H), "proj"), (m + "experts.down_proj", (E, H, I), "proj")]
        for e in range(0 if split and p.startswith("model.") else E):
            proj(m + f"experts.{e}.gate_proj.weight", I, H)
            proj(m + f"experts.{e}.up_proj.weight", I, H)
            proj(m + f"experts.{e}.down_proj.weight", H, I)
        out.append((m + "gate.weight", (E, H), "router"))
        if c["model_type"] in ("deepseek_v3", "glm4_moe", "mimo_v2_flash"):
            out.append((m + "gate.e_score_correction_bias", (E,), "bias"))
        if shared:  # Qwen's one gated shared_expert, DeepSeek's shared_experts
            se = m + ("shared_expert." if nxt else "shared_experts.")
            proj(se + "gate_proj.weight", shared, H)
            proj(se + "up_proj.weight", shared, H)
            proj(se + "down_proj.weight", H, shared)
            if nxt:
                out.append((m + "shared_expert_gate.weight", (1, H), "router"))
    out += [("model.norm.weight", (H,), "norm"), ("lm_head.weight", (V, H), "embed")]
    return out


def _v4_specs(c: dict) -> list:
    """DeepSeek-V4's tensors under its published names and dtypes (DeepSeek's own: no model. prefix, hc_head_*,
    attn.kv_norm; transformers saves others): the hyper-connections, sinks, compressors' position biases and the
    correction bias fp32; the compressors' projections, the indexer's head weights and the router bf16; the attention's
    and shared experts' projections "proj" (FP8 where quantized), the routed experts "fp4" where expert_dtype says so;
    the hash layers' token id -> experts tables int64. (No multi-token-prediction layer.)"""
    from moe_core.config import parse_config
    cfg = parse_config(c)
    H, V, hc, nh, D, qr = c["hidden_size"], c["vocab_size"], cfg.hc_mult, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    E, I, k, g, R = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.top_k, cfg.o_groups, cfg.o_lora_rank
    expert = "fp4" if cfg.mxfp4_experts else "proj"
    out = [("embed.weight", (V, H), "embed")]
    mixes = (2 + hc) * hc
    for L in range(cfg.num_layers):
        p, a = f"layers.{L}.", f"layers.{L}.attn."
        out += [(p + "attn_norm.weight", (H,), "norm"), (p + "ffn_norm.weight", (H,), "norm")]
        for b in ("hc_attn_", "hc_ffn_"):
            out += [(p + b + "fn", (mixes, hc * H), "fp32"), (p + b + "base", (mixes,), "fp32"),
                    (p + b + "scale", (3,), "fp32")]
        out += [(a + "wq_a.weight", (qr, H), "proj"), (a + "q_norm.weight", (qr,), "norm"),
                (a + "wq_b.weight", (nh * D, qr), "proj"), (a + "wkv.weight", (D, H), "proj"),
                (a + "kv_norm.weight", (D,), "norm"), (a + "wo_a.weight", (g * R, nh * D // g), "proj"),
                (a + "wo_b.weight", (H, g * R), "proj"), (a + "attn_sink", (nh,), "fp32")]
        rate = cfg.compress_rates[L]
        for cp, d, two in ((a + "compressor.", D, cfg.csa(L)), (a + "indexer.compressor.", cfg.index_dim, True)):
            if rate and (cp == a + "compressor." or cfg.csa(L)):
                w = (2 if two else 1) * d
                out += [(cp + "wkv.weight", (w, H), "embed"), (cp + "wgate.weight", (w, H), "embed"),
                        (cp + "ape", (rate, w), "fp32"), (cp + "norm.weight", (d,), "norm")]
        if cfg.csa(L):
            out += [(a + "indexer.wq_b.weight", (cfg.index_heads * cfg.index_dim, qr), "proj"),
                    (a + "indexer.weights_proj.weight", (cfg.index_heads, H), "embed")]
        f = p + "ffn."
        out.append((f + "gate.weight", (E, H), "router"))
        out.append((f + "gate.tid2eid", (V, k), "hash") if L in cfg.hash_layers else (f + "gate.bias", (E,), "bias"))
        for e in range(E):
            for n, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                out.append((f + f"experts.{e}.{n}.weight", shape, expert))
        for n, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            out.append((f + f"shared_experts.{n}.weight", shape, "proj"))
    out += [("hc_head_fn", (hc, hc * H), "fp32"), ("hc_head_base", (hc,), "fp32"), ("hc_head_scale", (1,), "fp32"),
            ("norm.weight", (H,), "norm"), ("head.weight", (V, H), "embed")]
    return out


def _glm5_next_specs(c: dict) -> list:
    """GLM-5.3-Flash's text model (tensor_specs stores it under its wrapper's names, model.language_model.*): KDA
    layers' projections, per-part convs, forget / output gates; the NoPE MLA layers' and (full layers) their k-pool
    indexer's; hyper-connections (fp32); dense first layers, then experts beside one shared expert."""
    from moe_core.config import parse_config
    cfg = parse_config({"model_type": "glm5_next", "text_config": c})
    t = c
    H, V, hc, nh = t["hidden_size"], t["vocab_size"], cfg.hc_mult, cfg.num_heads
    la, E, I = cfg.linear_attn, cfg.n_routed_experts, cfg.moe_intermediate_size
    qr, r, dn, dv, Di, Hi = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.index_dim, \
        cfg.index_heads
    m = "model."
    out = [(m + "embed_tokens.weight", (V, H), "embed")]
    mixes = (2 + hc) * hc
    for L in range(cfg.num_layers):
        p = f"{m}layers.{L}."
        a = p + "self_attn."
        out += [(p + "input_layernorm.weight", (H,), "norm"), (p + "post_attention_layernorm.weight", (H,), "norm")]
        for b in ("hc_attn_", "hc_ffn_"):
            out += [(p + b + "fn", (mixes, hc * H), "fp32"), (p + b + "base", (mixes,), "fp32"),
                    (p + b + "scale", (3,), "fp32")]
        if cfg.is_linear_attention(L):
            w = la.k_heads * la.k_dim
            out += [(a + f"{n}_proj.weight", (w, H), "proj") for n in "qkv"]
            out += [(a + f"{n}_conv1d.weight", (w, 1, la.conv_kernel), "conv") for n in "qkv"]
            out += [(a + "f_a_proj.weight", (la.k_dim, H), "proj"), (a + "f_b_proj.weight", (w, la.k_dim), "proj"),
                    (a + "b_proj.weight", (la.k_heads, H), "proj"), (a + "g_a_proj.weight", (la.k_dim, H), "proj"),
                    (a + "g_b_proj.weight", (w, la.k_dim), "proj"), (a + "A_log", (la.k_heads,), "log_decay"),
                    (a + "dt_bias", (w,), "norm"), (a + "o_norm.weight", (la.k_dim,), "norm"),
                    (a + "o_proj.weight", (H, w), "proj")]
        else:
            out += [(a + "q_a_proj.weight", (qr, H), "proj"), (a + "q_a_layernorm.weight", (qr,), "norm"),
                    (a + "q_b_proj.weight", (nh * dn, qr), "proj"), (a + "kv_a_proj_with_mqa.weight", (r, H), "proj"),
                    (a + "kv_a_layernorm.weight", (r,), "norm"), (a + "kv_b_proj.weight", (nh * (dn + dv), r), "proj"),
                    (a + "o_proj.weight", (H, nh * dv), "proj")]
            if cfg.has_indexer(L):
                ip = a + "indexer."
                out += [(ip + "wq_b.weight", (Hi * Di, qr), "proj"), (ip + "wk.weight", (Di, H), "proj"),
                        (ip + "k_norm.weight", (Di,), "norm"), (ip + "k_norm.bias", (Di,), "proj_bias"),
                        (ip + "weights_proj.weight", (Hi, H), "proj_bias"),
                        (ip + "index_kpool_compress_ape", (cfg.index_kpool, Di), "fp32"),
                        (ip + "index_kpool_compress_gate", (Di, H), "proj_bias")]
        f = p + "mlp."
        if not cfg.is_moe_layer(L):
            inter = t["intermediate_size"]
            out += [(f + "gate_proj.weight", (inter, H), "proj"), (f + "up_proj.weight", (inter, H), "proj"),
                    (f + "down_proj.weight", (H, inter), "proj")]
            continue
        for e in range(E):
            out += [(f + f"experts.{e}.gate_proj.weight", (I, H), "proj"),
                    (f + f"experts.{e}.up_proj.weight", (I, H), "proj"),
                    (f + f"experts.{e}.down_proj.weight", (H, I), "proj")]
        out += [(f + "gate.weight", (E, H), "fp32"), (f + "gate.e_score_correction_bias", (E,), "bias")]
        s = cfg.shared_intermediate_size
        out += [(f + "shared_experts.gate_proj.weight", (s, H), "proj"),
                (f + "shared_experts.up_proj.weight", (s, H), "proj"), (f + "shared_experts.down_proj.weight", (H, s), "proj")]
    out += [(m + "norm.weight", (H,), "norm"), ("lm_head.weight", (V, H), "embed")]
    return out


def _glm_vision_specs(v: dict, text_hidden: int) -> list:
    """A stand-in for GLM-5.3-Flash's vision tower (model.visual.*, which the services leave out): its patch embedding."""
    return [("model.visual.patch_embed.proj.weight", (v["hidden_size"], 3, 2, 14, 14), "embed")]  # (a Conv3d's)


def _kimi_vision_specs(v: dict, text_hidden: int) -> list:
    """The first blocks of Kimi-K2.5/K2.6's MoonViT tower and its projector (the services leave them out; written so
    that they must): num_hidden_layers of them."""
    d, D, p = v["hidden_size"], v["intermediate_size"], "vision_tower."
    out = [(p + "patch_embed.proj.weight", (d, 3, v["patch_size"], v["patch_size"]), "proj_bias"),
           (p + "patch_embed.proj.bias", (d,), "proj_bias")]
    for i in range(v["num_hidden_layers"]):
        b = f"{p}encoder.blocks.{i}."
        for n, shape in (("wqkv", (3 * d, d)), ("wo", (d, d)), ("mlp.fc0", (D, d)), ("mlp.fc1", (d, D))):
            out += [(b + n + ".weight", shape, "proj_bias"), (b + n + ".bias", shape[:1], "proj_bias")]
        out += [(b + n, (d,), "norm") for n in ("norm0.weight", "norm0.bias", "norm1.weight", "norm1.bias")]
    merged = d * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
    return out + [("mm_projector.pre_norm.weight", (d,), "norm"), ("mm_projector.pre_norm.bias", (d,), "norm"),
                  ("mm_projector.proj.0.weight", (merged, merged), "proj_bias"),
                  ("mm_projector.proj.2.weight", (text_hidden, merged), "proj_bias")]


def _m3_sparse(c: dict, layer: int) -> bool:
    return bool(c["sparse_attention_config"]["sparse_attention_freq"][layer])


def _m3_vision_specs(v: dict, text_hidden: int) -> list:
    """The first blocks of MiniMax-M3's vision tower and its projectors, as published (the services leave them out;
    written so that they must)."""
    d, D, p = v["hidden_size"], v["intermediate_size"], "vision_tower.vision_model."
    out = [(p + "embeddings.patch_embedding.weight", (d, 3, v["temporal_patch_size"], v["patch_size"], v["patch_size"]),
            "proj_bias"), (p + "pre_layrnorm.weight", (d,), "norm"), (p + "pre_layrnorm.bias", (d,), "norm")]
    for i in range(v["num_hidden_layers"]):
        b = f"{p}encoder.layers.{i}."
        for n, shape in (("self_attn.q_proj", (d, d)), ("self_attn.k_proj", (d, d)), ("self_attn.v_proj", (d, d)),
                         ("self_attn.out_proj", (d, d)), ("mlp.fc1", (D, d)), ("mlp.fc2", (d, D))):
            out += [(b + n + ".weight", shape, "proj_bias"), (b + n + ".bias", shape[:1], "proj_bias")]
        out += [(b + n, (d,), "norm") for n in ("layer_norm1.weight", "layer_norm1.bias", "layer_norm2.weight",
                                               "layer_norm2.bias")]
    proj_h, merged = 6144, text_hidden * v["spatial_merge_size"] ** 2
    for m, k in (("multi_modal_projector.", d), ("patch_merge_mlp.", merged)):
        out += [(m + "linear_1.weight", (proj_h, k), "proj_bias"), (m + "linear_1.bias", (proj_h,), "proj_bias"),
                (m + "linear_2.weight", (text_hidden, proj_h), "proj_bias"),
                (m + "linear_2.bias", (text_hidden,), "proj_bias")]
    return out


def _vision_specs(v: dict, text_hidden: int) -> list:
    """The vision tower of a Qwen3.5 checkpoint (the services leave it out; written so that they must)."""
    d, D, p = v["hidden_size"], v["intermediate_size"], "model.visual."
    patch = (d, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"])
    out = [(p + "patch_embed.proj.weight", patch, "proj_bias"), (p + "patch_embed.proj.bias", (d,), "proj_bias"),
           (p + "pos_embed.weight", (v["num_position_embeddings"], d), "embed")]
    for i in range(v["depth"]):
        b = f"{p}blocks.{i}."
        for n, shape in (("attn.qkv", (3 * d, d)), ("attn.proj", (d, d)), ("mlp.linear_fc1", (D, d)),
                         ("mlp.linear_fc2", (d, D))):
            out += [(b + n + ".weight", shape, "proj_bias"), (b + n + ".bias", shape[:1], "proj_bias")]
        out += [(b + n, (d,), "norm") for n in ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias")]
    m, merged = p + "merger.", d * v["spatial_merge_size"] ** 2
    return out + [(m + "norm.weight", (d,), "norm"), (m + "norm.bias", (d,), "norm"),
                  (m + "linear_fc1.weight", (merged, merged), "proj_bias"), (m + "linear_fc1.bias", (merged,), "proj_bias"),
                  (m + "linear_fc2.weight", (v["out_hidden_size"], merged), "proj_bias"),
                  (m + "linear_fc2.bias", (v["out_hidden_size"],), "proj_bias")]


def _linear_attention(c: dict, layer: int) -> bool:
    types = c.get("layer_types")
    return types[layer] == "linear_attention" if types else (layer + 1) % c.get("full_attention_interval", 4) != 0


def quantize_fp8(w: torch.Tensor, block: tuple[int, int], pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (e4m3 values, float32 scale_inv per block): each block's absolute maximum maps
    to e4m3's largest value, 448 (DeepSeek's recipe); pow2: the scale rounded up to a power of two (ue8m0 scales)."""
    (rows, cols), (br, bc) = w.shape, block
    sr, sc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(sr * br, sc * bc)
    padded[:rows, :cols] = w.float()
    amax = padded.view(sr, br, sc, bc).abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale = amax / 448.0
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (padded.view(sr, br, sc, bc) / scale[:, None, :, None]).view(sr * br, sc * bc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale.float()


def generate(c: dict, spec, std: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    name, shape, kind = spec
    stored = c.get("torch_dtype") or c.get("dtype") or (c.get("text_config") or {}).get("dtype")
    dtype = getattr(torch, {"bfloat16": "bfloat16", "float16": "float16"}.get(stored, "float32"))
    if kind == "norm":
        return {name: (1 + 0.1 * torch.randn(shape, generator=gen)).to(dtype)}
    if kind == "bias":
        return {name: (0.1 * torch.rand(shape, generator=gen)).float()}  # published as fp32
    if kind == "fp32":  # DeepSeek-V4's fp32 tensors (hyper-connections, sinks, compressors' position biases)
        return {name: (1 + 0.1 * torch.randn(shape, generator=gen) if name.endswith("scale")
                       else torch.randn(shape, generator=gen) * std).float()}
    if kind == "fp4":  # DeepSeek-V4's routed experts: any e2m1 pairs, e8m0 scales 2^-6..2^-4 as mx_scales'
        rows, cols = shape
        return {name: torch.randint(-128, 128, (rows, cols // 2), generator=gen, dtype=torch.int8),
                name[: -len(".weight")] + ".scale": torch.randint(121, 124, (rows, cols // 32), generator=gen,
                                                                  dtype=torch.uint8).view(torch.float8_e8m0fnu)}
    if kind == "hash":  # a token id -> experts table: distinct experts per token
        E = c["n_routed_experts"]
        return {name: torch.stack([torch.randperm(E, generator=gen)[:shape[1]] for _ in range(shape[0])])}
    if kind == "proj_bias":
        return {name: (0.1 * torch.randn(shape, generator=gen)).to(dtype)}
    if kind == "conv":  # DeltaNet's depthwise conv taps
        return {name: (0.5 * torch.randn(shape, generator=gen)).to(dtype)}
    if kind == "log_decay":  # A_log: decay rates 1..16 as transformers initializes them
        return {name: (1 + 15 * torch.rand(shape, generator=gen)).log().to(dtype)}
    if kind == "mx_blocks":  # any e2m1 codes
        return {name: torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)}
    if kind == "mx_scales":  # 2^-6..2^-4: values of std ~0.1 like the other weights'
        return {name: torch.randint(121, 124, shape, generator=gen, dtype=torch.uint8)}
    q = c.get("quantization_config")
    if kind == "proj" and q and q["quant_method"] == "compressed-tensors" and is_routed_expert_tensor(name):
        # int4 as published: any codes, one bf16 scale per 32 (values of about std)
        base, (rows, cols) = name[: -len(".weight")], shape
        return {base + ".weight_packed": torch.randint(-2**31, 2**31 - 1, (rows, cols // 8), generator=gen,
                                                       dtype=torch.int32),
                base + ".weight_scale": (std / 4 * (0.5 + torch.rand(rows, cols // 32, generator=gen))).bfloat16(),
                base + ".weight_shape": torch.tensor([rows, cols])}
    w = torch.randn(shape, generator=gen) * std
    if kind == "proj" and q and q["quant_method"] == "fp8":
        values, scale_inv = quantize_fp8(w, tuple(q["weight_block_size"]), q.get("scale_fmt") == "ue8m0")
        if c["model_type"] == "deepseek_v4":  # its scale as X.scale, e8m0
            return {name: values, name[: -len(".weight")] + ".scale": scale_inv.to(torch.float8_e8m0fnu)}
        return {name: values, name + "_scale_inv": scale_inv}
    return {name: w.to(dtype)}


def write(c: dict, out: pathlib.Path, std: float, seed: int, shard_mb: int, routed_experts: bool = True) -> pathlib.Path:
    """routed_experts=False: every tensor but the routed experts' (what a GPU side loads; a benchmark of it alone
    at full width without the experts' gigabytes)."""
    out.mkdir(parents=True, exist_ok=True)
    specs = [s for s in tensor_specs(c) if routed_experts or not is_routed_expert_tensor(s[0])]
    method = (c.get("quantization_config") or {}).get("quant_method")
    nbytes = lambda s: (0.5 if s[2] == "proj" and method == "compressed-tensors" and is_routed_expert_tensor(s[0])  # noqa
                        else 1 if (s[2] == "proj" and method == "fp8") or s[2].startswith("mx") else 2) * \
        int(torch.tensor(s[1]).prod())
    shards, cur, size = [], [], 0
    for s in specs:  # cut into shards of about shard_mb, in order
        if cur and size + nbytes(s) > shard_mb << 20:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += nbytes(s)
    shards.append(cur)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for s in group:
            tensors.update(generate(c, s, std, gen))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
        total += sum(t.nbytes for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(c, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    return out

# MiniMaxAI/MiniMax-M3 as transformers 5.24's MiniMaxM3VLTextConfig documents its shapes and llama.cpp's converter reads
# its fields (not read from the hub here): the text model inside a vision-language wrapper, with the legacy
# sparse_attention_config and moe_layer_freq transformers and llama.cpp both read. Which layers are dense and the FP8
# blocks (MiniMax-M2's) are assumptions of this preset (one dense layer first); sparse attention in every MoE layer, as
# llama.cpp's loader builds the model; rotary_dim 64 of 128 also given as the partial_rotary_factor transformers reads
PRESETS["minimax-m3"] = {
    "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
    "image_token_index": 200025, "video_token_index": 200026, "projector_hidden_size": 6144,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": PRESETS["minimax-m2"]["quantization_config"],
    "text_config": {
        "model_type": "minimax_m3_vl_text", "vocab_size": 200064, "hidden_size": 6144, "intermediate_size": 3072,
        "num_hidden_layers": 60, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "hidden_act": "swigluoai", "max_position_embeddings": 524288, "rms_norm_eps": 1e-06,
        "bos_token_id": 200034, "eos_token_id": 200020, "tie_word_embeddings": False, "num_experts_per_tok": 4,
        "num_local_experts": 128, "n_shared_experts": 1, "dense_intermediate_size": 12288,
        "shared_intermediate_size": 3072, "routed_scaling_factor": 2.0, "rotary_dim": 64,
        "partial_rotary_factor": 0.5, "rope_theta": 5000000.0, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "scoring_func": "sigmoid", "torch_dtype": "bfloat16", "moe_layer_freq": [0] + [1] * 59,
        "sparse_attention_config": {"sparse_attention_freq": [0] + [1] * 59,
                                    "sparse_num_index_heads": 4, "sparse_index_dim": 128, "sparse_block_size": 128,
                                    "sparse_topk_blocks": 16, "sparse_local_block": 1},
    },
    "vision_config": {"model_type": "minimax_m3_vl_vision", "hidden_size": 1280, "intermediate_size": 5120,
                      "num_hidden_layers": 32, "num_attention_heads": 16, "num_channels": 3, "patch_size": 14,
                      "temporal_patch_size": 2, "spatial_merge_size": 2},
}


# zai-org/GLM-5.3-Flash as transformers 5.24's Glm5NextConfig defaults give its shapes (its docstring's checkpoint) in
# the fields llama.cpp's converter reads (linear_attn_config, mla_use_nope, first_k_dense_replace; not read from the
# hub): 45 layers, KDA in three of every four, DSA on a NoPE MLA in the fourth with a k-pool indexer of 16, 4
# hyper-connected streams, 3 dense layers, 288 experts; FP8 blocks assumed (as GLM-5's release); a one-block tower
PRESETS["glm-5.3-flash"] = {
    "architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "tie_word_embeddings": False,
    "image_token_id": 154854, "video_token_id": 154855, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "text_config": {
        "model_type": "glm5_next_text", "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 2048, "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64,
        "n_shared_experts": 1, "n_routed_experts": 288, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 0, "v_head_dim": 256, "qk_nope_head_dim": 256, "mla_use_nope": True,
        "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu",
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-05, "pad_token_id": 154820, "first_k_dense_replace": 3,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "index_kpool": 16,
        "index_kpool_always_select_tail": True, "swiglu_limit": 10.0, "hc_mult": 4, "hc_eps": 1e-06,
        "hc_sinkhorn_iters": 20, "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16",
        "linear_attn_config": {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
        "eos_token_id": [154820, 154827, 154829]},
    "vision_config": {"model_type": "glm5_next_vision", "depth": 1, "hidden_size": 1024, "num_heads": 16,
                      "out_hidden_size": 4096, "intermediate_size": 4096, "projection_intermediate_size": 10240},
}


# deepseek-ai/DeepSeek-V4-Flash's config.json as public copies give it (not read from the hub here; its tail of MTP and
# later-release fields left out): 43 layers, two window-only then CSA / HCA alternating, the last CSA, a window of 128,
# MQA of one 512-wide head, 3 hash-routed layers, 4 hyper-connected streams; FP8 projections with ue8m0 scales as X.scale,
# routed experts FP4 (expert_dtype)
PRESETS["deepseek-v4-flash"] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096,
    "moe_intermediate_size": 2048, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "num_hash_layers": 3, "swiglu_limit": 10.0,
    "max_position_embeddings": 1048576, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "sliding_window": 128, "topk_method": "noaux_tc",
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-06, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
}


def config_of(arch: str, layers: int | None, overrides: dict) -> dict:
    """The preset with `layers` decoder layers and the fields in overrides set (a vision-language wrapper's
    go to its text_config, but vision_config, which replaces the tower's)."""
    top = json.loads(json.dumps(PRESETS[arch]))
    c = top.get("text_config", top)
    if "vision_config" in overrides:
        top["vision_config"] = {**top["vision_config"], **overrides.pop("vision_config")}
    if layers is not None:
        c["num_hidden_layers"] = layers
        if SAME_AS.get(c["model_type"], c["model_type"]) in ("deepseek_v3", "glm4_moe"):
            c["first_k_dense_replace"] = min(c["first_k_dense_replace"], layers - 1)
        for k in ("layer_types", "attn_type_list", "moe_layer_freq", "compress_ratios"):  # gpt-oss, Qwen3-Next,
            # MiniMax-M2/M3, DeepSeek-V4
            if isinstance(c.get(k), list):  # (DeepSeek's moe_layer_freq is a number)
                c[k] = c[k][:layers]
        if "sparse_attention_freq" in c.get("sparse_attention_config", {}):  # MiniMax-M3
            c["sparse_attention_config"]["sparse_attention_freq"] = c["sparse_attention_config"][
                "sparse_attention_freq"][:layers]
    c.update(overrides)
    return top


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: as published)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a config.json field, e.g. hidden_size=64 or quantization_config=null")
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of the random weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-mb", type=int, default=4096)
    ap.add_argument("--no-routed-experts", action="store_true",
                    help="leave the routed experts out (a checkpoint only a GPU side can load)")
    a = ap.parse_args(argv)
    overrides = {}
    for kv in a.set:
        k, _, v = kv.partition("=")
        overrides[k] = json.loads(v)
    c = config_of(a.arch, a.layers, overrides)
    out = write(c, pathlib.Path(a.out), a.std, a.seed, a.shard_mb, not a.no_routed_experts)
    print(f"wrote {out}: {c['model_type']}, {c.get('text_config', c)['num_hidden_layers']} layers")


if __name__ == "__main__":
    main()
