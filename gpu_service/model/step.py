"""One step of the model over a flat batch of tokens from several sequences, defined once.

A layer is these stages, each defined here and nowhere else:
  attention  the input norm, the layer's attention kind (attention.KINDS), the residual add, the post-attention
             norm (DeepSeek-V4, GLM-5.3-Flash: the residual as hyper-connected streams, hyper_connections.py); on
             the CPU one native call for all the step's sequences where native_stages.py built the layer's block
             (which also routes)
  route      an MoE layer's router: (expert ids, weights) per row
  mlp        a dense layer's MLP or an MoE layer's shared experts (native where native_stages.py built them)
  exchange   the routed experts handed over and collected, the previous layer's deferred part first (Exchange),
             and their sum added to the residual (merge)
  head       the final norm and the lm_head
Runners compose them and nothing else: `forward` below (the per-op layer loop, the reference), the native loop
(native_loop.py: every stage's native kernel, the whole step in one call) and CUDA graphs (cuda_graphs.py: these
functions captured per bucket of rows and positions). `choose` decides which runner a step takes; `describe` says at
start which one decode steps will take and why.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from moe_core.config import SILU, ExpertAct
from moe_core.routing import split_deferred
from moe_experts.kernels.torch_moe import activation
from moe_exchange.protocol import Experts, Span
from moe_kernels.dense import NativeLinear

from gpu_service.engine.kv_pool import KVPool, SeqCache
from gpu_service.model import hyper_connections as hc, native_loop, native_stages
from gpu_service.model.attention import KINDS, SequenceKV, kind
from gpu_service.model.layers import GATE_UP, linear, rms_norm
from gpu_service.model.layers import route as _route

PER_OP, NATIVE_LOOP, GRAPHS = "per-op", "native loop", "cuda graphs"  # the runners


@dataclasses.dataclass
class Segment:
    """One sequence's share of a step: `tokens` [t] at positions start..start+t-1."""
    cache: SeqCache
    tokens: torch.Tensor
    start: int
    all_logits: bool = False  # logits for every position (scoring), else only the last
    logprobs: bool = False    # scoring: log p(targets[i]) and the argmax at every position, into `scored`
    targets: torch.Tensor | None = None  # logprobs: the next token of each position (one fewer at the end)
    scored: tuple | None = None


# -- the stages ------------------------------------------------------------------------------------
def embed(model, tokens: torch.Tensor):
    """The residual of the tokens: their embeddings [n, H] (hyper-connected models: hc_mult streams, hc.Streams)."""
    e = F.embedding(tokens, model.W["model.embed_tokens.weight"])
    return hc.streams(model.cfg, e) if model.cfg.hc_mult else e


def norm(model, h: torch.Tensor, name: str) -> torch.Tensor:
    cfg = model.cfg
    return rms_norm(h, model.W[name], cfg.rms_norm_eps, cfg.norm_offset, model.native_attention)


def attention(model, L: int, h, cos, sin, kvs: list) -> tuple:
    """The attention block on torch (the reference): h [n, H] -> (h + attention, the post-attention norm of it).
    kvs: (rows, kv) in row order, each kv the cache view of its rows (attention.SequenceKV, or a graph's bucket).
    DeepSeek-V4, GLM-5.3-Flash: h the streams (hc.Streams), hyper-connections around the attention and before the
    MLP."""
    p = f"model.layers.{L}."
    fn, W, cfg = KINDS[kind(model.cfg, L)], model.W, model.cfg
    before, after = cfg.block_norms
    if cfg.hc_mult:
        post, comb, x = hc.mix(cfg, W, p + "hc_attn_", h.h)
        x = norm(model, x, p + before + ".weight")
    else:
        x = norm(model, h, p + before + ".weight")
    ap = p + cfg.attention_prefix(L)
    outs, off = [], 0
    for n, kv in kvs:
        sl = slice(off, off + n)
        outs.append(fn(cfg, W, ap, x[sl], cos[sl], sin[sl], kv, L, model.native_attention, model.scale))
        off += n
    a = torch.cat(outs) if len(outs) > 1 else outs[0]
    if cfg.hc_mult:
        s = hc.expand(hc.Streams(h.h, post, comb), a)
        post, comb, x = hc.mix(cfg, W, p + "hc_ffn_", s)
        return hc.Streams(s, post, comb), norm(model, x, p + after + ".weight")
    h = h + a
    return h, norm(model, h, p + after + ".weight")


