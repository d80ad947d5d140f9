"""What an 8-bit KV cache (--kv-cache-dtype int8 / fp8, moe_kernels/kv_quant.py) costs in accuracy, against the
fp32 and bf16 caches, in one process (fp32 arithmetic, so that the cache is the only thing that differs).

    python bench/bench_kv_cache.py --ppl [--windows 8] [--len 1024]
    python bench/bench_kv_cache.py --agree DIR [--len 1024] [--experts int8]
    python bench/bench_kv_cache.py --decode DIR [--lengths 2048 32768] [--caches bf16,int8,fp8] [--rounds 3]
    python bench/bench_kv_cache.py --agree-decode DIR [--len 1024] [--steps 64]

--ppl: perplexity of the embedded model (MLA, 1024 positions) over held-out text (Python's standard library files it
was not trained on: bench/common.py windows), each window one prompt whose every position's attention reads the
cache as stored (written, then read back: the prefill reads what decode would).
--agree DIR: a GQA checkpoint (tools/synth_checkpoint.py --arch qwen3-30b-a3b --layers 6 --out DIR: random weights,
full width), every logit of a prompt of random ids: top-1 agreement and mean KL against the fp32 cache.
The native decode kernels read the 8-bit rows as exactly these values (tests/kernels/test_kv_quant.py), so the
figures hold for decode too.
--agree-decode DIR: a GQA checkpoint's decode steps (teacher-forced after a prompt of random ids) with an int8 cache
on the native kernels, against torch's attention over the same pool (on the AVX-512 paths the int8 scores round each
query head to int8: this is what that costs) and against the fp32 cache.
--decode DIR: decode tokens/s at each length of context with each cache, one process (the GPU side's model on its
native decode loop, --dense-format and --weight-format int4 experts in this process: the weights a token reads are
the same for every cache), the cache filled directly (no prefill), caches alternating within each round; beside it
the bytes a token reads (weights + the cache's) and the ratio those bytes allow: a bytes-bound decode's ceiling.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import statistics

import torch

from common import ROOT, cpu_name, timed, windows  # noqa: E402

CACHES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


@functools.cache
def local_experts(model_dir: pathlib.Path, fmt: str):
    """The routed experts in this process, loaded once for every cache compared."""
    from moe_experts.store import load_expert_layers
    from gpu_service.experts.local import LocalExperts
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config

    return LocalExperts(load_expert_layers(load_config(model_dir), Checkpoint(model_dir), fmt, torch.get_num_threads()))


def all_logits(model_dir: pathlib.Path, kv: torch.dtype, prompts: list[list[int]], experts: str) -> list[torch.Tensor]:
    from gpu_service.model.model import Model
    from gpu_service.model.step import Segment
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config

    model = Model(load_config(model_dir), Checkpoint(model_dir), torch.device("cpu"), torch.float32, kv_dtype=kv)
    ex = local_experts(model_dir, experts)
    out = []
    with torch.no_grad():
        for p in prompts:
            c = model.new_cache()
            out.append(model.forward([Segment(c, torch.tensor(p), 0, all_logits=True)], ex))
            c.release()
    return out


def perplexity(logits: list[torch.Tensor], prompts: list[list[int]]) -> float:
    nll = n = 0
    for lg, p in zip(logits, prompts):
        t = torch.tensor(p[1:])
        nll += float(-lg[:-1].log_softmax(-1).gather(1, t[:, None]).sum())
        n += len(t)
    return math.exp(nll / n)


def decode_logits(model_dir: pathlib.Path, kv: torch.dtype, prompt: list[int], feed: list[int], native: bool):
    """The prompt prefilled, then each of feed's tokens teacher-forced: the decode steps' logits [len(feed), vocab],
    bf16 dense layers (--dense-format bf16, as a bf16 checkpoint runs), int8 experts; native: decode attention on the
    native kernels (else torch's ops over the same pool)."""
    from gpu_service.model.model import Model
    from gpu_service.model.step import Segment
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config

    model = Model(load_config(model_dir), Checkpoint(model_dir), torch.device("cpu"), torch.float32, kv_dtype=kv,
                  dense_format="bf16")
    ex = local_experts(model_dir, "int8")
    c = model.new_cache()
    with torch.no_grad():
        model.forward([Segment(c, torch.tensor(prompt), 0)], ex)
        model.native_attention = native
        model.decode_blocks = model.decode_blocks if native else {}
        out = [model.forward([Segment(c, torch.tensor([t]), len(prompt) + i)], ex) for i, t in enumerate(feed)]
    c.release()
    return torch.cat(out)


def decode_agreement(a) -> None:
    """--agree-decode DIR: decode logits with an int8 cache on the native kernels (whose scores may round the query:
    the VNNI paths) against torch's attention over the same pool, and each against the fp32 cache's."""
    from moe_core.config import load_config
    from moe_kernels import ISA
    from moe_kernels.attention import rounds_query

    cfg = load_config(a.agree_decode)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, cfg.vocab_size, (a.len,), generator=g).tolist()
    feed = torch.randint(2, cfg.vocab_size, (a.steps,), generator=g).tolist()
    runs = {"int8 native": decode_logits(a.agree_decode, torch.int8, prompt, feed, True),
            "int8 torch": decode_logits(a.agree_decode, torch.int8, prompt, feed, False),
            "fp32 torch": decode_logits(a.agree_decode, torch.float32, prompt, feed, False)}
    print(f"kernel path {ISA}; the int8 scores round the query: {rounds_query(torch.int8, cfg.head_dim)}", flush=True)
    for x, y in (("int8 native", "int8 torch"), ("int8 torch", "fp32 torch"), ("int8 native", "fp32 torch")):
        p, r = runs[x], runs[y]
        kl = float(torch.nn.functional.kl_div(p.log_softmax(-1), r.log_softmax(-1), log_target=True,
                                              reduction="batchmean"))
        print(json.dumps({"model": a.agree_decode.name, "prompt": a.len, "steps": a.steps, "compare": f"{x} vs {y}",
                          "top1_agreement": round(float((p.argmax(-1) == r.argmax(-1)).float().mean()), 4),
                          "mean_kl": f"{kl:.3e}"}), flush=True)


