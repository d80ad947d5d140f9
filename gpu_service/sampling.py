"""Token sampling from one row of logits: greedy, temperature, top-k, top-p, seeded per request
(a per-request torch.Generator on the CPU, so results do not depend on batching or device).
Temperatures below SAMPLING_EPS are greedy (as in vLLM): dividing by them overflows the logits."""
from __future__ import annotations

import dataclasses

import torch

SAMPLING_EPS = 1e-5


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """logits [V] fp32 (any device) -> token id."""
    if p.greedy:
        return int(torch.argmax(logits))
    logits = logits.float().cpu() / p.temperature
    if 0 < p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen))
