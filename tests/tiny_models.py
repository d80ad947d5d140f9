"""Tiny checkpoints of every supported family, built with transformers (the reference) from a
fixed seed and saved with save_pretrained, plus a small BPE tokenizer shared by all of them."""
from __future__ import annotations

import pathlib

import torch

VOCAB = 320

FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=512)),
    # DeepSeek-V3.2: V3's layers behind the lightning indexer; index_topk 4 < a 9-token prompt: the selection matters
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=512,
        index_n_heads=8, index_head_dim=16, index_topk=4)),
    # GLM-5: V3.2 with its indexer's rope interleaved, layers 2 and 3 reusing the previous full layer's selection,
    # a value head wider than the key's nope part, no expert groups
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_group=1, topk_group=1,
        num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=12, v_head_dim=24, n_shared_experts=1, routed_scaling_factor=2.5,
        max_position_embeddings=512, index_n_heads=8, index_head_dim=16, index_topk=4,
        indexer_types=["full", "shared", "full", "shared"])),
    # DeepSeek-V4: a window of 6 keys in every layer; a window-only layer, compressed sparse attention (entries of 4
    # positions in two overlapping series, the indexer keeping 3) and heavily compressed attention (entries of 8); two
    # hash-routed layers; 3 hyper-connected streams; a swiglu_limit low enough to clamp (randomised further in build)
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, partial_rotary_factor=0.5, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2,
        hc_mult=3, sliding_window=6, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=3,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, swiglu_limit=0.5,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        max_position_embeddings=512)),
    # GLM-5.3-Flash as published: the text model inside its vision-language wrapper; KDA linear attention in layers 0
    # and 3, DSA on a NoPE MLA in 1, 2 and 4 (layer 2 reusing layer 1's selection) whose indexer keeps 2 pools of 4
    # keys and the query's unfinished pool; 2 hyper-connected streams; a dense first layer; a clamping swiglu_limit
    "glm5_next": ("Glm5NextConfig", "Glm5NextForConditionalGeneration", dict(
        vocab_size=VOCAB, pad_token_id=0, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16,
        index_n_heads=8, index_kpool=4, linear_head_dim=16, linear_num_heads=2, hc_mult=2, swiglu_limit=1.0,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                     "indexed_attention"], indexer_types=["full", "full", "shared", "full", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"], max_position_embeddings=512)),
    # MiMo-V2-Flash: full attention on layers 0 and 3, sliding windows of 5 (twice the KV heads, sinks, their own rope
    # base) between; a value head narrower than the key's, values scaled; a dense first layer, sigmoid routing
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, sliding_window=5, attention_value_scale=0.7, max_position_embeddings=512,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
        topk_method="group_limited_greedy", first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=2, max_position_embeddings=512)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=16, n_group=4, topk_group=2,
        num_experts_per_tok=4, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
        partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, max_position_embeddings=512)),
    # sliding window 4 (a 9-token prompt and 32 new tokens cross it), a limit low enough to clamp
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
        swiglu_limit=0.5, max_position_embeddings=512)),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=3, rotary_dim=8,
        max_position_embeddings=512)),
    # 4 layers: three gated DeltaNet, then gated full attention; a dense MLP layer (mlp_only_layers)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=512)),
    # Qwen3.5 as published: the text model inside the vision-language wrapper (a one-block vision tower
    # that the services leave out); DeltaNet's projections one per part; every layer MoE
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", dict(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, max_position_embeddings=512)),
    # MiniMax-M3 as published: the text model inside its vision-language wrapper; block-sparse attention on layers 1
    # and 2 (blocks of 4 keys, 3 kept per KV group, the query's own always) beside full layers, a dense first layer,
    # zero-centred norms made to matter, a swiglu_limit low enough to clamp, rotary on half of each head
    "minimax_m3_vl": ("MiniMaxM3VLConfig", "MiniMaxM3SparseForConditionalGeneration", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, dense_intermediate_size=48, shared_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "full_attention"],
        index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=3, index_local_blocks=1,
        swiglu_limit=1.0, rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        max_position_embeddings=512)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=512)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512)),
}

