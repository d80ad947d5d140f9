"""--kv-cache-dtype: a KV pool of another element type than the model computes in (fp16 under an fp32 model: half
the cache's memory and half the bytes decode attention reads a token). Every attention path reads the narrower
pool (GQA decode on the native kernel, prefill after a cached prefix, MLA's latent cache, gpt-oss's windows and
sinks, the hybrid linear-attention model's full-attention layers) and stays close to the fp32 cache's logits; the
pool's size and the prefix cache's keys follow the type. The native decode step and loop with an fp16 pool are
tested bit for bit against the torch path in test_decode_step.py and test_decode_loop.py."""
from __future__ import annotations

import os

import pytest
import torch

from moe_experts.store import load_expert_layers
from gpu_service import cli
from gpu_service.experts.local import LocalExperts
from gpu_service.engine.kv_pool import block_bytes
from gpu_service.model.model import Model, Segment
from moe_core.checkpoint import Checkpoint
from moe_core.config import load_config

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
    bufs = next(b for b in model.kv_pool().bufs if b is not None)
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
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "m", "--kv-cache-dtype", "fp8"])
