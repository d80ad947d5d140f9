"""Our GGUF reader against llama.cpp's own converter (tests/core/test_gguf.py emulates the converter with the gguf
package; this runs the real one): each family's tiny checkpoint (tests/tiny_models.py) through the
convert_hf_to_gguf.py of the llama-cpp-python sdist (downloaded into --work once, no build needed), then every
tensor read back under transformers' name must equal the checkpoint's, and the config read from the metadata
must describe the same model.

    python bench/check_gguf_converter.py [--families deepseek_v3,qwen3_moe,...] [--work /tmp/llama-work]

(needs sentencepiece, which the converter imports for llama files)

Checkpoint configs are first written as the model makers publish them where transformers' save drops what the
converter reads (common.convert_to_gguf: DeepSeek's scoring_func and MLA's head count).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import torch

from common import convert_to_gguf, llama_source

FIELDS = ("model_type", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "n_routed_experts",
          "top_k", "moe_intermediate_size", "shared_intermediate_size", "moe_layers", "scoring", "topk_method",
          "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group", "rope_theta", "rope_type",
          "rope_interleave", "rotary_dim", "attention", "qkv_bias", "qk_norm", "kv_lora_rank", "q_lora_rank",
          "qk_nope_head_dim", "v_head_dim", "sliding_window", "layer_types", "tie_word_embeddings", "index_heads",
          "index_dim", "index_topk", "index_rope_interleave", "index_shared", "intermediate_size", "norm_offset",
          "index_block", "index_topk_blocks", "index_local_blocks", "mlp_act", "expert_act", "compress_rates", "hc_mult",
          "hc_iters", "hc_eps", "o_groups", "o_lora_rank", "hash_layers", "sliding_rope_theta", "mxfp4_experts",
          "linear_attn", "linear_bound", "index_kpool", "sliding_kv_heads", "v_head_dim", "value_scale",
          "sliding_rope_theta", "attn_sinks", "rms_norm_eps")
# llama.cpp's files cannot hold these tiny checkpoints as transformers builds them (tests/core/test_gguf.py's reasons)
# (Qwen's tokenizer class adds <|endoftext|> after the tiny vocabulary: room for it)
OVERRIDES = {"qwen2_moe": {"mlp_only_layers": [], "vocab_size": 384}, "mixtral": {"intermediate_size": 64},
             "gpt_oss": {"swiglu_limit": 7.0}, "qwen3_moe": {"vocab_size": 384}, "deepseek_v3": {},
             "deepseek_v2": {}, "glm4_moe": {}, "minimax_m2": {}, "deepseek_v32": {}, "glm_moe_dsa": {},
             # MiniMax-M3 as llama.cpp builds it: block-sparse attention in every MoE layer, its constant SwiGLU limit
             "minimax_m3_vl": {"swiglu_limit": 7.0, "layer_types": ["full_attention"] + ["minimax_m3_sparse"] * 3},
             # DeepSeek-V4 as DeepSeek publishes it (its own names, FP8 projections, FP4 experts: all the converter
             # reads), at toy width (tests/published.py), its compression rates the ones llama.cpp knows
             "deepseek_v4": {"compress_rate_hca": 128},
             # GLM-5.3-Flash in its published fields (linear_attn_config, mla_use_nope, first_k_dense_replace: what the
             # converter reads), at toy width, bf16 (this converter reads no FP8 for it); its KDA layers as many heads
             # as attention's (the converter asserts it)
             "glm5_next": {},
             # MiMo-V2-Flash in the fields Xiaomi publishes (common.convert_to_gguf), experts 64 wide
             "mimo_v2_flash": {"moe_intermediate_size": 64}}


def same(family: str, name: str, got: torch.Tensor, want: torch.Tensor, stored: str = "") -> bool:
    """Exactly the checkpoint's; MiniMax-M3's norms to the rounding of the 1 the converter adds (and we take away);
    DeepSeek-V4's FP8 projections, which the converter requantizes to Q8_0, to its rounding (half a step of a block's
    scale, max |w| / 127, plus the fp16 rounding of that scale times 127)."""
    if family == "minimax_m3_vl" and name.endswith("norm.weight"):
        return torch.allclose(got, want, rtol=2 ** -22, atol=2 ** -23)
    if name.endswith(".A_log"):  # the file holds -exp(A_log): its log back, to an ulp
        return torch.allclose(got, want, rtol=1e-6, atol=0)
    if stored == "Q8_0":
        step = want.abs().reshape(want.shape[0], -1, 32).amax(-1, keepdim=True) / 127
        return bool(((got - want).reshape(step.shape[0], -1, 32).abs() <= step * (0.5 + 127 * 2 ** -11)).all())
    return torch.equal(got.to(want.dtype), want)


def build(family: str, out: pathlib.Path) -> pathlib.Path:
    """The family's tiny checkpoint: transformers' save, or (DeepSeek-V4) its published form (tools/synth_checkpoint)."""
    import tiny_models
    if family == "deepseek_v4":
        from published import synth  # (its 128 x 128 FP8 blocks: the converter's own)
        return synth("deepseek-v4-flash", out, layers=3, **OVERRIDES[family])
    if family == "glm5_next":
        from published import NARROW, synth_checkpoint
        c = synth_checkpoint.config_of("glm-5.3-flash", 5, dict(NARROW["glm-5.3-flash"]))
        c.pop("quantization_config")
        return synth_checkpoint.write(c, out, std=0.1, seed=0, shard_mb=8)
    return tiny_models.build(family, out, **OVERRIDES[family])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(OVERRIDES))
    ap.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/llama-work"))
    a = ap.parse_args()
    from moe_core import gguf_model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config

    a.work.mkdir(parents=True, exist_ok=True)
    src, tmp, failed = llama_source(a.work), pathlib.Path(tempfile.mkdtemp()), []
    for family in a.families.split(","):
        ckpt = build(family, tmp / family)
        f = tmp / f"{family}.gguf"
        try:
            convert_to_gguf(src, ckpt, f, outtype="f32")
            d = gguf_model.prepare(f, tmp / "cache")
            ours, theirs = gguf_model.open_checkpoint(d), Checkpoint(ckpt)
            mtp = {n for n in theirs.names() if n.startswith(f"model.layers.{load_config(ckpt).num_layers}.")}
            want = sorted(set(theirs.names()) - mtp)
            problems = [] if sorted(ours.names()) == want else \
                [f"names differ: {sorted(set(ours.names()) ^ set(want))[:6]}"]
            problems += [f"{n} differs" for n in want if n in set(ours.names())
                         and not same(family, n, ours.get(n), theirs.get(n).float(), ours.block_type(n))]
            got, ref = load_config(d), load_config(ckpt)
            problems += [f"{k}: {getattr(got, k)!r} != {getattr(ref, k)!r}" for k in FIELDS
                         if getattr(got, k, None) != getattr(ref, k, None)]
        except Exception as e:  # noqa: BLE001  (one family's failure must not hide the others')
            problems = [f"{type(e).__name__}: {(getattr(e, 'stderr', None) or str(e))[-600:]}"]
        print(f"{family}: {'ok' if not problems else '; '.join(problems[:8])}", flush=True)
        failed += [family] if problems else []
    print(f"\n{len(a.families.split(',')) - len(failed)} of {len(a.families.split(','))} families read back exactly"
          + (f"; not: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
