"""Build a random-weight stand-in of the default model's family: a small DeepSeek-V3 checkpoint
in real Hugging Face format with a byte-level BPE tokenizer trained on Python's standard library.
The shipped models/default is trained instead (tools/train_default_model.py); this one is for
quick experiments that need no training.

Deterministic (fixed seeds, sorted inputs); needs transformers (a test/dev dependency):
    python tools/make_default_model.py [--out build/random-default]
"""
import argparse
import json
import pathlib
import sysconfig

import torch

CONFIG = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
    first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32,
    v_head_dim=32, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=2048,
    initializer_range=0.1, bos_token_id=0, eos_token_id=1,
)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def stdlib_text(limit_bytes: int = 4_000_000) -> list[str]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for f in sorted(root.glob("*.py")):
        t = f.read_text(errors="ignore")
        out.append(t)
        n += len(t)
        if n > limit_bytes:
            break
    return out


def build_tokenizer(out: pathlib.Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(stdlib_text(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, indent=1))


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "build" / "random-default"))
    out = pathlib.Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG)).to(torch.bfloat16)
    for n, b in model.named_buffers():
        if n.endswith("e_score_correction_bias"):
            b.copy_(torch.rand(b.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    model.save_pretrained(out)
    build_tokenizer(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
