"""The paged KV pool (gpu_service/engine/kv_pool.py) and automatic prefix caching over it (gpu_service/engine/prefix_cache.py): a
request that starts with cached blocks shares them and computes only the rest, and its greedy tokens are those of a
run without the cache, on every family; deferral settings are separate keys; eviction under a small budget and
preemption when the pool is full never change an answer; the cached share is reported on both APIs."""
from __future__ import annotations

import os
import queue

import openai
import pytest
import torch

import tiny_models
from gpu_service.engine.scheduler import Failure, Request
from gpu_service import metrics
from gpu_service.engine.kv_pool import BLOCK, KVPool
from gpu_service.engine.sampling import SamplingParams
from harness import ROOT, Services, free_port, local_engine
from moe_core.config import load_config
from protos import generate_pb2
from tiers import some

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


def cache_for(d, gb: float = 1.0, tokens: int = 1 << 14) -> KVPool:
    """A pool of `tokens` positions keeping up to gb GiB of cached blocks (0: no prefix caching)."""
    return KVPool(load_config(d), torch.float32, torch.device("cpu"), tokens // BLOCK, int(gb * 2**30))


def hit(n: int) -> int:
    """What a cached prompt of n tokens gives: its full blocks before the last token (whose logits are needed)."""
    return (n - 1) // BLOCK * BLOCK


def resident_share(addr: int, nbytes: int) -> float:
    """The share of [addr, addr + nbytes)'s pages in memory now (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start, end = addr // page * page, -(-(addr + nbytes) // page) * page
    vec = (ctypes.c_ubyte * ((end - start) // page))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / len(vec)


def test_a_cpu_pool_touches_its_first_blocks_when_made(checkpoints):
    """The blocks every request uses first (the lowest ids) are in memory before the first step, so that no decode
    step stalls on their pages' first faults."""
    from gpu_service.engine.kv_pool import PREFAULT_BLOCKS

    cfg = load_config(checkpoints["qwen3_moe"])
    pool = KVPool(cfg, torch.bfloat16, torch.device("cpu"), 4 * PREFAULT_BLOCKS)
    for bufs in pool.bufs:
        for t in bufs:
            first = t.narrow(pool.block_dim, 0, PREFAULT_BLOCKS)
            for row in first.reshape(-1, *first.shape[pool.block_dim:]) if pool.block_dim else [first]:
                assert resident_share(row.data_ptr(), row.nbytes) == 1.0
            assert not first.any()


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
    cached = local_engine(d, kv_pool=pc)
    try:
        assert run(cached, PROMPT) == (a, 0)
        assert run(cached, PROMPT) == (a, hit(len(PROMPT)))  # whole blocks before the last token
        # the next turn hits the answer's blocks too: prompt + all generated tokens but the last (never fed back)
        assert run(cached, turn2) == (want2, hit(len(PROMPT) + len(a)))
        toks, n = run(cached, fork)  # diverges mid-block (40): the full blocks before it
        assert toks == want3
        # states (Qwen3-Next, DeepSeek-V4): kept only at a prompt's and an answer's last block boundary
        assert n == (0 if pc.stateful else 40 // BLOCK * BLOCK)
        assert pc.used() == 0  # every request gave its blocks back
    finally:
        cached.stop()


def test_settings_that_change_the_numbers_are_separate_keys(checkpoints):
    d = checkpoints["deepseek_v3"]
    e = local_engine(d, kv_pool=cache_for(d))
    try:
        run(e, PROMPT, defer=0)
        assert run(e, PROMPT, defer=1)[1] == 0  # deferral changes every layer's output: not a hit
        assert run(e, PROMPT, defer=1)[1] == hit(len(PROMPT))
        assert run(e, PROMPT, defer=0)[1] == hit(len(PROMPT))
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
    blocks = (len(PROMPT) + 8 - 1) // BLOCK  # a finished request's full blocks: its prompt and answer but the last
    pc = cache_for(d, gb=(3 * blocks * cache_for(d).block_bytes + 1) / 2**30)  # room for three requests' blocks
    e = local_engine(d, kv_pool=pc)
    evicted = metrics.PREFIX_EVICTIONS._value.get()
    try:
        got = [run(e, p) for p in prompts + prompts]
        assert [t for t, _ in got] == want + want
        assert len(pc.cached) == 3 * blocks and pc.cached_bytes() <= pc.prefix_bytes
        assert not any(n for _, n in got)  # six prompts in turn through room for three: each was evicted
        assert metrics.PREFIX_EVICTIONS._value.get() - evicted == (12 - 3) * blocks
        assert run(e, prompts[-1]) == (want[-1], hit(len(PROMPT)))  # the most recent ones stay
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
    e = local_engine(d, kv_pool=cache_for(d), step_tokens=8)
    try:
        started = threading.Event()
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("a", run(e, PROMPT, n=48, wait_first=started)))
        t.start()
        assert started.wait(300)
        b = run(e, PROMPT, n=48)
        t.join(300)
        assert out["a"] == (want_a, 0) and b == (want_a, hit(len(PROMPT)))
        assert run(e, long_prompt) == (want_long, len(PROMPT))  # the shared prompt, then 50 more in chunks of 8
    finally:
        e.stop()


def test_a_short_prefix_is_not_looked_up(checkpoints):
    d = checkpoints["qwen3_moe"]
    e = local_engine(d, kv_pool=cache_for(d))
    try:
        short = PROMPT[:BLOCK]  # its last token is computed: no whole block before it
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
        assert r2.usage.prompt_tokens_details.cached_tokens == hit(r2.usage.prompt_tokens) > 0
        assert r2.choices[0].message.content == r1.choices[0].message.content
        last = list(svc.stub.Generate(generate_pb2.GenerateRequest(
            chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(**m) for m in msgs]), max_tokens=8,
            sampling=generate_pb2.SamplingParams(temperature=0)), timeout=60))[-1]
        assert last.usage.cached_tokens == hit(r2.usage.prompt_tokens)
        streamed = [ch for ch in c.chat.completions.create(model="default", messages=msgs, max_tokens=4, stream=True,
                                                           stream_options={"include_usage": True}) if ch.usage]
        assert streamed[-1].usage.prompt_tokens_details.cached_tokens == hit(r2.usage.prompt_tokens)
    finally:
        svc.stop()


