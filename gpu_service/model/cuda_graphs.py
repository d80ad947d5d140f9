"""Decode steps as captured CUDA graphs: the GPU side's step without per-op launches (issue #28; on the H200 the
per-op step was launch-bound: ~30 torch ops a layer, each a kernel launch, and host round trips between them).

A step whose every sequence adds one token runs, per bucket of (batch rows, context positions), as a fixed list of
segments over buffers that live as long as the bucket (those sized by rows alone shared by the buckets of as many
rows: Rows):
  head      the step's tokens, positions and block tables (one host->device copy), their rope rows, the KV slots
            each row writes and the attention mask; the embedding
  layer L   the residual add of the previous MoE layer's results (routed, deferred, shared), the attention block
            (input norm, q/k/v, rope, the KV write, attention, o_proj), the post-attention norm; then a dense layer's
            MLP, or an MoE layer's router into x, ids and w
  shared L  an MoE layer's shared experts on x: launched after x went to the expert service, so they overlap it
  tail      the last residual add, the final norm and the lm_head into the logits
Each segment runs eagerly the first time its bucket runs (the capture's warm-up, which is the step's own
computation), is captured as a graph right after, and is replayed from then on; the buckets a service expects
(--max-batch, --cuda-graphs-capture) are captured at start-up instead (prepare). Between segments the host hands x, ids
and w to the experts (the shared-memory channel copies them straight from the device: the layer's one device->host
copy and the stream's one synchronization) and copies each result into a bucket buffer (one host->device copy).

Attention has no paged kernel in torch: each row gathers its sequence's blocks up to the bucket's context and masks
the positions past its own (zeroing their values: never-written pool memory may hold NaN), in the per-head matmuls
the CPU path uses at decode. Padded rows write their keys into the pool's spare block, which it never gives out.
Layers the segments do not cover (linear attention, windows, sinks) and steps
with deferral skipped, a depth study or log-probabilities take Model.forward's per-op loop.

Graph-safe by construction: no host synchronization, no shapes that depend on values, every per-step value read from
the bucket's buffers. On the CPU (tests) the same segments run eagerly, and a recording stand-in for the graph checks
that each replay would read what the capture read (tests/model/test_graphed_decode.py)."""
from __future__ import annotations

import logging
from typing import Callable

import torch

from moe_core.config import ModelConfig

from gpu_service.model import step
from gpu_service.model.attention import masked_rows
from gpu_service.model.step import Exchange
from gpu_service.engine.kv_pool import BLOCK, KVPool, raw, read, stored

log = logging.getLogger("gpu_service.model.cuda_graphs")

BATCHES = (1, 2, 4, 8, 16, 32, 64)  # rows a bucket pads a step to
MIN_CONTEXT = 256  # positions of the smallest context bucket; the others double
GATHER_BYTES = 512 << 20  # most bytes one layer's gathered keys and values may take; a bigger bucket runs per op


def eligible(cfg: ModelConfig) -> bool:
    """Whether every layer fits the segments: full attention (GQA or MLA) everywhere, no sinks (DeepSeek Sparse
    Attention's indexer and MiniMax-M3's block indexer: not yet run on a GPU, so per op)."""
    return not (cfg.attn_sinks or cfg.index_topk or cfg.index_block) and all(
        not cfg.is_linear_attention(L) and not cfg.window(L) for L in range(cfg.num_layers))


def context_bucket(end: int) -> int:
    """Positions of the context bucket a step reaching position end - 1 runs in."""
    return max(MIN_CONTEXT, 1 << (end - 1).bit_length())


def bucket(cfg: ModelConfig, dtype: torch.dtype, rows: int, end: int) -> tuple[int, int] | None:
    """(batch rows, context positions) of the bucket a step of `rows` sequences reaching position end - 1 runs in;
    None where no bucket takes it (more rows than the largest, or a gather over GATHER_BYTES)."""
    B = next((b for b in BATCHES if b >= rows), None)
    if B is None:
        return None
    C = context_bucket(end)
    per_position = (cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.attention == "mla"
                    else 2 * cfg.num_kv_heads * cfg.head_dim) * dtype.itemsize
    return (B, C) if B * C * per_position <= GATHER_BYTES else None


