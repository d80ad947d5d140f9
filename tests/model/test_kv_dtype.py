"""--kv-cache-dtype: a KV pool of another element type than the model computes in (fp16 under an fp32 model: half
the cache's memory and half the bytes decode attention reads a token). Every attention path reads the narrower
pool (GQA decode on the native kernel, prefill after a cached prefix, MLA's latent cache, gpt-oss's windows and
sinks, the hybrid linear-attention model's full-attention layers) and stays close to the fp32 cache's logits; the
pool's size and the prefix cache's keys follow the type. The native decode step and loop with an fp16 pool are
tested bit for bit against the torch path in test_decode_step.py and test_decode_loop.py.

The 8-bit caches (int8, fp8: moe_kernels/kv_quant.py's rows, tests/kernels/test_kv_quant.py) on every family's
tiny checkpoint: their logits near the fp32 cache's, prefix-cache hits and chunked prefills giving a whole
prefill's tokens, the pool sized in bytes holding ~2x the positions of a bf16 one. (Tiny random models amplify a
perturbation: on qwen3_moe a bf16 cache moves its logits more than an int8 one; the accuracy that matters is
measured on the embedded trained model by bench/bench_kv_cache.py.)"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from moe_kernels import attention as native_attention
from moe_experts.store import load_expert_layers
from gpu_service import cli, metrics
from gpu_service.experts.local import LocalExperts
from gpu_service.engine.kv_pool import KVPool, block_bytes
from gpu_service.model.model import Model, Segment
from moe_core.checkpoint import Checkpoint
from moe_core.config import load_config
from harness import ROOT
import tiny_models
from tiers import some

# GQA with QK-norm, MLA, windows and sinks, DeltaNet beside full attention
FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next"]


def logits_of(d, kv_dtype, prompt, n: int = 12):
    """A prompt in two chunks (the second attends to the first through the cache), then n greedy decode steps:
    every step's logits [2 + n, vocab], and the pool's element type."""
    cfg, ckpt = load_config(d), Checkpoint(d)
    dev = torch.device(os.environ.get("MOE_TEST_DEVICE", "cpu"))  # scripts/gpu_check.sh: cuda (torch's paths)
    model = Model(cfg, ckpt, dev, torch.float32, kv_dtype=kv_dtype)
    experts = LocalExperts(load_expert_layers(cfg, ckpt, "fp32", 1))
    c = model.new_cache()
    h = len(prompt) // 2
    out = [model.forward([Segment(c, prompt[:h], 0)], experts), model.forward([Segment(c, prompt[h:], h)], experts)]
    pos = len(prompt)
    for _ in range(n):
        out.append(model.forward([Segment(c, out[-1].argmax(-1).view(1), pos)], experts))
        pos += 1
    bufs = next(b for b in model.kv_pool().bufs if b)
    return torch.cat(out).cpu(), {b.dtype for b in bufs}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp16_cache_stays_close_to_the_fp32_one(checkpoints, family):
    prompt = torch.arange(5, 45)
    want, kinds = logits_of(checkpoints[family], None, prompt)
    got, kinds16 = logits_of(checkpoints[family], torch.float16, prompt)
    assert kinds == {torch.float32} and kinds16 == {torch.float16}
    err = (got - want).abs().max().item()
    scale = want.abs().max().item()
    # fp16 rounds each K/V value by at most 2^-11 of itself: the logits move by about that share, not more
    assert 0 < err <= 2e-3 * scale, (err, scale)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_pool_and_the_prefix_keys_follow_the_type(checkpoints, family):
    cfg = load_config(checkpoints[family])
    assert 2 * block_bytes(cfg, torch.float16) == block_bytes(cfg, torch.float32)
    keys = {cli.namespace("fp", torch.float32, kv, "bf16", ("int4", "avx2")) for kv in (torch.float32, torch.float16)}
    assert len(keys) == 2  # an fp16 cache's blocks are never served to an fp32 one's requests


def test_the_flag_resolves(checkpoints):
    cfg = load_config(checkpoints["qwen3_moe"])

    def resolved(*flags):
        args = cli.parse_args(["--model", str(checkpoints["qwen3_moe"]), "--device", "cpu", *flags])
        _, dtype, kv, _, _ = cli.check_args(args, cfg)
        return dtype, kv

    assert resolved("--dtype", "fp32") == (torch.float32, torch.float32)  # auto: the compute dtype
    assert resolved("--dtype", "fp32", "--kv-cache-dtype", "fp16") == (torch.float32, torch.float16)
    assert resolved("--dtype", "bf16", "--kv-cache-dtype", "fp32") == (torch.bfloat16, torch.float32)
    assert resolved("--dtype", "bf16", "--kv-cache-dtype", "int8") == (torch.bfloat16, torch.int8)
    assert resolved("--dtype", "fp32", "--kv-cache-dtype", "fp8") == (torch.float32, torch.float8_e4m3fn)
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "m", "--kv-cache-dtype", "int4"])


Q8 = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def forced_logits(d, kv_dtype, prompt, feed, dense=None, native=True):
    """The prompt in two chunks, then each of feed's tokens (teacher-forced): every step's logits. native False:
    the decode steps on torch's attention (no native block or kernel; the prefill as with it), the dense layers as
    `dense` packs them."""
    cfg, ckpt = load_config(d), Checkpoint(d)
    model = Model(cfg, ckpt, torch.device("cpu"), torch.float32, kv_dtype=kv_dtype, dense_format=dense)
    experts = LocalExperts(load_expert_layers(cfg, ckpt, "fp32", 1))
    c = model.new_cache()
    h = len(prompt) // 2
    out = [model.forward([Segment(c, prompt[:h], 0)], experts), model.forward([Segment(c, prompt[h:], h)], experts)]
    if not native:
        model.native_attention, model.decode_blocks = False, {}
    for i, tok in enumerate(feed):
        out.append(model.forward([Segment(c, tok.view(1), len(prompt) + i)], experts))
    bufs = next(b for b in model.kv_pool().bufs if b)
    return torch.cat(out), {b.dtype for b in bufs}


FEED = torch.randint(2, tiny_models.VOCAB, (12,), generator=torch.Generator().manual_seed(0))
# DeepSeek Sparse Attention's tiny checkpoints keep 4 keys of ~50 by the indexer's scores: 8-bit keys flip near-ties
# there (their KL ~0.07-0.1 to the fp32 cache's; bf16's ~1e-6 to 2e-3), so they are checked by the round trip alone
DSA = {"deepseek_v32", "glm_moe_dsa"}


@pytest.mark.parametrize("kv", list(Q8))
@pytest.mark.parametrize("family", some(list(tiny_models.FAMILIES), fast=["qwen3_moe", "deepseek_v32"]))
def test_an_8bit_cache_is_an_fp32_cache_of_its_rows_round_trip(checkpoints, family, kv, monkeypatch):
    """Every family: the 8-bit pool holds 8-bit rows, and its logits are bit for bit those of an fp32 pool into
    which each row is written as quantize-then-dequantize gives it (what was stored is what is read, on every
    attention path: prefill after a chunk, decode, windows, sinks, indexer keys); and near the plain fp32 cache's
    (teacher-forced, so that one flipped token does not make every later step another sequence's; a misread row
    or scale is another distribution: KL ~ 1; the tiny models' logits are too flat for their argmax to say more)."""
    from gpu_service.engine.kv_pool import SeqCache
    from moe_kernels import kv_quant

    prompt = torch.arange(5, 45)
    got, kinds = forced_logits(checkpoints[family], Q8[kv], prompt, FEED)
    assert kinds == {Q8[kv]} and got.isfinite().all()
    plain, _ = forced_logits(checkpoints[family], None, prompt, FEED)
    round_trip = lambda x: kv_quant.dequantize(kv_quant.quantize(x, Q8[kv]), Q8[kv], x.dtype)  # noqa: E731
    write, put = SeqCache.write, SeqCache.put
    monkeypatch.setattr(SeqCache, "write", lambda self, layer, start, *xs: write(self, layer, start,
                                                                               *map(round_trip, xs)))
    monkeypatch.setattr(SeqCache, "put", lambda self, layer, i, b, s, x: put(self, layer, i, b, s, round_trip(x)))
    rounded, kinds = forced_logits(checkpoints[family], None, prompt, FEED)
    assert kinds == {torch.float32} and torch.equal(got, rounded)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), plain.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl > 0 and (family in DSA or kl < 0.05), float(kl)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_the_native_decode_reads_an_8bit_pool_as_torch_reads_it(checkpoints, family, monkeypatch):
    """The dense layers packed (--dense-format bf16): the Model's own choice of path takes the 8-bit pool natively
    (the decode blocks, or for DeepSeek Sparse Attention the indexer and latent kernels) and gives the torch path's
    logits over the same pool, bit for bit. (GQA's native block and loop need vector head dims, wider than the tiny
    checkpoints': test_decode_step.py and test_decode_loop.py check them over 8-bit pools bit for bit.)"""
    import moe_kernels.attention as kernels
    from gpu_service.model import native_loop, native_stages

    calls = []
    for mod, name in ((native_stages, "run"), (native_loop, "run"), (kernels, "dsa_scores")):
        def counted(*a, f=getattr(mod, name), n=f"{mod.__name__}.{name}", **k):
            out = f(*a, **k)
            if out is not False:  # (the layer loop declines experts it cannot run)
                calls.append(n)
            return out
        monkeypatch.setattr(mod, name, counted)
    d = checkpoints[family]
    prompt = torch.arange(5, 45)
    got, _ = forced_logits(d, torch.int8, prompt, FEED, dense="bf16")
    assert len(calls) >= len(FEED), calls
    calls.clear()
    want, _ = forced_logits(d, torch.int8, prompt, FEED, dense="bf16", native=False)
    assert not calls and torch.equal(got, want)


