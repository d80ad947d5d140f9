"""The decode step against its kernels: where a token's time goes when both services share one host,
and how far the step is from the same kernels alone on the same bytes and from DRAM's read bandwidth,
all measured in this run.

    python bench/bench_step.py --synth qwen3-30b-a3b --layers 6 --vocab 32000 --weight-format int4 \\
        --dense-format int4 [--context 256] [--tokens 32] [--rounds 3] [--threads 2]
    python bench/bench_step.py --model DIR --weight-format int8 --dense-format int8

1. Kernels alone, in this process (loaded before the services start, writing the packed-weight cache the
   expert service then starts from), in a token's order: layer by layer every packed dense weight of the
   GPU side (fused q/k/v, o_proj, shared experts, dense MLPs, router) at T=1 -- for MLA also kv_b_proj's two
   absorbed products (its bytes counted with the dense layers') and the latent attention over the decode's mean
   context in a pool layer of its own (compute, no weight bytes; GQA's attention over its cache is left out, as
   the issue's yardstick leaves it) -- then the layer's experts at T=1 with k distinct random experts; then the
   lm_head. The DRAM read probe before and after. Their sum
   is what a token costs at the kernels' own speed; bytes per token / the probe is the roofline. Measured
   before the first decode round and again after each (the services idle meanwhile): this machine's speed
   moves by tens of percent within minutes, so each round is set against the kernels measured beside it.
2. Both services, each on --threads (the CPU-only deployment: they share the cores), decode with
   profile=True. Per decode step: the period (one step's start to the next's: what a token costs), the
   GPU side's spans (embed, attention, router, shared experts, the wait for the experts, lm_head,
   sampling) and the expert side's compute spans. The spans' sum is checked against the period before
   the split is trusted (coverage). Then the same decode unprofiled (a prompt of the same length): its period
   from the client's token stamps, free of what the profile's spans cost the step.
3. Ratios: period / kernels alone (the issue #28 bar: <= 1.15x), the experts' read rate (their bytes a token over
   their compute time) in the service and alone as a fraction of the DRAM probe, the experts' compute in the service /
   the same kernels alone (<= 1.15x), and everything outside the kernels per MoE layer, in microseconds
   (<= 30 us), then split: each GPU-side span less the kernels it runs, and the time between steps that no
   span covers. The kernels alone are the median of all their measurements; "per round" rows set each
   round's median period against the mean of the kernels measured just before and just after it.

One JSON line per figure, then tables; medians over the decode steps of --rounds requests. The services inherit
this process's environment: `MOE_DECODE_STEP=torch` (the torch decode step instead of the native one) and
`MOE_SPIN=...` (the waits' policy) for A/B runs. `--streams 1,2,4,8`: then N requests at once (a few users),
their aggregate decode rate.
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import pathlib
import shutil
import statistics
import tempfile
import time

from common import cpu_name, free_port, start, wait_healthy  # noqa: E402  (the repository on sys.path)
from moe_core.openmp import passive_by_default  # noqa: E402

passive_by_default()  # as in the services: torch's threads do not spin beside the native pool's (the MLA kernels'
                      # inputs are large enough for torch's conversions to go parallel)
import torch  # noqa: E402

from moe_core.checkpoint import Checkpoint  # noqa: E402
from moe_core.config import load_config  # noqa: E402
from moe_core.fingerprint import fingerprint  # noqa: E402
from protos import generate_pb2, generate_pb2_grpc  # noqa: E402

GPU_SPANS = ("embed", "attention", "linear_attention", "dense_mlp", "router", "expert_submit", "shared_experts",
             "expert_wait", "lm_head", "sampling")


class MlaAbsorbed:
    """MLA's kv_b_proj products at one token, as mla_attention's decode runs them: the latent query (W_uk), then the
    heads' output (W_uv) of a latent of the same shape."""

    def __init__(self, cfg, kv_b: torch.Tensor):
        self.kv_b, self.dims = kv_b, (cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim)
        self.K, self.nbytes = cfg.num_heads * cfg.qk_nope_head_dim, kv_b.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from moe_kernels.attention import mla_absorb_o, mla_absorb_q
        nh, dn, dv = self.dims
        return mla_absorb_o(mla_absorb_q(x.view(1, nh, dn), self.kv_b, *self.dims), self.kv_b, *self.dims)


