"""End-to-end benchmark: decode tokens/s through both services (real processes, real gRPC) and
the exchange round trip per layer; each against a baseline measured in the same run.

    python bench/bench_e2e.py [--model models/default] [--tokens 64] [--runs 5] [--device cpu|cuda]
                              [--transport auto|grpc|shm]

Prints one JSON line per measurement, then a table. Baselines:
- decode: the same requests to one GPU service holding the experts itself (`--experts local`: the same native
  paths, no exchange, no second process);
- exchange: one LayerRequest round trip over the Exchange stream minus the expert compute time
  the service reports for it (= wire + serialization + scheduling overhead per layer).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile

import grpc
import torch

from common import ROOT, Services, decode_rate, exchange_rtt, free_port, start, terminate_all, wait_healthy  # noqa: E402
from moe_core.config import load_config  # noqa: E402
from protos import generate_pb2, generate_pb2_grpc  # noqa: E402


def decode_rates(stub, prompt_ids, tokens, runs) -> list[float]:
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt_ids), max_tokens=tokens,
                                       ignore_eos=True, sampling=generate_pb2.SamplingParams(temperature=0))
    list(stub.Generate(req, timeout=600))  # warm-up
    return [decode_rate(list(stub.Generate(req, timeout=600))) for _ in range(runs)]


def bench_local(model_dir, prompt_ids, tokens, runs, device, tmp: pathlib.Path) -> list[float]:
    """Decode rates of a GPU service with the experts in its own process (`--experts local`), one thread as each
    service of the split has. (It replaced a bare Model.forward loop, which kept none of the services' native
    decode paths and ran ~5x slower than the split it was the baseline of.)"""
    port = free_port()
    p = start("gpu_service", "--model", str(model_dir), "--experts", "local", "--listen", f"127.0.0.1:{port}",
              "--threads", "1", "--device", device, log=tmp / "local.log")
    try:
        wait_healthy(port, p, timeout=600)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            return decode_rates(generate_pb2_grpc.GenerateServiceStub(ch), prompt_ids, tokens, runs)
    finally:
        terminate_all([p])


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

    tmp = pathlib.Path(tempfile.mkdtemp())
    local = statistics.median(bench_local(a.model, prompt, a.tokens, a.runs, a.device, tmp))
    svc = Services(a.model, tmp, gpu_args=("--device", a.device, "--transport", a.transport))  # each service: 1 thread, as on a 2-core machine
    try:
        split = statistics.median(decode_rates(svc.stub, prompt, a.tokens, a.runs))
        transport = svc.stub.Info(generate_pb2.ServerInfoRequest(), timeout=5).transport
        report(f"decode tok/s, split (2 processes, {transport} exchange, GPU side on {a.device})", split, "tok/s", local,
               "--experts local, no exchange")
        n_moe = len(cfg.moe_layers)
        report("per-token cost of the split", (1 / split - 1 / local) * 1e6 / n_moe, "us per MoE layer")
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