@pytest.mark.parametrize("kv", list(Q8))
@pytest.mark.parametrize("family", some(["qwen3_moe", "deepseek_v3", "deepseek_v32", "gpt_oss", "qwen3_next"],
                                        fast=["deepseek_v32"]))
def test_hits_and_chunks_give_the_tokens_of_a_whole_prefill(checkpoints, family, kv):
    """A row's bytes depend on it alone, so a prefix-cache hit (the cached rows as stored) and a prompt prefilled in
    chunks give the greedy tokens of one whole prefill over the same 8-bit cache."""
    from test_prefix_cache import PROMPT, hit, run
    from harness import local_engine

    d = checkpoints[family]
    cfg = load_config(d)
    pool = lambda caching: KVPool(cfg, Q8[kv], torch.device("cpu"), 64, caching * 2**30)  # noqa: E731
    plain = local_engine(d, kv_pool=pool(0))
    try:
        want, _ = run(plain, PROMPT)
    finally:
        plain.stop()
    cached = local_engine(d, kv_pool=pool(1), step_tokens=24)
    try:
        assert run(cached, PROMPT) == (want, 0)  # in chunks of 24
        assert run(cached, PROMPT) == (want, hit(len(PROMPT)))
    finally:
        cached.stop()


@pytest.mark.parametrize("name", ["embedded", "gqa128", "gqa64"])
def test_a_pool_in_bytes_holds_twice_the_positions(checkpoints, name):
    """--kv-cache-gb: an 8-bit pool of the same bytes holds 2d / (d + 1) times a bf16 one's positions for rows of d
    values, scales included: 1.95x on the embedded model (MLA: a latent row of 64 and a rotary row of 16), 1.98x
    at 128-dim GQA heads, 1.97x at 64."""
    cfg = load_config(ROOT / "models" / "default") if name == "embedded" else \
        dataclasses.replace(load_config(checkpoints["qwen3_moe"]), head_dim=int(name[3:]))
    args = cli.parse_args(["--model", "m", "--kv-cache-gb", "0.25"])
    blocks = {}
    for kv in (torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        pool, limit = cli.kv_pool(args, cfg, torch.device("cpu"), kv, 4096)
        blocks[kv] = pool.num_blocks
        assert metrics.KV_POSITION_BYTES._value.get() == pool.block_bytes / 16  # /metrics: a position's bytes
        assert pool.num_blocks * pool.block_bytes <= 0.25 * 2**30 < (pool.num_blocks + 1) * pool.block_bytes
        # the bytes are the buffers': nothing uncounted
        assert pool.block_bytes * (pool.num_blocks + 1) == sum(b.nbytes for bufs in pool.bufs if bufs for b in bufs)
    for kv in (torch.int8, torch.float8_e4m3fn):
        assert blocks[kv] / blocks[torch.bfloat16] >= 1.95, (name, blocks)


@pytest.mark.skipif(not native_attention.rounds_query(torch.int8, 64), reason="the int8 VNNI scores: AVX-512 paths")
def test_the_int8_scores_round_the_query_and_little_else(tmp_path):
    """On the AVX-512 paths an int8 cache's decode scores run on VNNI over each query head rounded to int8 (attention.cpp
    I8Query): the native decode's logits are no longer the torch path's bits over the same pool, but near them --
    far nearer than the int8 cache itself is to the fp32 one."""
    d = tiny_models.build("qwen3_moe", tmp_path / "q", head_dim=64)
    prompt = torch.arange(5, 45)
    got, _ = forced_logits(d, torch.int8, prompt, FEED, dense="bf16")
    want, _ = forced_logits(d, torch.int8, prompt, FEED, dense="bf16", native=False)
    plain, _ = forced_logits(d, None, prompt, FEED, dense="bf16", native=False)

    def kl(a, b):
        return float(torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True,
                                                reduction="batchmean"))
    assert not torch.equal(got, want)
    assert kl(got, want) < 1e-5 and kl(got, want) < kl(want, plain) / 4, (kl(got, want), kl(want, plain))
