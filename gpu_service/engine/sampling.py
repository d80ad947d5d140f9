"""Token sampling from one row of logits: penalties, greedy, temperature, min-p, top-k, top-p, seeded
per request (a per-request torch.Generator on the CPU, so results do not depend on batching or
device). Temperatures below SAMPLING_EPS are greedy (as in vLLM): dividing by them overflows the
logits. The order is vLLM's: penalties, then temperature, min-p, top-k, top-p."""
from __future__ import annotations

import dataclasses

import torch

SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs limit)


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0     # OpenAI's, on generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0   # transformers' / vLLM's, on prompt and generated tokens
    seed: int | None = None
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to these ids' logits before sampling

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def penalize(logits: torch.Tensor, p: SamplingParams, prompt_ids, output_ids) -> torch.Tensor:
    """logits [V] -> a penalized fp32 copy on the CPU. Repetition: every id seen in the prompt or the
    output, divided by the penalty where positive, multiplied where not (transformers' rule); then
    OpenAI's presence and frequency penalties over the output's ids; last the logit bias (OpenAI's order: a bias of
    -100 bans a token, +100 all but forces it)."""
    logits = logits.float().cpu().clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if seen.numel():
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(output_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
    return logits


def warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] -> fp32 CPU logits to sample from: divided by the temperature, then -inf outside
    min-p, top-k and top-p (in that order)."""
    logits = logits.float().cpu() / p.temperature
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < logits.shape[0]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return logits


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None,
           prompt_ids=(), output_ids=()) -> int:
    """logits [V] fp32 (any device) -> token id; prompt_ids / output_ids: what the penalties look at."""
    if p.penalized:
        logits = penalize(logits, p, prompt_ids, output_ids)
    if p.greedy:
        return argmax(logits)
    return int(torch.multinomial(warp(logits, p).softmax(-1), 1, generator=gen))


def argmax(logits: torch.Tensor) -> int:
    """torch.argmax of a row (the first of equal maxima; a NaN wins): on the CPU numpy's, which takes ~10 us a
    32000-id row where torch's reduction takes ~100 (once a token, on the decode step's critical path)."""
    if logits.device.type == "cpu" and logits.dim() == 1 and logits.dtype in (torch.float32, torch.float64):
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


def token_logprobs(logits: torch.Tensor, tok: int, top: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(tok, log p(tok), the `top` most likely (id, log p)) under the model's own distribution: the
    raw logits, before penalties and temperature (vLLM's default, raw_logprobs)."""
    lp = torch.log_softmax(logits.float(), -1)
    alts = []
    if top:
        v, i = torch.topk(lp, top)
        alts = list(zip(i.tolist(), v.tolist()))
    return tok, float(lp[tok]), alts
