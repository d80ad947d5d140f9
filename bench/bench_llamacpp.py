"""End to end against llama.cpp on the same weights, CPU only: prefill of a 512-token prompt and
decode tokens/s, our two services (sharing the cores) against llama.cpp's llama-bench, in alternating
rounds within one run.

    python bench/bench_llamacpp.py --model DIR [--formats bf16,int8,int4] [--rounds 3] [--isa native|avx2|avxvnni|avx512]
    python bench/bench_llamacpp.py --model DIR --formats int4-all --depth 8192 [--kv-cache-dtype bf16,int8]
                                   [--decode-only]

--depth N: decode after N tokens of context instead (llama-bench -d N -fa 1; ours after an N-token prompt, a new
one each round), and the prefill of an N-token prompt (ours: the time to its first token; llama-bench -p N): where
the KV cache's bytes count. --kv-cache-dtype: ours, one run each in the same rounds (auto: the compute dtype, fp32
on a CPU without bf16 arithmetic); llama.cpp's cache of equal bytes beside each: f16 for our bf16 / fp16 / auto, q8_0
(32 values and an fp16 scale: 8.5 bits) for our int8 / fp8 (8 bits and a scale byte a row).

DIR: a Qwen3-MoE checkpoint (tools/synth_checkpoint.py --arch qwen3-30b-a3b --layers 6 --out DIR).
llama.cpp is built here from the llama-cpp-python sdist on PyPI (its vendored tree; nothing of it is
committed) into --work (kept between runs): llama-bench and llama-quantize, CPU backend. --isa avx2
builds it for AVX2 + FMA + F16C only and runs our side on the avx2 kernel path with torch limited to
AVX2, i.e. what both do on an AVX2-only CPU; --isa avxvnni adds AVX-VNNI to both (llama.cpp's
GGML_AVX_VNNI, our avxvnni path, torch's oneDNN up to AVX2_VNNI): an Intel 12th-14th gen desktop;
--isa avx512 builds llama.cpp for AVX-512 without its AMX code and runs ours on its default path;
--isa native lets both use everything this CPU has (llama.cpp's AMX code included).
The GGUF holds the checkpoint's tensors under llama.cpp's qwen3moe names (written with the sdist's
gguf-py), in bf16; Q8_0 and Q4_0 come from llama-quantize. Pairs: bf16 <-> our bf16 experts and bf16
dense layers; Q8_0 <-> int8 experts, int8 dense; Q4_0 <-> int4 experts, int8 dense layers (ours keep
8 bits outside the experts, llama.cpp's Q4_0 puts 4 bits everywhere but the output matrix, Q6_K);
int4-all: Q4_0 <-> int4 experts and int4 dense layers (fewer bytes than Q4_0's Q6_K output). The grid types
(--formats IQ2_XXS,IQ1_S...): llama-quantize writes the file (with an importance matrix of ones: uniform_imatrix) and
both sides run that one file, ours with its experts as stored and its other matrices in int4.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile

from common import ISAS, build_llama, cpu_name, free_port, generate, peer_env, start, wait_healthy  # noqa: E402



PAIRS = {"bf16": ("bf16", "bf16", "bf16"), "int8": ("Q8_0", "int8", "int8"), "int4": ("Q4_0", "int4", "int8"),
         "int4-all": ("Q4_0", "int4", "int4")}
# the grid types: both sides run the one file llama-quantize writes (ours: its experts as stored, its other matrices
# dequantized and held in int4, the nearest of our dense formats to the file's 2-5 bits there)
GRID_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
PAIRS.update({t: (t, "auto", "int4") for t in GRID_TYPES})


def uniform_imatrix(gguf_path: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """An importance matrix of ones for every weight matrix of the file (llama.cpp's legacy .dat layout: entries of
    name, ncall, and n_in x experts sums), which llama-quantize wants for the grid types: llama-imatrix cannot run this
    synthetic checkpoint's placeholder vocabulary on text, and a speed benchmark does not depend on the weighting."""
    import struct

    from gguf import GGUFReader
    with open(out, "wb") as f:
        tensors = [t for t in GGUFReader(str(gguf_path)).tensors if t.name.endswith(".weight") and len(t.shape) >= 2]
        f.write(struct.pack("<i", len(tensors)))
        for t in tensors:
            n = int(t.shape[0]) * (int(t.shape[2]) if len(t.shape) > 2 else 1)  # ne0 (the input width) x experts
            name = t.name.encode()
            f.write(struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, n))
            f.write(struct.pack(f"<{n}f", *([1.0] * n)))
    return out

