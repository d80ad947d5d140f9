"""The native routed-expert operator (C++ in native/). Same contract as TorchMoELayer.

Weights are packed once at load in one of moe_kernels.packing's formats (gate and up fused into one
[E, 2I, K] matrix). Activations are rounded to bf16 (bf16 weights) or quantized to int8 per token
(int formats); dequantization happens in registers. The kernel isa is moe_kernels.ISA; amx runs
prefill of bf16/int8 weights on tiles, everything else on AVX-512.
"""
from __future__ import annotations

import os

import torch

from moe_core.config import SILU, ExpertAct
from moe_kernels import ISA, native as _n
from moe_kernels.packing import FORMATS, alloc, data_ptr, layout, pack_expert, row_len, stack_rows, store_expert


ACTS = ("silu", "clamped_swiglu", "clamped_silu")  # native/moe.h's Act


class NativeMoELayer:
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: str = "bf16",
                 threads: int | None = None, isa: str | None = None, down_fmt: str | None = None):
        E, I, H = gate.shape
        if up.shape != (E, I, H) or down.shape != (E, H, I):
            raise ValueError(f"expert shapes disagree: gate {tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}")
        self._build(E, I, H, lambda e: (gate[e], up[e], down[e]), (fmt, down_fmt or fmt), threads, isa)

    @classmethod
    def from_experts(cls, E: int, I: int, H: int, load, fmt: str = "bf16", threads: int | None = None,
                     isa: str | None = None, down_fmt: str | None = None) -> "NativeMoELayer":
        """Pack expert by expert: load(e) -> (gate [I, H], up [I, H], down [H, I]) in any float dtype or as
        published (packing.Mx4, packing.Fp8), so at most one expert's source tensors exist beside the packed
        layer. down_fmt: down's format where it is not fmt."""
        self = cls.__new__(cls)
        self._build(E, I, H, load, (fmt, down_fmt or fmt), threads, isa)
        return self

    @classmethod
    def empty(cls, E: int, I: int, H: int, fmt: str, isa: str | None = None, down_fmt: str | None = None
              ) -> "NativeMoELayer":
        """A layer whose packed buffers (self.gu, self.dn) are allocated, not filled: the packed-weight
        cache reads straight into them, then calls ready()."""
        self = cls.__new__(cls)
        self._alloc(E, I, H, (fmt, down_fmt or fmt), isa)
        return self

    @classmethod
    def wrap(cls, E: int, I: int, H: int, fmt: str, gu: tuple, dn: tuple, threads: int | None = None,
             isa: str | None = None, down_fmt: str | None = None) -> "NativeMoELayer":
        """A layer over packed tensors that exist already (the packed-weight cache's mapped file), laid
        out as packed_layout() says; they are read, never written."""
        self = cls.__new__(cls)
        self._shape(E, I, H, (fmt, down_fmt or fmt), isa)
        self.gu, self.dn = tuple(gu), tuple(dn)
        self.ready(threads)
        return self

    @staticmethod
    def packed_layout(E: int, I: int, H: int, fmt: str, down_fmt: str | None = None) -> dict[str, tuple]:
        """{"gu": gate and up fused, "dn": down} -> packing.layout()'s (data, scale, rowsum, rowcorr)."""
        dfmt = down_fmt or fmt
        return {"gu": layout(fmt, E, 2 * I, row_len(H, fmt)), "dn": layout(dfmt, E, H, row_len(I, dfmt))}

    def _shape(self, E, I, H, fmts: tuple[str, str], isa) -> None:
        for f in fmts:
            if f not in FORMATS:
                raise ValueError(f"the native kernels support {FORMATS}, not {f!r}")
        self.num_experts, self.intermediate, self.hidden = E, I, H
        self.fmt, self.down_fmt = fmts  # gate/up's, down's
        self.path = isa or ISA
        self.act, self.biases = SILU, (None, None)
        self.Kp_h, self.Kp_i = row_len(H, self.fmt), row_len(I, self.down_fmt)

    def _alloc(self, E, I, H, fmts, isa) -> None:
        self._shape(E, I, H, fmts, isa)
        self.gu = alloc(self.fmt, E, 2 * I, self.Kp_h)       # [E, 2I, Kp_h]: gate rows, then up rows
        self.dn = alloc(self.down_fmt, E, H, self.Kp_i)      # [E, H, Kp_i]

    def ready(self, threads: int | None = None) -> None:
        self._bind()
        _n.init_pool(threads or os.cpu_count() or 1)

    def _bind(self) -> None:
        """The native layer over the packed buffers: the kernel isa and format resolved once; it keeps the
        buffers alive (owner) for as long as anyone holds it (the shared-memory ring does)."""
        self.native = _n.MoELayer(
            self.path, self.fmt, self.down_fmt, self.num_experts, self.intermediate, self.hidden, self.Kp_h, self.Kp_i,
            tuple(map(data_ptr, self.gu)), tuple(map(data_ptr, self.dn)), *map(data_ptr, self.biases),
            self.act.kind, self.act.alpha, self.act.limit, owner=(self.gu, self.dn, self.biases))

    def _build(self, E, I, H, load, fmts, threads, isa) -> None:
        self._alloc(E, I, H, fmts, isa)
        fmt, dfmt = fmts
        for e in range(E):
            g, u, d = load(e)
            if g.shape != (I, H) or u.shape != (I, H) or d.shape != (H, I):
                raise ValueError(f"expert {e}: shapes gate {tuple(g.shape)}, up {tuple(u.shape)}, down "
                                 f"{tuple(d.shape)}; expected [{I}, {H}], [{I}, {H}], [{H}, {I}]")
            store_expert(self.gu, e, pack_expert(stack_rows([g, u], fmt), fmt, self.Kp_h))
            store_expert(self.dn, e, pack_expert(d, dfmt, self.Kp_i))
        self.ready(threads)

    def set_extras(self, act: ExpertAct = SILU, gate_up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None) -> "NativeMoELayer":
        """gpt-oss's experts: their activation, and biases ([E, 2I] gate then up, [E, H]; kept in fp32,
        outside the packed weights and their cache)."""
        E, I, H = self.num_experts, self.intermediate, self.hidden
        for b, shape, name in ((gate_up_bias, (E, 2 * I), "gate_up_bias"), (down_bias, (E, H), "down_bias")):
            if b is not None and tuple(b.shape) != shape:
                raise ValueError(f"{name}: expected {list(shape)}, got {list(b.shape)}")
        if act.kind not in ACTS:
            raise ValueError(f"unknown expert activation {act.kind!r}")
        self.act = act
        self.biases = tuple(None if b is None else b.float().contiguous() for b in (gate_up_bias, down_bias))
        self._bind()
        return self

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.gu, *self.dn) if t is not None)

    @property
    def weight_bytes_per_expert(self) -> int:
        """Bytes the kernels read for one expert (quantized weights and their scales)."""
        return self.nbytes // self.num_experts

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] fp32/bf16; topk_ids [T, k] int; topk_weights [T, k] -> [T, H] in hidden.dtype."""
        T, k = topk_ids.shape
        if hidden.shape != (T, self.hidden):
            raise ValueError(f"hidden: expected [{T}, {self.hidden}], got {list(hidden.shape)}")
        if topk_weights.shape != (T, k):
            raise ValueError(f"topk_weights: expected [{T}, {k}], got {list(topk_weights.shape)}")
        x = hidden.float().contiguous()
        ids = topk_ids.to(torch.int32).contiguous()
        w = topk_weights.float().contiguous()
        out = torch.empty(T, self.hidden, dtype=torch.float32)
        if T and k:
            self.native.forward(x.data_ptr(), ids.data_ptr(), w.data_ptr(), out.data_ptr(), T, k)
        else:
            out.zero_()
        return out.to(hidden.dtype)

    def forward_part(self, hidden: int, hidden_bf16: bool, ids: int, weights: int, out: int, out_bf16: bool,
                     T: int, k: int, defer: int, part: int) -> None:
        """The exchange ring's entry: raw addresses (hidden [T, H] bf16|fp32, ids [T, k] int32, weights
        [T, k] fp32, out [T, H]) that the caller has bounds-checked; part 0 = the immediate experts, 1 =
        the deferred ones (moe_core/routing.py's rule, applied in C++). Raises ValueError on bad ids or
        non-finite inputs."""
        self.native.forward_part(hidden, hidden_bf16, ids, weights, out, out_bf16, T, k, defer, part)

    def exchange_part(self, request: bytes, part: int, received_unix_ns: int):
        """One part of a serialized LayerRequest that moe_exchange.wire.head() took, computed in C++ -> native.Exchanged
        (.result: the serialized LayerResult; .start_unix_ns/.end_unix_ns: the kernels' run). Raises ValueError on
        bad ids or non-finite inputs."""
        return self.native.exchange_part(request, part, received_unix_ns)
