"""The paged KV cache: one pool of fixed-size blocks per attention layer, shared by every sequence through its
block table, with the blocks of finished prefixes kept for reuse (prefix_cache.py).

Layout (the native decode step reads it as it is; agree any change with native/kernels/attention.cpp):
- a block holds BLOCK consecutive positions of one sequence, in every attention layer at once (one block id,
  the same row of each layer's buffers);
- GQA / MHA, sinks included: K and V per layer [kv heads, blocks, BLOCK, head dim]: head-major across
  the pool, so a head's rows of consecutive blocks are one contiguous matrix (a lone sequence's blocks are
  consecutive: allocation takes the lowest free ids), read as the contiguous cache was;
- a GQA layer with a sliding window (gpt-oss's, MiMo-V2-Flash's sliding layers: `window_layers`) reads only its
  last `window` positions, so its rows live in a second pool of their own (`KVPool.window`, the same layout, its own
  block ids): a sequence's window table (SeqCache.wblocks) gives back its blocks below the window after each step
  (they stay cached for prefix hits, as full blocks do). MiMo-V2-Flash's 39 sliding layers are 195 of its 217.5 KiB
  a position; a sequence holds about window / BLOCK + 1 of their blocks at any length;
  MiniMax-M3's sparse layers a third, its block indexer's key [1, blocks, BLOCK, index dim];
- MLA: the latent [blocks, BLOCK, kv_lora_rank] and the rotary key [blocks, BLOCK, rope dim];
- DeepSeek-V4: only what grows with the context, a compressed layer's entries (and a CSA layer's indexer's), each in
  the block holding its window's last position, at slot (that position % BLOCK) // rate of `entry_slots(rate)` a block
  [1, blocks, slots, dim]; a window-only layer has no buffers. The window's keys and the open windows' compressor rows
  are a fixed-size state a sequence (compressed_attention.py);
- linear-attention layers (Qwen3-Next's DeltaNet) have no blocks: their fixed-size state lives with the sequence
  (SeqCache.states) and is snapshotted at block boundaries for reuse, as DeepSeek-V4's states are;
- an 8-bit cache (--kv-cache-dtype int8 / fp8) holds each row of n values as n codes and its scale byte
  (moe_kernels/kv_quant.py): the buffers' last dim is n + 1, of one byte elements; written quantized, read back
  by torch's paths dequantized (gather's dtype), by the native kernels in place;
- a block table is int32 block ids, position p in block table[p // BLOCK] at row p % BLOCK;
- the buffers hold one block more than the pool gives out (`spare`, the last): a graphed decode step's padding rows
  write there (cuda_graphs.py).

A block is free, used (referenced by one or more sequences: a shared prefix is referenced, never copied), or
cached (unreferenced, holding a full block of a known token chain: prefix_cache.py's hash). Allocation takes a
free block (the lowest id: the resident set stays compact on the CPU, where the pool is allocated but only
touched pages are resident), else evicts the least recently used cached one. Cached blocks and state
snapshots beyond the prefix budget are evicted at once. A block in use is never evicted, and positions below a
sequence's length are never written again (writes go at and past it, into blocks no one else holds), so an
eviction never changes an answer: a miss recomputes the same positions.

With a host tier (CUDA: --prefix-cache-host-gb), an evicted cached block is copied to pinned host memory first
(asynchronously, on the stream that later overwrites the block, so the copy reads it before); a lookup that misses
on the device finds it there and copies it back into a newly allocated block. The host tier keeps least recently
used blocks too; its copies run in stream order, so no synchronization is needed.
"""
from __future__ import annotations

import collections
import heapq
import itertools
import math

import torch

from moe_core import serving
from moe_core.config import ModelConfig
from moe_kernels import kv_quant

from gpu_service import metrics
from gpu_service.engine.block_names import next_name