class MlaLatent:
    """One token's latent attention over L positions of an MLA pool layer of its own (consecutive blocks, as a lone
    sequence's), its cache of `dtype`."""

    def __init__(self, cfg, L: int, dtype: torch.dtype, scale: float):
        from gpu_service.engine.kv_pool import BLOCK
        nb = -(-L // BLOCK)
        self.C = torch.randn(nb, BLOCK, cfg.kv_lora_rank).to(dtype)
        self.KPE = torch.randn(nb, BLOCK, cfg.qk_rope_head_dim).to(dtype)
        self.table, self.L, self.scale = torch.arange(nb, dtype=torch.int32), L, scale
        self.nh, self.K = cfg.num_heads, cfg.num_heads * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from moe_kernels.attention import mla_paged_attention
        return mla_paged_attention(x.view(self.nh, -1), self.C, self.KPE, self.table, self.L, self.scale, first=0)


def kernels_alone(model: pathlib.Path, fmt: str, dense: str, threads: int, cache: pathlib.Path, reps: int,
                  positions: int, kv_dtype: str):
    """-> measure(): seconds per token of the kernels at T=1, run as a token runs them: layer by layer the
    attention block's dense kernels (fused q/k/v, o_proj, router, shared experts, dense MLPs) then the layer's
    routed experts (k distinct random ones, new each pass), then the lm_head; each call timed, summed by group
    (experts, blocks, lm_head), medians over the passes. Together their weights are far larger than the caches, so
    each pass reads them from DRAM as a token does (timing one small weight again and again would time the
    last-level cache). Also bytes per token and the DRAM read probe (GB/s, median of probes taken before and
    after). measure() keeps the weights loaded: it runs again between the decode rounds. positions: MLA's latent
    attention's context; kv_dtype: its cache's type (gpu-service --kv-cache-dtype)."""
    from moe_experts.packed_cache import PackedCache, source_stamp
    from moe_experts.store import load_expert_layers
    from gpu_service.model.model import Model
    from moe_kernels import ISA, native
    from moe_kernels.dense import NativeLinear

    native.init_pool(threads)
    torch.set_num_threads(threads)
    cfg, ckpt = load_config(model), Checkpoint(model)
    probe = torch.ones(1 << 28)  # 1 GiB: well past the caches
    bw = []

    def dram() -> None:
        bw.append(native.read_bandwidth(probe.data_ptr(), probe.numel()))

    layers = load_expert_layers(cfg, ckpt, fmt, threads, progress=False,
                                cache=PackedCache(cache, fingerprint(ckpt), source_stamp(ckpt), fmt))
    m = None if dense == "torch" else Model(
        cfg, ckpt, torch.device("cpu"), torch.bfloat16 if cfg.torch_dtype == "bfloat16" else torch.float32,
        dense_format=dense)
    head = m.lm_head if m is not None and isinstance(m.lm_head, NativeLinear) else None
    linears = {} if m is None else {n: w for n, w in m.W.items() if isinstance(w, NativeLinear) and w is not head}
    seq = []  # (group, kernel) in a token's order
    mla = m is not None and cfg.attention == "mla"
    if mla:
        from gpu_service.model.layers import softmax_scale
        from moe_kernels.attention import mla_supported, supports_kv_b
        kv = m.dtype if kv_dtype == "auto" else {"fp32": torch.float32, "bf16": torch.bfloat16,
                                                  "fp16": torch.float16}[kv_dtype]
        scale = softmax_scale(cfg, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    for L in range(cfg.num_layers):
        seq += [("blocks", lin) for n, lin in linears.items() if n.startswith(f"model.layers.{L}.")]
        kv_b = m.W.get(f"model.layers.{L}.self_attn.kv_b_proj.weight") if mla else None
        if kv_b is not None and supports_kv_b(kv_b):  # what the native decode step runs
            latent = MlaLatent(cfg, positions, kv, scale)
            if mla_supported(latent.C, latent.KPE):
                seq += [("blocks", MlaAbsorbed(cfg, kv_b)), ("attention", latent)]
        if L in layers:
            seq.append(("experts", layers[L]))
    seq += [("blocks", lin) for n, lin in linears.items() if not n.startswith("model.layers.")]
    seq += [("lm_head", head)] if head is not None else []
    gen = torch.Generator().manual_seed(0)
    k = cfg.top_k
    xs = {id(op): torch.randn(1, cfg.hidden_size if g == "experts" else op.K, generator=gen).to(torch.bfloat16)
          for g, op in seq}
    w = torch.rand(1, k, generator=gen)

    def one_pass() -> collections.Counter:
        t = collections.Counter()
        for group, op in seq:
            x = xs[id(op)]
            if group == "experts":
                ids = torch.randperm(op.num_experts, generator=gen)[:k].view(1, k).to(torch.int32)  # k distinct
                t0 = time.perf_counter()
                op.forward(x, ids, w)
            else:
                t0 = time.perf_counter()
                op(x)
            t[group] += time.perf_counter() - t0
        return t

    def measure() -> dict:
        bw.clear()
        dram()
        one_pass()  # warm
        passes = [one_pass() for _ in range(reps)]
        dram()
        out = {f"{g}_s": statistics.median(p[g] for p in passes) for g in ("experts", "blocks", "lm_head", "attention")}
        out["dense_s"] = out["blocks_s"] + out["lm_head_s"] + out["attention_s"]
        out["experts_bytes"] = sum(op.weight_bytes_per_expert * k for op in layers.values())
        out["dense_bytes"] = sum(op.nbytes for g, op in seq if g in ("blocks", "lm_head"))
        out["dram_gbps"] = statistics.median(bw) / 1e9  # read_bandwidth gives bytes/s
        out["path"] = ISA
        return out

    return measure  # (it keeps the weights: measured again between the decode rounds)


def decode_profile(port: int, prompt: list[int], tokens: int) -> list[tuple]:
    import grpc
    # the profile's spans (~200 bytes each, ~5 a layer and token: 4.4 MB at 48 layers and 400 tokens) exceed
    # grpc's default 4 MB a message
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 1 << 30)]) as ch:
        req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=tokens,
                                           ignore_eos=True, profile=True,
                                           sampling=generate_pb2.SamplingParams(temperature=0))
        chunks = list(generate_pb2_grpc.GenerateServiceStub(ch).Generate(req, timeout=3600))
    return [(s.name, s.service, s.layer, s.step, s.start_unix_ns, s.end_unix_ns) for s in chunks[-1].profile.spans]


