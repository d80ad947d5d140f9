"""Sampling settings against transformers' own logits processors (a reference nobody here wrote), and
OpenAI's presence/frequency penalties against their documented formula."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from gpu_service.engine.sampling import SamplingParams, penalize, sample, token_logprobs, warp

V = 1000


def logits(seed: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("rp", [0.7, 1.3, 2.0])
def test_repetition_penalty_is_transformers(rp):
    x, prompt, out = logits(0), [3, 5, 5, 900], [5, 17, 42, 17]
    got = penalize(x, SamplingParams(repetition_penalty=rp), prompt, out)
    want = RepetitionPenaltyLogitsProcessor(rp)(torch.tensor([prompt + out]), x[None].clone())[0]
    assert torch.allclose(got, want)


def test_presence_and_frequency_penalties_follow_openai():
    x, out = logits(1), [7, 7, 7, 9]
    got = penalize(x, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [7, 8], out)
    want = x.clone()
    want[7] -= 3 * 0.25 + 0.5  # logit - count x frequency - [count > 0] x presence, generated tokens only
    want[9] -= 1 * 0.25 + 0.5
    assert torch.allclose(got, want)


@pytest.mark.parametrize("temperature,min_p,top_k,top_p", [(0.7, 0.0, 0, 0.9), (1.3, 0.05, 0, 1.0),
                                                            (1.0, 0.0, 50, 1.0), (0.9, 0.02, 40, 0.8)])
def test_warpers_are_transformers(temperature, min_p, top_k, top_p):
    for seed in range(5):
        x = logits(seed)
        got = warp(x, SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p))
        want = TemperatureLogitsWarper(temperature)(None, x[None].clone())
        if min_p:
            want = MinPLogitsWarper(min_p)(None, want)
        if top_k:
            want = TopKLogitsWarper(top_k)(None, want)
        if top_p < 1:
            want = TopPLogitsWarper(top_p)(None, want)
        want = want[0]
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        kept = ~torch.isinf(want)
        assert torch.allclose(got[kept], want[kept])


def test_penalties_change_greedy_choices_and_seeds_repeat():
    x = logits(2)
    best = int(x.argmax())
    assert sample(x, SamplingParams(temperature=0), None) == best
    assert sample(x, SamplingParams(temperature=0, frequency_penalty=2.0), None, [], [best] * 10) != best
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    assert [sample(x, p, p.generator()) for _ in range(3)] == [sample(x, p, p.generator())] * 3


def test_token_logprobs_are_the_raw_distribution():
    x = logits(3)
    tok, lp, top = token_logprobs(x, 11, 4)
    ref = torch.log_softmax(x.double(), -1)
    assert tok == 11 and lp == pytest.approx(float(ref[11]), abs=1e-5)
    assert [i for i, _ in top] == ref.topk(4).indices.tolist()
    assert [v for _, v in top] == pytest.approx(ref.topk(4).values.tolist(), abs=1e-5)


def test_greedy_choice_is_torch_argmax_with_ties_nans_and_infinities():
    """The CPU greedy path (numpy's argmax) picks what torch.argmax picks: the first of equal maxima, a NaN over
    everything, -inf rows (a constraint masking all but one id), rows of a batch (views)."""
    from gpu_service.engine.sampling import argmax
    g = torch.Generator().manual_seed(0)
    rows = [logits(s) for s in range(20)]
    x = torch.full((V,), float("-inf"))
    x[[3, 700]] = 1.5  # a tie: the first wins
    rows.append(x)
    y = logits(1)
    y[[5, 9]] = float("nan")
    rows.append(y)
    z = torch.full((V,), float("-inf"))
    z[998] = float("inf")
    rows.append(z)
    rows.append(torch.randint(-3, 3, (V,), generator=g).float())  # many ties
    batch = torch.stack(rows)
    for i, r in enumerate(rows):
        assert argmax(r) == int(torch.argmax(r)) == argmax(batch[i]), i
    assert argmax(x) == 3 and argmax(y) == 5 and argmax(z) == 998
    assert sample(batch[20], SamplingParams(temperature=0), None) == 3


def test_logit_bias_is_added_after_the_penalties():
    """OpenAI's logit_bias on the logits before sampling: +100 makes an id the greedy choice, -100 bans one; it comes
    after the penalties, so a penalized token can still be forced."""
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0])
    assert sample(logits, SamplingParams(temperature=0, logit_bias={2: 100.0}), None) == 2
    assert sample(logits, SamplingParams(temperature=0, logit_bias={1: -100.0}), None) == 3
    p = SamplingParams(temperature=0, presence_penalty=2.0, logit_bias={2: 10.0})
    assert sample(logits, p, None, prompt_ids=[], output_ids=[2, 2]) == 2
    g = torch.Generator().manual_seed(0)
    assert all(sample(logits, SamplingParams(temperature=1.0, logit_bias={0: 100.0}), g) == 0 for _ in range(20))