BLOCK = 16  # positions per block (vLLM's default); a power of two (the native kernel shifts)
GROW = 4  # blocks a growing sequence takes at once while the pool has SPARE x that many free
SPARE = 4
# Blocks whose pages a CPU pool touches when it is made: the allocator hands out the lowest ids first, so every
# request uses these. Untouched, each of their huge pages faulted on a decode step's first write into it, 1-3 ms
# each (zeroing and compacting for 2 MiB: docs/performance/decode_step.md, "Inside the attention block"), once per layer, head
# and K/V in the first requests. The rest of the pool stays untouched until used.
PREFAULT_BLOCKS = 512


class KVPool:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, num_blocks: int,
                 prefix_bytes: int = 0, host_bytes: int = 0, window_blocks: int | None = None,
                 layers: tuple[int, ...] | None = None):
        """num_blocks: the pool's size (at least one block); prefix_bytes: most bytes of cached blocks and
        state snapshots kept for reuse (0: no prefix caching); host_bytes: the host tier's size (pinned
        when the pool is on CUDA); window_blocks: the window pool's size where the model has window layers (None:
        num_blocks; on the CPU only touched pages take memory). layers: the window pool's own (its maker's)."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.cfg, self.dtype, self.device, self.num_blocks = cfg, dtype, device, num_blocks
        self.mla = cfg.attention == "mla"
        # whether sequences carry states besides their blocks (linear attention's, DeepSeek-V4's windows): a prefix
        # hit then needs a kept state too (prefix_cache.py)
        self.stateful = cfg.attention == "compressed" or any(cfg.is_linear_attention(L) for L in range(cfg.num_layers))
        rings = window_layers(cfg) if layers is None else ()
        own = set(layers if layers is not None else range(cfg.num_layers)) - set(rings)
        # the window layers' pool (its blocks cached as long as it has room: allocation evicts them first)
        self.window = KVPool(cfg, dtype, device, window_blocks or num_blocks, (window_blocks or num_blocks) *
                             block_bytes(cfg, dtype, rings) if prefix_bytes else 0, layers=rings) if rings else None
        self.windowed = [L in rings for L in range(cfg.num_layers)]  # which layers' rows are the window pool's
        self.reach = window_reach(cfg) if rings else 0
        self.reports = layers is None  # (the metrics are the main pool's)
        # one block more than the pool gives out: `spare`, which a graphed decode step's padding rows write into
        # (cuda_graphs.py), and a window table's entries below the window name
        self.spare = num_blocks
        rows = num_blocks + 1
        shapes = lambda L: [(*lead, kv_quant.row_width(dtype, n)) for lead, n in _rows(cfg, L, rows)]  # noqa: E731
        self.block_dim = 0 if self.mla else 1  # where the block index is in a layer's buffers
        # per layer its own buffers, None for a linear-attention layer and for the window pool's layers (untouched
        # pages of these cost no memory on the CPU; on CUDA they are the pool's reservation)
        self.own = [[_empty(s, dtype, device) for s in shapes(L)] if L in own and not cfg.is_linear_attention(L)
                    else None for L in range(cfg.num_layers)]
        # and every layer's as its readers take them (a window layer's from the window pool)
        self.bufs: list[list[torch.Tensor] | None] = [self.window.bufs[L] if self.windowed[L] else b
                                                      for L, b in enumerate(self.own)]
        if device.type == "cpu":
            for bufs in self.own:
                for t in bufs or ():
                    raw(t).narrow(self.block_dim, 0, min(rows, PREFAULT_BLOCKS)).zero_()
        self.block_bytes = block_bytes(cfg, dtype, tuple(sorted(own)))
        self.prefix_bytes = prefix_bytes
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free = list(range(num_blocks))  # a heap: lowest id first
        # unreferenced blocks with a hash, and snapshots, least recently used first: key -> stamp
        self.cached: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.snaps: collections.OrderedDict[bytes, tuple[list, int, int]] = collections.OrderedDict()  # -> (states, bytes, stamp)
        self.snap_bytes = 0
        self.stamp = itertools.count()
        self.host_blocks = host_bytes // self.block_bytes if self.caching and self.block_bytes else 0
        pin = device.type == "cuda"
        bd = self.block_dim
        self.host = [None if bufs is None else [
            torch.empty((*b.shape[:bd], self.host_blocks, *b.shape[bd + 1:]), dtype=b.dtype, pin_memory=pin) for b in bufs]
            for bufs in self.own] if self.host_blocks else []
        self.host_free = list(range(self.host_blocks))
        self.host_by_hash: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # least recently used first
        self._report()

    @property
    def caching(self) -> bool:
        return self.prefix_bytes > 0

    def available(self) -> int:
        """Blocks an allocation can have now (free, and cached ones it would evict)."""
        return len(self.free) + len(self.cached)

    def used(self) -> int:
        return self.num_blocks - self.available()

    def cached_bytes(self) -> int:
        return len(self.cached) * self.block_bytes + self.snap_bytes

    # -- blocks ---------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n blocks for one sequence's new positions (reference 1 each), or None if the pool has not that many."""
        if n > self.available():
            return None
        out = []
        for _ in range(n):
            b = heapq.heappop(self.free) if self.free else self._evict_block()
            self.ref[b] = 1
            out.append(b)
        self._report()
        return out

    def _evict_block(self) -> int:
        b, _ = self.cached.popitem(last=False)
        h = self.hash_of[b]
        del self.by_hash[h]
        self.hash_of[b] = None
        metrics.PREFIX_EVICTIONS.inc()
        if self.host_blocks:
            self._spill(b, h)
        return b

    def _spill(self, b: int, h: bytes) -> None:
        """Copy block b (chain h) to the host tier, the least recently used host block making room."""
        if h in self.host_by_hash:
            self.host_by_hash.move_to_end(h)
            return
        slot = self.host_free.pop() if self.host_free else self.host_by_hash.popitem(last=False)[1]
        for host, bufs in zip(self.host, self.own):
            if bufs is not None:
                for hb, db in zip(host, bufs):
                    raw(hb).select(self.block_dim, slot).copy_(raw(db).select(self.block_dim, b), non_blocking=True)
        self.host_by_hash[h] = slot
        metrics.PREFIX_HOST_SPILLS.inc()
        metrics.PREFIX_HOST_BLOCKS.set(len(self.host_by_hash))

    def restore(self, h: bytes) -> int | None:
        """A block holding chain h copied back from the host tier (referenced once, named), or None."""
        slot = self.host_by_hash.get(h)
        if slot is None or h in self.by_hash:
            return None
        self.host_by_hash.move_to_end(h)  # the allocation's own spill must not take this slot
        got = self.allocate(1)
        if got is None:
            return None
        b = got[0]
        for host, bufs in zip(self.host, self.own):
            if bufs is not None:
                for hb, db in zip(host, bufs):
                    raw(db).select(self.block_dim, b).copy_(raw(hb).select(self.block_dim, slot), non_blocking=True)
        self.register(b, h)
        metrics.PREFIX_HOST_RESTORES.inc()
        return b

    def share(self, b: int) -> None:
        """One more sequence holds block b (a prefix hit)."""
        if self.ref[b] == 0:
            del self.cached[b]
        self.ref[b] += 1

    def release(self, blocks: list[int]) -> None:
        """A sequence's blocks, in its order: the tail goes first in the eviction order (a chain's later blocks are
        no use without its earlier ones; vLLM's order too)."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of[b] is not None and self.caching:
                    self.cached[b] = next(self.stamp)
                else:
                    self._forget(b)
                    heapq.heappush(self.free, b)
        self._trim()
        self._report()

    def _forget(self, b: int) -> None:
        h = self.hash_of[b]
        if h is not None:
            del self.by_hash[h]
            self.hash_of[b] = None

    def register(self, b: int, h: bytes) -> None:
        """Block b (full, held by a sequence) holds the chain h: later requests may share it. Another block with
        the same chain (computed at the same time by another sequence) keeps it; b stays private."""
        if self.caching and h not in self.by_hash and self.hash_of[b] is None:
            self.by_hash[h], self.hash_of[b] = b, h

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    # -- states (linear attention's, DeepSeek-V4's windows) -------------------------------------
    def keep_states(self, h: bytes, states: list) -> None:
        """The layers' states after the block whose chain is h (tensors replaced, never changed
        in place, so holding them is the snapshot)."""
        if not self.caching or h in self.snaps:
            return
        n = sum(t.nbytes for s in states if s is not None for t in s)
        self.snaps[h] = (list(states), n, next(self.stamp))
        self.snap_bytes += n
        self._trim()
        self._report()

    def states(self, h: bytes) -> list | None:
        got = self.snaps.get(h)
        if got is None:
            return None
        self.snaps.move_to_end(h)
        self.snaps[h] = (got[0], got[1], next(self.stamp))
        return got[0]

    def _trim(self) -> None:
        """Evict the least recently used cached blocks and snapshots beyond the prefix budget."""
        while self.cached_bytes() > self.prefix_bytes and (self.cached or self.snaps):
            block_first = self.cached and (not self.snaps or next(iter(self.cached.values())) <
                                           next(iter(self.snaps.values()))[2])
            if block_first:
                heapq.heappush(self.free, self._evict_block())
            else:
                _, (_, n, _) = self.snaps.popitem(last=False)
                self.snap_bytes -= n
                metrics.PREFIX_EVICTIONS.inc()

    def clear(self) -> None:
        """Drop every cached block and snapshot (blocks in use stay)."""
        while self.cached:
            heapq.heappush(self.free, self._evict_block())
        self.snaps.clear()
        self.snap_bytes = 0
        if self.window is not None:
            self.window.clear()
        self._report()

    def _report(self) -> None:
        if not self.reports:
            return
        metrics.KV_BLOCKS.labels("used").set(self.used())
        metrics.KV_BLOCKS.labels("cached").set(len(self.cached))
        metrics.KV_BLOCKS.labels("free").set(len(self.free))
        metrics.PREFIX_BYTES.set(self.cached_bytes())


def window_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """The GQA layers whose queries see only their last `window` keys (gpt-oss's and MiMo-V2-Flash's sliding layers):
    their rows live in the window pool (KVPool.window). DeepSeek-V4's windows are each sequence's state instead."""
    if cfg.attention != "gqa":
        return ()
    return tuple(L for L in range(cfg.num_layers) if cfg.window(L) and not cfg.is_linear_attention(L))


def window_reach(cfg: ModelConfig) -> int:
    """The widest window of the window layers: the positions before its next that a sequence's step may read there."""
    return max((cfg.window(L) for L in window_layers(cfg)), default=0)


