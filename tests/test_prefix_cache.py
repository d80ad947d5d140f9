"""Automatic prefix caching (gpu_service/prefix_cache.py): a request that starts with remembered tokens computes
only the rest, and its greedy tokens are those of a run without the cache, on every family; deferral settings
are separate keys; eviction under a small budget never changes an answer; the cached share is reported on both
APIs."""
from __future__ import annotations

import queue

import openai
import pytest

import tiny_models
from gpu_service.engine import Failure, Request
from gpu_service.prefix_cache import MIN_TOKENS, PrefixCache
from gpu_service.sampling import SamplingParams
from harness import ROOT, Services, free_port, local_engine
from moe_core.config import load_config
from protos import generate_pb2

PROMPT = list(range(5, 69))  # 64 ids: every tiny vocabulary has them


def run(engine, ids, n: int = 8, defer: int = 0, wait_first=None) -> tuple[list[int], int]:
    """Greedy tokens of ids, and how many prompt tokens came from the prefix cache."""
    q: queue.Queue = queue.Queue()
    engine.submit(Request(prompt_ids=list(ids), emit=q.put, max_tokens=n, sampling=SamplingParams(temperature=0),
                          ignore_eos=True, defer=defer))
    toks, cached = [], None
    while True:
        ev = q.get(timeout=300)
        assert not isinstance(ev, Failure), ev.message
        toks += ev.token_ids
        cached = ev.cached_tokens
        if wait_first is not None:
            wait_first.set()
            wait_first = None
        if ev.finish_reason:
            return toks, cached


def cache_for(d, gb: float = 1.0) -> PrefixCache:
    cfg = load_config(d)
    return PrefixCache(int(gb * 2**30), any(cfg.is_linear_attention(L) for L in range(cfg.num_layers)))


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_hits_give_the_tokens_of_a_full_prefill(checkpoints, family):
    d = checkpoints[family]
    plain = local_engine(d)
    try:
        a, _ = run(plain, PROMPT)
        turn2 = PROMPT + a[:-1] + list(range(100, 120))  # the next turn: the answer, then more
        want2, _ = run(plain, turn2)
        fork = PROMPT[:40] + list(range(200, 230))         # shares 40 tokens, then diverges
        want3, _ = run(plain, fork)
    finally:
        plain.stop()
    pc = cache_for(d)
    cached = local_engine(d, prefix_cache=pc)
    try:
        assert run(cached, PROMPT) == (a, 0)
        assert run(cached, PROMPT) == (a, len(PROMPT) - 1)  # all but the last token, whose logits are needed
        # the next turn hits the answer: prompt + all generated tokens but the last (never fed back)
        assert run(cached, turn2) == (want2, len(PROMPT) + len(a) - 1)
        toks, n = run(cached, fork)
        assert toks == want3
        # linear attention (Qwen3-Next): its state exists at an entry's end only, so no partial hit
        assert n == (0 if pc.linear else 40)
    finally:
        cached.stop()


def test_settings_that_change_the_numbers_are_separate_keys(checkpoints):
    d = checkpoints["deepseek_v3"]
    e = local_engine(d, prefix_cache=cache_for(d))
    try:
        run(e, PROMPT, defer=0)
        assert run(e, PROMPT, defer=1)[1] == 0  # deferral changes every layer's output: not a hit
        assert run(e, PROMPT, defer=1)[1] == len(PROMPT) - 1
        assert run(e, PROMPT, defer=0)[1] == len(PROMPT) - 1
    finally:
        e.stop()


def test_eviction_never_changes_an_answer(checkpoints):
    d = checkpoints["qwen3_moe"]
    plain = local_engine(d)
    prompts = [[7 + i] + PROMPT[1:] for i in range(6)]
    try:
        want = [run(plain, p)[0] for p in prompts]
    finally:
        plain.stop()
    pc = cache_for(d)
    e = local_engine(d, prefix_cache=pc)
    try:
        run(e, prompts[0])
        size = max(x.nbytes for x in pc.entries)
        pc.clear()
        pc.budget = 3 * size + size // 2  # room for three
        got = [run(e, p) for p in prompts + prompts]
        assert [t for t, _ in got] == want + want
        assert len(pc.entries) == 3 and pc.nbytes <= pc.budget
        assert not any(n for _, n in got)  # six prompts in turn through room for three: each was evicted
        assert run(e, prompts[-1]) == (want[-1], len(PROMPT) - 1)  # the most recent ones stay
    finally:
        e.stop()


