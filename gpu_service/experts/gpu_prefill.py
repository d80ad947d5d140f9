"""Prefill on the GPU side (gpu-service --gpu-prefill-tokens T): a step of at least T tokens (a long prompt's
chunk) computes every routed expert here instead of on the expert service; smaller steps (decode) go on as
before. The Experts protocol (experts.py), around the one that serves decode.

The weights come from the expert service's packed-weight cache on the same host (expert_service/
packed_cache.py), mapped read-only: the page cache holds one copy for both processes. On CUDA each layer's
experts are copied to the device a chunk of experts at a time, unpacked there to bf16 (packing.unpack: the
expert service's numbers, rounded once) and multiplied by torch; on the CPU the mapped layer runs on the
expert service's own kernels in this process (how CPU-only machines test the option; it saves the exchange,
not compute).
"""
from __future__ import annotations

import logging
import time

import torch

from moe_experts.kernels.native_moe import NativeMoELayer
from moe_experts.kernels.torch_moe import TorchMoELayer
from moe_core.gguf_model import layer_formats
from moe_core.routing import split_deferred

from gpu_service import metrics
from moe_exchange.protocol import Experts, PartTiming, ShardWait, Span
from moe_kernels.packing import unpack
from moe_experts import packed_cache
from moe_experts.loading import open_cache
from moe_experts.store import expert_biases

log = logging.getLogger("gpu_service.experts.gpu_prefill")

CHUNK_EXPERTS = 8  # experts copied and unpacked at once on CUDA: bounds the device memory to 8 experts in bf16


class MappedLayer:
    """One MoE layer's packed experts as views of the mapped cache file, and how to compute with them."""

    def __init__(self, op: NativeMoELayer, device: torch.device, streamed: bool | None = None):
        self.op, self.device = op, device
        self.streamed = device.type != "cpu" if streamed is None else streamed

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """-> [T, H] fp32 on the device: the pairs (ids -1: none) weighted and summed."""
        if not self.streamed:
            return self.op.forward(x.float().cpu(), ids.cpu(), w.cpu()).to(self.device)

        op, dev = self.op, self.device
        E, I, H = op.num_experts, op.intermediate, op.hidden
        x, ids, w = x.to(dev).float(), ids.to(dev).long(), w.to(dev)
        out = torch.zeros(x.shape[0], H, dtype=torch.float32, device=dev)
        used = torch.zeros(E + 1, dtype=torch.bool, device=dev)
        used[ids.reshape(-1)] = True  # (index -1 marks the extra slot)
        used = used[:E].cpu()
        for e0 in range(0, E, CHUNK_EXPERTS):
            e1 = min(E, e0 + CHUNK_EXPERTS)
            if not bool(used[e0:e1].any()):
                continue
            gu = unpack(tuple(None if p is None else p[e0:e1].to(dev) for p in op.gu), op.fmt, H)
            dn = unpack(tuple(None if p is None else p[e0:e1].to(dev) for p in op.dn), op.down_fmt, I)
            chunk = TorchMoELayer.from_packed(gu.to(torch.bfloat16), dn.to(torch.bfloat16), "bf16")
            if op.biases != (None, None):
                chunk.set_extras(op.act, *(None if b is None else b[e0:e1].to(dev) for b in op.biases))
            elif op.act.kind != "silu":
                chunk.set_extras(op.act)
            local = torch.where((ids >= e0) & (ids < e1), ids - e0, -1)
            out += chunk.forward(x, local, w)
        return out