def window_pool_blocks(cfg: ModelConfig, sequences: int, step_tokens: int, caching: bool) -> int:
    """The window pool's size for `sequences` running at once in steps of up to `step_tokens` new positions: each
    sequence's blocks of the widest window's positions before its next (one more where they straddle a block) and
    of its new ones (one more where they straddle), a step's new positions; twice that with prefix caching (the last
    windows of finished prefixes, where later requests hit)."""
    running = sequences * (-(-(window_reach(cfg) - 1) // BLOCK) + 2) + -(-step_tokens // BLOCK)
    return running * (2 if caching else 1)


def entry_slots(rate: int) -> int:
    """DeepSeek-V4: the entries of windows of `rate` positions a block can hold (those closing in it)."""
    return -(-BLOCK // rate)


def _rows(cfg: ModelConfig, L: int, rows: int) -> list[tuple[tuple, int]]:
    """Layer L's buffers (not a linear-attention one's): each as (its leading dims, values a row)."""
    if cfg.attention == "compressed":  # DeepSeek-V4 (compressed_attention.py): a compressed layer's entries, a CSA
        # layer's indexer's too; no per-position rows (its window and open windows are the sequence's state)
        rate = cfg.compress_rates[L]
        widths = ([cfg.head_dim] if rate else []) + ([cfg.index_dim] if cfg.csa(L) else [])
        return [((1, rows, entry_slots(rate)), n) for n in widths]
    if cfg.attention == "mla":  # the latent, the rotary key, DeepSeek Sparse Attention's indexer key where it has one
        return [((rows, BLOCK), cfg.kv_lora_rank), ((rows, BLOCK), cfg.qk_rope_head_dim)] + \
            ([((rows, BLOCK), cfg.index_dim)] if cfg.has_indexer(L) else []) + \
            ([((rows, BLOCK), cfg.index_dim)] * 2 if cfg.has_indexer(L) and cfg.index_kpool else [])  # GLM-5.3-Flash:
            # each key's pool gate logits, and at a pool's last position the pool's key
    return [((cfg.kv_heads(L), rows, BLOCK), cfg.head_dim), ((cfg.kv_heads(L), rows, BLOCK), cfg.value_dim)] + \
        ([((1, rows, BLOCK), cfg.index_dim)] if cfg.block_sparse(L) else [])  # MiniMax-M3's block indexer key


def raw(t: torch.Tensor) -> torch.Tensor:
    """A pool buffer as its elements are copied and indexed: an 8-bit one as bytes (torch does those on every
    device; fp8 tensors not everywhere)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def stored(buf: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(buf as written to, x [..., n] as its rows go there): an 8-bit pool's rows quantized (codes and scale,
    kv_quant.py) into its bytes; others as they are (cast on assignment)."""
    if kv_quant.quantized(buf.dtype):
        return buf.view(torch.uint8), kv_quant.quantize(x, buf.dtype)
    return buf, x


def _empty(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A pool buffer; on the CPU backed by huge pages where the kernel allows (a sequence's blocks can be anywhere in
    it: with 4 KiB pages each block read was a TLB miss)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu":
        serving.advise_huge_pages(t.data_ptr(), t.nbytes)
    return t


def block_bytes(cfg: ModelConfig, dtype: torch.dtype, layers: tuple[int, ...] | None = None) -> int:
    """Bytes of one block over these attention layers (None: every one; an 8-bit cache's scales included)."""
    def per_block(L: int) -> int:
        if cfg.is_linear_attention(L):
            return 0
        return sum(math.prod(lead) * kv_quant.row_width(dtype, n) for lead, n in _rows(cfg, L, 1))
    return sum(map(per_block, range(cfg.num_layers) if layers is None else layers)) * \
        torch.empty(0, dtype=dtype).element_size()


def pool_block_bytes(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of a block of the main pool, of the window pool: its layers' rows, 0 where the model has none)."""
    rings = window_layers(cfg)
    return block_bytes(cfg, dtype, tuple(L for L in range(cfg.num_layers) if L not in rings)), \
        block_bytes(cfg, dtype, rings)


def read(rows: torch.Tensor, pool_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.Tensor:
    """Rows of a pool of pool_dtype (an 8-bit pool's as bytes) as `dtype`'s values (None: as they are stored)."""
    if kv_quant.quantized(pool_dtype):
        return rows.view(pool_dtype) if dtype is None else kv_quant.dequantize(rows, pool_dtype, dtype)
    return rows if dtype is None or rows.dtype == dtype else rows.to(dtype)


class SeqCache:
    """One sequence's cache: its block table into the pool (and into the window pool, where the model has window
    layers), the ids it holds (for the prefix chain), and its layers' states (linear attention's; DeepSeek-V4's
    windows).

    A state is replaced, not appended to, so a step stages its new states and `commit` installs them once the
    whole forward pass is done: a step that fails half way (and is retried) leaves the sequence as it was, as KV
    entries written at fixed positions do."""

    def __init__(self, pool: KVPool, root: bytes = b""):
        self.pool, self.root = pool, root
        self.blocks: list[int] = []
        # the window pool's blocks, one a BLOCK positions as `blocks`; -1 below the window (given back: never read)
        self.wblocks: list[int] = []
        self._table: torch.Tensor | None = None  # the block table as the native kernel takes it
        self._wtable: torch.Tensor | None = None  # the window table so (given back entries: the window pool's spare)
        self._index: tuple[torch.Tensor, bool] | None = None  # as gather takes it, and whether ids are consecutive
        self.length = 0  # positions held (the same in every layer once a step completes)
        self.tokens: list[int] = []  # their ids
        self.hashes: list[bytes] = []  # the chain of each full block (prefix_cache.py)
        self.states: list[tuple[torch.Tensor, ...] | None] = [None] * pool.cfg.num_layers  # as of `length`
        self.staged: dict[int, tuple[torch.Tensor, ...]] = {}
        self.aligned: tuple[bytes, list] | None = None  # a stateful pool's: the states at the last full block
        self.keep_at = 0  # a stateful pool's: keep the states when the length reaches this block boundary

    # -- blocks ---------------------------------------------------------------------------------
    def reserve(self, end: int) -> bool:
        """Blocks for positions below `end` (False: the pool has not enough; nothing taken). A growing sequence
        takes GROW blocks at once while the pool has room to spare: taken together they are consecutive ids, so
        sequences decoding side by side do not interleave block by block (scattered blocks cost the paged kernel
        up to ~1.4x at long contexts; bench_attention.py)."""
        got = _take(self.pool, -(-end // BLOCK) - len(self.blocks), bool(self.blocks))
        if got is None:
            return False
        window = self.pool.window
        if window is not None:
            wgot = _take(window, -(-end // BLOCK) - len(self.wblocks), bool(self.wblocks))
            if wgot is None:
                self.pool.release(got)  # (new blocks: back to the free list)
                return False
            if wgot:
                self.wblocks += wgot
                self._wtable = None
        if got:
            self.blocks += got
            self._table = self._index = None
        return True

    def room(self) -> int:
        """The most positions this sequence could hold with the pool as it is."""
        room = (len(self.blocks) + self.pool.available()) * BLOCK
        if self.pool.window is not None:
            room = min(room, (len(self.wblocks) + self.pool.window.available()) * BLOCK)
        return room

    def release(self) -> None:
        """Give the blocks back (full ones stay cached for reuse) and keep the last aligned states."""
        if self.aligned is not None:
            self.pool.keep_states(*self.aligned)
            self.aligned = None
        self.pool.release(self.blocks)
        if self.pool.window is not None:
            self.pool.window.release([b for b in self.wblocks if b >= 0])
        self.blocks, self.wblocks, self._table, self._wtable, self._index = [], [], None, None, None

    def __del__(self):  # a direct caller's dropped cache gives its blocks back (the engine releases explicitly)
        if self.blocks or self.wblocks:
            self.release()

    def table(self, layer: int | None = None) -> torch.Tensor:
        """The block table a layer's rows are read through (the main pool's, or a window layer's: the window
        table)."""
        if layer is not None and self.pool.windowed[layer]:
            return self.window_table()
        if self._table is None:
            self._table = torch.tensor(self.blocks, dtype=torch.int32)
        return self._table

    def window_table(self) -> torch.Tensor:
        """The window table as the native kernels take it (given back entries: the window pool's spare)."""
        if self._wtable is None:
            spare = self.pool.window.spare
            self._wtable = torch.tensor([b if b >= 0 else spare for b in self.wblocks], dtype=torch.int32)
        return self._wtable

    def first(self, layer: int | None = None) -> int:
        """The block of position 0 where the layer's blocks are consecutive ids (the kernels then read each head's
        rows as one strided matrix), else -1 (read through the table; a window layer's always)."""
        if layer is not None and self.pool.windowed[layer]:
            return -1
        return self.blocks[0] if self.consecutive() else -1

    def held_from(self, layer: int) -> int:
        """The first position whose rows the layer still holds (a window layer's: its window's first block's)."""
        if not self.pool.windowed[layer]:
            return 0
        return next((i for i, b in enumerate(self.wblocks) if b >= 0), len(self.wblocks)) * BLOCK

    def _slide(self) -> None:
        """Give back the window pool's blocks below every window layer's reach from the next position (full and
        named: they stay cached for a prefix hit there)."""
        lo = min(max(0, self.length - self.pool.reach + 1) // BLOCK, len(self.wblocks))
        old = [b for b in self.wblocks[:lo] if b >= 0]
        if old:
            self.pool.window.release(old)
            self.wblocks[:lo] = [-1] * lo
            self._wtable = None

    def write(self, layer: int, start: int, *xs: torch.Tensor) -> None:
        """Store xs ([t, ...] each, one per buffer of the layer) at positions start..start+t-1 (the engine reserved
        the blocks for the step; a direct caller's come here)."""
        bufs, t = self.pool.bufs[layer], xs[0].shape[0]
        if not self.reserve(start + t):
            raise MemoryError(f"the KV pool ({self.pool.num_blocks} blocks of {BLOCK}) is full")
        bufs, xs = zip(*(stored(b, x) for b, x in zip(bufs, xs)))
        blocks = self.wblocks if self.pool.windowed[layer] else self.blocks
        if t == 1:
            b, o = blocks[start // BLOCK], start % BLOCK
            for buf, x in zip(bufs, xs):
                (buf[:, b, o] if not self.pool.mla else buf[b, o]).copy_(x[0])
            return
        pos = torch.arange(start, start + t)
        blk = torch.tensor(blocks, dtype=torch.long)[pos // BLOCK].to(self.pool.device)
        off = (pos % BLOCK).to(self.pool.device)
        for buf, x in zip(bufs, xs):
            if self.pool.mla:
                buf[blk, off] = x.to(buf.dtype)
            else:
                buf[:, blk, off] = x.transpose(0, 1).to(buf.dtype)

    def put(self, layer: int, which: int, blocks: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store rows x [n, dim] in the layer's buffer `which` (one of a single head, [1, blocks, slots, dim]) at
        (block id, slot) pairs: DeepSeek-V4's entries."""
        buf, x = stored(self.pool.bufs[layer][which], x)
        buf[0, blocks, slots] = x.to(buf.dtype)

    def consecutive(self) -> bool:
        """Whether the blocks are consecutive ids (then gather gives views, which the contiguous kernels read)."""
        if self._index is None:
            ids = self.blocks
            self._index = (torch.tensor(ids, dtype=torch.long, device=self.pool.device),
                           all(b == a + 1 for a, b in zip(ids, ids[1:])))
        return self._index[1]

    def block_ids(self) -> torch.Tensor:
        """The block table as a long tensor on the pool's device (for indexing the buffers)."""
        self.consecutive()
        return self._index[0]

    def gather(self, layer: int, end: int, begin: int = 0, dtype: torch.dtype | None = None,
               only: tuple[int, ...] | None = None) -> list[torch.Tensor]:
        """Positions begin..end-1 of the layer: GQA [kv heads, positions, dim], MLA [positions, dim]; a view when
        the blocks are consecutive (as a lone sequence's are: the lowest free ids first), else a copy. For the paths
        that have no paged kernel. dtype: the values in it (a copy where the pool holds another type; an 8-bit
        pool's rows dequantized), else the pool's rows as they are. only: these of the layer's buffers (by index), else
        every one."""
        b0, b1 = begin // BLOCK, -(-end // BLOCK)
        if self.pool.windowed[layer]:
            ids = self.wblocks[b0:b1]
            if min(ids, default=0) < 0:
                raise ValueError(f"layer {layer}'s positions from {begin} are below its window (given back)")
            first = ids[0] if ids and all(b == ids[0] + i for i, b in enumerate(ids)) else None
            idx = torch.tensor(ids, dtype=torch.long, device=self.pool.device)
        else:
            first = self.blocks[b0] if self.consecutive() else None
            idx = self._index[0][b0:b1]
        lo, n = begin - b0 * BLOCK, end - begin
        out = []
        bufs = self.pool.bufs[layer] if only is None else [self.pool.bufs[layer][i] for i in only]
        for buf in map(raw, bufs):
            if first is not None:  # one view, no copy
                rows = buf.narrow(self.pool.block_dim, first, b1 - b0)
            elif self.pool.mla:
                rows = buf.index_select(0, idx)
            else:  # a block of a head as one row: the copy moves whole rows (~10x faster for short contexts)
                rows = buf.view(buf.shape[0], buf.shape[1], -1).index_select(1, idx)
            if self.pool.mla:  # (explicit sizes: GLM-5.3-Flash's NoPE MLA has a rotary key of no dims)
                out.append(rows.reshape(rows.shape[0] * rows.shape[1], buf.shape[-1])[lo:lo + n])
            else:
                out.append(rows.reshape(buf.shape[0], -1, buf.shape[-1])[:, lo:lo + n])
        return [read(x, self.pool.dtype, dtype) for x in out]

    # -- states and the step's end --------------------------------------------------------------
    def stage(self, layer: int, *state: torch.Tensor) -> None:
        self.staged[layer] = state

    def commit(self, length: int, tokens: list[int]) -> None:
        """The step is complete: tokens now sit below `length`; the new states replace the old ones; full blocks
        join the prefix chain (_name_full_blocks)."""
        for layer, state in self.staged.items():
            self.states[layer] = state
        self.staged.clear()
        self.tokens += tokens
        self.length = length
        self._name_full_blocks()
        if self.pool.window is not None:
            self._slide()
        if self.pool.stateful and self.pool.caching and length % BLOCK == 0 and self.hashes:
            if length == self.keep_at:
                self.pool.keep_states(self.hashes[-1], self.states)
            else:
                self.aligned = (self.hashes[-1], list(self.states))

    def _name_full_blocks(self) -> None:
        """Name the newly full blocks (block_names.py) and offer them to the pool for prefix caching."""
        while len(self.hashes) < self.length // BLOCK:
            i = len(self.hashes)
            h = next_name(self.hashes[-1] if self.hashes else self.root, self.tokens[i * BLOCK:(i + 1) * BLOCK])
            self.hashes.append(h)
            self.pool.register(self.blocks[i], h)
            if self.pool.window is not None and i < len(self.wblocks) and self.wblocks[i] >= 0:
                self.pool.window.register(self.wblocks[i], h)

    @property
    def nbytes(self) -> int:
        window = self.pool.window
        return len(self.blocks) * self.pool.block_bytes + sum(
            t.nbytes for s in self.states if s is not None for t in s) + \
            (sum(b >= 0 for b in self.wblocks) * window.block_bytes if window is not None else 0)


def _take(pool: KVPool, need: int, growing: bool) -> list[int] | None:
    """`need` more blocks of the pool for a sequence ([] for none; None: the pool has not that many). A growing
    sequence takes GROW blocks at once while the pool has room to spare (SeqCache.reserve)."""
    if need <= 0:
        return []
    got = None
    if growing and need < GROW and len(pool.free) >= SPARE * GROW:  # never evicting cached ones for it
        got = pool.allocate(GROW)
    return got or pool.allocate(need)
