"""The GPU side's decode step per layer, per op against graphed (gpu_service/model/cuda_graphs.py): issue #28's bar is
<= 100 us a layer of GPU-side wall time outside the weights' reads, copies included, the expert service's wait
excluded, for a Qwen3-shape and a DeepSeek-V3-shape (MLA) layer.

The GPU side alone, in this process: a checkpoint of an architecture at full width without its routed experts
(tools/synth_checkpoint.py --no-routed-experts), and in place of the expert service an object that hands back a held
host tensor of each step's shape at once (pinned on CUDA: the result's copy to the device stays in the step), so
the time is the GPU side's own. Per round, per mode: fresh sequences, a --context-token prefill, then --steps greedy
steps, each timed to its logits on the host; rounds alternate the modes. "Outside the weight reads": the step's time
less the time its weights (every layer's and the lm_head's) take at the memory bandwidth probed in the same run (a
device copy), over the layers.

    python bench/bench_graphs.py --arch qwen3-30b-a3b --device cuda --batch 1,4
    python bench/bench_graphs.py --arch deepseek-v3 --device cuda --batch 1   # every layer MoE (MLA)
On the CPU (no graphs there: the "graphed" mode runs the same segments eagerly) it only checks the script."""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from gpu_service.model.model import DTYPES, Model, Segment  # noqa: E402
from moe_core.checkpoint import Checkpoint  # noqa: E402
from moe_core.config import load_config  # noqa: E402
import synth_checkpoint  # noqa: E402