def native_block(model, L: int, h: torch.Tensor, cos, sin, pool: KVPool, seqs: torch.Tensor):
    """The attention block as native_stages.py's native call for a decode step's rows (the same numbers as
    `attention`): h [B, H] updated in place -> (the post-attention norm, the router's (ids, w) where the block
    routes, else None)."""
    return native_stages.run(model.decode_blocks[L], pool, L, h, cos, sin, seqs, model.cfg.top_k)


def route(model, L: int, x: torch.Tensor, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE layer's router -> (ids int32 [n, k], weights fp32 [n, k]). tokens: the rows' ids, which a hash-routed
    layer's table (DeepSeek-V4) chooses the experts of."""
    table = model.W.get(f"model.layers.{L}.{model.cfg.ffn_prefix}.gate.tid2eid") if L in model.cfg.hash_layers else None
    return _route(model.cfg, x, *model.router(L), None if table is None else table[tokens.to(table.device)])


def swiglu_mlp(W: dict, p: str, x: torch.Tensor, act: ExpertAct = SILU) -> torch.Tensor:
    """SwiGLU (or act's clamped form) of the weights under prefix p (gate and up fused where packed)."""
    if p + GATE_UP in W:
        gate, up = linear(x, W[p + GATE_UP]).chunk(2, dim=-1)
    elif p + "w1.weight" in W:  # DeepSeek-V4's names
        gate, up = linear(x, W[p + "w1.weight"]), linear(x, W[p + "w3.weight"])
        return linear(activation(gate, up, act), W[p + "w2.weight"])
    else:
        gate, up = linear(x, W[p + "gate_proj.weight"]), linear(x, W[p + "up_proj.weight"])
    return linear(activation(gate, up, act), W[p + "down_proj.weight"])


def mlp(model, L: int, x: torch.Tensor, native: bool = False) -> torch.Tensor | None:
    """A dense layer's MLP, or an MoE layer's shared experts (None where it has none). native: a decode step's rows
    on native_stages.py's native MLP where it built one (the same numbers)."""
    cfg, W = model.cfg, model.W
    m = model.decode_mlps.get(L) if native else None
    if m is not None:
        return native_stages.mlp(m, x)
    fp = f"model.layers.{L}.{cfg.ffn(L)}."
    if not cfg.is_moe_layer(L):
        return swiglu_mlp(W, fp, x, cfg.mlp_act)
    if cfg.shared_intermediate_size == 0:
        return None
    if cfg.shared_expert_gate:  # Qwen2-MoE
        return F.sigmoid(linear(x, W[fp + "shared_expert_gate.weight"])) * swiglu_mlp(W, fp + "shared_expert.", x)
    return swiglu_mlp(W, fp + "shared_experts.", x, cfg.mlp_act)


def merge(h, y: torch.Tensor, late: torch.Tensor | None, shared: torch.Tensor | None):
    """h plus an MoE layer's results: its routed experts' (plus the previous layer's deferred part), plus its
    shared experts' (or a dense layer's MLP output as y). Streams (DeepSeek-V4): the sum expanded into them."""
    if late is not None:
        y = y + late
    y = y + shared if shared is not None else y
    return hc.Streams(hc.expand(h, y)) if isinstance(h, hc.Streams) else h + y


def logits(model, h: torch.Tensor) -> torch.Tensor:
    """The lm_head of final-normed rows -> fp32 [n, vocab]."""
    if isinstance(model.lm_head, NativeLinear):
        return model.lm_head(h, as_float=True)
    return linear(h, model.lm_head).float()


class Exchange:
    """A step's routed experts: each MoE layer's rows handed over, then its answer collected after the previous
    layer's deferred part (results arrive in request order). defer: the lowest-weighted experts of each MoE layer but
    the last (and only `defer_layers` where given) merged one MoE layer later; skip: dropped instead."""

    def __init__(self, experts: Experts, step: int, defer: int, last_moe: int, defer_layers: range | None = None,
                 skip: bool = False):
        self.experts, self.step, self.defer, self.last_moe = experts, step, defer, last_moe
        self.defer_layers, self.skip = defer_layers, skip
        self.pending: int | None = None  # the MoE layer whose deferred part is still outstanding
        self.deferring = False

    def submit(self, L: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        d = self.defer if L != self.last_moe and (self.defer_layers is None or L in self.defer_layers) else 0
        if self.skip and d:
            ids, w, _, _ = split_deferred(ids, w, d)
            d = 0
        self.experts.submit(self.step, L, x, ids, w, d)
        self.deferring = bool(d)

    def collect(self, L: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (layer L's immediate answer, the previous MoE layer's deferred answer or None)."""
        late = self.experts.result(self.pending, deferred=True) if self.pending is not None else None
        y = self.experts.result(L, deferred=False)
        self.pending = L if self.deferring else None
        return y, late


# -- which runner a step takes ---------------------------------------------------------------------
def choose(model, segments: list[Segment], skip: bool, defer: int, defer_layers) -> str:
    """The runner of a step: CUDA graphs (no log-probabilities) or the native loop for a plain decode step (every
    sequence adds one token, deferral not skipped, no depth study) where the model has them, else per_op. (The native
    loop also needs experts that can drive it: native_loop.run says, and per_op runs where they cannot.)"""
    plain = all(s.tokens.shape[0] == 1 for s in segments) and not (skip and defer) and defer_layers is None
    if not plain:
        return PER_OP
    if model.graphs != "off" and not any(s.logprobs for s in segments) and \
            model.graph_runner(segments[0].cache.pool).takes(segments) is not None:
        return GRAPHS
    if model.decode_blocks and model.native_loop(segments[0].cache.pool) is not None:
        return NATIVE_LOOP
    return PER_OP


def describe(model) -> str:
    """Which runner decode steps take on this model, and why (logged at start)."""
    cfg, n = model.cfg, model.cfg.num_layers
    if model.graphs != "off":
        return f"{GRAPHS} ({model.graphs}; steps of more rows or positions than a bucket's: {PER_OP})"
    blocks, mlps = len(model.decode_blocks), len(model.decode_mlps)
    if not blocks:
        dsa = ("; DeepSeek Sparse Attention's indexer, top k and latent attention on native kernels"
               if cfg.index_topk and model.native_attention else
               "; MiniMax-M3's block indexer and its sparse layers' attention on native kernels"
               if cfg.index_block and model.native_attention else "")
        return f"{PER_OP} (no native attention block for this model, dtype or kernel path{dsa})"
    if native_loop.fits(cfg, model.decode_blocks, model.decode_mlps):
        return f"{NATIVE_LOOP} ({n} layers' native blocks and {mlps} native MLPs in one call a step)"
    torch_layers = [L for L in range(n) if L not in model.decode_blocks]
    return (f"{PER_OP} with {blocks} of {n} layers' attention blocks native (torch's: layers {torch_layers}), "
            f"{mlps} native MLPs")


# -- the per-op runner ------------------------------------------------------------------------------
@torch.inference_mode()
def forward(model, segments: list[Segment], experts: Experts, step: int = 0, defer: int = 0,
            spans: list | None = None, skip: bool = False, exact_spans: bool = False,
            defer_layers: range | None = None, records: list | None = None) -> torch.Tensor:
    """The step -> logits [n, vocab] fp32 (Model.forward's contract), on the runner `choose` picks."""
    # on CUDA a span is only exact if the kernels finished: synchronize for profiles only
    sync = model.device.type == "cuda" and spans is not None and exact_spans
    clock = time.time_ns

    def mark(name: str, layer: int, t0: int) -> int:
        if sync:
            torch.cuda.synchronize(model.device)
        t1 = clock()
        if spans is not None:
            spans.append(Span(name, "gpu", layer, step, t0, t1))
        return t1

    t = clock()
    how = choose(model, segments, skip, defer, defer_layers)
    if how == GRAPHS:
        clock_at = [t]

        def segment_done(name: str, layer: int) -> None:
            clock_at[0] = mark(name, layer, clock_at[0])

        runner = model.graph_runner(segments[0].cache.pool)
        out = runner.run(segments, runner.takes(segments), experts, step, defer, segment_done)
        for s in segments:
            s.cache.commit(s.start + 1, s.tokens.tolist())
        return out
    if how == NATIVE_LOOP:
        out = _native_loop_step(model, segments, experts, step, defer, t, mark, spans, records)
        if out is not None:
            return out
        how = PER_OP  # the experts cannot drive the loop
    cfg, pool = model.cfg, segments[0].cache.pool
    decoding = all(s.tokens.shape[0] == 1 for s in segments)  # every sequence adds one token
    tokens = (segments[0].tokens if len(segments) == 1 else torch.cat([s.tokens for s in segments])).to(model.device)
    if decoding:  # one op where the aranges take B + 2: each costs ~10 us between the kernels
        positions = torch.tensor([s.start for s in segments], device=model.device)
    else:
        positions = torch.cat([torch.arange(s.start, s.start + s.tokens.shape[0]) for s in segments]).to(model.device)
    end = max(s.start + s.tokens.shape[0] for s in segments)
    cos, sin = model.rope(positions, end)
    # MiMo-V2-Flash: its sliding-window layers' rope base is their own
    sliding = model.rope(positions, end, sliding=True) if cfg.sliding_rope_theta else (cos, sin)  # (and DeepSeek-V4's)
    h = embed(model, tokens)
    # the attention blocks the native step takes run as one call each for all the sequences
    native_seqs = native_stages.sequences([s.cache for s in segments], [s.start for s in segments]) \
        if model.decode_blocks and decoding else None
    t = mark("embed", -1, t)
    layers = range(cfg.num_layers)
    out = None
    kvs = [(s.tokens.shape[0], SequenceKV(s.cache, s.start, s.tokens.shape[0])) for s in segments]
    exchange = Exchange(experts, step, defer, model.last_moe_layer, defer_layers, skip)
    for L in layers:
        routed = None  # the router's choice where the native block made it
        if native_seqs is not None and L in model.decode_blocks:
            x, routed = native_block(model, L, h, *(sliding if cfg.sliding_rope(L) else (cos, sin)), pool, native_seqs)
            t = mark("attention", L, t)
        else:
            h, x = attention(model, L, h, *(sliding if cfg.sliding_rope(L) else (cos, sin)), kvs)
            t = mark("linear_attention" if cfg.is_linear_attention(L) else "attention", L, t)
        native = native_seqs is not None
        if not cfg.is_moe_layer(L):
            h = merge(h, mlp(model, L, x, native), None, None)
            t = mark("dense_mlp", L, t)
            continue
        ids, w = routed or route(model, L, x, tokens)
        t = mark("router", L, t)  # the post-attention norm and the routing
        exchange.submit(L, x, ids, w)
        t = mark("expert_submit", L, t)  # the request handed over (wire bytes or the ring, its doorbell)
        shared = mlp(model, L, x, native)  # overlaps the expert service's work
        t = mark("shared_experts", L, t)
        y, late = exchange.collect(L)
        t = mark("expert_wait", L, t)
        # from pinned memory (shared-memory exchange) these copies to the GPU are asynchronous
        if y.dtype != h.dtype or y.device != h.device:  # (the parse of a no-op .to() costs more than these tests)
            y = y.to(device=model.device, dtype=h.dtype, non_blocking=True)
        if late is not None:
            late = late.to(device=model.device, dtype=h.dtype, non_blocking=True)
        h = merge(h, y, late, shared)
    if out is None:  # (else the native loop ended the step: the final norm, the lm_head and its span)
        h = _final_rows(model, h, segments, decoding)
    for s in segments:  # the step is complete: its linear-attention states replace the old ones
        s.cache.commit(s.start + s.tokens.shape[0], s.tokens.tolist())
    if out is None:
        out = logits(model, h)
        mark("lm_head", -1, t)
    return out


def _native_loop_step(model, segments: list[Segment], experts: Experts, step: int, defer: int, t: int, mark,
                      spans: list | None, records: list | None) -> torch.Tensor | None:
    """A decode step on the native loop (every layer in one call), with the step's start in the same call where the
    embedding table is h's dtype (each sequence's embedding row and rope rows taken natively: a torch op here costs
    tens of microseconds once the experts' bytes have streamed through the caches) and its end (final norm, lm_head)
    where the loop has the head -> logits, or None where the experts cannot drive the loop (nothing computed; the KV
    blocks for the new tokens reserved)."""
    cfg, pool = model.cfg, segments[0].cache.pool
    loop = model.native_loop(pool)
    B = len(segments)
    tokens = segments[0].tokens if B == 1 else torch.cat([s.tokens for s in segments])
    table = model.W["model.embed_tokens.weight"]
    end = max(s.start for s in segments) + 1
    rope = model.rope_tables(end)
    sliding = model.rope_tables(end, sliding=True) if cfg.sliding_rope_theta else rope
    seqs = native_stages.sequences([s.cache for s in segments], [s.start for s in segments])
    native_embed = table.dtype == model.dtype and table.is_contiguous() and tokens.dtype == torch.long and \
        tokens.device.type == "cpu" and table.device.type == "cpu"
    h = torch.empty(B, cfg.hidden_size, dtype=model.dtype) if native_embed else embed(model, tokens.to(model.device))
    t = mark("embed", -1, t)
    # the step's end in it too, where every row is a segment's last and per_op's end would be native too
    out = torch.empty(B, model.lm_head.rows) if loop.has_head and not any(s.logprobs for s in segments) else None
    if not native_loop.run(loop, experts, step, h, (rope, sliding), seqs, cfg.top_k, defer, t, spans, records, out,
                           rope[0].stride(0), *((tokens, table) if native_embed else ())):
        return None
    t = time.time_ns()
    if out is None:  # (the final norm and the lm_head on the layer loop's ops)
        out = logits(model, _final_rows(model, h, segments, True))
        mark("lm_head", -1, t)
    for s in segments:
        s.cache.commit(s.start + 1, s.tokens.tolist())
    return out


def _final_rows(model, h: torch.Tensor, segments: list[Segment], decoding: bool) -> torch.Tensor:
    """The final norm of the rows the lm_head takes (each segment's last, or all of it with all_logits); a logprobs
    segment is scored here instead (Segment.scored)."""
    if isinstance(h, hc.Streams):
        h = hc.head(model.cfg, model.W, h.h)
    h = norm(model, h, "model.norm.weight")
    if not decoding or any(s.logprobs for s in segments):  # else every row is a segment's last: all of h
        rows, off = [torch.zeros(0, dtype=torch.long)], 0
        for s in segments:
            n = s.tokens.shape[0]
            if s.logprobs:
                s.scored = _token_logprobs(model, h[off:off + n], s.targets)
            else:
                rows.append(torch.arange(off, off + n) if s.all_logits else torch.tensor([off + n - 1]))
            off += n
        h = h[torch.cat(rows).to(model.device)]
    return h


def _token_logprobs(model, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [n, H] (final-normed), targets [m <= n] -> (log p(targets[i]) at position i < m, argmax id at each
    position), in chunks of positions so that no [n, vocab] tensor exists for long contexts."""
    n, chunk = h.shape[0], max(1, (1 << 24) // model.cfg.vocab_size)
    nxt = targets.to(model.device)
    lps, ams = [torch.zeros(0)], []
    for i in range(0, n, chunk):
        lg = linear(h[i:i + chunk], model.lm_head).float()
        ams.append(lg.argmax(-1).cpu())
        j = min(i + chunk, len(nxt))  # positions whose next token is known
        if j > i:
            lps.append(lg[: j - i].log_softmax(-1).gather(1, nxt[i:j, None])[:, 0].cpu())
    return torch.cat(lps), torch.cat(ams)