def write_gguf(model: pathlib.Path, src: pathlib.Path, out: pathlib.Path) -> None:
    """The checkpoint as a bf16 GGUF for llama.cpp's qwen3moe (experts stacked per layer)."""
    sys.path.insert(0, str(src / "gguf-py"))
    import gguf
    import torch

    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config

    cfg, ck = load_config(model), Checkpoint(model)
    raw = json.loads((model / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(raw["intermediate_size"])
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.top_k)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    # llama-bench feeds random ids: a placeholder vocabulary of the checkpoint's size is enough
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    # (the last token is the one merge's result: llama.cpp refuses a gpt2 vocabulary without merges, and the tokenizers
    # library, reading the file for our side, a merge whose result is not in it)
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size - 1)] + ["<t2><t3>"])
    w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    w.add_token_merges(["<t2> <t3>"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def put(name: str, t: torch.Tensor) -> None:
        t = t.to(torch.bfloat16) if t.dim() > 1 else t.float()
        a = t.contiguous().view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.contiguous().numpy()
        w.add_tensor(name, a, raw_dtype=gguf.GGMLQuantizationType.BF16 if t.dtype == torch.bfloat16 else None)

    put("token_embd.weight", ck.get("model.embed_tokens.weight"))
    put("output_norm.weight", ck.get("model.norm.weight"))
    put("output.weight", ck.get("lm_head.weight"))
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}
    for L in range(cfg.num_layers):
        for hf, gg in names.items():
            put(f"blk.{L}.{gg}.weight", ck.get(f"model.layers.{L}.{hf}.weight"))
        for proj, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            put(f"blk.{L}.{gg}.weight", torch.stack([ck.get(f"model.layers.{L}.mlp.experts.{e}.{proj}.weight")
                                                     for e in range(cfg.n_routed_experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf(model: pathlib.Path, src: pathlib.Path, isa: str, work: pathlib.Path, qtype: str) -> pathlib.Path:
    """-> the checkpoint as a GGUF of qtype (bf16, Q8_0, Q4_0) in work, written once per checkpoint (named by its
    fingerprint and its files' stamp, as the packed caches are: two checkpoints in folders of one name differ)."""
    from moe_experts.packed_cache import source_stamp
    from moe_core.checkpoint import Checkpoint
    from moe_core.fingerprint import fingerprint
    ckpt = Checkpoint(model)
    tag = f"{model.name}-{fingerprint(ckpt)[:8]}{source_stamp(ckpt)[:8]}"
    bf16 = work / f"{tag}-bf16.gguf"
    out = bf16 if qtype == "bf16" else work / f"{tag}-{qtype}.gguf"
    if not out.exists() and not bf16.exists():  # (a quantized one is kept without its bf16: disk)
        write_gguf(model, src, bf16)
    if not out.exists():
        imatrix = (("--imatrix", str(uniform_imatrix(bf16, work / f"{tag}-ones.imatrix.dat"))) if qtype in GRID_TYPES
                   else ())
        subprocess.run([str(src / f"build-{isa}" / "bin" / "llama-quantize"), *imatrix, str(bf16), str(out), qtype],
                       check=True, capture_output=True, env=peer_env())
    return out


LLAMA_CACHE = {"int8": "q8_0", "fp8": "q8_0"}  # ours -> llama.cpp's cache of (about) the same bytes; else f16


def llama_bench(src: pathlib.Path, isa: str, gguf_path: pathlib.Path, threads: int, prompt: int, gen: int,
                depth: int = 0, cache: str = "f16"):
    """-> (prefill tok/s, nan when prompt is 0; decode tok/s) from one llama-bench run of each test, the decode after
    `depth` tokens of context (flash attention on: llama.cpp's quantized V cache needs it)."""
    out = subprocess.run([str(src / f"build-{isa}" / "bin" / "llama-bench"), "-m", str(gguf_path), "-t", str(threads),
                          "-p", str(prompt), "-n", str(gen), "-d", str(depth), "-r", "1", "-o", "json",
                          *(["-fa", "1", "-ctk", cache, "-ctv", cache] if cache != "f16" or depth else [])],
                         capture_output=True, text=True, check=True, env=peer_env()).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0) if prompt else float("nan")
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == gen and r["n_prompt"] == 0) if gen else float("nan")
    return pp, tg


def ours_up(model, expert_fmt, dense_fmt, threads, work, env, kv_dtype="auto"):
    ep, gp = free_port(), free_port()
    e = start("expert_service", "--model", str(model), "--listen", f"127.0.0.1:{ep}", "--threads", str(threads),
              "--weight-format", expert_fmt, log=work / f"expert-{expert_fmt}.log", env=env)
    g = start("gpu_service", "--model", str(model), "--experts", f"127.0.0.1:{ep}", "--listen", f"127.0.0.1:{gp}",
              "--threads", str(threads), "--device", "cpu", "--dense-format", dense_fmt, "--kv-cache-dtype", kv_dtype,
              log=work / f"gpu-{expert_fmt}.log", env=env)
    wait_healthy(ep, e, timeout=3600)
    wait_healthy(gp, g, timeout=3600)
    return gp, (e, g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=pathlib.Path, required=True)
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--isa", choices=list(ISAS), default="native",
                    help="native (the default): each side on its best build for this CPU (llama.cpp's GGML_NATIVE); "
                         "on an AMX CPU with GCC 12 llama.cpp's AMX code dies (SIGILL): use avx512 there")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--depth", type=int, default=0, help="decode after this many tokens of context (no prefill figure)")
    ap.add_argument("--decode-only", action="store_true",
                    help="with --depth: no llama-bench prefill figure (its own N-token prefill, besides the one "
                         "-d runs before the decode: at 32768 each takes tens of minutes on 2 cores)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="our gpu-service's --kv-cache-dtype; comma-separated: each")
    ap.add_argument("--work", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()) / "moe-llamacpp")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    src = build_llama(a.work, a.isa)
    env = {"MOE_CACHE_DIR": str(a.work / "cache")} | ISAS[a.isa][1]
    print(f"CPU: {cpu_name()}; {a.model.name}; {a.threads} threads each; isa {a.isa} (llama.cpp built for it; "
          f"ours on {env.get('MOE_KERNEL_PATH', 'its default path')}); prompt {a.prompt}, "
          f"decode {a.gen} tokens; {a.rounds} alternating rounds"
          + (f"; decode after {a.depth} tokens, our KV caches {a.kv_cache_dtype} (llama.cpp's: "
             f"{', '.join(LLAMA_CACHE.get(k, 'f16') for k in a.kv_cache_dtype.split(','))}), flash attention"
             if a.depth else ""),
          flush=True)
    # a new prompt every round: the services' prefix cache would otherwise answer a repeated one without a prefill
    # random ids over the whole vocabulary, as llama-bench feeds its own: the rows the embedding and the routing reach
    n, vocab = a.depth or a.prompt, json.loads((a.model / "config.json").read_text()).get("vocab_size", 4002)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for _ in range(a.rounds + 1)]
    rows = []
    for fmt, kv in ((f, k) for f in a.formats.split(",") for k in a.kv_cache_dtype.split(",")):
        qtype, expert_fmt, dense_fmt = PAIRS[fmt]
        gg = gguf(a.model, src, a.isa, a.work, qtype)
        # a grid type: ours runs the same file (its experts as stored)
        port, procs = ours_up(gg if qtype in GRID_TYPES else a.model, expert_fmt, dense_fmt, a.threads, a.work, env, kv)
        try:
            generate(port, prompts[-1][:16], 4)  # warm-up
            ours, theirs = [], []
            for r in range(a.rounds):
                if a.depth:  # the prompt's prefill, then the decode after it; nothing cached (a new prompt a round)
                    ttft, dec = generate(port, prompts[r], a.gen)
                    ours.append((a.depth / ttft, dec))
                    cache = LLAMA_CACHE.get(kv, "f16")
                    # (llama-bench's -d applies to each test: the prefill's figure from a run at depth 0)
                    theirs.append((float("nan") if a.decode_only else
                                   llama_bench(src, a.isa, gg, a.threads, a.depth, 0, 0, cache)[0],
                                   llama_bench(src, a.isa, gg, a.threads, 0, a.gen, a.depth, cache)[1]))
                    print(f"  round {r}: ours {ours[-1][0]:.1f} / {ours[-1][1]:.2f}, llama.cpp {theirs[-1][0]:.1f} / "
                          f"{theirs[-1][1]:.2f} tok/s (prefill / decode)", flush=True)
                    continue
                ttft, _ = generate(port, prompts[r], 2)
                _, dec = generate(port, prompts[-1][:16], a.gen)
                ours.append((a.prompt / ttft, dec))
                theirs.append(llama_bench(src, a.isa, gg, a.threads, a.prompt, a.gen))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)
        med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
        row = {"format": f"{fmt} (experts {expert_fmt}, dense {dense_fmt}) vs {qtype}"
                         + (f", KV {kv} vs {LLAMA_CACHE.get(kv, 'f16')}" if a.depth else ""),
               "prefill_tok_s": round(med(ours, 0), 1), "llama_prefill_tok_s": round(med(theirs, 0), 1),
               "decode_tok_s": round(med(ours, 1), 2), "llama_decode_tok_s": round(med(theirs, 1), 2)}
        row["prefill_ratio"] = round(statistics.median(o[0] / t[0] for o, t in zip(ours, theirs)), 2)
        row["decode_ratio"] = round(statistics.median(o[1] / t[1] for o, t in zip(ours, theirs)), 2)
        # each round's pair: this machine's speed moves between rounds, the ratio above is their median
        row["decode_rounds"] = [[round(o[1], 1), round(t[1], 1)] for o, t in zip(ours, theirs)]
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| weights | prefill tok/s ours / llama.cpp | ratio | decode tok/s ours / llama.cpp | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['format']} | {r['prefill_tok_s']} / {r['llama_prefill_tok_s']} | {r['prefill_ratio']}x | "
              f"{r['decode_tok_s']} / {r['llama_decode_tok_s']} | {r['decode_ratio']}x |")


if __name__ == "__main__":
    main()
