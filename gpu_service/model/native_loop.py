"""A decode step's layers in one native call (native/decode/decode_loop.cpp): per layer the native attention block
(native_stages.py, which also routes), the routed experts handed over and their answer added, with no Python and no
torch op between the layers. Where the torch path (Model.forward's layer loop, the reference: the same tokens bit
for bit) costs ~15 ops and their Python a layer, this is one call a token.

It applies to a model whose every layer's attention block is native (GQA or MLA), dense layers first (their MLP
native) and MoE layers after them routing natively (softmax routers: Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V2;
sigmoid ones: GLM-4.5, DeepSeek-V3, MiMo-V2-Flash, whose sliding layers rotate with their own rope table and
whose values are narrower than its keys: each layer has its pool's strides and its choice of the step's two rope
tables), with
their shared experts native where the model has them (run while the expert service computes), to decode steps
with or without deferral (not the accuracy harness's skipping), and to experts that can run it: the shared-memory
ring to one expert service (RemoteExperts) and in-process native kernels (LocalExperts); anything else takes the
layer loop.

Where the lm_head is a packed native one, the loop also ends the step (set_head): the final norm and the lm_head in
the same call, the logits written where the caller asks (`run(..., logits=)`), as Model.forward's own end computes
them.

The experts drive it (`decode_layers(run, step, times, T, H, dtype, k)` on the Experts object): they supply the
exchange (a native RingClient or LocalExperts) and the policy while waiting, the loop supplies `run`."""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch

from moe_core.config import ModelConfig
from moe_kernels import native
from moe_kernels.attention import KV_CODES

from moe_exchange.protocol import Span
from gpu_service.engine.kv_pool import BLOCK, KVPool

TIMES = native.DecodeLoop.times  # int64s a layer in the times array (native/decode/decode_loop.h LoopTime)
(ATTENTION_END, SUBMIT_END, WAIT_END, QUEUED_US, COMPUTE_US, EXPERT_START, EXPERT_END, LATE_START, LATE_END,
 MLP_END) = range(10)


class Record(NamedTuple):
    """What one run of the loop measured, kept as its array: the metrics read it with numpy, and Spans (a dozen
    Python objects a layer, ~10 us) are made of it only for a profile."""
    step: int
    start_ns: int        # the first layer's start (the end of the span before)
    times: np.ndarray    # int64 [layers, TIMES]: the expert columns 0 where the experts ran here
    head_end: int = 0    # the head's end (the call's return) where it ran, else 0


class Figures(NamedTuple):
    """What the metrics take of records, ns (numpy int64)."""
    layers: np.ndarray    # the layer of each wait
    waits: np.ndarray     # the GPU side's wait for each layer's answers
    immediate: np.ndarray  # the expert service's compute of each layer's immediate part it reported
    deferred: np.ndarray   # ... and of each deferred part
    overhead: np.ndarray   # each reported layer's round trip (submit to answer) less its immediate compute


def fits(cfg: ModelConfig, blocks: dict, mlps: dict) -> bool:
    """Whether the loop can run the model: every layer's block native, the dense layers (each with its native MLP)
    before the MoE layers (each routing natively, with its native shared experts where the model has them)."""
    n = cfg.num_layers
    moe = [cfg.is_moe_layer(L) for L in range(n)]
    if len(blocks) != n or not moe[-1] or any(a and not b for a, b in zip(moe, moe[1:])):
        return False
    return all(blocks[L].routes == moe[L] and (moe[L] and not cfg.shared_intermediate_size or L in mlps)
               for L in range(n))


def build(cfg: ModelConfig, blocks: dict, mlps: dict, pool: KVPool,
          head: tuple | None = None) -> native.DecodeLoop | None:
    """The loop over every layer's block (and MLP) bound to its layer of `pool`; None when the model does not fit
    it (`fits`). head: (the final norm's weight,
    its eps, the lm_head as a NativeLinear) for the step's end in the same call, or None."""
    if not fits(cfg, blocks, mlps):
        return None
    n = cfg.num_layers
    K = [pool.bufs[L][0] for L in range(n)]
    V = [pool.bufs[L][1] for L in range(n)]
    loop = native.DecodeLoop([blocks[L] for L in range(n)], [mlps.get(L) for L in range(n)],
                             [t.data_ptr() for t in K], [t.data_ptr() for t in V], KV_CODES[pool.dtype],
                             [(k.stride(0), k.stride(1), v.stride(0), v.stride(1)) for k, v in zip(K, V)],
                             BLOCK.bit_length() - 1, [cfg.sliding_rope(L) for L in range(n)],
                             owner=(blocks, mlps, pool), second_table=pool.windowed)
    if head is not None:
        norm, eps, lm_head = head
        loop.set_head(norm.data_ptr(), norm.dtype == torch.bfloat16, eps, lm_head.native, owner=(norm, lm_head))
    return loop


