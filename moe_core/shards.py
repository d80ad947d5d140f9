"""How a model's routed experts are split over several expert services (shards), in one place.

Expert e of every MoE layer lives on shard e % N, as that shard's local expert e // N. Round robin
rather than contiguous ranges: a token's top-k experts then spread over all shards, so each layer's
work is split about evenly per token and a step waits for k/N experts per shard, where contiguous
ranges put whole expert groups (DeepSeek-V3 routes into 4 of 8 contiguous groups) on one shard
(bench/bench_shards.py measures both splits' balance on a real router)."""
from __future__ import annotations

import dataclasses
import re

import torch


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not (self.count >= 1 and 0 <= self.index < self.count):
            raise ValueError(f"shard {self.index}/{self.count}: needs 0 <= index < count")

    @classmethod
    def parse(cls, text: str) -> "Shard":
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not m:
            raise ValueError(f"shard {text!r}: expected INDEX/COUNT, e.g. 0/2")
        return cls(int(m[1]), int(m[2]))

    def experts(self, n_experts: int) -> range:
        """The global ids of the experts this shard holds, in local order."""
        return range(self.index, n_experts, self.count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def owner_and_local(ids: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert ids -> (the shard holding each, its id there)."""
    return ids % count, ids // count


def check_coverage(shards: dict[str, Shard]) -> None:
    """target -> the shard it serves: together every index 0..N-1 exactly once, for one N. ValueError
    naming the target that breaks it (another count, an index served twice) or the index nobody serves."""
    counts = {s.count for s in shards.values()}
    if len(counts) != 1:
        first = next(iter(shards.items()))
        odd = next(t for t, s in shards.items() if s.count != first[1].count)
        raise ValueError(f"expert service at {odd} serves shard {shards[odd]}, but {first[0]} serves shard "
                         f"{first[1]}: every shard must split the experts the same way (one --shard I/N count)")
    n = counts.pop()
    seen: dict[int, str] = {}
    for target, s in shards.items():
        if s.index in seen:
            raise ValueError(f"expert services at {seen[s.index]} and {target} both serve shard {s}")
        seen[s.index] = target
    missing = sorted(set(range(n)) - set(seen))
    if missing:
        raise ValueError(f"no expert service serves shard{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(f'{i}/{n}' for i in missing)} (connected: "
                         f"{', '.join(f'{t} = {s}' for t, s in shards.items())})")
