"""Chunked prefill under a per-step token budget: long prompts run in chunks interleaved with running
decodes, never more tokens in one step than the budget (and the expert service's --max-tokens), with
the same tokens and scores as an unchunked run and as transformers."""
from __future__ import annotations

import threading

import pytest
import torch
import transformers

from harness import greedy, local_engine
from moe_exchange import codec
from protos import generate_pb2


def score(stub, ids, **kw):
    return stub.Score(generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=ids), **kw), timeout=300)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_next"])  # qwen3_next: the DeltaNet state across chunks
def test_chunked_prefill_matches_transformers_and_unchunked(family, checkpoints, services_factory):
    d = checkpoints[family]
    torch.manual_seed(3)
    prompt = torch.randint(2, 320, (300,)).tolist()
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        ref_logits = ref(torch.tensor([prompt])).logits[0]
    chunked = services_factory(d, gpu_args=("--max-step-tokens", "32"))
    assert "32 tokens per step" in chunked.logs()
    assert greedy(chunked.stub, prompt, 16) == want
    logits = codec.decode(score(chunked.stub, prompt).logits, "logits")
    assert (logits - ref_logits).abs().max().item() < 1e-4
    lp = score(chunked.stub, prompt, logprobs_only=True)
    want_lp = ref_logits.log_softmax(-1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(list(lp.token_logprobs)), want_lp, rtol=1e-4, atol=1e-4)
    assert list(lp.argmax_ids) == ref_logits.argmax(-1).tolist()


@pytest.mark.slow
def test_prompts_longer_than_the_expert_limit_run_in_chunks(checkpoints, services_factory):
    """The expert service takes 64 tokens per request: a 200-token prompt and four 40-token prompts at
    once all run (before: the whole batch failed with INTERNAL) and give their solo tokens."""
    s = services_factory(checkpoints["qwen3_moe"], expert_args=("--max-tokens", "64"))
    assert "64 tokens per step" in s.logs()
    big = services_factory(checkpoints["qwen3_moe"])
    long = [(i * 11) % 300 + 2 for i in range(200)]
    assert greedy(s.stub, long, 8) == greedy(big.stub, long, 8)
    prompts = [[(i * 7 + j) % 300 + 2 for j in range(40)] for i in range(4)]
    solo = [greedy(big.stub, p, 8) for p in prompts]
    out = [None] * 4

    def run(i):
        out[i] = greedy(s.stub, prompts[i], 8)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == solo


@pytest.fixture
def engine(checkpoints):
    e = local_engine(checkpoints["qwen3_moe"], max_batch=4, step_tokens=16)
    yield e
    e.stop()


def test_decodes_go_on_while_a_long_prompt_prefills(engine, monkeypatch):
    """Every step carries at most the budget, and a running stream gets a token in every step while a
    200-token prompt is prefilled in chunks (it is stalled by one chunk at a time, never by the prompt)."""
    from gpu_service.engine.scheduler import Request
    from gpu_service.engine.sampling import SamplingParams

    steps, real = [], engine.model.forward

    def forward(segs, *a, **kw):
        steps.append([(s.start, s.tokens.shape[0]) for s in segs])
        return real(segs, *a, **kw)

    def request(prompt, n, started=None):
        done, toks = threading.Event(), []

        def emit(ev):
            toks.extend(ev.token_ids)
            if started is not None and len(toks) == 2:
                started.set()
            if ev.finish_reason:
                done.set()
        return Request(prompt_ids=prompt, emit=emit, max_tokens=n, sampling=SamplingParams(temperature=0),
                       ignore_eos=True), done, toks

    long_prompt = [(i * 13) % 300 + 2 for i in range(200)]
    solo = []
    for p, n in (([5, 9, 17], 60), (long_prompt, 4)):
        r, done, toks = request(p, n)
        engine.submit(r)
        assert done.wait(120)
        solo.append(toks)
    monkeypatch.setattr(engine.model, "forward", forward)
    started = threading.Event()
    stream, s_done, s_toks = request([5, 9, 17], 60, started)
    engine.submit(stream)
    assert started.wait(60)
    long, l_done, l_toks = request(long_prompt, 4)
    engine.submit(long)
    assert l_done.wait(120) and s_done.wait(120)
    assert [s_toks, l_toks] == solo
    assert all(sum(n for _, n in step) <= 16 for step in steps)
    prefill = [step for step in steps if any(n > 3 for _, n in step)]  # the long prompt's chunks (the stream's is 3)
    assert len(prefill) >= 200 // 16  # the prompt went in chunks
    assert all(any(n == 1 for _, n in step) for step in prefill)  # the stream decoded in each of those steps


def test_mla_scores_in_head_groups_change_nothing(checkpoints, monkeypatch):
    """MLA attention holds at most SCORE_BYTES of scores at once (heads in groups): the same output."""
    from gpu_service.model import attention
    from gpu_service.model.layers import rope_cos_sin
    from gpu_service.model.model import Model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config

    d = checkpoints["deepseek_v3"]
    cfg, ckpt = load_config(d), Checkpoint(d)
    model = Model(cfg, ckpt, torch.device("cpu"), torch.float32)
    x = torch.randn(40, cfg.hidden_size)
    cos, sin = rope_cos_sin(model.inv_freq, model.rope_scaling, torch.arange(40), torch.float32)

    def run():
        cache = model.new_cache()
        return attention.mla_attention(cfg, model.W, "model.layers.1.self_attn.", x, cos, sin,
                                       attention.SequenceKV(cache, 0, 40), 1, scale=model.scale)
    whole = run()
    monkeypatch.setattr(attention, "SCORE_BYTES", 40 * 40 * 4)  # one head at a time
    assert torch.allclose(run(), whole, atol=1e-6, rtol=1e-5)
