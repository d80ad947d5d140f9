"""Routed experts over several expert services, one per shard (moe_core.shards: expert e on shard
e % N). The Experts protocol (experts.py), as one RemoteExperts (dispatch.py) keeps it: per MoE layer, submit() sends each shard
only the tokens with at least one of its experts, their other pairs as id -1, all shards at once;
result() sums the shards' partial results in shard order.

Deferral across shards: each token's pairs are put in descending weight order (ties: slot order)
before the split, so the `defer` last columns are the globally lowest-weighted pairs on every shard,
and each shard's own split (the same rule) defers exactly those. Without deferral the slots keep the
router's order, as one expert service gets them.
"""
from __future__ import annotations

import time

import torch

from moe_core.shards import owner_and_local

from moe_exchange.dispatch import ExpertServiceError, RemoteExperts
from moe_exchange.protocol import PartTiming, ShardWait


class ShardedExperts:
    def __init__(self, shards: list[RemoteExperts]):
        """shards[i] serves shard i of len(shards)."""
        self.shards = shards
        # layer -> (per shard: True (every row), the rows sent, or None (not asked); [T, H]; dtype; parts left)
        self.sent: dict[int, tuple] = {}
        self.waits: list[ShardWait] = []  # how long result() blocked on each shard

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
        n, T = len(self.shards), x.shape[0]
        if defer:  # the deferral split takes each shard's last columns: order them by weight first
            order = torch.argsort(w, dim=1, descending=True, stable=True)
            ids, w = ids.gather(1, order), w.gather(1, order)
        owner, local = owner_and_local(ids, n)
        # every shard's view in a few whole-tensor ops (a decode step pays per op, not per element)
        mine = owner.unsqueeze(0) == torch.arange(n, device=ids.device).view(n, 1, 1)  # [n, T, k]
        lids = torch.where(mine, local.to(torch.int32), -1)  # other shards' pairs: -1, no expert
        asked = mine.any(dim=2)  # [n, T]: rows with at least one of the shard's experts
        counts = asked.sum(dim=1).tolist()
        sent = []
        for i, shard in enumerate(self.shards):
            if counts[i] == 0:  # none of this layer's pairs: the shard is not asked
                sent.append(None)
            elif counts[i] == T:
                shard.submit(step, layer, x, lids[i], w, defer)
                sent.append(True)
            else:
                rows = asked[i].nonzero()[:, 0]
                shard.submit(step, layer, x[rows], lids[i][rows], w[rows], defer)
                sent.append(rows.cpu())
        self.sent[layer] = (sent, (x.shape[0], x.shape[1]), x.dtype, 2 if defer else 1)

    def _result(self, layer, deferred):
        sent, shape, dtype, left = self.sent[layer]
        y = None
        for i, (shard, rows) in enumerate(zip(self.shards, sent)):
            if rows is None:
                continue
            t0 = time.time_ns()
            part = shard.result(layer, deferred)
            self.waits.append(ShardWait(layer, i, t0, time.time_ns()))
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

    def drain_timings(self) -> list[PartTiming]:
        return [t._replace(shard=i) for i, s in enumerate(self.shards) for t in s.drain_timings()]

    def drain_waits(self) -> list[ShardWait]:
        """A shard whose answer was already in costs ~0, the slowest one shows the layer's wait."""
        out, self.waits = self.waits, []
        return out

    def drain_spans(self):
        return []

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
