"""How a model's real routing spreads over expert-service shards: round robin (expert e on shard
e % N, moe_core.shards) against contiguous ranges (e // (E / N)), on held-out text through trained
models (the embedded one; the deep one if built: tools/train_default_model.py --preset deep).

Two figures per split and N, over every MoE layer and token:
- decode: the busiest shard's pairs per token, against the even share k / N. A layer waits for its
  slowest shard, so this is the per-token critical path (1.00 = perfectly even);
- batch: over a window of tokens (a prefill), the busiest shard's pairs against the mean shard's.

    python bench/bench_shards.py [--models models/default build/deep-model] [--shards 2 4 8]
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from accuracy import windows  # noqa: E402
from gpu_service.dispatch import LocalExperts  # noqa: E402
from gpu_service.model import Model, Segment  # noqa: E402
from expert_service.store import load_expert_layers  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = [str(ROOT / "models/default")] + ([str(ROOT / "build/deep-model")]
                                                if (ROOT / "build/deep-model/config.json").exists() else [])
    ap.add_argument("--models", nargs="+", default=default)
    ap.add_argument("--shards", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--len", type=int, default=256)
    a = ap.parse_args()
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
