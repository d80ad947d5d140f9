"""Expert deferral: decode tokens/s with defer=0 vs defer=d, each service pinned to its own core,
on a model whose GPU-side and CPU-side work per layer are comparable (built here, random weights).

    python bench/bench_deferral.py [--defer 2] [--tokens 48] [--runs 3] [--family qwen3_moe|deepseek_v3]

Deferral hides at most the deferred experts' time behind the next layer's attention and router
(the expert side runs layers in order), so with defer=2 of k=8 the gain is capped at +25%, reached
only when the routed experts take 4x the attention + router time; the benchmark prints that cap
for the measured times next to the measured gain.

Also reports each side's busy fraction during decode (from their Prometheus counters): with
deferral the expert service keeps computing layer L's deferred experts while the GPU side runs
layer L+1's attention and shared experts.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time
import urllib.request

import torch

from common import free_port, Services  # noqa: E402
from protos import generate_pb2  # noqa: E402

MODELS = {
    # no shared experts: nothing on the GPU side hides the experts' time, which is deferral's best case.
    # Per decode layer ~2.5 ms of routed experts (8 x 6 MB) vs ~0.9 ms of attention + router.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=2000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=2048)),
    # MLA + 4 shared experts, whose time already hides most of the routed experts'
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=2000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=9,
        num_attention_heads=16, n_routed_experts=64, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=1, kv_lora_rank=256, q_lora_rank=512, qk_rope_head_dim=32, qk_nope_head_dim=64,
        v_head_dim=64, n_shared_experts=4, max_position_embeddings=2048)),
}


def build(out: pathlib.Path, family: str) -> None:
    import transformers
    cfg_name, model_name, kw = MODELS[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**kw, bos_token_id=0, eos_token_id=1)
    getattr(transformers, model_name)(cfg).to(torch.bfloat16).save_pretrained(out)
    import tiny_models
    tiny_models.build_tokenizer(out)


def per_layer_profile(stub, req) -> dict:
    """ms per decode step, summed over layers, of each span kind (one profiled run, prefill left out)."""
    r = generate_pb2.GenerateRequest()
    r.CopyFrom(req)
    r.profile = True
    last = list(stub.Generate(r, timeout=600))[-1]
    steps = sorted({sp.step for sp in last.profile.spans})[1:]
    out: dict = {}
    for sp in last.profile.spans:
        if sp.step in steps:
            out[sp.name] = out.get(sp.name, 0.0) + (sp.end_unix_ns - sp.start_unix_ns) / 1e6 / len(steps)
    return out


def counter(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--defer", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--family", default="qwen3_moe", choices=sorted(MODELS))
    ap.add_argument("--transport", default="auto", choices=["grpc", "shm", "auto"])
    ap.add_argument("--moe-intermediate", type=int, default=0, help="override the experts' size (0: the model's)")
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp())
    if a.moe_intermediate:
        MODELS[a.family][2]["moe_intermediate_size"] = a.moe_intermediate
    build(tmp / "model", a.family)
    gm, em = free_port(), free_port()
    svc = Services(tmp / "model", tmp, gpu_args=("--metrics-port", str(gm), "--transport", a.transport), expert_args=("--metrics-port", str(em)),
                   gpu_prefix=("taskset", "-c", "0"), expert_prefix=("taskset", "-c", "1"))
    rows, prof = {}, {}
    try:
        for defer in (0, a.defer, 0, a.defer):  # interleaved, so drift hits both alike
            req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=list(range(2, 34))),
                                               max_tokens=a.tokens, ignore_eos=True, defer=defer,
                                               sampling=generate_pb2.SamplingParams(temperature=0))
            list(svc.stub.Generate(req, timeout=600))  # warm-up
            prof.setdefault(defer, per_layer_profile(svc.stub, req))
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
    # Where the time goes per decode step (ms, all layers), and the most deferral can give here: the
    # expert side works layers in order, so per MoE layer the step shrinks by min(deferred experts'
    # time, the GPU side's time before it needs them) out of (GPU side + experts).
    p0 = prof[0]
    gpu = sum(v for k, v in p0.items() if k not in ("expert_wait", "shard_wait") and not k.startswith("experts_"))
    # (GPU-side work: the waits and the expert side's spans left out)
    shared, experts = p0.get("shared_experts", 0.0), p0.get("experts_immediate", 0.0)
    # what the next layer runs before it needs them
    overlap = p0.get("attention", 0.0) + p0.get("router", 0.0) + p0.get("expert_submit", 0.0)
    hidden = min(experts * a.defer / MODELS[a.family][2]["num_experts_per_tok"], overlap)
    step0 = gpu - shared + max(shared, experts)  # shared experts already run beside the routed ones
    step_d = gpu - shared + max(shared, experts - hidden)
    for d in (0, a.defer):
        print(f"per decode step, defer {d} (ms, all layers): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof[d].items())))
    print(f"most deferral can give with these times: {step0 / step_d - 1:+.1%} (GPU side {gpu:.1f} ms, routed experts "
          f"{experts:.1f} ms per step, of which {hidden:.1f} ms can hide behind the next layers' attention)")


if __name__ == "__main__":
    main()
