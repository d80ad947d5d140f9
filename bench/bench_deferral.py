"""Expert deferral: decode tokens/s with defer=0 vs defer=d, each service pinned to its own core,
on a model whose GPU-side and CPU-side work per layer are comparable (built here, random weights).

    python bench/bench_deferral.py [--defer 2] [--tokens 48] [--runs 3]

Also reports each side's busy fraction during decode (from their Prometheus counters): with
deferral the expert service keeps computing layer L's deferred experts while the GPU side runs
layer L+1's attention and shared experts.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
import urllib.request

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import Services, free_port  # noqa: E402
from protos import generate_pb2  # noqa: E402

CONFIG = dict(  # per decode step and layer: ~25 MB of routed experts on the CPU side vs attention + 4 shared on the other
    vocab_size=2000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=9,
    num_attention_heads=16, n_routed_experts=64, n_group=8, topk_group=4, num_experts_per_tok=8,
    first_k_dense_replace=1, kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=32, qk_nope_head_dim=64,
    v_head_dim=64, n_shared_experts=4, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
)


def build(out: pathlib.Path) -> None:
    import transformers
    torch.manual_seed(0)
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG)).to(torch.bfloat16).save_pretrained(out)
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models
    tiny_models.build_tokenizer(out)


def counter(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--defer", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp())
    build(tmp / "model")
    gm, em = free_port(), free_port()
    svc = Services(tmp / "model", tmp, gpu_args=("--metrics-port", str(gm)), expert_args=("--metrics-port", str(em)),
                   gpu_prefix=("taskset", "-c", "0"), expert_prefix=("taskset", "-c", "1"))
    rows = {}
    try:
        for defer in (0, a.defer, 0, a.defer):  # interleaved, so drift hits both alike
            req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=list(range(2, 34))),
                                               max_tokens=a.tokens, ignore_eos=True, defer=defer,
                                               sampling=generate_pb2.SamplingParams(temperature=0))
            list(svc.stub.Generate(req, timeout=600))  # warm-up
            for _ in range(a.runs):
                g0, e0, t0 = counter(gm, "moe_gpu_busy_seconds_total"), counter(em, "moe_expert_busy_seconds_total"), \
                    time.perf_counter()
                chunks = list(svc.stub.Generate(req, timeout=600))
                wall = time.perf_counter() - t0
                last = chunks[-1]
                rate = (last.usage.completion_tokens - 1) / (last.elapsed_s - last.time_to_first_token_s)
                r = rows.setdefault(defer, {"rate": [], "gpu_busy": [], "expert_busy": []})
                r["rate"].append(rate)
                r["gpu_busy"].append((counter(gm, "moe_gpu_busy_seconds_total") - g0) / wall)
                r["expert_busy"].append((counter(em, "moe_expert_busy_seconds_total") - e0) / wall)
    finally:
        svc.stop()
    med = {d: {k: statistics.median(v) for k, v in r.items()} for d, r in rows.items()}
    for d, m in med.items():
        print(json.dumps({"defer": d, "decode_tok_s": round(m["rate"], 2), "gpu_busy": round(m["gpu_busy"], 3),
                          "expert_busy": round(m["expert_busy"], 3)}))
    base, dfr = med[0]["rate"], med[a.defer]["rate"]
    print("\n| defer | decode tok/s | vs defer 0 | GPU-side busy | expert-side busy |\n|---|---|---|---|---|")
    for d, m in med.items():
        print(f"| {d} | {m['rate']:.2f} | {m['rate'] / base:.3f}x | {m['gpu_busy']:.0%} | {m['expert_busy']:.0%} |")
    print(f"\ndeferral speed-up: {dfr / base - 1:+.1%} (each service on its own core; medians of {a.runs * 2} runs)")


if __name__ == "__main__":
    main()
