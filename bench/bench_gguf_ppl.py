"""GGUF files against llama.cpp: the embedded trained model (models/default, DeepSeek-V3's architecture) converted
by llama.cpp's own converter, quantized by llama-quantize, and its perplexity on held-out text measured by
llama-perplexity and by our two services on the same file and the same tokens.

    python bench/bench_gguf_ppl.py [--types bf16,Q8_0,Q6_K,Q4_K_M,Q4_0] [--ctx 256] [--chunks 16]
                                   [--work /tmp/llama-work] [--isa native]

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


def held_out_text(limit_chars: int) -> str:
    from tools.train_default_model import read, split, stdlib_files

    out, n = [], 0
    for f in split(stdlib_files())[1]:
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
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    src = build_llama(a.work, a.isa, targets=("llama-perplexity", "llama-quantize"))
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
            subprocess.run([str(src / f"build-{a.isa}" / "bin" / "llama-quantize"), str(bf16), str(f), qtype],
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