def aggregate_decode(port: int, prompts: list[list[int]], tokens: int) -> float:
    """Requests started together, one stream each: their decode tokens per second together, from the last
    stream's first token (every one decoding by then) to the last token."""
    import threading

    import grpc
    firsts, ends = [], []

    def one(prompt):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=tokens,
                                               ignore_eos=True, sampling=generate_pb2.SamplingParams(temperature=0))
            stamps = []
            for c in generate_pb2_grpc.GenerateServiceStub(ch).Generate(req, timeout=3600):
                stamps += [time.perf_counter()] * len(c.token_ids)
        firsts.append(stamps[0])
        ends.append(stamps)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = max(firsts)
    counts = [sum(1 for x in st if x > start) for st in ends]
    return sum(counts) / (max(st[-1] for st in ends) - start)


def split_outside(period: float, spans: dict, expert_compute: float, k: dict) -> dict:
    """Where the time outside the kernels goes, seconds a token: each GPU-side span less the kernels it runs
    (medians of different steps: the parts need not add up to the whole exactly)."""
    blocks = sum(spans[n] for n in ("attention", "linear_attention", "dense_mlp", "router", "shared_experts"))
    return {"attention blocks and router over their kernels": blocks - k["blocks_s"] - k["attention_s"],
            "lm_head span over its kernel": spans["lm_head"] - k["lm_head_s"],
            "embed, submit, sampling": spans["embed"] + spans["expert_submit"] + spans["sampling"],
            "the wait over the experts' compute": spans["expert_wait"] - expert_compute,
            "between the steps (no span)": period - sum(spans.values())}


