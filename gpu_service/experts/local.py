"""Experts computed in this process (tests, tools, `gpu-service --experts local`): the Experts protocol
(moe_exchange/protocol.py) over expert layers loaded here."""
from __future__ import annotations

import collections

from moe_core.routing import split_deferred
from moe_exchange.protocol import PartTiming, ShardWait, Span
from moe_kernels import native

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