# vision-language wrappers: kw is the text config, beside a one-block vision tower of these
WRAPPED = {"qwen3_5_moe": dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                               patch_size=4, num_position_embeddings=16),
           "glm5_next": dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, projection_intermediate_size=32,
                             intermediate_size=32),
           "minimax_m3_vl": dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 patch_size=14)}

CORPUS = ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
          "The quick brown fox jumps over the lazy dog. Grüße aus Köln — 東京 ✓ ünïcödé\n") * 20


def reference_model(d, **kw):
    """transformers' model of a checkpoint in fp32: its causal LM, or (MiniMax-M3, whose wrapper has none) the class
    config.json names."""
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval()
    except ValueError:
        arch = transformers.AutoConfig.from_pretrained(d).architectures[0]
        return getattr(transformers, arch).from_pretrained(d, dtype=torch.float32, **kw).eval()


def build_tokenizer(out: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "chat_template": '
        '"{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\\n{% endfor %}'
        '{% if add_generation_prompt %}<|assistant|>{% endif %}"}')


def build(family: str, out: pathlib.Path, dtype=torch.float32, seed: int = 0, shards: int = 1, **overrides) -> pathlib.Path:
    import transformers

    cfg_name, model_name, kw = FAMILIES[family]
    kw = {"initializer_range": 0.1, **kw, **overrides, "bos_token_id": 0, "eos_token_id": 1}
    if family in WRAPPED:
        kw = dict(text_config=kw, vision_config=WRAPPED[family])
    cfg = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(dtype).eval()
    # random init leaves the DeepSeek correction bias at zero: give it values so it matters
    for n, b in model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            b.copy_(torch.rand_like(b) * 0.1)
    if family == "gpt_oss":  # its biases start at zero too (attention, experts)
        with torch.no_grad():
            for n, w in model.named_parameters():
                if n.endswith("bias"):
                    w.copy_(torch.randn_like(w) * 0.2)
    if family == "glm5_next":  # the k-pool's position biases start at zero and its gate at one, the HC bases at zero
        with torch.no_grad():
            for n, w in model.named_parameters():
                if n.endswith(("index_kpool_compress_ape", ".base", "norm.weight", "dt_bias")):
                    w.add_(torch.randn_like(w) * 0.5)
                elif n.endswith("index_kpool_compress_gate"):
                    w.copy_(torch.randn_like(w) * 0.3)
                elif n.endswith(".scale"):
                    w.copy_(1 + torch.randn_like(w) * 0.2)
    if family == "deepseek_v4":  # sinks, biases, hyper-connection bases and the hash tables start at zero
        with torch.no_grad():
            for n, w in model.named_parameters():
                if n.endswith(("sinks", "position_bias", ".base", "hc_base", "norm.weight")):
                    w.add_(torch.randn_like(w) * 0.5)
                elif n.endswith(("scale", "hc_scale")):
                    w.copy_(1 + torch.randn_like(w) * 0.2)
            for n, b in model.named_buffers():
                if n.endswith("tid2eid"):
                    b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts)[:cfg.num_experts_per_tok]
                                         for _ in range(cfg.vocab_size)]))
    if family in ("qwen3_next", "qwen3_5_moe", "minimax_m3_vl"):  # zero-centred norms start at 0 and the gated norm at 1: make them matter
        with torch.no_grad():
            for n, w in model.named_parameters():
                if n.endswith("norm.weight") or n.endswith("dt_bias"):
                    w.add_(torch.randn_like(w) * 0.3)
    out.mkdir(parents=True, exist_ok=True)
    if shards > 1:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(out, max_shard_size=total // shards + 1)
    else:
        model.save_pretrained(out)
    build_tokenizer(out)
    return out