@pytest.mark.parametrize("flag, value", some([("--prefix-cache-gb", "-1"), ("--kv-cache-gb", "0"),
                                              ("--kv-cache-gb", "nan")], fast=[("--kv-cache-gb", "nan")]))
def test_a_bad_budget_is_refused_at_start(flag, value):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "gpu_service", "--model", str(ROOT / "models" / "default"), "--experts",
                        "local", flag, value], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode != 0 and flag in p.stderr + p.stdout


def test_a_context_the_pool_cannot_hold_is_refused_at_start():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "gpu_service", "--model", str(ROOT / "models" / "default"), "--experts",
                        "local", "--kv-cache-gb", "0.0001", "--max-context", "1024"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode != 0 and "--kv-cache-gb" in p.stderr and "--max-context 1024 needs" in p.stderr


@pytest.mark.parametrize("caching", some([True, False], fast=[True]))
def test_a_full_pool_sets_requests_aside_and_they_finish_with_the_same_tokens(checkpoints, caching):
    """Three requests whose contexts need 7 blocks each share a pool of 12: the latest ones are preempted (their
    blocks go back; with caching the full ones stay cached and are evicted as room is needed) and resume later;
    every one ends with the tokens it gets alone, none fails."""
    import threading

    d = checkpoints["qwen3_moe"]
    prompts = [[9 + i] + PROMPT[1:] for i in range(3)]
    plain = local_engine(d)
    try:
        want = [run(plain, p, n=48)[0] for p in prompts]
    finally:
        plain.stop()
    pc = cache_for(d, gb=1.0 if caching else 0, tokens=12 * BLOCK)
    e = local_engine(d, kv_pool=pc, max_context=12 * BLOCK)
    before = metrics.PREEMPTIONS._value.get()
    try:
        out = {}
        threads = [threading.Thread(target=lambda i=i: out.setdefault(i, run(e, prompts[i], n=48))) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert [out[i][0] for i in range(3)] == want
        assert metrics.PREEMPTIONS._value.get() > before
        assert pc.used() == 0
    finally:
        e.stop()


def test_blocks_are_shared_not_copied_and_the_pool_keeps_its_rules(checkpoints):
    """Two sequences with a common prefix hold the same blocks; allocation takes the lowest free ids, then the least
    recently cached; a block in use is never evicted; cached bytes stay within the prefix budget."""
    from gpu_service.engine import block_names, prefix_cache
    from gpu_service.model.model import Model, Segment
    from moe_core.checkpoint import Checkpoint

    d = checkpoints["qwen3_moe"]
    cfg = load_config(d)
    model = Model(cfg, Checkpoint(d), torch.device("cpu"), torch.float32)
    pool = cache_for(d, tokens=8 * BLOCK, gb=(3 * cache_for(d).block_bytes + 1) / 2**30)  # 8 blocks, 3 cached at most
    root = block_names.root("", ())
    a = prefix_cache.SeqCache(pool, root)
    model.forward([Segment(a, torch.tensor(PROMPT[:40]), 0)], _no_experts(cfg))
    assert a.blocks == [0, 1, 2] and len(a.hashes) == 2  # two full blocks named, the third partial
    b = prefix_cache.lookup(pool, PROMPT[:40] + [1, 2], root)
    assert b.blocks == [0, 1] and b.length == 32 and pool.ref[:3] == [2, 2, 1]
    assert prefix_cache.lookup(pool, [3] + PROMPT[1:40], root).length == 0  # another first block: another chain
    assert prefix_cache.lookup(pool, PROMPT[:40], block_names.root("", (1, False))).length == 0  # another key
    a.release()
    assert pool.ref[:3] == [1, 1, 0] and not pool.cached and pool.free[0] == 2  # shared: still used; partial: free
    b.release()
    assert list(pool.cached) == [1, 0] or list(pool.cached) == [0, 1]
    c = prefix_cache.SeqCache(pool, root)
    assert c.reserve(6 * BLOCK) and sorted(c.blocks) == [2, 3, 4, 5, 6, 7]  # free ones first: the cached stay
    assert c.reserve(7 * BLOCK) and len(pool.cached) == 1  # then the least recently cached one goes
    assert not c.reserve(9 * BLOCK) and len(c.blocks) == 7  # not enough: nothing taken
    c.release()
    assert len(pool.cached) == 1  # c named none of its blocks (never computed): they went free
    d = prefix_cache.SeqCache(pool, root)
    ids = [3] + PROMPT + PROMPT[:16]  # another chain of five full blocks and one more id
    model.forward([Segment(d, torch.tensor(ids), 0)], _no_experts(cfg))
    d.release()  # five named blocks into room for three: the older entry and d's tail go first
    assert pool.cached_bytes() <= pool.prefix_bytes
    assert len(pool.cached) == 3 and prefix_cache.lookup(pool, ids, root).length == 3 * BLOCK


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_scattered_blocks_give_the_numbers_of_consecutive_ones(checkpoints, family):
    """A sequence whose blocks lie apart in the pool (after others came and went) decodes through the block table
    (the native paged kernel for GQA; a gather for MLA, windows and sinks) to the same logits as one whose blocks
    are consecutive (views, the contiguous kernel)."""
    from gpu_service.model.model import Model, Segment
    from moe_core.checkpoint import Checkpoint

    d = checkpoints[family]
    cfg = load_config(d)
    model = Model(cfg, Checkpoint(d), torch.device("cpu"), torch.bfloat16, dense_format="bf16")
    ids = torch.tensor(PROMPT[:50])
    out = []
    for scatter in (False, True):
        model.kv = KVPool(cfg, torch.bfloat16, torch.device("cpu"), 16)
        seq, other = model.new_cache(), model.new_cache()
        if scatter:  # every other block taken by another sequence as they grow
            for n in range(1, 5):
                assert other.reserve(n * BLOCK) and seq.reserve(n * BLOCK)
        logits = [model.forward([Segment(seq, ids, 0)], _no_experts(cfg))]
        for _ in range(3):
            logits.append(model.forward([Segment(seq, logits[-1].argmax(-1), seq.length)], _no_experts(cfg)))
        assert seq.consecutive() != scatter
        out.append(torch.cat(logits))
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=0)


