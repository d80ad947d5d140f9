"""GGUF files against llama.cpp: the embedded trained model (models/default, DeepSeek-V3's architecture) converted
by llama.cpp's own converter, quantized by llama-quantize, and its perplexity on held-out text measured by
llama-perplexity and by our two services on the same file and the same tokens.

    python bench/bench_gguf_ppl.py [--types bf16,Q8_0,Q6_K,Q4_K_M,Q4_0] [--ctx 256] [--chunks 16]
                                   [--work /tmp/llama-work] [--isa native] [--pad-experts 256]

The grid types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, and mixes of them as IQ2_M, IQ3_M) are
quantized with an importance matrix from llama-imatrix on the model's training text, as their users do (llama-quantize
refuses most of them without one). Their rows must be whole blocks of 256: --pad-experts 256 runs a copy of the model
whose experts' intermediate width (128) is padded with zeros to 256 (zero gate / up rows, zero down columns: the same
function), so that llama-quantize puts the down matrices in the asked type too and not in IQ4_NL.

llama.cpp is built from the llama-cpp-python sdist (bench/common.py: build_llama; llama-perplexity and
llama-quantize). Its convert_hf_to_gguf.py writes the bf16 GGUF (the model's small custom BPE tokenizer is not
one the converter knows by hash, so its pre-tokenizer is named "default"; the ids both sides score are
llama.cpp's, whatever that changes). llama-perplexity --kl-divergence-base saves the tokens it scored; ours
scores exactly those windows (the first token of each replaced by BOS where the file says so, the second half
of each window counted), through Score(logprobs_only) on the services started with --model FILE.gguf in their
default formats, --weight-format fp32 --dtype fp32 (the exact path) and each of --formats (requantized). Prints
each type's perplexities and their ratios to llama.cpp's.
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
import struct
import subprocess

import numpy as np

from common import ROOT, Services, build_llama, convert_to_gguf, cpu_name, peer_env, wait_healthy
from protos import generate_pb2


def held_out_text(limit_chars: int, part: int = 1) -> str:
    """The default model's held-out text (part 1), or its training text (part 0: the importance matrix's)."""
    from tools.train_default_model import read, split, stdlib_files

    out, n = [], 0
    for f in split(stdlib_files())[part]:
        out.append(read(f))
        n += len(out[-1])
        if n > limit_chars:
            break
    return "\n".join(out)


def llama_ppl(src: pathlib.Path, isa: str, gguf_path: pathlib.Path, text: pathlib.Path, ctx: int, chunks: int,
              threads: int) -> tuple[float, np.ndarray]:
    """-> (llama-perplexity's PPL, the tokens it read [chunks, ctx])."""
    base = gguf_path.with_suffix(".kld")
    r = subprocess.run([str(src / f"build-{isa}" / "bin" / "llama-perplexity"), "-m", str(gguf_path), "-f", str(text),
                        "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks), "-t", str(threads),
                        "--kl-divergence-base", str(base)], capture_output=True, text=True, env=peer_env())
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
    if m is None:
        raise RuntimeError(f"llama-perplexity failed:\n{(r.stdout + r.stderr)[-3000:]}")
    with open(base, "rb") as f:
        assert f.read(8) == b"_logits_"
        n_ctx, _, n_chunk = struct.unpack("<iii", f.read(12))  # (n_vocab between)
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32).reshape(n_chunk, n_ctx)
    return float(m.group(1)), tokens


def our_ppl(stub, tokens: np.ndarray, bos: int | None) -> float:
    """llama-perplexity's measure on our side: each window from scratch (BOS first where the file adds one),
    -log p of the tokens after its middle."""
    ctx = tokens.shape[1]
    first, nll, count = ctx // 2, 0.0, 0
    for row in tokens:
        ids = [int(t) for t in row]
        if bos is not None:
            ids[0] = bos
        r = stub.Score(generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=ids), logprobs_only=True),
                       timeout=600)
        lp = list(r.token_logprobs)  # lp[j] = log p(ids[j + 1] | ids[..j])
        nll -= sum(lp[first:ctx - 1])
        count += ctx - 1 - first
    return math.exp(nll / count)


