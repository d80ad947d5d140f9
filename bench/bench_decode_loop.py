"""The native decode loop against the layer loop it replaces, in one process, interleaved: what a decode token costs
outside the kernels, free of this machine's DRAM swings (both modes run the same kernels on the same bytes, in
alternating blocks of tokens, so a swing hits both alike).

    python bench/bench_decode_loop.py --model DIR [--weight-format int4 --dense-format int4] [--context 256]
    python bench/bench_decode_loop.py --synth qwen3-30b-a3b --layers 6 --vocab 32000 --work DIR

The GPU side's Model with the experts in its own process (LocalExperts, the expert service's native kernels),
two sequences with the same prompt: one decodes with the decode loop (gpu_service/model/native_loop.py: every layer in
one native call), the other with the layer loop (Model.forward's per-layer Python and torch ops around the same
native attention blocks and experts), greedy, --block tokens at a time each, --rounds times. Per mode: ms a token
(median), the torch ops a token dispatches (counted with a TorchDispatchMode: a figure no noise moves); then the
difference per layer. The two must pick the same tokens (the loop is the layer loop bit for bit): checked.

--against per-op: the layer loop with its native attention blocks (native_stages.py) against the same loop with
every block on torch's ops (the per-op path, the reference): what the native blocks save, for any model with them
(`--synth mimo-v2-flash --layers 4 --vocab 32000 --against per-op`)."""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import tempfile
import time

from common import cpu_name, synth_model

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_experts.packed_cache import PackedCache, source_stamp
from moe_experts.store import load_expert_layers
from gpu_service.experts.local import LocalExperts
from gpu_service.model.model import Model, Segment
from gpu_service.engine.sampling import argmax
from moe_core.checkpoint import Checkpoint
from moe_core.config import load_config
from moe_core.fingerprint import fingerprint
from moe_kernels import ISA, native


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=pathlib.Path)
    src.add_argument("--synth", help="an architecture of tools/synth_checkpoint.py, written for this run")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=0, help="--synth: vocabulary size (0 = the architecture's)")
    ap.add_argument("--weight-format", default="int4")
    ap.add_argument("--dense-format", default="int4")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the decode")
    ap.add_argument("--block", type=int, default=8, help="tokens a mode decodes before the other takes over")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--work", type=pathlib.Path, help="keep the checkpoint and the packed experts here")
    ap.add_argument("--against", choices=["loop", "per-op"], default="loop",
                    help="the layer loop against the decode loop, or its native blocks against torch's ops")
    a = ap.parse_args()
    work = a.work or pathlib.Path(tempfile.mkdtemp(prefix="bench-loop-"))
    model_dir = a.model
    if a.synth:
        model_dir = work / "model"
        if not (model_dir / "config.json").exists():
            synth_model(a.synth, a.layers, model_dir, {"vocab_size": a.vocab} if a.vocab else {}, shard_mb=4096)
    native.init_pool(a.threads)
    torch.set_num_threads(a.threads)
    cfg, ckpt = load_config(model_dir), Checkpoint(model_dir)
    dtype = torch.bfloat16 if cfg.torch_dtype == "bfloat16" else torch.float32
    model = Model(cfg, ckpt, torch.device("cpu"), dtype, dense_format=a.dense_format)
    experts = LocalExperts(load_expert_layers(cfg, ckpt, a.weight_format, a.threads, progress=False, cache=PackedCache(
        work / "cache", fingerprint(ckpt), source_stamp(ckpt), a.weight_format)))
    fast, slow = ("loop", "layers") if a.against == "loop" else ("layers", "per-op")
    if a.against == "loop" and model.native_loop(model.kv_pool()) is None:
        raise SystemExit("this model does not fit the decode loop (every layer MoE, a native routing block, no "
                         "shared experts)")
    if a.against == "per-op" and not model.decode_blocks:
        raise SystemExit("this model has no native attention blocks (native_stages.eligible)")
    layer_loop, blocks = model.native_loop, model.decode_blocks

    def step(mode: str, cache, tok: int, pos: int) -> torch.Tensor:
        model.native_loop = layer_loop if mode == "loop" else (lambda pool: None)
        model.decode_blocks = {} if mode == "per-op" else blocks
        return model.forward([Segment(cache, torch.tensor([tok]), pos)], experts)

    prompt = torch.tensor([(i * 7919) % (cfg.vocab_size - 2) + 2 for i in range(a.context)])
    state = {}
    for mode in (fast, slow):
        cache = model.new_cache()
        state[mode] = [cache, argmax(model.forward([Segment(cache, prompt, 0)], experts)[0]), a.context, [], []]
    for i in range(a.rounds):
        for mode in ((fast, slow) if i % 2 == 0 else (slow, fast)):
            cache, tok, pos, times, toks = state[mode]
            for _ in range(a.block):
                t0 = time.perf_counter()
                tok = argmax(step(mode, cache, tok, pos)[0])
                times.append(time.perf_counter() - t0)
                toks.append(tok)
                pos += 1
            state[mode][1:3] = tok, pos
    ops = {}
    for mode in (fast, slow):
        cache, tok, pos = state[mode][:3]
        with Ops() as count:
            step(mode, cache, tok, pos)
        ops[mode] = count.n
    same = state[fast][4] == state[slow][4]
    ms = {m: statistics.median(state[m][3]) * 1e3 for m in state}
    print(f"CPU: {cpu_name()} ({ISA} dense path); {a.threads} threads; {cfg.num_layers} layers, vocab "
          f"{cfg.vocab_size}; experts {a.weight_format} (in process), dense {a.dense_format}; context {a.context}; "
          f"{a.rounds} rounds of {a.block} tokens a mode, interleaved")
    names = {"layers": "layer loop (Python)", "loop": "decode loop (native)", "per-op": "layer loop, attention per op"}
    print("| mode | ms/token (median) | torch ops/token |\n|---|---|---|")
    for m in (slow, fast):
        print(f"| {names[m]} | {ms[m]:.3f} | {ops[m]} |")
    print(f"\n{names[fast]} saves {(ms[slow] - ms[fast]) * 1e3 / cfg.num_layers:.1f} us a layer "
          f"({ms[slow] / ms[fast]:.3f}x); the same tokens: {same}")
    if not same and a.against == "per-op" and cfg.scoring == "sigmoid":  # (tests/model/test_decode_step.py)
        print("(the native sigmoid router's fp32 logits differ from torch's in the last bits: a near-tie of two experts "
              "can change a later token; the blocks without it are the per-op path bit for bit)")
    elif not same:
        raise SystemExit("the two modes picked different tokens")


if __name__ == "__main__":
    main()
