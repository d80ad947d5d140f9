"""How a model's real routing spreads over expert-service shards: round robin (expert e on shard
e % N, moe_core.shards) against contiguous ranges (e // (E / N)), on held-out text through trained
models (the embedded one; the deep one if built: tools/train_default_model.py --preset deep).

With --e2e MODEL: decode through a GPU service and N expert-service shards on this host (real
processes; --transport shm or grpc), per N: tokens/s, and per MoE layer and token the busiest shard's
compute, and the exchange's cost beyond it (router done -> every part back, minus that compute), from
the services' own profile spans. On one host the shards share the cores, so this measures what
sharding adds (the fan-out and the sums), not the compute it divides (docs/performance/sharding.md models that).

Two figures per split and N, over every MoE layer and token:
- decode: the busiest shard's pairs per token, against the even share k / N. A layer waits for its
  slowest shard, so this is the per-token critical path (1.00 = perfectly even);
- batch: over a window of tokens (a prefill), the busiest shard's pairs against the mean shard's.

    python bench/bench_shards.py [--models models/default build/deep-model] [--shards 2 4 8]
    python bench/bench_shards.py --e2e DIR --shards 1 2 3 [--transport grpc]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics

import torch

from common import ROOT, windows  # noqa: E402
from gpu_service.experts.local import LocalExperts  # noqa: E402
from gpu_service.model.model import Model, Segment  # noqa: E402
from moe_experts.store import load_expert_layers  # noqa: E402
from moe_core.checkpoint import Checkpoint  # noqa: E402
from moe_core.config import load_config  # noqa: E402


def routed_ids(model_dir: str, wins) -> list[torch.Tensor]:
    """Every MoE layer's top-k ids [T, k] for each window (fp32, as the services would route)."""
    cfg, ckpt = load_config(model_dir), Checkpoint(model_dir)
    experts = LocalExperts(load_expert_layers(cfg, ckpt, "fp32", 2))
    seen, submit = [], experts.submit

    def record(step, layer, x, ids, *a):
        seen.append(ids.clone())
        return submit(step, layer, x, ids, *a)
    experts.submit = record
    model = Model(cfg, Checkpoint(model_dir), torch.device("cpu"), torch.float32)
    for w in wins:
        model.forward([Segment(model.new_cache(), torch.tensor(w), 0)], experts)
    return seen, cfg


def balance(all_ids: list[torch.Tensor], E: int, k: int, n: int, split: str) -> tuple[float, float]:
    decode, batch = [], []
    for ids in all_ids:
        shard = ids % n if split == "round robin" else ids // (E // n)
        per_token = torch.stack([(shard == s).sum(1) for s in range(n)], 1)   # [T, n] pairs per shard
        decode.append(per_token.max(1).values.float().mean().item() / (k / n))
        totals = per_token.sum(0).float()
        batch.append((totals.max() / totals.mean()).item())
    return statistics.mean(decode), statistics.mean(batch)


def e2e(model: str, counts: list[int], transport: str, tokens: int, rounds: int) -> None:
    import collections
    import tempfile

    from common import Sharded, cpu_name, wait_healthy
    from protos import generate_pb2
    print(f"CPU: {cpu_name()}; {model}; transport {transport}; decode {tokens} tokens after a 16-token prompt, "
          f"median of {rounds}")
    print("| shards | decode tok/s | busiest shard's compute per layer | exchange beyond it per layer |")
    print("|---|---|---|---|")
    prompt = [(i * 7919) % 4000 + 2 for i in range(16)]
    for n in counts:
        with tempfile.TemporaryDirectory() as tmp:
            s = Sharded(model, pathlib.Path(tmp), n, gpu_args=("--transport", transport, "--device", "cpu"))
            try:
                wait_healthy(s.gpu_port, s.gpu, timeout=600)
                req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=tokens,
                                                   ignore_eos=True, profile=True,
                                                   sampling=generate_pb2.SamplingParams(temperature=0))
                list(s.stub.Generate(req, timeout=600))  # warm-up
                rates, computes, overheads = [], [], []
                for _ in range(rounds):
                    chunks = list(s.stub.Generate(req, timeout=600))
                    last = chunks[-1]
                    rates.append((last.usage.completion_tokens - 1) / (last.elapsed_s - last.time_to_first_token_s))
                    steps = collections.defaultdict(dict)  # (step, layer) -> what happened
                    for sp in last.profile.spans:
                        d = steps[(sp.step, sp.layer)]
                        if sp.name == "expert_submit":
                            d["submitted"] = sp.end_unix_ns
                        elif sp.name == "expert_wait":
                            d["back"] = sp.end_unix_ns
                        elif sp.name == "experts_immediate":
                            d["compute"] = max(d.get("compute", 0), sp.end_unix_ns - sp.start_unix_ns)
                    per = [(d["compute"], d["back"] - d["submitted"] - d["compute"]) for (step, _), d in steps.items()
                           if step > 0 and {"submitted", "back", "compute"} <= d.keys()]  # decode steps only
                    computes.append(statistics.mean(c for c, _ in per) / 1e3)
                    overheads.append(statistics.mean(o for _, o in per) / 1e3)
                print(f"| {n} | {statistics.median(rates):.1f} | {statistics.median(computes):.0f} us | "
                      f"{statistics.median(overheads):.0f} us |", flush=True)
            finally:
                s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = [str(ROOT / "models/default")] + ([str(ROOT / "build/deep-model")]
                                                if (ROOT / "build/deep-model/config.json").exists() else [])
    ap.add_argument("--models", nargs="+", default=default)
    ap.add_argument("--shards", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--e2e", help="a checkpoint to decode through N shards (with --shards)")
    ap.add_argument("--transport", default="shm", choices=["shm", "grpc"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.e2e:
        return e2e(a.e2e, a.shards, a.transport, a.tokens, a.rounds)
    print("| model | experts, top-k | shards | split | decode: busiest shard / even share | batch: busiest / mean |")
    print("|---|---|---|---|---|---|")
    for m in a.models:
        wins = windows(m, a.windows, a.len)
        ids, cfg = routed_ids(m, wins)
        E, k = cfg.n_routed_experts, cfg.top_k
        for n in a.shards:
            if E % n:
                continue
            for split in ("round robin", "contiguous"):
                dec, bat = balance(ids, E, k, n, split)
                print(f"| {pathlib.Path(m).name} | {E}, top-{k} | {n} | {split} | {dec:.2f} | {bat:.2f} |", flush=True)


if __name__ == "__main__":
    main()