def run(loop: native.DecodeLoop, experts, step: int, h: torch.Tensor, rope: tuple, seqs: torch.Tensor, top_k: int,
        defer: int, t0: int, spans: list | None, records: list | None, logits: torch.Tensor | None = None,
        rope_rows: int = 0, tokens: torch.Tensor | None = None, embed: torch.Tensor | None = None) -> bool:
    """h [B, H] through every layer (updated in place) when `experts` can run the loop; False: they cannot (the
    caller takes the layer loop), nothing done. rope: (cos, sin) of the step's positions, then the sliding layers'
    (cos, sin) where their base is their own (cfg.sliding_rope), else the same pair; seqs: native_stages.sequences's
    (the window layers read the second rows); with rope_rows, the whole tables
    (Model.rope_tables: rope_rows elements a position), each sequence's row taken in the call by its position.
    tokens (int64 [B]) and embed (the embedding table, h's dtype): h's rows their embeddings, set in the call (each
    torch op here costs tens of microseconds a token: the experts' bytes have streamed through the caches). defer:
    the layer loop's (every layer but the last). logits: fp32 [B, vocab] for the loop's head to fill (the loop has
    one), or None. Raises what the experts' submit/result would. What it measured (from t0): a Record appended to
    `records` when given, else its spans to `spans` (the layer loop's names, and the expert service's compute; the
    head's as lm_head)."""
    decode_layers = getattr(experts, "decode_layers", None)
    if decode_layers is None:
        return False
    B, H = h.shape
    times = np.empty((loop.layers, TIMES), np.int64)
    (cos, sin), (cos2, sin2) = rope
    ptrs = (B, h.data_ptr(), cos.data_ptr(), sin.data_ptr(), seqs.data_ptr(), times.ctypes.data)  # (main rows first)
    out = 0 if logits is None else logits.data_ptr()
    start = (rope_rows, 0, 0, 0) if embed is None else (rope_rows, tokens.data_ptr(), embed.data_ptr(), embed.shape[0])

    def call(exchange, first: int, waiting: bool):
        return loop.run(*ptrs, first, waiting, defer, exchange, out, cos2.data_ptr(), sin2.data_ptr(), *start,
                        seqs[1].data_ptr())

    if not decode_layers(call, step, times, B, H, h.dtype, top_k):
        return False
    rec = Record(step, t0, times, 0 if logits is None else time.time_ns())
    if records is not None:
        records.append(rec)
    elif spans is not None:
        spans += spans_of(rec)
    return True


def spans_of(rec: Record) -> list[Span]:
    """A run's spans for the profile: per MoE layer the GPU side's attention (the block), router (in the block:
    empty), expert_submit, shared_experts (where the model has them) and expert_wait, one after the other, and
    the expert service's compute where it reported one; per dense layer its attention and dense_mlp."""
    out, t, step = [], rec.start_ns, rec.step
    for L, row in enumerate(rec.times.tolist()):
        a, s, w, m = row[ATTENTION_END], row[SUBMIT_END], row[WAIT_END], row[MLP_END]
        out.append(Span("attention", "gpu", L, step, t, a))
        if not s:  # a dense layer
            out.append(Span("dense_mlp", "gpu", L, step, a, m))
            t = m
            continue
        out += (Span("router", "gpu", L, step, a, a), Span("expert_submit", "gpu", L, step, a, s))
        if m:
            out.append(Span("shared_experts", "gpu", L, step, s, m))
        out.append(Span("expert_wait", "gpu", L, step, m or s, w))
        if row[EXPERT_END]:
            out.append(Span("experts_immediate", "expert", L, step, row[EXPERT_START], row[EXPERT_END]))
        if row[LATE_END]:  # the previous layer's deferred part, read in this layer's wait
            out.append(Span("experts_deferred", "expert", L - 1, step, row[LATE_START], row[LATE_END]))
        t = w
    if rec.head_end:
        out.append(Span("lm_head", "gpu", -1, step, t, rec.head_end))  # with the final norm
    return out


def figures(recs: list[Record]) -> Figures:
    """The metrics' figures of the runs."""
    if not recs:
        z = np.zeros(0, np.int64)
        return Figures(z, z, z, z, z)
    t = np.concatenate([np.asarray(r.times) for r in recs])
    layers = np.concatenate([np.arange(r.times.shape[0]) for r in recs])
    moe = t[:, SUBMIT_END] != 0  # (a dense layer waits for nothing)
    t, layers = t[moe], layers[moe]
    waits = t[:, WAIT_END] - np.maximum(t[:, SUBMIT_END], t[:, MLP_END])  # from the shared experts' end
    remote, late = t[:, EXPERT_END] != 0, t[:, LATE_END] != 0
    immediate = t[remote, EXPERT_END] - t[remote, EXPERT_START]
    trip = t[remote, WAIT_END] - t[remote, SUBMIT_END]  # the round trip, shared experts or not
    return Figures(layers, waits, immediate, t[late, LATE_END] - t[late, LATE_START], np.maximum(0, trip - immediate))
