"""The routed experts as the GPU side's layers see them: one protocol (Experts), whatever runs them, and the
records of what they measured.

    Experts (this protocol)
      ├─ LocalExperts      (gpu_service/experts/local.py)       in this process: tests, tools, `--experts local`
      ├─ RemoteExperts     (moe_exchange/dispatch.py)           one expert service: a gRPC Exchange stream, and a
      │                                                         shared-memory ring (channel.py) on one host
      ├─ ShardedExperts    (gpu_service/experts/sharded.py)     several expert services, one per shard
      ├─ HotExperts        (gpu_service/experts/hot.py)         around one of the two above: each layer's most-used
      │                                                         experts computed here (gpu-service --gpu-experts)
      └─ PrefillExperts    (gpu_service/experts/gpu_prefill.py) around any of them: long steps' experts computed here
                                                                from the expert service's mapped packed cache

submit() returns at once; result() blocks for the next result, which must be the one asked for (results
come back in request order: a layer's IMMEDIATE part, then its DEFERRED one). What they measured comes
back as typed records, which the engine turns into the request's profile (Span).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from moe_exchange.wire import Timing


class Span(NamedTuple):
    """One timed piece of a step, for the profile (GenerateChunk.profile) and the metrics."""
    name: str      # "attention", "router", "expert_wait", "experts_immediate", "sampling", ...
    service: str   # "gpu", "expert", or "expert-I" (shard I)
    layer: int     # -1: not a layer's
    step: int
    start_ns: int  # unix ns, one clock on both services (the same host, or NTP between hosts)
    end_ns: int


class PartTiming(NamedTuple):
    """What an expert service reported of one part it computed."""
    layer: int
    deferred: bool
    timing: Timing
    shard: int | None = None  # sharded: which shard


class ShardWait(NamedTuple):
    """How long result() blocked on one shard (sharded only): the slowest shard shows the layer's wait."""
    layer: int
    shard: int
    start_ns: int
    end_ns: int


class Experts(Protocol):
    def submit(self, step: int, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
               defer: int) -> None:
        """Hand over layer `layer`'s routed experts: hidden x [T, H], ids/weights [T, k]; the `defer`
        lowest-weighted of each token come back as a separate DEFERRED result."""

    def result(self, layer: int, deferred: bool) -> torch.Tensor:
        """The next result ([T, H]), which must be (layer, deferred); raises ExpertServiceError."""

    def drain_timings(self) -> list[PartTiming]:
        """What the expert side measured since the last call."""

    def drain_waits(self) -> list[ShardWait]:
        """The blocking waits on each shard since the last call (empty unless sharded)."""

    def drain_spans(self) -> list[Span]:
        """Expert compute done in this process since the last call, for the profile (hot experts)."""

    def reset(self) -> None:
        """Forget what is in flight (after an error): the next submit starts afresh."""

    def close(self) -> None: ...

    # Optional: experts that can run a decode step's layers in one native call (native_loop.py) offer
    # decode_layers(run, step, times, T, H, dtype, k) -> bool (False: not this step; the layer loop runs it).
