"""Automatic prefix caching over the paged KV pool (kv_pool.py): a request that starts with tokens some earlier or
running request already computed (a chat's next turn, an agent resending its history, a shared system prompt)
shares their blocks and computes only the rest.

A full block is named by a hash chain: blake2b of the previous block's name and this block's token ids, starting
from a root that names everything else that changes the numbers (the model's fingerprint, compute dtype, dense
and expert weight formats and kernel path: `namespace`; and per request the deferral settings: engine.prefix_key).
Blocks join the chain when they fill, while prompts are prefilled and while answers are generated (a chat's next
turn hits the previous answer); a lookup walks the new prompt's chain while the pool has the blocks and shares
them (no copy; from the host tier, kv_pool.py, by a copy back). The prompt's last token is always computed (its logits are needed), so a hit covers at most the
full blocks before it.

Linear-attention layers (Qwen3-Next) have a state instead of blocks, and DeepSeek-V4's layers one beside their
entries' blocks (the window's keys, the open compression windows' rows), which exists only where it was kept: at the
last block boundary before a prompt's final token (the engine ends a prefill step there) and at the last one an
answer passed (kept when the sequence ends). A hit there needs both the blocks and a kept state, so it ends at the
longest such boundary.

Window layers (gpt-oss's, MiMo-V2-Flash's sliding ones) read their rows from the window pool, which gives a
sequence's blocks below its window back as it goes (kv_pool.py): a hit needs only the last window's blocks there,
so it ends at the longest boundary whose window blocks are still cached.
"""
from __future__ import annotations

from gpu_service import metrics
from gpu_service.engine.block_names import next_name
from gpu_service.engine.kv_pool import BLOCK, KVPool, SeqCache


def lookup(pool: KVPool, ids: list[int], root_hash: bytes) -> SeqCache:
    """A cache for a sequence of these ids, holding the longest cached prefix of them (whole blocks, never the
    last id). Shared blocks are referenced, not copied."""
    seq = SeqCache(pool, root_hash)
    metrics.PREFIX_QUERY_TOKENS.inc(len(ids))
    if not pool.caching:
        return seq
    blocks, hashes, ends = [], [], {}
    prev = root_hash
    for i in range((len(ids) - 1) // BLOCK):
        prev = next_name(prev, ids[i * BLOCK:(i + 1) * BLOCK])
        # referenced at once: bringing a later block back from the host tier must not evict an earlier one
        b = pool.lookup(prev)
        if b is not None:
            pool.share(b)
        elif (b := pool.restore(prev)) is None:
            break
        blocks.append(b)
        hashes.append(prev)
        if not pool.stateful:
            ends[i + 1] = None
        elif (s := pool.states(prev)) is not None:
            ends[i + 1] = s
    best, wblocks = _window_blocks(pool, hashes, sorted(ends, reverse=True))
    pool.release(blocks[best:])  # a stateful pool: past the last kept state; a window pool: its last window's
    if best:
        n = best * BLOCK
        seq.blocks, seq.hashes, seq.tokens, seq.length = blocks[:best], hashes[:best], list(ids[:n]), n
        seq.wblocks = wblocks
        if ends[best] is not None:
            seq.states = list(ends[best])
        metrics.PREFIX_HIT_TOKENS.inc(n)
    return seq


def _window_blocks(pool: KVPool, hashes: list[bytes], ends: list[int]) -> tuple[int, list[int]]:
    """The longest hit of `ends` (block counts, longest first) whose last window the window pool holds too (every
    end, where the model has no window layers) -> (it, 0 for none; the window table for it, its blocks shared)."""
    window = pool.window
    if window is None or not ends:
        return (ends[0] if ends else 0), []
    limit = ends[0]
    for end in ends:
        if end > limit:
            continue
        lo = max(0, end * BLOCK - pool.reach + 1) // BLOCK  # the blocks the next position's window reads
        got = [window.lookup(h) for h in hashes[lo:end]]
        if None not in got:
            for b in got:
                window.share(b)
            return end, [-1] * lo + got
        limit = lo + max(j for j, b in enumerate(got) if b is None)  # a longer hit's window reads the missing block
    return 0, []