def padded_model(model: pathlib.Path, width: int, out: pathlib.Path) -> pathlib.Path:
    """A copy of the checkpoint whose routed and shared experts are `width` wide (zero rows of gate / up, zero columns
    of down: the outputs unchanged, exactly)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((model / "config.json").read_text())
    cfg["moe_intermediate_size"] = width
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    t = {}
    for f in model.glob("*.safetensors"):
        for name, x in load_file(str(f)).items():
            if "experts." in name and name.endswith(("gate_proj.weight", "up_proj.weight")):
                x = torch.cat([x, x.new_zeros(width - x.shape[0], x.shape[1])])
            elif "experts." in name and name.endswith("down_proj.weight"):
                x = torch.cat([x, x.new_zeros(x.shape[0], width - x.shape[1])], 1)
            t[name] = x.contiguous()
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


GRID_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_S", "IQ3_M")


def importance_matrix(src: pathlib.Path, isa: str, bf16: pathlib.Path, work: pathlib.Path, ctx: int,
                      threads: int) -> pathlib.Path:
    """llama-imatrix on the model's training text (once per file)."""
    out = bf16.with_suffix(".imatrix.gguf")
    if not out.exists():
        text = work / "train.txt"
        text.write_text(held_out_text(ctx * 64 * 8, part=0))
        subprocess.run([str(src / f"build-{isa}" / "bin" / "llama-imatrix"), "-m", str(bf16), "-f", str(text),
                        "-o", str(out), "-c", str(ctx), "--chunks", "64", "-t", str(threads)],
                       check=True, capture_output=True, env=peer_env())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=pathlib.Path, default=ROOT / "models" / "default")
    ap.add_argument("--types", default="bf16,Q8_0,Q6_K,Q4_K_M,Q4_0")
    ap.add_argument("--formats", default="", help="expert formats to run each file in besides the default and the "
                    "exact path (requantized: int8, int4g32, ...)")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--isa", default="native")
    ap.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/llama-work"))
    ap.add_argument("--pad-experts", type=int, default=0, help="run a copy whose experts are this wide (zero-padded)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    grid = any(t in GRID_TYPES for t in a.types.split(","))
    src = build_llama(a.work, a.isa, targets=("llama-perplexity", "llama-quantize", *(("llama-imatrix",) if grid else ())))
    if a.pad_experts:
        a.model = padded_model(a.model, a.pad_experts, a.work / f"{a.model.name}-experts{a.pad_experts}")
    print(f"# {cpu_name()}; llama.cpp build-{a.isa}; {a.model.name}, ctx {a.ctx} x {a.chunks} chunks")
    text = a.work / "heldout.txt"
    text.write_text(held_out_text(a.ctx * a.chunks * 8))
    bf16 = a.work / f"{a.model.name}-bf16.gguf"
    if not bf16.exists():
        convert_to_gguf(src, a.model, bf16)
    from gguf import GGUFReader
    fields = GGUFReader(str(bf16)).fields
    bos = int(fields["tokenizer.ggml.bos_token_id"].contents()) \
        if "tokenizer.ggml.add_bos_token" in fields and fields["tokenizer.ggml.add_bos_token"].contents() else None
    rows = []
    for qtype in a.types.split(","):
        f = bf16 if qtype == "bf16" else a.work / f"{a.model.name}-{qtype}.gguf"
        if not f.exists():
            imatrix = (("--imatrix", str(importance_matrix(src, a.isa, bf16, a.work, a.ctx, a.threads)))
                       if qtype in GRID_TYPES else ())
            subprocess.run([str(src / f"build-{a.isa}" / "bin" / "llama-quantize"), *imatrix, str(bf16), str(f), qtype],
                           check=True, capture_output=True, env=peer_env())
        theirs, tokens = llama_ppl(src, a.isa, f, text, a.ctx, a.chunks, a.threads)
        ours = {}
        paths = [("default", (), ()), ("exact", ("--dtype", "fp32"), ("--weight-format", "fp32"))]
        paths += [(fmt, (), ("--weight-format", fmt)) for fmt in a.formats.split(",") if fmt]
        for path, gpu, expert in paths:
            tmp = a.work / f"svc-{qtype}-{path}"
            tmp.mkdir(exist_ok=True)
            s = Services(f, tmp, gpu_args=("--threads", str(a.threads), *gpu),
                         expert_args=("--threads", str(a.threads), *expert))
            try:
                wait_healthy(s.gpu_port, s.gpu)
                ours[path] = our_ppl(s.stub, tokens, bos)
                fmt = re.search(r"\((\w+), (\w+), via", s.logs())
            finally:
                s.stop()
            if path == "default":
                ours["formats"] = fmt.group(1) if fmt else "?"
        rows.append((qtype, theirs, ours))
        print(f"{qtype}: llama-perplexity {theirs:.4f}, ours " +
              ", ".join(f"{k} {v:.4f}" for k, v in ours.items() if k != "formats") +
              f" (default experts {ours['formats']})", flush=True)
    extra = [p for p, _, _ in paths[2:]]
    print("\n| file | llama-perplexity | ours, default path | ratio | experts as | ours, exact path | ratio |" +
          "".join(f" --weight-format {e} | ratio |" for e in extra) + "\n|---|---|---|---|---|---|---|" +
          "---|---|" * len(extra))
    for qtype, theirs, ours in rows:
        print(f"| {qtype} | {theirs:.4f} | {ours['default']:.4f} | {ours['default'] / theirs:.4f} | {ours['formats']} | "
              f"{ours['exact']:.4f} | {ours['exact'] / theirs:.4f} |" +
              "".join(f" {ours[e]:.4f} | {ours[e] / theirs:.4f} |" for e in extra))

if __name__ == "__main__":
    main()