class HeldExperts:
    """The experts' answers without the experts: each result is a held host tensor of the step's shape."""

    def __init__(self, hidden: int, pinned: bool):
        self.hidden, self.pinned = hidden, pinned
        self.y = self._held(64)
        self.out = []

    def _held(self, rows: int) -> torch.Tensor:
        y = torch.randn(rows, self.hidden) * 1e-3
        return y.pin_memory() if self.pinned else y

    def submit(self, step, layer, x, ids, w, defer):
        if x.shape[0] > self.y.shape[0]:  # a prompt's rows (the prefill before the timed decode steps)
            self.y = self._held(x.shape[0])
        self.out.append(x.shape[0])
        if defer:
            self.out.append(x.shape[0])

    def result(self, layer, deferred):
        return self.y[:self.out.pop(0)]

    def drain_timings(self):
        return []

    def drain_waits(self):
        return []

    def drain_spans(self):
        return []

    def reset(self):
        self.out.clear()

    def close(self):
        pass


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(device: torch.device) -> float:
    """Bytes a second a device copy of 1 GiB moves (read + write), best of 5."""
    x = torch.empty(1 << 28, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.nbytes / best


def weight_bytes(model: Model) -> int:
    """Bytes of the weights a decode step reads: every layer's and the lm_head (the embedding: a row a token)."""
    return sum(t.nbytes for n, t in model.W.items() if n.startswith("model.layers.")) + model.lm_head.nbytes


def prefilled(model: Model, experts, batch: int, context: int, seed: int) -> tuple[list, torch.Tensor]:
    """batch fresh sequences of `context` random tokens, prefilled per op -> (their caches, each one's next token)."""
    model.graphs = "off"
    caches = [model.new_cache() for _ in range(batch)]
    g = torch.Generator().manual_seed(seed)
    toks = []
    for c in caches:
        prompt = torch.randint(0, model.cfg.vocab_size, (context,), generator=g)
        toks.append(int(model.forward([Segment(c, prompt, 0)], experts)[-1].argmax()))
    return caches, torch.tensor(toks)


def round_(model: Model, experts, batch: int, context: int, steps: int, graphs: str) -> list[float]:
    """Seconds of each decode step of one round."""
    caches, toks = prefilled(model, experts, batch, context, 0)
    model.graphs = graphs
    times = []
    for i in range(steps):
        sync(model.device)
        t0 = time.perf_counter()
        logits = model.forward([Segment(c, toks[j:j + 1], context + i) for j, c in enumerate(caches)], experts, step=i)
        toks = logits.argmax(-1).cpu()  # (the host has the tokens: the step is over)
        times.append(time.perf_counter() - t0)
    for c in caches:
        c.release()
    return times


def where_it_goes(model: Model, experts, batch: int, context: int, steps: int, graphs: str) -> dict[str, float]:
    """Seconds a step by span name (Model.forward's spans, the device synchronized at each: the split of a step, not
    its unprofiled time), medians over the steps."""
    caches, toks = prefilled(model, experts, batch, context, 1)
    model.graphs = graphs
    per_step = []
    for i in range(steps):
        spans = []
        logits = model.forward([Segment(c, toks[j:j + 1], context + i) for j, c in enumerate(caches)], experts, step=i,
                               spans=spans, exact_spans=True)
        toks = logits.argmax(-1).cpu()
        got: dict[str, float] = {}
        for sp in spans:
            got[sp.name] = got.get(sp.name, 0.0) + (sp.end_ns - sp.start_ns) / 1e9
        per_step.append(got)
    for c in caches:
        c.release()
    names = sorted({n for got in per_step[1:] for n in got})
    return {n: statistics.median(got.get(n, 0.0) for got in per_step[1:]) for n in names}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3-30b-a3b", choices=sorted(synth_checkpoint.PRESETS))
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (DeepSeek-V3: the first one dense)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="a config.json override")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    ap.add_argument("--batch", default="1", help="sequences a step, comma-separated")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prepare", default="8,1024", metavar="ROWS,POSITIONS",
                    help="then time gpu-service's start-up capture (--max-batch ROWS, --cuda-graphs-capture POSITIONS) "
                         "on a fresh runner; empty: not")
    ap.add_argument("--work", type=pathlib.Path, help="keep the checkpoint here (default: a temporary folder)")
    a = ap.parse_args(argv)
    overrides = {k: json.loads(v) for k, _, v in (s.partition("=") for s in a.set)}
    if a.arch == "deepseek-v3":  # every layer an MoE one (the published model's first three are dense)
        overrides.setdefault("first_k_dense_replace", 0)
        overrides.setdefault("quantization_config", None)  # bf16 weights: no FP8 to quantize while writing
    work = a.work or pathlib.Path(tempfile.mkdtemp(prefix="bench_graphs-"))
    d = work / f"{a.arch}-{a.layers}-{hashlib.sha1(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]}"
    if not (d / "config.json").exists():
        synth_checkpoint.write(synth_checkpoint.config_of(a.arch, a.layers, overrides), d, 0.02, 0, 4096,
                               routed_experts=False)
    cfg = load_config(d)
    device = torch.device(a.device)
    model = Model(cfg, Checkpoint(d), device, DTYPES[a.dtype])
    graphed = "cuda" if device.type == "cuda" else "eager"
    if model.graphs == "off" and device.type == "cuda":
        sys.exit(f"{cfg.model_type}: no graphs for this model (cuda_graphs.eligible)")
    experts = HeldExperts(cfg.hidden_size, device.type == "cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw, nbytes = bandwidth(device), weight_bytes(model)
    L = cfg.num_layers
    print(f"{a.arch}, {L} layers ({len(cfg.moe_layers)} MoE), {a.dtype}, {name}, context {a.context}, "
          f"{a.steps} steps x {a.rounds} rounds; weights read a step {nbytes / 1e6:.0f} MB, bandwidth probe "
          f"{bw / 1e9:.0f} GB/s: {nbytes / bw * 1e3:.3f} ms")
    print("| batch | per op: ms a step | graphed: ms a step | per op / graphed | outside the weight reads, us a layer: "
          "per op | graphed | a bucket's first step (its captures), ms |")
    print("|---|---|---|---|---|---|---|")
    for B in (int(b) for b in a.batch.split(",")):
        got = {"off": [], graphed: []}
        first = round_(model, experts, B, a.context, 2, graphed)[0]  # the bucket's captures, outside the rounds
        for _ in range(a.rounds):
            for mode in ("off", graphed):
                got[mode] += round_(model, experts, B, a.context, a.steps, mode)[1:]
        per_op, gr = (statistics.median(got[m]) for m in ("off", graphed))
        floor = nbytes / bw
        print(f"| {B} | {per_op * 1e3:.3f} | {gr * 1e3:.3f} | {per_op / gr:.2f}x | {(per_op - floor) / L * 1e6:.0f} | "
              f"{(gr - floor) / L * 1e6:.0f} | {first * 1e3:.1f} |")
        prof = {m: where_it_goes(model, experts, B, a.context, 16, m) for m in ("off", graphed)}
        for n in sorted(set(prof["off"]) | set(prof[graphed])):
            print(f"|  span {n} (profiled: synchronized at each span) | {prof['off'].get(n, 0) * 1e3:.3f} | "
                  f"{prof[graphed].get(n, 0) * 1e3:.3f} | | | | |")
    buckets = model._graphed[1].buckets.values()
    print(f"graphs captured: {sum(g is not None for b in buckets for g in b.graphs)} of "
          f"{sum(len(b.graphs) for b in buckets)} segments in {len(buckets)} buckets")
    if a.prepare:
        rows, end = map(int, a.prepare.split(","))
        model._graphed, model.graphs = None, graphed  # a fresh runner: nothing captured yet
        held = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        sync(device)
        t0 = time.perf_counter()
        n, graphs = model.prepare_decode_graphs(model.kv_pool(), rows, end, False)
        sync(device)
        took = time.perf_counter() - t0
        more = (torch.cuda.memory_reserved(device) - held) / 2**20 if device.type == "cuda" else 0.0
        print(f"start-up capture (--max-batch {rows}, --cuda-graphs-capture {end}): {n} buckets, {graphs} graphs in "
              f"{took:.2f} s" + (f" ({took / graphs * 1e3:.2f} ms a graph)" if graphs else "") +
              f"; device memory reserved +{more:.0f} MiB")


if __name__ == "__main__":
    main()