def decode_speed(a) -> None:
    from moe_experts.store import load_expert_layers
    from gpu_service.engine.kv_pool import BLOCK, KVPool, SeqCache, block_bytes
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import Model
    from gpu_service.model.step import Segment
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    from moe_kernels import kv_quant, native
    from moe_kernels.dense import NativeLinear

    native.init_pool(a.threads)
    torch.set_num_threads(a.threads)
    cfg, ckpt = load_config(a.decode), Checkpoint(a.decode)
    model = Model(cfg, ckpt, torch.device("cpu"), torch.bfloat16, dense_format=a.dense_format)
    layers = load_expert_layers(cfg, ckpt, a.weight_format, a.threads, progress=False)
    experts = LocalExperts(layers)
    # a token's weights: the packed dense ones (all of them, the lm_head's too), k experts a MoE layer
    dense = sum(w.nbytes for w in {id(w): w for w in [*model.W.values(), model.lm_head]}.values()
                if isinstance(w, NativeLinear))
    weights = dense + sum(op.weight_bytes_per_expert * cfg.top_k for op in layers.values())
    caches = {n: CACHES[n] for n in a.caches.split(",")}
    print(f"CPU: {cpu_name()}; {a.threads} threads; {a.decode.name}: {cfg.num_layers} layers, dense "
          f"{a.dense_format}, experts {a.weight_format}; weights read a token {weights / 2**20:.0f} MiB", flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    for L in a.lengths:
        filled = {}
        for name, kv in caches.items():
            pool = KVPool(cfg, kv, torch.device("cpu"), -(-(L + 2) // BLOCK) + 4)
            cache = SeqCache(pool)
            cache.reserve(L + 2)
            for bufs in pool.bufs:
                for buf in bufs or ():
                    x = torch.randn(*buf.shape[:-1], kv_quant.values(kv, buf.shape[-1]), generator=g)
                    if kv_quant.quantized(kv):
                        buf.view(torch.uint8).copy_(kv_quant.quantize(x, kv))
                    else:
                        buf.copy_(x)
            filled[name] = cache
        per = {n: [] for n in caches}
        for _ in range(a.rounds):
            for name, cache in filled.items():
                ts = [timed(lambda: model.forward([Segment(cache, torch.tensor([5 + i]), L - 1)], experts))
                      for i in range(a.reps + 1)]
                per[name].append(statistics.median(ts[1:]))  # (the first: warm-up)
        base = next(iter(caches))
        row = {"positions": L}
        for name, kv in caches.items():
            kv_bytes = block_bytes(cfg, kv) / BLOCK * L
            row[name] = {"tok_s": round(1 / statistics.median(per[name]), 2), "kv_MiB": round(kv_bytes / 2**20, 1),
                         "rounds_tok_s": [round(1 / t, 2) for t in per[name]]}
        for name, kv in caches.items():
            if name != base:
                b0, b1 = block_bytes(cfg, caches[base]) / BLOCK * L + weights, block_bytes(cfg, kv) / BLOCK * L + weights
                row[name]["vs_" + base] = round(statistics.median(
                    p0 / p1 for p0, p1 in zip(per[base], per[name])), 2)
                row[name]["bytes_ceiling"] = round(b0 / b1, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ppl", action="store_true")
    ap.add_argument("--agree", type=pathlib.Path)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--len", type=int, default=1024)
    ap.add_argument("--experts", default="fp32", help="the routed experts' format (the same for every cache)")
    ap.add_argument("--decode", type=pathlib.Path)
    ap.add_argument("--agree-decode", type=pathlib.Path)
    ap.add_argument("--steps", type=int, default=64, help="--agree-decode: teacher-forced decode steps")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--caches", default="bf16,int8,fp8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dense-format", default="int4")
    ap.add_argument("--weight-format", default="int4")
    a = ap.parse_args()
    if a.decode:
        return decode_speed(a)
    if a.agree_decode:
        return decode_agreement(a)
    print(f"CPU: {cpu_name()}; fp32 arithmetic; caches {', '.join(CACHES)}", flush=True)
    if a.ppl:
        model = ROOT / "models" / "default"
        prompts = windows(str(model), a.windows, a.len)
        ppl = {name: perplexity(all_logits(model, kv, prompts, a.experts), prompts) for name, kv in CACHES.items()}
        row = {"model": "embedded (deepseek_v3, MLA 64 + 16)", "windows": a.windows, "positions": a.len,
               "ppl": {k: round(v, 4) for k, v in ppl.items()},
               "vs_bf16": {k: f"{100 * (v / ppl['bf16'] - 1):+.2f}%" for k, v in ppl.items()}}
        print(json.dumps(row), flush=True)
    if a.agree:
        g = torch.Generator().manual_seed(0)
        from moe_core.config import load_config
        vocab = load_config(a.agree).vocab_size
        prompts = [torch.randint(2, vocab, (a.len,), generator=g).tolist() for _ in range(max(1, a.windows // 4))]
        fmt = a.experts if a.experts != "fp32" else "int8"  # (fp32 experts of a full-width model: too many bytes)
        ref = all_logits(a.agree, torch.float32, prompts, fmt)
        for name, kv in list(CACHES.items())[1:]:
            got = all_logits(a.agree, kv, prompts, fmt)
            agree = sum(int((x.argmax(-1) == y.argmax(-1)).sum()) for x, y in zip(got, ref)) / sum(len(p) for p in prompts)
            kl = sum(float(torch.nn.functional.kl_div(x.log_softmax(-1), y.log_softmax(-1), log_target=True,
                                                      reduction="sum")) for x, y in zip(got, ref)) / sum(map(len, prompts))
            print(json.dumps({"model": a.agree.name, "cache": name, "positions": a.len, "top1_agreement": round(agree, 4),
                              "mean_kl": f"{kl:.3e}"}), flush=True)


if __name__ == "__main__":
    main()
