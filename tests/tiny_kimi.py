"""Tiny Kimi checkpoints as Moonshot publishes them, made here from a tiny DeepseekV3ForCausalLM (the reference:
transformers has no kimi_k2 type, its Kimi-K2.5 config reads one as deepseek_v3): Kimi-K2 / K2-Thinking's layout
(config model_type kimi_k2, DeepSeek-V3's weight names) and Kimi-K2.5 / K2.6's (model_type kimi_k25 with the text
model's config under text_config, its weights under language_model.model.* and language_model.lm_head.*, a vision
tower and projector beside them), each with a tiny tiktoken vocabulary (tiny_tiktoken.py) and a chat template in
Kimi's syntax (tool_templates.KIMI)."""
from __future__ import annotations

import json
import pathlib

import torch
import transformers
from safetensors.torch import save_file

import tiny_models
import tiny_tiktoken
import tool_templates

TEXT = dict(tiny_models.FAMILIES["deepseek_v3"][2], max_position_embeddings=4096)


def reference(vocab: int, seed: int = 0) -> transformers.PreTrainedModel:
    """The tiny DeepSeek-V3 both layouts hold (fp32), its correction bias given values so it matters."""
    cfg = transformers.DeepseekV3Config(**{**TEXT, "vocab_size": vocab, "initializer_range": 0.1, "bos_token_id": None,
                                           "eos_token_id": None})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    for n, b in model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            b.copy_(torch.rand_like(b) * 0.1)
    return model


def build(out: pathlib.Path, wrapped: bool, seed: int = 0) -> tuple[pathlib.Path, transformers.PreTrainedModel]:
    """-> (the checkpoint folder, the reference model on its weights)."""
    out.mkdir(parents=True, exist_ok=True)
    ranks = tiny_tiktoken.write(out, tool_templates.KIMI)
    vocab = len(ranks) + tiny_tiktoken.RESERVED
    model = reference(vocab, seed)
    n = len(ranks)
    eos = n + next(k for k, c in tiny_tiktoken.SPECIALS.items() if c == "<|im_end|>")
    text = {**model.config.to_dict(), "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
            "bos_token_id": n, "eos_token_id": n + 1, "torch_dtype": "float32"}
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if wrapped:
        config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                  "text_config": text, "vision_config": {"hidden_size": 16, "num_hidden_layers": 1},
                  "tie_word_embeddings": False, "media_placeholder_token_id": vocab - 1}
        state = {("language_model." + k): v for k, v in state.items()}
        torch.manual_seed(seed + 1)
        state |= {"vision_tower.patch_embed.proj.weight": torch.randn(16, 3, 2, 2),
                  "vision_tower.encoder.blocks.0.mlp.fc0.weight": torch.randn(32, 16),
                  "mm_projector.proj.0.weight": torch.randn(TEXT["hidden_size"], 64)}
    else:
        config = text
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, n + 1]}))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, model