def test_a_request_shares_a_running_ones_prompt_and_chunked_prefill_crosses_the_boundary(checkpoints):
    """B arrives while A decodes: it hits A's prompt (remembered once A's prefill ended). A prompt longer than a
    step's budget after the hit is prefilled in chunks past the cached boundary."""
    import threading

    d = checkpoints["qwen3_moe"]
    plain = local_engine(d)
    long_prompt = PROMPT + list(range(80, 130))
    try:
        want_a, _ = run(plain, PROMPT, n=48)
        want_long, _ = run(plain, long_prompt)
    finally:
        plain.stop()
    e = local_engine(d, prefix_cache=cache_for(d), step_tokens=8)
    try:
        started = threading.Event()
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("a", run(e, PROMPT, n=48, wait_first=started)))
        t.start()
        assert started.wait(300)
        b = run(e, PROMPT, n=48)
        t.join(300)
        assert out["a"] == (want_a, 0) and b == (want_a, len(PROMPT) - 1)
        assert run(e, long_prompt) == (want_long, len(PROMPT))  # the shared prompt, then 50 more in chunks of 8
    finally:
        e.stop()


def test_a_short_prefix_is_not_looked_up(checkpoints):
    d = checkpoints["qwen3_moe"]
    e = local_engine(d, prefix_cache=cache_for(d))
    try:
        short = PROMPT[:MIN_TOKENS - 2]
        run(e, short)
        assert run(e, short)[1] == 0
    finally:
        e.stop()


def test_the_cached_share_is_reported_on_both_apis(tmp_path):
    http = free_port()
    svc = Services(ROOT / "models" / "default", tmp_path, gpu_args=("--http-listen", f"127.0.0.1:{http}",
                                                                    "--served-model-name", "default"))
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0)
        msgs = [{"role": "system", "content": "You write short Python functions. " * 4},
                {"role": "user", "content": "Sort a dict by value"}]
        r1 = c.chat.completions.create(model="default", messages=msgs, max_tokens=8, temperature=0)
        r2 = c.chat.completions.create(model="default", messages=msgs, max_tokens=8, temperature=0)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        assert r2.usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens - 1
        assert r2.choices[0].message.content == r1.choices[0].message.content
        last = list(svc.stub.Generate(generate_pb2.GenerateRequest(
            chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(**m) for m in msgs]), max_tokens=8,
            sampling=generate_pb2.SamplingParams(temperature=0)), timeout=60))[-1]
        assert last.usage.cached_tokens == r2.usage.prompt_tokens - 1
        streamed = [ch for ch in c.chat.completions.create(model="default", messages=msgs, max_tokens=4, stream=True,
                                                           stream_options={"include_usage": True}) if ch.usage]
        assert streamed[-1].usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens - 1
    finally:
        svc.stop()


def test_a_bad_budget_is_refused_at_start():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "gpu_service", "--model", str(ROOT / "models" / "default"), "--experts",
                        "local", "--prefix-cache-gb", "-1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode != 0 and "--prefix-cache-gb" in p.stderr + p.stdout


def test_the_bookkeeping_is_bounded_and_lookups_read_one_group():
    from gpu_service.attention import KVCache
    from gpu_service.prefix_cache import MAX_ENTRIES

    pc = PrefixCache(1 << 30, False)

    def cache(n):
        c = KVCache(1)
        c.length = n
        return c
    for i in range(MAX_ENTRIES + 10):
        pc.remember([i] + PROMPT, cache(65), ())
    assert len(pc.entries) == MAX_ENTRIES and len(pc.groups) == MAX_ENTRIES  # the oldest ten went
    assert pc.lookup([3] + PROMPT, (), lambda: cache(0))[1] == 0             # evicted
    c, n = pc.lookup([MAX_ENTRIES + 9] + PROMPT + [1, 2], (), lambda: cache(0))
    assert n == 65 and c.length == 65
    assert pc.lookup([MAX_ENTRIES + 9] + PROMPT + [1, 2], ("other key",), lambda: cache(0))[1] == 0