def cuda_capture(stream: torch.cuda.Stream, pool) -> Callable:
    """fn -> a torch.cuda.CUDAGraph of it, after one run of fn (the warm-up, whose results the caller keeps),
    captured on `stream` into the memory pool all the runner's graphs share (they replay one at a time on one
    stream, and none keeps a tensor of its own past its end). capture_begin and capture_end directly:
    torch.cuda.graph's context also synchronizes the device and runs the garbage collector at each capture."""
    def capture(fn: Callable) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            fn()  # the warm-up torch asks for on the capturing stream (per-stream set-up); the step's result
            # thread_local: the service's other threads (a hot-expert placement swap's copies) may use the device
            # meanwhile; only this thread's calls are held to capture's rules
            g.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                fn()
            finally:
                g.capture_end()
        torch.cuda.current_stream(stream.device).wait_stream(stream)
        return g
    return capture


class Rows:
    """The buffers of B rows that every bucket of B rows shares (its contexts, deferring or not): the hidden states,
    the hand-over and the results, the logits. Buckets run one at a time and a step leaves nothing in them that a
    later step reads (no deferred part crosses a step: the last MoE layer defers none), so one set serves them all:
    at 64 rows the logits alone are 64 x vocab fp32 (39 MB at 151936), once instead of once per bucket."""

    def __init__(self, model, B: int):
        cfg, dev, dt = model.cfg, model.device, model.dtype
        H, k = cfg.hidden_size, cfg.top_k
        z = lambda *shape, dtype=dt: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        self.h = [z(B, H), z(B, H)]  # layer L reads h[L % 2] and writes the other: a segment run twice is the same
        # the hand-over's x, ids and w, two of each: MoE layers alternate, so what a layer handed over stays as it
        # was until its deferred part is in (one layer later; an Experts may compute from its inputs then)
        self.x = [z(B, H), z(B, H)]
        self.ids = [z(B, k, dtype=torch.int32), z(B, k, dtype=torch.int32)]
        self.w = [z(B, k, dtype=torch.float32), z(B, k, dtype=torch.float32)]
        self.y, self.late, self.shared = z(B, H), z(B, H), z(B, H)
        self.logits = z(B, model.lm_head.shape[0], dtype=torch.float32)