def test_evicted_blocks_spill_to_the_host_tier_and_come_back(checkpoints):
    """A pool of 8 blocks with a host tier of 16: a prompt's blocks evicted by others' come back by copy, holding what
    they held, and the engine's answer from them is the answer without the cache."""
    from gpu_service.engine import block_names, prefix_cache
    from gpu_service.model.model import Model, Segment
    from moe_core.checkpoint import Checkpoint

    d = checkpoints["qwen3_moe"]
    cfg = load_config(d)
    dev = torch.device(os.environ.get("MOE_TEST_DEVICE", "cpu"))  # scripts/gpu_check.sh: cuda, the host tier pinned
    model = Model(cfg, Checkpoint(d), dev, torch.float32)
    for kv in (torch.float32, torch.int8):  # (an 8-bit pool's rows: codes and scales, copied as bytes)
        bb = KVPool(cfg, kv, dev, 1).block_bytes
        pool = KVPool(cfg, kv, dev, 8, 8 * bb, 16 * bb)
        root = block_names.root("", ())
        a = prefix_cache.SeqCache(pool, root)
        model.forward([Segment(a, torch.tensor(PROMPT), 0)], _no_experts(cfg, dev))
        want = [t.clone() for t in a.gather(0, 64)]
        a.release()
        spills = metrics.PREFIX_HOST_SPILLS._value.get()
        b = prefix_cache.SeqCache(pool, root)
        model.forward([Segment(b, torch.tensor([4] + PROMPT[1:] + PROMPT[:48]), 0)], _no_experts(cfg, dev))  # 7 blocks
        assert metrics.PREFIX_HOST_SPILLS._value.get() - spills == 3  # a's blocks 1-3 went to make room (tail first)
        b.release()
        c = prefix_cache.lookup(pool, PROMPT + [1], root)
        assert c.length == 64
        for got, w in zip(c.gather(0, 64), want):
            assert got.dtype == kv and torch.equal(got, w)
        c.release()
    bb = cache_for(d).block_bytes

    plain = local_engine(d)
    try:
        want_tokens = [run(plain, p)[0] for p in ([7] + PROMPT[1:], [8] + PROMPT[1:])]
    finally:
        plain.stop()
    # 5 blocks: one request's 72 positions fill them, so the next one evicts all four of its named blocks
    e = local_engine(d, kv_pool=KVPool(cfg, torch.float32, torch.device("cpu"), 5, 5 * bb, 16 * bb), max_context=80)
    try:
        assert run(e, [7] + PROMPT[1:]) == (want_tokens[0], 0)
        assert run(e, [8] + PROMPT[1:]) == (want_tokens[1], 0)  # evicts the first prompt's blocks to the host
        restores = metrics.PREFIX_HOST_RESTORES._value.get()
        assert run(e, [7] + PROMPT[1:]) == (want_tokens[0], hit(len(PROMPT)))
        assert metrics.PREFIX_HOST_RESTORES._value.get() - restores == hit(len(PROMPT)) // BLOCK
    finally:
        e.stop()


def test_the_host_tier_is_refused_off_cuda():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "gpu_service", "--model", str(ROOT / "models" / "default"), "--experts",
                        "local", "--device", "cpu", "--prefix-cache-host-gb", "1"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode != 0 and "--prefix-cache-host-gb" in p.stderr


def _no_experts(cfg, device=torch.device("cpu")):
    """Routed experts that give zeros: the pool's bookkeeping does not need their numbers."""
    class Zero:
        def submit(self, step, layer, x, ids, w, defer):
            self.shape = x.shape

        def result(self, layer, deferred):
            return torch.zeros(self.shape, device=device)

        def drain_timings(self):
            return []
    return Zero()
