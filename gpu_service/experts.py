"""The routed experts as the GPU side's layers see them: one protocol, whatever runs them.

    Experts (this protocol)
      ├─ LocalExperts      (here)               in this process: tests, tools, `gpu-service --experts local`
      ├─ RemoteExperts     (dispatch.py)        one expert service: a gRPC Exchange stream, and a shared-memory
      │                                         ring (shm_channel.py) when both run on one host
      ├─ ShardedExperts    (sharded_experts.py) several expert services, one per shard
      ├─ HotExperts        (hot_experts.py)     around one of the two above: each layer's most-used experts
      │                                         computed here (gpu-service --gpu-experts)
      └─ PrefillExperts    (prefill_experts.py) around any of them: long steps' experts computed here from the
                                                expert service's mapped packed cache (--gpu-prefill-tokens)

submit() returns at once; result() blocks for the next result, which must be the one asked for (results
come back in request order: a layer's IMMEDIATE part, then its DEFERRED one). What they measured comes
back as typed records, which the engine turns into the request's profile (Span).
"""
from __future__ import annotations

import collections
from typing import NamedTuple, Protocol

import torch

from moe_core.routing import split_deferred
from moe_core.wire import Timing


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

    # Optional: experts that can run a decode step's layers in one native call (decode_loop.py) offer
    # decode_layers(run, step, times, T, H, dtype, k) -> bool (False: not this step; the layer loop runs it).


class LocalExperts:
    """The experts' operators in this process, called in submit(): results are ready at once."""

    def __init__(self, layers: dict):
        self.layers = layers
        self.out: collections.deque = collections.deque()
        self._native = None  # the decode loop's native.LocalExperts, False when a layer has no native kernels

    def submit(self, step, layer, x, ids, w, defer):
        op = self.layers[layer]
        x, ids, w = x.cpu(), ids.cpu(), w.cpu()
        if defer == 0:
            self.out.append((layer, False, op.forward(x, ids, w)))
            return
        i_ids, i_w, d_ids, d_w = split_deferred(ids, w, defer)
        self.out.append((layer, False, op.forward(x, i_ids, i_w)))
        self.out.append((layer, True, op.forward(x, d_ids, d_w)))

    def decode_layers(self, run, step, times, T, H, dtype, k) -> bool:
        """The decode loop's experts here: every layer's native kernels (bf16 or fp32 rows in and out, as the
        expert service's ring computes them)."""
        if self._native is None:
            ops = [self.layers.get(L) for L in range(times.shape[0])]  # None: a dense layer
            if all(op is None or hasattr(op, "native") for op in ops):
                from moe_kernels import native
                self._native = native.LocalExperts([op and op.native for op in ops], owner=ops)
            else:
                self._native = False
        if not self._native:
            return False
        _, status, msg = run(self._native, 0, False)
        if status:  # the kernels' check of their inputs (non-finite hidden rows)
            raise ValueError(msg.decode(errors="replace"))
        return True

    def result(self, layer, deferred):
        got = self.out.popleft()
        assert got[:2] == (layer, deferred), f"out of order: wanted {(layer, deferred)}, got {got[:2]}"
        return got[2]

    def drain_timings(self) -> list[PartTiming]:
        return []

    def drain_waits(self) -> list[ShardWait]:
        return []

    def drain_spans(self) -> list[Span]:
        return []

    def reset(self):
        self.out.clear()

    def close(self):
        self.out.clear()
