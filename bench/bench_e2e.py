"""End-to-end benchmark: decode tokens/s through both services (real processes, real gRPC) and
the exchange round trip per layer; each against a baseline measured in the same run.

    python bench/bench_e2e.py [--model models/default] [--tokens 64] [--runs 5] [--device cpu|cuda]
                              [--transport auto|grpc|shm]

Prints one JSON line per measurement, then a table. Baselines:
- decode: the same model in one process, experts called in-process (no gRPC, no second process);
- exchange: one LayerRequest round trip over the Exchange stream minus the expert compute time
  the service reports for it (= wire + serialization + scheduling overhead per layer).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

from common import ROOT, decode_rate, exchange_rtt, Services  # noqa: E402
from moe_core.checkpoint import Checkpoint  # noqa: E402
from moe_core.config import load_config  # noqa: E402
from protos import generate_pb2  # noqa: E402


def bench_split(svc: Services, prompt_ids, tokens, runs) -> list[float]:
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt_ids), max_tokens=tokens,
                                       ignore_eos=True, sampling=generate_pb2.SamplingParams(temperature=0))
    list(svc.stub.Generate(req, timeout=600))  # warm-up
    return [decode_rate(list(svc.stub.Generate(req, timeout=600))) for _ in range(runs)]


def bench_inprocess(model_dir, prompt_ids, tokens, runs, device="cpu") -> list[float]:
    from expert_service.store import load_expert_layers
    from gpu_service.experts import LocalExperts
    from gpu_service.model import DTYPES, Model, Segment

    cfg, ckpt = load_config(model_dir), Checkpoint(model_dir)
    model = Model(cfg, ckpt, torch.device(device), DTYPES[cfg.torch_dtype])
    fmt = {"bfloat16": "bf16", "float16": "fp16"}.get(cfg.torch_dtype, "fp32")
    experts = LocalExperts(load_expert_layers(cfg, ckpt, fmt, torch.get_num_threads()))
    rates = []
    for r in range(runs + 1):
        cache = model.new_cache()
        logits = model.forward([Segment(cache, torch.tensor(prompt_ids), 0)], experts)
        t0 = time.perf_counter()
        for i in range(tokens - 1):
            tok = torch.argmax(logits[0]).view(1)
            logits = model.forward([Segment(cache, tok, cache.length)], experts)
        if r:  # the first run warms up
            rates.append((tokens - 1) / (time.perf_counter() - t0))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--exchanges", type=int, default=300)
    ap.add_argument("--device", default="cpu", help="the GPU side's device, in-process and as a service")
    ap.add_argument("--transport", default="auto", choices=["auto", "grpc", "shm"], help="the GPU service's")
    a = ap.parse_args()
    cfg = load_config(a.model)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.torch_dtype, torch.float32)
    torch.set_num_threads(1)
    prompt = list(range(2, 18))
    rows = []

    def report(name, value, unit, baseline=None, baseline_name=None):
        row = {"case": name, "value": round(value, 2), "unit": unit}
        if baseline is not None:
            row |= {"baseline": baseline_name, "baseline_value": round(baseline, 2), "ratio": round(value / baseline, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)

    inproc = statistics.median(bench_inprocess(a.model, prompt, a.tokens, a.runs, a.device))
    tmp = pathlib.Path(__import__("tempfile").mkdtemp())
    svc = Services(a.model, tmp, gpu_args=("--device", a.device, "--transport", a.transport))  # each service: 1 thread, as on a 2-core machine
    try:
        split = statistics.median(bench_split(svc, prompt, a.tokens, a.runs))
        transport = svc.stub.Info(generate_pb2.ServerInfoRequest(), timeout=5).transport
        report(f"decode tok/s, split (2 processes, {transport} exchange, GPU side on {a.device})", split, "tok/s", inproc,
               "in-process, no exchange")
        n_moe = len(cfg.moe_layers)
        report("per-token cost of the split", (1 / split - 1 / inproc) * 1e6 / n_moe, "us per MoE layer")
        rtt, comp, *_ = exchange_rtt(svc.expert_port, "grpc", cfg.moe_layers[0], cfg.hidden_size, cfg.n_routed_experts,
                                 cfg.top_k, dtype, a.exchanges)
        med_rtt, med_comp = statistics.median(rtt), statistics.median(comp)
        report(f"gRPC exchange round trip, H={cfg.hidden_size} {cfg.torch_dtype}, T=1", med_rtt, "us median",
               med_comp, "expert compute inside it")
        report("exchange overhead (round trip - compute)", med_rtt - med_comp, "us median")
    finally:
        svc.stop()
    print("\n| case | value | unit | baseline | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['value']} | {r['unit']} | {r.get('baseline', '')} {r.get('baseline_value', '')} "
              f"| {r.get('ratio', '')} |")


if __name__ == "__main__":
    main()