class PrefillExperts:
    def __init__(self, inner: Experts, layers: dict[int, MappedLayer], threshold: int, device: torch.device):
        self.inner, self.layers, self.threshold, self.device = inner, layers, threshold, device
        self.local: dict[int, list] = {}  # layer -> [immediate, deferred] computed here
        self.spans: list[Span] = []

    def submit(self, step, layer, x, ids, w, defer):
        if x.shape[0] < self.threshold:
            return self.inner.submit(step, layer, x, ids, w, defer)
        t0, op = time.time_ns(), self.layers[layer]
        if defer:
            i_ids, i_w, d_ids, d_w = split_deferred(ids, w, defer)
            self.local[layer] = [op.forward(x, i_ids, i_w), op.forward(x, d_ids, d_w)]
        else:
            self.local[layer] = [op.forward(x, ids, w), None]
        self.spans.append(Span("prefill_experts", "gpu", layer, step, t0, time.time_ns()))
        metrics.PREFILL_EXPERT_TOKENS.inc(x.shape[0])

    def decode_layers(self, run, step, times, T, H, dtype, k) -> bool:
        inner = getattr(self.inner, "decode_layers", None)  # decode steps are short: the inner experts' own
        return T < self.threshold and inner is not None and inner(run, step, times, T, H, dtype, k)

    def result(self, layer, deferred):
        got = self.local.get(layer)
        if got is None:
            return self.inner.result(layer, deferred)
        y = got[1 if deferred else 0]
        if deferred or got[1] is None:
            del self.local[layer]
        return y

    def drain_timings(self) -> list[PartTiming]:
        return self.inner.drain_timings()

    def drain_waits(self) -> list[ShardWait]:
        return self.inner.drain_waits()

    def drain_spans(self) -> list[Span]:
        out, self.spans = self.spans, []
        return out + self.inner.drain_spans()

    def start_transport(self) -> str:
        return self.inner.start_transport()

    def reset(self):
        self.local.clear()
        self.spans.clear()
        self.inner.reset()

    def close(self):
        self.inner.close()


# -- gpu-service's options --------------------------------------------------------------------------------
def add_args(ap) -> None:
    ap.add_argument("--gpu-prefill-tokens", type=int, default=0,
                    help="steps of at least this many tokens (long prompts' chunks) compute the routed experts on this "
                         "side's device from the expert service's packed-weight cache on this host (mapped, not "
                         "copied); 0 = off (the expert service computes every step)")
    ap.add_argument("--gpu-prefill-cache-dir", default=None,
                    help="the expert service's --cache-dir (default: the same default, $MOE_CACHE_DIR/packed)")


def check_args(args, targets: list[str]) -> str | None:
    if args.gpu_prefill_tokens < 0:
        return f"--gpu-prefill-tokens must be >= 0, got {args.gpu_prefill_tokens}"
    if args.gpu_prefill_tokens and targets == ["local"]:
        return "--gpu-prefill-tokens: --experts local computes every routed expert in this process already"
    if args.gpu_prefill_tokens and len(targets) > 1:
        return "--gpu-prefill-tokens works with one expert service (its packed-weight cache), not shards"
    return None


def from_args(args, inner: Experts, cfg, ckpt, fp: str, fmt: str, device: torch.device) -> Experts:
    """`inner` itself when off; else PrefillExperts over every MoE layer of the expert service's packed cache.
    ValueError (the message for serving.fail) when that cache is not there."""
    if not args.gpu_prefill_tokens:
        return inner

    where = args.gpu_prefill_cache_dir or str(packed_cache.default_dir())
    cache = open_cache(where, ckpt, fp, fmt)
    if cache is None:
        raise ValueError(f"--gpu-prefill-tokens: the expert service's weight format {fmt} has no packed-weight cache "
                         "(native formats only)")
    layers = {}
    for L in cfg.moe_layers:
        op = cache.map_layer(L, cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size, args.threads,
                             layer_formats(cfg, ckpt, L, fmt))
        if op is None:
            raise ValueError(f"--gpu-prefill-tokens: no packed-weight cache of MoE layer {L} for this model in "
                             f"{cache.dir}: run it on the expert service's host, with its --cache-dir "
                             "(--gpu-prefill-cache-dir)")
        if cfg.expert_bias or cfg.expert_act.kind != "silu":
            op.set_extras(cfg.expert_act, *expert_biases(cfg, ckpt, L, range(cfg.n_routed_experts)))
        layers[L] = MappedLayer(op, device)
    log.info("prefill of steps >= %d tokens on %s, from %d mapped layers of %s", args.gpu_prefill_tokens, device,
             len(layers), cache.dir)
    return PrefillExperts(inner, layers, args.gpu_prefill_tokens, device)