class Bucket:
    """The buffers and segments of one (rows, context) bucket; `deferring`: the results' merge adds a deferred
    part (a step with defer 0 has none to add); `rows`: the buffers it shares with the other buckets of B rows."""

    def __init__(self, model, pool: KVPool, B: int, C: int, deferring: bool, rows: Rows):
        cfg, dev, dt = model.cfg, model.device, model.dtype
        self.model, self.pool, self.B, self.C, self.deferring = model, pool, B, C, deferring
        nb = C // BLOCK
        pin = dev.type == "cuda"
        # per row: token, position, then the block table padded with the pool's spare block
        self.meta_host = torch.zeros(B, 2 + nb, dtype=torch.int32, pin_memory=pin)
        self.meta = torch.zeros(B, 2 + nb, dtype=torch.int32, device=dev)
        model.rope(torch.zeros(1, dtype=torch.long, device=dev), C)  # the table covers the bucket (and is kept)
        self.rope_table = model.rope_table
        rot = self.rope_table[0].shape[1]
        z = lambda *shape, dtype=dt: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        self.cos, self.sin = z(B, rot), z(B, rot)
        self.blk, self.off = z(B, dtype=torch.long), z(B, dtype=torch.long)  # where each row's new KV goes
        self.tables = z(B, nb, dtype=torch.long)
        self.unseen = z(B, C, dtype=torch.bool)  # the positions past each row's own
        self.h, self.x, self.ids, self.w = rows.h, rows.x, rows.ids, rows.w
        self.y, self.late, self.shared, self.logits = rows.y, rows.late, rows.shared, rows.logits
        self.slot = {L: i % 2 for i, L in enumerate(cfg.moe_layers)}
        self.positions = torch.arange(C, device=dev)
        self.segments: list[tuple[str, int, Callable]] = [("embed", -1, self._head)]
        for L in range(cfg.num_layers):
            self.segments.append(("attention", L, lambda L=L: self._layer(L)))
            if cfg.is_moe_layer(L) and cfg.shared_intermediate_size:
                self.segments.append(("shared_experts", L, lambda L=L: self._shared(L)))
        self.segments.append(("lm_head", -1, self._tail))
        self.graphs: list = [None] * len(self.segments)

    # -- the KV view the attention kinds take (attention.py): one token per row, each its own sequence's ----------
    decoding = True
    paged = None  # (no native kernel reads a graph's pool)

    def write(self, layer: int, *xs: torch.Tensor) -> None:
        """Each row's new entries at its slot: padded rows write the pool's spare block."""
        for buf, x in zip(self.pool.bufs[layer], xs):
            buf, x = stored(buf, x)  # (an 8-bit pool: the rows' codes and scales, as bytes)
            if buf.dim() == 4:  # GQA's [kv, blocks, BLOCK, d]
                buf[:, self.blk, self.off] = x.transpose(0, 1).to(buf.dtype)
            else:  # MLA's [blocks, BLOCK, r]
                buf[self.blk, self.off] = x.to(buf.dtype)

    def rows(self, layer: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each row's blocks up to the bucket's context, gathered: GQA [kv, B, C, d], MLA [B, C, r]; past a row's own
        length they read whatever the pool holds, hence the mask (and masked_rows' zeros)."""
        out = []
        for buf in self.pool.bufs[layer]:
            if buf.dim() == 4:
                rows = raw(buf)[:, self.tables].reshape(buf.shape[0], self.B, self.C, -1)
            else:
                rows = raw(buf)[self.tables].reshape(self.B, self.C, -1)
            out.append(read(rows, buf.dtype, dtype))
        return masked_rows(out, self.unseen), self.unseen

    # -- segments: every input and output a buffer of the bucket, every computation a stage of step.py -------------
    def _head(self) -> None:
        meta = self.meta.long()
        pos = meta[:, 1]
        self.tables.copy_(meta[:, 2:])
        self.blk.copy_(self.tables.gather(1, (pos // BLOCK)[:, None])[:, 0])
        self.off.copy_(pos % BLOCK)
        self.unseen.copy_(self.positions[None, :] > pos[:, None])
        self.cos.copy_(self.rope_table[0][pos])
        self.sin.copy_(self.rope_table[1][pos])
        self.h[0].copy_(step.embed(self.model, meta[:, 0]))

    def _merged(self, h: torch.Tensor) -> torch.Tensor:
        """h plus the previous MoE layer's results (step.merge): the late buffer holds zeros where none came."""
        return step.merge(h, self.y, self.late if self.deferring else None,
                          self.shared if self.model.cfg.shared_intermediate_size else None)

    def _layer(self, L: int) -> None:
        model, cfg = self.model, self.model.cfg
        h = self.h[L % 2]
        if L and cfg.is_moe_layer(L - 1):
            h = self._merged(h)
        h, x = step.attention(model, L, h, self.cos, self.sin, [(self.B, self)])
        if not cfg.is_moe_layer(L):
            h = h + step.mlp(model, L, x)
        else:
            ids, w = step.route(model, L, x)
            k = self.slot[L]
            self.x[k].copy_(x)
            self.ids[k].copy_(ids)
            self.w[k].copy_(w)
        self.h[(L + 1) % 2].copy_(h)

    def _shared(self, L: int) -> None:
        self.shared.copy_(step.mlp(self.model, L, self.x[self.slot[L]]))

    def _tail(self) -> None:
        cfg = self.model.cfg
        h = self.h[cfg.num_layers % 2]
        if cfg.is_moe_layer(cfg.num_layers - 1):
            h = self._merged(h)
        self.logits.copy_(step.logits(self.model, step.norm(self.model, h, "model.norm.weight")))


class GraphedDecode:
    """The graphed decode steps of one model on one KV pool. `capture`: fn -> something with replay(), having run fn
    once (the CUDA graph of fn; a recording stand-in in tests), None to run the segments eagerly (the same numbers)."""

    def __init__(self, model, pool: KVPool, capture: Callable | None):
        self.model, self.pool, self.capture = model, pool, capture
        self.buckets: dict[tuple[int, int, bool], Bucket] = {}
        self.rows: dict[int, Rows] = {}  # by batch rows: the buffers those buckets share

    def takes(self, segments: list) -> tuple[int, int] | None:
        """The bucket of a decode step's segments (one token each, on this pool), None where it runs per op."""
        if any(s.cache.pool is not self.pool for s in segments):
            return None
        return bucket(self.model.cfg, self.pool.dtype, len(segments), max(s.start for s in segments) + 1)

    def run(self, segments: list, key: tuple[int, int], experts, step: int, defer: int, mark) -> torch.Tensor:
        """The step -> logits [len(segments), vocab] fp32. mark(name, layer): a span ends (Model.forward's)."""
        cfg = self.model.cfg
        n = len(segments)
        b = self._bucket(*key, defer > 0)
        meta = self._padded(b, n)
        for i, s in enumerate(segments):
            if not s.cache.reserve(s.start + 1):
                raise MemoryError(f"the KV pool ({self.pool.num_blocks} blocks of {BLOCK}) is full")
            table = s.cache.table()
            meta[i, 0] = int(s.tokens[0])
            meta[i, 1] = s.start
            meta[i, 2:2 + len(table)] = table[:b.C // BLOCK]
            meta[i, 2 + len(table):] = self.pool.spare
        b.meta.copy_(meta, non_blocking=True)
        exchange = Exchange(experts, step, defer, self.model.last_moe_layer)
        for i, (name, L, _) in enumerate(b.segments):
            if name == "shared_experts":
                continue  # (played right after its layer's hand-over)
            self._play(b, i)
            mark(name, L)
            if name != "attention" or not cfg.is_moe_layer(L):
                continue
            k = b.slot[L]
            exchange.submit(L, b.x[k][:n], b.ids[k][:n], b.w[k][:n])
            mark("expert_submit", L)
            if b.segments[i + 1][0] == "shared_experts":  # overlaps the expert service's work
                self._play(b, i + 1)
            mark("shared_experts", L)  # (every MoE layer marks it, as the per-op path does)
            y, late = exchange.collect(L)
            mark("expert_wait", L)
            b.y[:n].copy_(y, non_blocking=True)  # (merged by the next segment: step.merge)
            if late is not None:
                b.late[:n].copy_(late, non_blocking=True)
            elif b.deferring:
                b.late.zero_()
        return b.logits[:n].clone()

    def prepare(self, rows: int, end: int, deferring: bool) -> list[Bucket]:
        """Captures ahead of need the buckets a step of up to `rows` sequences below position `end` runs in (every
        batch bucket up to rows', every context bucket up to end's, the gather limit allowing): their first steps then
        replay, where they would otherwise pause to capture mid-serving. Each segment runs once on padded rows, which
        read and write only the pool's spare block. -> the buckets prepared."""
        cfg, dtype = self.model.cfg, self.pool.dtype
        out = []
        for B in (b for b in BATCHES if b < 2 * min(rows, BATCHES[-1])):  # up to rows' bucket
            C = MIN_CONTEXT
            while C <= context_bucket(end) and bucket(cfg, dtype, B, C) == (B, C):
                b = self._bucket(B, C, deferring)
                b.meta.copy_(self._padded(b, 0), non_blocking=True)
                for i in range(len(b.segments)):
                    self._play(b, i)
                out.append(b)
                C *= 2
        return out

    def _padded(self, b: Bucket, n: int) -> torch.Tensor:
        """b's host meta with rows n.. padding: token 0 at position 0, every table entry the pool's spare block."""
        b.meta_host[n:, :2] = 0
        b.meta_host[n:, 2:] = self.pool.spare
        return b.meta_host

    def _bucket(self, B: int, C: int, deferring: bool) -> Bucket:
        key = (B, C, deferring)
        if key not in self.buckets:
            if B not in self.rows:
                self.rows[B] = Rows(self.model, B)
            self.buckets[key] = Bucket(self.model, self.pool, B, C, deferring, self.rows[B])
            log.info("decode graphs: a bucket of %d rows x %d positions%s", B, C, " (deferring)" if deferring else "")
        return self.buckets[key]

    def _play(self, b: Bucket, i: int) -> None:
        g = b.graphs[i]
        if g is not None:
            g.replay()
            return
        fn = b.segments[i][2]
        if self.capture is None:
            fn()
            return
        try:
            b.graphs[i] = self.capture(fn)  # (its warm-up run is this step's own computation)
        except Exception as e:  # (a capture that fails leaves the segment eager: the same numbers, slower)
            log.warning("decode graphs: capturing %s of layer %d failed (%s); running it per op from now on",
                        b.segments[i][0], b.segments[i][1], e)
            self.capture = None
            fn()  # (run twice if the warm-up did: every output a bucket buffer, none of its inputs)
