"""Qwen3-Next's gated DeltaNet layers and their per-sequence state: the chunked form against the plain
one-token recurrence, and the state carried by chunked prefill, continuous batching and a retried
step (in process, against transformers on the same weights)."""
from __future__ import annotations

import grpc
import pytest
import torch
import transformers

from gpu_service.model.linear_attention import CHUNK, delta_rule
from harness import local_engine


def reference_rule(q, k, v, g, beta, S):
    """The delta rule one token at a time, as written in the papers: S <- exp(g) S;
    S <- S + k (beta (v - k^T S))^T; o = q^T S, with q, k l2-normalised and q scaled by 1/sqrt(dk)."""
    t, nk, dk = k.shape
    r = v.shape[1] // nk
    q = torch.nn.functional.normalize(q.double(), dim=-1, eps=1e-3).repeat_interleave(r, 1) * dk ** -0.5
    k = torch.nn.functional.normalize(k.double(), dim=-1, eps=1e-3).repeat_interleave(r, 1)
    S, out = S.double(), []
    for i in range(t):
        S = S * g[i].double().exp()[:, None, None]
        kS = torch.einsum("hk,hkv->hv", k[i], S)
        S = S + k[i][:, :, None] * ((v[i].double() - kS) * beta[i].double()[:, None])[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[i], S))
    return torch.stack(out), S


def inputs(t, nk=2, nv=4, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, nk, dk, generator=gen), torch.randn(t, nk, dk, generator=gen)
    v = torch.randn(t, nv, dv, generator=gen)
    g = -torch.rand(t, nv, generator=gen) * 2      # log decay: exp(g) in (0.13, 1]
    beta = torch.rand(t, nv, generator=gen)
    S = torch.randn(nv, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, S


@pytest.mark.parametrize("t", [1, 5, CHUNK, CHUNK + 1, 3 * CHUNK - 7])
def test_chunked_form_equals_the_recurrence(t):
    q, k, v, g, beta, S = inputs(t)
    o, S1 = delta_rule(q, k, v, g, beta, S)
    want_o, want_S = reference_rule(q, k, v, g, beta, S)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S1.double(), want_S, rtol=1e-4, atol=1e-4)


def test_state_carries_across_any_split():
    """Prefill in pieces (chunked prefill, then decode tokens) ends where one pass ends."""
    q, k, v, g, beta, S = inputs(150, seed=1)
    whole_o, whole_S = delta_rule(q, k, v, g, beta, S)
    outs = []
    for a, b in [(0, 37), (37, 38), (38, 130), (130, 131), (131, 150)]:
        o, S = delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], S)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs), whole_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S, whole_S, rtol=1e-4, atol=1e-4)


# -- the engine, in process ------------------------------------------------------------------------
def make_engine(d, **kw):
    return local_engine(d, **kw)


def run(engine, prompts, n):
    """All prompts submitted at once (one batch) -> their greedy tokens."""
    import threading

    from gpu_service.engine.scheduler import Failure, Request
    from gpu_service.engine.sampling import SamplingParams

    outs = []
    for p in prompts:
        done, events = threading.Event(), []

        def emit(ev, events=events, done=done):
            events.append(ev)
            if isinstance(ev, Failure) or ev.finish_reason:
                done.set()
        outs.append((done, events))
        engine.submit(Request(prompt_ids=list(p), emit=emit, max_tokens=n, sampling=SamplingParams(temperature=0),
                              ignore_eos=True))
    got = []
    for done, events in outs:
        assert done.wait(120)
        assert not isinstance(events[-1], Failure), events[-1]
        got.append([t for ev in events for t in ev.token_ids])
    return got


def hf_greedy(d, prompt, n):
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def qwen3_next(checkpoints):
    return checkpoints["qwen3_next"]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_chunked_prefill_carries_the_state(family, checkpoints):
    """A 200-token prompt in steps of 24 tokens (chunk edges fall inside the rule's 64-token blocks)
    gives transformers' tokens."""
    d = checkpoints[family]
    prompt = [(i * 37) % 300 + 2 for i in range(200)]
    e = make_engine(d, step_tokens=24)
    try:
        assert run(e, [prompt], 12) == [hf_greedy(d, prompt, 12)]
    finally:
        e.stop()


def test_batched_sequences_keep_their_own_state(qwen3_next):
    """Prompts of different lengths decoded in one batch (prefills mixed with decodes): each gets
    what it gets alone and what transformers gives."""
    prompts = [[(i * 7 + j) % 300 + 2 for j in range(n)] for i, n in enumerate((3, 70, 11, 130))]
    e = make_engine(qwen3_next, step_tokens=48)
    try:
        together = run(e, prompts, 10)
        alone = [run(e, [p], 10)[0] for p in prompts]
    finally:
        e.stop()
    assert together == alone
    assert together[1] == hf_greedy(qwen3_next, prompts[1], 10)


def test_a_retried_step_does_not_advance_the_state(qwen3_next, monkeypatch):
    """The expert exchange breaks in the last MoE layer of some steps, after every DeltaNet layer of
    the step ran: the engine retries the step, which must start from the state before it."""
    from moe_exchange.dispatch import ExpertServiceError

    prompt = [(i * 13) % 300 + 2 for i in range(40)]
    e = make_engine(qwen3_next, step_tokens=16)
    try:
        want = run(e, [prompt], 12)
        real, calls = e.experts.result, {"n": 0}
        last = e.model.cfg.moe_layers[-1]

        def flaky(layer, deferred):
            if layer == last and not deferred:
                calls["n"] += 1
                if calls["n"] % 3 == 1:  # steps 1, 4, 7, ...: the first try fails, the retry succeeds
                    real(layer, deferred)
                    raise ExpertServiceError(grpc.StatusCode.UNAVAILABLE, "stream broke", retry=True)
            return real(layer, deferred)
        monkeypatch.setattr(e.experts, "result", flaky)
        got = run(e, [prompt], 12)
    finally:
        e.stop()
    assert calls["n"] > 6 and got == want
