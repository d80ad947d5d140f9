"""What the paged KV pool holds for a sequence of models with sliding-window layers (MiMo-V2-Flash, gpt-oss), at their
published shapes (tools/synth_checkpoint.py's presets), bf16: a SeqCache taken through each length in prompt chunks of
--chunk positions (reserve and commit, as the engine does; no model computed), then the blocks it holds in the main
pool and in the window pool counted. Against it, what the pool held before the window pool (every layer's rows for
every position: the main pool's block and the window pool's block per BLOCK positions), and the service's window pool
size for --max-batch sequences (kv_pool.window_pool_blocks).

    python bench/bench_kv_pool.py [--models mimo-v2-flash gpt-oss-20b] [--lengths 2048 32768 131072] [--chunk 2048]
        [--max-batch 8]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import synth_checkpoint  # noqa: E402

from gpu_service.engine.kv_pool import (BLOCK, KVPool, SeqCache, pool_block_bytes, window_layers,  # noqa: E402
                                        window_pool_blocks, window_reach)
from moe_core.config import parse_config  # noqa: E402

DT = torch.bfloat16


def held(cfg, length: int, chunk: int) -> tuple[int, int, int]:
    """A sequence taken to `length` positions -> (main pool blocks, window pool blocks it holds, its nbytes)."""
    pool = KVPool(cfg, DT, torch.device("cpu"), -(-length // BLOCK) + 8,
                  window_blocks=window_pool_blocks(cfg, 1, chunk, False))
    seq = SeqCache(pool)
    at = 0
    while at < length:
        n = min(chunk, length - at)
        assert seq.reserve(at + n), "the pool is full"
        seq.commit(at + n, [at % 1000] * n)
        at += n
    return pool.used(), pool.window.used(), seq.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mimo-v2-flash", "gpt-oss-20b"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 32768, 131072])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--max-batch", type=int, default=8)
    a = ap.parse_args()
    for name in a.models:
        cfg = parse_config(synth_checkpoint.config_of(name, None, {}))
        main_b, ring_b = pool_block_bytes(cfg, DT)
        rings = window_layers(cfg)
        service = window_pool_blocks(cfg, a.max_batch, a.chunk, True)
        print(f"{name}: {cfg.num_layers} layers, {len(rings)} with a window of {window_reach(cfg)}; "
              f"a position {(main_b + ring_b) / BLOCK / 1024:.1f} KiB, of which the window layers' "
              f"{ring_b / BLOCK / 1024:.1f} KiB; the service's window pool at --max-batch {a.max_batch} "
              f"--max-step-tokens {a.chunk} with prefix caching: {service} blocks, {service * ring_b / 2**30:.2f} GiB")
        for L in a.lengths:
            m, w, nbytes = held(cfg, L, a.chunk)
            before = -(-L // BLOCK) * (main_b + ring_b)
            print(f"  {L:>7} positions: holds {m} main + {w} window blocks = {nbytes / 2**20:8.1f} MiB "
                  f"(every position in every layer: {before / 2**20:8.1f} MiB, {before / nbytes:5.2f}x)")


if __name__ == "__main__":
    main()
