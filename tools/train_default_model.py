"""Train the embedded default model: a small DeepSeek-V3 (MLA, one dense first layer, shared
expert, 16 routed experts top-4 with sigmoid group routing) on Python's standard library sources
(PSF licence), with a byte-level BPE tokenizer trained on the training split.

    python tools/train_default_model.py --out models/default [--steps 1500] [--resume]

--preset deep trains the accuracy harness's second model (bench/accuracy.py, issue: what deferral
costs in a model shaped like the real ones): the same architecture, data and tokenizer, 24 layers
deep with fine-grained experts (top-8 of 64 in 8 groups, a shared expert), rebuilt on demand:

    python tools/train_default_model.py --preset deep --out build/deep-model --work build/train-deep --resume

Deterministic (fixed seeds; files split by sorted position: every 20th file is held out).
Resumable: a checkpoint of model, optimizer and data position goes to --work every 100 steps.
Writes a normal Hugging Face checkpoint directory (bf16 safetensors, config, tokenizer).
Needs transformers (a dev/test dependency).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sysconfig
import time

import torch

CONFIG = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
    first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=32,
    v_head_dim=32, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=1024,
    initializer_range=0.02, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
)
# Deep and fine-grained like DeepSeek-V3 (61 layers, top-8 of 256 in 8 groups, 1 shared expert) within
# what 2 cores train in about two hours: the default's width and attention, 24 layers, each token's
# routed width the default's (8 x 64 = 4 x 128), so the expert output deferred per token is a small
# share of a deep residual stream, as in the real models.
DEEP = dict(CONFIG, num_hidden_layers=24, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
            moe_intermediate_size=64, n_shared_experts=1)
PRESETS = {"default": CONFIG, "deep": DEEP}
CHAT_TEMPLATE = ("{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\n{% endif %}")


def stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts and "idlelib" not in p.parts)
    return [f for f in files if 200 < f.stat().st_size < 400_000]


def split(files):
    train = [f for i, f in enumerate(files) if i % 20]
    held = [f for i, f in enumerate(files) if i % 20 == 0]
    return train, held


def read(f: pathlib.Path) -> str:
    return f.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files, out: pathlib.Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read(f) for f in files), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}, indent=1))
    return tok


def encode_files(tok, files) -> torch.Tensor:
    """One stream: each file's tokens, then </s>."""
    ids = []
    for f in files:
        ids.extend(tok.encode(read(f)).ids)
        ids.append(CONFIG["eos_token_id"])
    return torch.tensor(ids, dtype=torch.int32)


def update_router_bias(model, ids_per_layer, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-used experts, lower
    the over-used ones' (the bias only affects which experts are chosen, not their weights)."""
    for gate, ids in ids_per_layer:
        load = torch.bincount(ids.flatten(), minlength=gate.e_score_correction_bias.numel()).float()
        gate.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))


def main() -> None:
    import transformers
    from tqdm import tqdm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = pathlib.Path(__file__).resolve().parent.parent
    ap.add_argument("--out", default=str(root / "models" / "default"))
    ap.add_argument("--work", default=str(root / "build" / "train"), help="resumable state and the token cache")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    a = ap.parse_args()
    config = PRESETS[a.preset]
    torch.set_num_threads(a.threads)
    out, work = pathlib.Path(a.out), pathlib.Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    train_files, held_files = split(stdlib_files())
    tok = train_tokenizer(train_files, out)
    cache = work / "tokens.pt"
    if cache.exists():
        data = torch.load(cache)
    else:
        data = {"train": encode_files(tok, train_files), "held": encode_files(tok, held_files)}
        torch.save(data, cache)
    (out / "heldout_files.json").write_text(json.dumps([str(f.relative_to(f.parents[len(f.parents) - 1]))
                                                         for f in held_files][:50], indent=0))
    print(f"train {len(data['train']):,} tokens ({len(train_files)} files), held-out {len(data['held']):,} tokens")

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**config)
    model = transformers.DeepseekV3ForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    step, log = 0, []
    state = work / "state.pt"
    if a.resume and state.exists():
        s = torch.load(state, weights_only=False)
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        step, log = s["step"], s["log"]
        torch.set_rng_state(s["rng"])
        print(f"resumed at step {step}")
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    routed = []
    for g in gates:
        g.register_forward_hook(lambda mod, inp, outp: routed.append((mod, outp[2].detach())))
    gen = torch.Generator().manual_seed(1000 + step)
    n = len(data["train"]) - a.seq - 1
    warmup = 50
    t0 = time.time()
    bar = tqdm(total=a.steps, initial=step, desc="train", unit="step")
    while step < a.steps:
        lr = a.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / a.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n, (a.batch,), generator=gen)
        x = torch.stack([data["train"][s:s + a.seq] for s in starts.tolist()]).long()
        routed.clear()
        loss = model(input_ids=x, labels=x, use_cache=False).loss  # transformers shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            update_router_bias(model, routed, 1e-3)
        step += 1
        log.append((step, loss.item()))
        bar.update(1)
        bar.set_postfix(loss=f"{log[-1][1]:.3f}", lr=f"{lr:.2e}")
        if step % 100 == 0 or step == a.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "log": log,
                        "rng": torch.get_rng_state()}, state)
    bar.close()
    model.eval()
    with torch.no_grad():  # held-out loss on up to 64 windows, and the unigram baseline
        held = data["held"]
        wins = [held[i:i + a.seq].long() for i in range(0, min(len(held) - a.seq, 64 * a.seq), a.seq)]
        held_loss = sum(float(model(input_ids=w[None], labels=w[None]).loss) for w in wins) / len(wins)
        counts = torch.bincount(data["train"].long(), minlength=cfg.vocab_size).float() + 1
        logp = (counts / counts.sum()).log()
        unigram = float(-logp[torch.cat([w[1:] for w in wins])].mean())
    model.to(torch.bfloat16).save_pretrained(out)
    summary = {"preset": a.preset, "steps": step, "tokens_seen": step * a.batch * a.seq, "train_minutes_this_run": (time.time() - t0) / 60,
               "final_train_loss": sum(l for _, l in log[-20:]) / min(20, len(log)), "heldout_loss": held_loss,
               "heldout_ppl": math.exp(held_loss), "unigram_heldout_ppl": math.exp(unigram)}
    (out / "training_summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
