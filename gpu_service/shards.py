"""Routed experts over several expert services, one per shard (moe_core.shards: expert e on shard
e % N). The same contract as one RemoteExperts (dispatch.py): per MoE layer, submit() sends each shard
only the tokens with at least one of its experts, their other pairs as id -1, all shards at once;
result() sums the shards' partial results in shard order.

Deferral across shards: each token's pairs are put in descending weight order (ties: slot order)
before the split, so the `defer` last columns are the globally lowest-weighted pairs on every shard,
and each shard's own split (the same rule) defers exactly those.
"""
from __future__ import annotations

import time

import torch

from moe_core.shards import owner_and_local

from .dispatch import ExpertServiceError, RemoteExperts


class ShardedExperts:
    def __init__(self, shards: list[RemoteExperts]):
        """shards[i] serves shard i of len(shards)."""
        self.shards = shards
        # layer -> (per shard: True (every row), the rows sent, or None (not asked); [T, H]; dtype; parts left)
        self.sent: dict[int, tuple] = {}
        self.waits: list = []  # (layer, shard, start ns, end ns): how long result() blocked on each shard

    def submit(self, step, layer, x, ids, w, defer):
        try:
            self._submit(step, layer, x, ids, w, defer)
        except ExpertServiceError:
            self.reset()  # the other shards' streams hold answers nobody will read: start all afresh
            raise

    def result(self, layer, deferred):
        try:
            return self._result(layer, deferred)
        except ExpertServiceError:
            self.reset()
            raise

    def _submit(self, step, layer, x, ids, w, defer):
        n = len(self.shards)
        order = torch.argsort(w, dim=1, descending=True, stable=True)
        ids, w = ids.gather(1, order), w.gather(1, order)
        owner, local = owner_and_local(ids, n)
        sent = []
        for i, shard in enumerate(self.shards):
            mine = owner == i
            rows = mine.any(dim=1).nonzero()[:, 0]
            if rows.numel() == 0:  # none of this layer's pairs: the shard is not asked
                sent.append(None)
                continue
            whole = rows.numel() == x.shape[0]
            lid = torch.where(mine, local, torch.full_like(local, -1)).to(torch.int32)
            shard.submit(step, layer, x if whole else x[rows], lid if whole else lid[rows], w if whole else w[rows],
                         defer)
            sent.append(True if whole else rows.cpu())
        self.sent[layer] = (sent, (x.shape[0], x.shape[1]), x.dtype, 2 if defer else 1)

    def _result(self, layer, deferred):
        sent, shape, dtype, left = self.sent[layer]
        y = None
        for i, (shard, rows) in enumerate(zip(self.shards, sent)):
            if rows is None:
                continue
            t0 = time.time_ns()
            part = shard.result(layer, deferred)
            self.waits.append((layer, i, t0, time.time_ns()))
            # summed in fp32, then rounded once to the hidden dtype (bf16 parts were each rounded by their
            # shard already), into a tensor of our own (a part may view a buffer its transport reuses)
            if rows is True:
                y = part.to(torch.float32, copy=True) if y is None else y.add_(part)
            else:
                if y is None:
                    y = torch.zeros(shape, dtype=torch.float32, device=part.device)
                y.index_add_(0, rows.to(part.device), part.float())
        if left == 1:
            del self.sent[layer]
        else:
            self.sent[layer] = (sent, shape, dtype, left - 1)
        return y.to(dtype) if y is not None else torch.zeros(shape, dtype=dtype)

    def drain_timings(self) -> list:
        """(layer, deferred, timing, shard index) of every shard since the last drain."""
        return [(*t, i) for i, s in enumerate(self.shards) for t in s.drain_timings()]

    def drain_waits(self) -> list:
        """(layer, shard index, start ns, end ns) of each blocking result() since the last drain: a shard
        whose answer was already in costs ~0, the slowest one shows the layer's wait."""
        out, self.waits = self.waits, []
        return out

    def start_transport(self) -> str:
        return ",".join(s.start_transport() for s in self.shards)

    def reset(self):
        self.sent.clear()
        self.waits.clear()
        for s in self.shards:
            s.reset()

    def close(self):
        for s in self.shards:
            s.close()
