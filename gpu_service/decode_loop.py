"""A decode step's layers in one native call (native/decode_loop.cpp): per layer the native attention block
(decode_step.py, which also routes), the routed experts handed over and their answer added, with no Python and no
torch op between the layers. Where the torch path (Model.forward's layer loop, the reference: the same tokens bit
for bit) costs ~15 ops and their Python a layer, this is one call a token.

It applies to a model whose every layer is an MoE layer with a native routing block and no shared experts
(Qwen3-MoE, Mixtral, Qwen2-MoE without its shared expert), to steps without deferral, and to experts that can
run it: the shared-memory ring to one expert service (RemoteExperts) and in-process native kernels
(LocalExperts); anything else takes the layer loop.

The experts drive it (`decode_layers(run, step, times, T, H, dtype, k)` on the Experts object): they supply the
exchange (a native RingClient or LocalExperts) and the policy while waiting, the loop supplies `run`."""
from __future__ import annotations

import torch

from moe_core.config import ModelConfig
from moe_kernels import native

from .experts import Span
from .kv_pool import BLOCK, KVPool

TIMES = native.DecodeLoop.times  # int64s a layer in the times array (native/decode_loop.h LoopTime)
ATTENTION_END, SUBMIT_END, WAIT_END = 0, 1, 2


def build(cfg: ModelConfig, blocks: dict, pool: KVPool) -> native.DecodeLoop | None:
    """The loop over every layer's block bound to its layer of `pool`; None when the model does not fit it."""
    if cfg.shared_intermediate_size or len(blocks) != cfg.num_layers or \
            not all(cfg.is_moe_layer(L) and blocks[L].routes for L in range(cfg.num_layers)):
        return None
    K = [pool.bufs[L][0] for L in range(cfg.num_layers)]
    V = [pool.bufs[L][1] for L in range(cfg.num_layers)]
    return native.DecodeLoop([blocks[L] for L in range(cfg.num_layers)], [t.data_ptr() for t in K],
                             [t.data_ptr() for t in V], K[0].stride(0), K[0].stride(1), BLOCK.bit_length() - 1,
                             owner=(blocks, pool))


def run(loop: native.DecodeLoop, experts, step: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        seqs: torch.Tensor, top_k: int, spans: list | None, t0: int) -> bool:
    """h [B, H] through every layer (updated in place) when `experts` can run the loop; False: they cannot (the
    caller takes the layer loop), nothing done. Raises what the experts' submit/result would. spans: the
    layers' attention, router, expert_submit and expert_wait spans appended (the layer loop's names), from t0."""
    decode_layers = getattr(experts, "decode_layers", None)
    if decode_layers is None:
        return False
    B, H = h.shape
    times = torch.empty(loop.layers, TIMES, dtype=torch.int64)
    ptrs = (B, h.data_ptr(), cos.data_ptr(), sin.data_ptr(), seqs.data_ptr(), times.data_ptr())

    def call(exchange, first: int, waiting: bool):
        return loop.run(*ptrs, first, waiting, exchange)

    if not decode_layers(call, step, times, B, H, h.dtype, top_k):
        return False
    if spans is not None:
        t = t0
        for L, row in enumerate(times.tolist()):
            a, s, w = row[ATTENTION_END], row[SUBMIT_END], row[WAIT_END]
            spans += (Span("attention", "gpu", L, step, t, a), Span("router", "gpu", L, step, a, a),
                      Span("expert_submit", "gpu", L, step, a, s), Span("expert_wait", "gpu", L, step, s, w))
            t = w
    return True