def split_steps(spans: list[tuple]) -> list[dict]:
    """Per decode step (the prompt's steps left out): its period, the sum of the GPU side's spans by name,
    the experts' compute and per-layer waits."""
    by_step = collections.defaultdict(list)
    for sp in spans:
        by_step[sp[3]].append(sp)
    steps = sorted(by_step)
    starts = {s: min(sp[4] for sp in by_step[s] if sp[1] == "gpu") for s in steps}
    out = []
    for s, nxt in zip(steps[1:], steps[2:]):  # steps[0] is the prefill; the last has no next start
        gpu = collections.Counter()
        for name, svc, layer, _, t0, t1 in by_step[s]:
            if svc == "gpu":
                gpu[name] += (t1 - t0) / 1e9
        expert = sum((t1 - t0) / 1e9 for name, svc, *_, t0, t1 in by_step[s] if svc.startswith("expert")
                     and name.startswith("experts_"))
        out.append({"period": (starts[nxt] - starts[s]) / 1e9, "gpu": gpu, "expert_compute": expert,
                     "legs": handoff_legs(by_step[s])})
    return out


def handoff_legs(spans: list[tuple]) -> list[tuple[float, float]]:
    """Per MoE layer of one step: (the request's way: the GPU side's submit span ends -> the expert side starts
    computing, the answer's way: it ends -> the GPU side's wait ends), seconds. Both services stamp spans
    with the same wall clock on one host. The answer's way counts only where the GPU side was already
    waiting (its wait began before the compute ended)."""
    by = {(name, layer): (t0, t1) for name, _, layer, _, t0, t1 in spans}
    legs = []
    for (name, layer), (r0, r1) in by.items():
        if name != "expert_submit" or ("experts_immediate", layer) not in by or ("expert_wait", layer) not in by:
            continue
        c0, c1 = by[("experts_immediate", layer)]
        w0, w1 = by[("expert_wait", layer)]
        legs.append(((c0 - r1) / 1e9, (w1 - c1) / 1e9 if w0 < c1 else float("nan")))
    return legs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=pathlib.Path)
    src.add_argument("--synth", help="an architecture of tools/synth_checkpoint.py, written for this run")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=0, help="--synth: vocabulary size (0 = the architecture's)")
    ap.add_argument("--weight-format", default="int4")
    ap.add_argument("--dense-format", default="int4", help="gpu-service --dense-format (torch: no native dense kernels)")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the decode")
    ap.add_argument("--kv-cache-dtype", default="auto", help="gpu-service --kv-cache-dtype")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20, help="timings per kernel (median)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--local", action="store_true",
                    help="gpu-service --experts local: the experts in the GPU side's process (no expert service)")
    ap.add_argument("--work", type=pathlib.Path, help="keep the checkpoint and cache here (default: a temporary folder)")
    ap.add_argument("--streams", default="", help="also: aggregate decode tok/s of N requests at once, N in this "
                                                   "comma list (64-token prompts, --tokens each), medians of --rounds")
    a = ap.parse_args()
    work = a.work or pathlib.Path(tempfile.mkdtemp(prefix="bench-step-"))
    work.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        model = a.model
        if a.synth:
            import synth_checkpoint
            model = work / "model"
            if not (model / "config.json").exists():
                over = {"vocab_size": a.vocab} if a.vocab else {}
                synth_checkpoint.write(synth_checkpoint.config_of(a.synth, a.layers, over), model, std=0.02, seed=0,
                                       shard_mb=4096)
        cfg = load_config(model)
        cache = work / "cache"
        measure = kernels_alone(model, a.weight_format, a.dense_format, a.threads, cache, a.reps,
                                a.context + a.tokens // 2, a.kv_cache_dtype)
        ks = [measure()]
        gc.collect()  # the loading's temporaries, before the services load their weights
        n_moe = len(cfg.moe_layers)
        nbytes = ks[0]["experts_bytes"] + ks[0]["dense_bytes"]
        print(f"CPU: {cpu_name()}; {a.threads} threads per service (shared cores); "
              f"{'experts in the GPU side (--experts local); ' if a.local else ''}"
              f"{model.name if a.model else a.synth} {cfg.num_layers} layers ({n_moe} MoE), vocab {cfg.vocab_size}; "
              f"experts {a.weight_format}, dense {a.dense_format}; context {a.context}; DRAM probe "
              f"{ks[0]['dram_gbps']:.1f} GB/s", flush=True)

        ep, gp = free_port(), free_port()
        env = {"MOE_CACHE_DIR": str(cache)}
        if not a.local:
            procs.append(start("expert_service", "--model", str(model), "--listen", f"127.0.0.1:{ep}", "--threads",
                               str(a.threads), "--weight-format", a.weight_format, log=work / "expert.log", env=env))
        procs.append(start("gpu_service", "--model", str(model), "--experts", "local" if a.local else f"127.0.0.1:{ep}",
                           "--listen", f"127.0.0.1:{gp}", "--threads", str(a.threads), "--device", "cpu",
                           "--dense-format", a.dense_format, "--weight-format", a.weight_format,
                           "--kv-cache-dtype", a.kv_cache_dtype, log=work / "gpu.log", env=env))
        for port, p in zip(([] if a.local else [ep]) + [gp], procs):
            wait_healthy(port, p, timeout=3600)
        prompt = [(i * 7919) % min(4000, cfg.vocab_size - 2) + 2 for i in range(a.context)]
        decode_profile(gp, prompt[:16], 4)  # warm-up
        def total(x: dict) -> float:  # a measurement's kernels alone, seconds a token
            return x["experts_s"] + x["dense_s"]

        steps, rounds = [], []  # rounds: (median period, kernels alone before it and after it, unprofiled period)
        for r in range(a.rounds):
            got = split_steps(decode_profile(gp, prompt, a.tokens))
            steps += got
            # the same decode without the profile (its spans are work a plain step does not do): the client's period
            plain = 1 / aggregate_decode(gp, [prompt[r + 1:] + prompt[:r + 1]], a.tokens)
            ks.append(measure())
            rounds.append((statistics.median(s["period"] for s in got), (total(ks[-2]) + total(ks[-1])) / 2, plain))
        med = lambda xs: statistics.median(xs)  # noqa: E731
        k = {name: med([x[name] for x in ks]) if name.endswith(("_s", "_gbps")) else v for name, v in ks[0].items()}
        alone = total(k)
        roofline = nbytes / (k["dram_gbps"] * 1e9)
        totals = [total(x) for x in ks]
        period = med([s["period"] for s in steps])
        spans = {n: med([s["gpu"].get(n, 0.0) for s in steps]) for n in GPU_SPANS}
        coverage = med([sum(s["gpu"].values()) / s["period"] for s in steps])
        expert_compute = med([s["expert_compute"] for s in steps])
        legs = [leg for s in steps for leg in s["legs"]]
        there = [a for a, _ in legs]
        back = [b for _, b in legs if b == b]  # nan: the GPU side was not waiting yet
        outside = period - alone
        rows = [
            ("decode step (period)", period * 1e3, "ms/token", None),
            ("kernels alone, same bytes", alone * 1e3, "ms/token", period / alone),
            ("DRAM roofline of those bytes", roofline * 1e3, "ms/token", period / roofline),
            ("experts: compute in the service", expert_compute * 1e3, "ms/token", expert_compute / k["experts_s"]),
            ("experts: kernels alone", k["experts_s"] * 1e3, "ms/token", None),
            # the experts' bytes a token over their time: in the service (live) and alone, beside the probe
            ("experts: read rate in the service (live; x: of the probe)", k["experts_bytes"] / expert_compute / 1e9, "GB/s",
             k["experts_bytes"] / expert_compute / 1e9 / k["dram_gbps"]),
            ("experts: read rate alone (x: of the probe)", k["experts_bytes"] / k["experts_s"] / 1e9, "GB/s",
             k["experts_bytes"] / k["experts_s"] / 1e9 / k["dram_gbps"]),
            ("DRAM read probe", k["dram_gbps"], "GB/s", None),
            ("dense + lm_head: kernels alone", k["dense_s"] * 1e3, "ms/token", None),
            *([("of which MLA's latent attention (compute)", k["attention_s"] * 1e3, "ms/token", None)]
              if k["attention_s"] else []),
            ("outside the kernels, per MoE layer", outside / n_moe * 1e6, "us", None),
            ("per round: step over the kernels beside it (median)", med([p / q for p, q, _ in rounds]), "x", None),
            ("per round: outside the kernels, per MoE layer (median)", med([p - q for p, q, _ in rounds]) / n_moe * 1e6,
             "us", None),
            ("per round, unprofiled: step over the kernels beside it (median)", med([u / q for _, q, u in rounds]),
             "x", None),
            ("per round, unprofiled: outside the kernels, per MoE layer (median)",
             med([u - q for _, q, u in rounds]) / n_moe * 1e6, "us", None),
            ("kernels alone, highest of the run over its lowest", max(totals) / min(totals), "x", None),
        ] + [(f"outside the kernels: {n}", v * 1e3, "ms/token", None) for n, v in split_outside(
            period, spans, expert_compute, k).items()] + [
            ("spans' sum / period (coverage)", coverage * 100, "%", None),
        ] + ([
            ("handoff to the experts (submit end -> compute start)", med(there) * 1e6, "us median", None),
            ("handoff back (compute end -> the wait ends)", med(back) * 1e6, "us median", None),
        ] if there and back else []) + [(f"GPU side: {n}", v * 1e3, "ms/token", None) for n, v in spans.items() if v]
        for name, v, unit, ratio in rows:
            print(json.dumps({"case": name, "value": round(v, 3), "unit": unit,
                              **({"ratio": round(ratio, 3)} if ratio else {})}), flush=True)
        print(f"\nbytes per token: {nbytes / 1e6:.1f} MB (experts {k['experts_bytes'] / 1e6:.1f}, dense + lm_head "
              f"{k['dense_bytes'] / 1e6:.1f}); {len(steps)} decode steps\n")
        print("| figure | value | unit | step / it |\n|---|---|---|---|")
        for name, v, unit, ratio in rows:
            print(f"| {name} | {v:.3f} | {unit} | {f'{ratio:.2f}x' if ratio else ''} |")
        if a.streams:
            rates = {}
            for n in map(int, a.streams.split(",")):
                prompts = [[(i * 7919 + 104729 * j) % min(4000, cfg.vocab_size - 2) + 2 for i in range(64)]
                           for j in range(n)]
                rates[n] = med([aggregate_decode(gp, prompts, a.tokens) for _ in range(a.rounds)])
                print(json.dumps({"case": f"{n} streams: aggregate decode", "value": round(rates[n], 2),
                                  "unit": "tok/s", "ratio": round(rates[n] / next(iter(rates.values())), 3)}),
                      flush=True)
            print("\n| streams | aggregate decode tok/s | vs the first |\n|---|---|---|")
            first = next(iter(rates.values()))
            for n, r in rates.items():
                print(f"| {n} | {r:.1f} | {r / first:.2f}x |")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except Exception:
                p.kill()
        if not a.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
