"""The native routed-expert operator (C++ in native/). Same contract as TorchMoELayer.

Weight formats, packed once at load (gate and up fused into one [E, 2I, K] matrix):
- bf16: as is;
- int8: symmetric, one fp32 scale per output channel (row);
- int4: symmetric, one fp32 scale per group of 64 consecutive weights of a row (INT4_GROUP).
Activations are rounded to bf16 (bf16 weights) or quantized to int8 per token (int formats);
dequantization happens in registers. The kernel path (portable | avx2 | avx512 | amx) is chosen at
import from CPUID and the OS's XSAVE state (amx: also the OS's grant of the tile state), or forced
with MOE_KERNEL_PATH. amx runs prefill of bf16/int8 weights on tiles, everything else on AVX-512.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from expert_service import _moe_native as _n

from .submit_wait import SubmitWait

log = logging.getLogger("expert_service.kernels")

FORMATS = ("bf16", "int8", "int4")
INT4_GROUP = 64


def choose_path() -> str:
    forced = os.environ.get("MOE_KERNEL_PATH")
    if forced and forced != "torch":
        if not _n.path_supported(forced):
            raise RuntimeError(f"MOE_KERNEL_PATH={forced} cannot run on this CPU/OS (features: {_n.cpu_features()})")
        return forced
    return _n.best_path()


PATH = choose_path()
log.info("native MoE kernel path: %s; NUMA: %s", PATH, _n.numa_topology())


def _ptr_of(buf) -> int:
    return torch.frombuffer(buf, dtype=torch.uint8).data_ptr()


def row_len(n: int, fmt: str) -> int:
    """Packed row length: a multiple of 64 elements (whole VNNI steps and int4 groups), bumped when
    the row's byte stride is a multiple of 512 so the rows a micro-kernel reads together do not all
    fall in one L1 set."""
    n = (n + 63) // 64 * 64
    nbytes = {"bf16": 2 * n, "int8": n, "int4": n // 2}[fmt]
    return n + 64 if nbytes % 512 == 0 else n


def huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized [E, ...] tensor on huge-page-advised memory (streaming GBs of weights without a
    TLB miss per 4 KiB), each expert's slice bound to its NUMA node before anything touches it."""
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    buf = _n.HugeBuffer(n)
    _n.numa_place(_ptr_of(buf), n // shape[0], shape[0])
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # keeps `buf` alive


def alloc(fmt: str, E: int, rows: int, Kp: int):
    """Empty packed storage of E experts' [rows, Kp] matrices: (data, scale, rowsum, rowcorr), None where
    the format has none."""
    if fmt == "bf16":
        return huge((E, rows, Kp), torch.bfloat16), None, None, None
    if fmt == "int8":
        return huge((E, rows, Kp), torch.int8), torch.empty(E, rows), torch.empty(E, rows, dtype=torch.int32), None
    return huge((E, rows, Kp // 2), torch.uint8), torch.empty(E, rows, Kp // INT4_GROUP), None, torch.empty(E, rows)


def pack_expert(w: torch.Tensor, fmt: str, Kp: int) -> tuple:
    """One expert's w [rows, K] (any float dtype) -> its (data, scale, rowsum, rowcorr) in the kernels' layout."""
    w = F.pad(w.float(), (0, Kp - w.shape[-1]))
    if fmt == "bf16":
        return w.to(torch.bfloat16), None, None, None
    if fmt == "int8":
        scale = (w.abs().amax(-1) / 127).clamp_min(1e-12)
        q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
        return q, scale, q.sum(-1, dtype=torch.int32), None
    R = w.shape[0]
    g = w.view(R, Kp // INT4_GROUP, INT4_GROUP)
    scale = (g.abs().amax(-1) / 7).clamp_min(1e-12)
    q = (torch.round(g / scale[..., None]).clamp(-7, 7) + 8).to(torch.uint8)      # 1..15, 8 = zero
    packed = q[..., :INT4_GROUP // 2] | (q[..., INT4_GROUP // 2:] << 4)           # byte i: elems i, i+32
    rowcorr = 128 * (scale * (q.float() - 8).sum(-1)).sum(-1)                      # takes the +128 of u8 x out
    return packed.reshape(R, Kp // 2), scale, None, rowcorr


def store_expert(dst: tuple, e: int, parts: tuple) -> None:
    for d, p in zip(dst, parts):
        if d is not None:
            d[e].copy_(p)


def _ptr(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


class NativeMoELayer(SubmitWait):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: str = "bf16",
                 threads: int | None = None, path: str | None = None):
        E, I, H = gate.shape
        if up.shape != (E, I, H) or down.shape != (E, H, I):
            raise ValueError(f"expert shapes disagree: gate {tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}")
        self._build(E, I, H, lambda e: (gate[e], up[e], down[e]), fmt, threads, path)

    @classmethod
    def from_experts(cls, E: int, I: int, H: int, load, fmt: str = "bf16", threads: int | None = None,
                     path: str | None = None) -> "NativeMoELayer":
        """Pack expert by expert: load(e) -> (gate [I, H], up [I, H], down [H, I]) in any float dtype, so at
        most one expert's source tensors exist beside the packed layer."""
        self = cls.__new__(cls)
        self._build(E, I, H, load, fmt, threads, path)
        return self

    @classmethod
    def empty(cls, E: int, I: int, H: int, fmt: str, path: str | None = None) -> "NativeMoELayer":
        """A layer whose packed buffers (self.gu, self.dn) are allocated, not filled: the packed-weight
        cache reads straight into them, then calls ready()."""
        self = cls.__new__(cls)
        self._alloc(E, I, H, fmt, path)
        return self

    def _alloc(self, E, I, H, fmt, path) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"the native kernels support {FORMATS}, not {fmt!r}")
        self.num_experts, self.intermediate, self.hidden, self.fmt = E, I, H, fmt
        self.path = path or PATH
        self.Kp_h, self.Kp_i = row_len(H, fmt), row_len(I, fmt)
        self.gu = alloc(fmt, E, 2 * I, self.Kp_h)   # [E, 2I, Kp_h]: gate rows, then up rows
        self.dn = alloc(fmt, E, H, self.Kp_i)       # [E, H, Kp_i]

    def ready(self, threads: int | None = None) -> None:
        self._wargs = self._weight_args()  # the packed buffers live as long as self
        _n.init_pool(threads or os.cpu_count() or 1)

    def _build(self, E, I, H, load, fmt, threads, path) -> None:
        self._alloc(E, I, H, fmt, path)
        for e in range(E):
            g, u, d = load(e)
            if g.shape != (I, H) or u.shape != (I, H) or d.shape != (H, I):
                raise ValueError(f"expert {e}: shapes gate {tuple(g.shape)}, up {tuple(u.shape)}, down "
                                 f"{tuple(d.shape)}; expected [{I}, {H}], [{I}, {H}], [{H}, {I}]")
            store_expert(self.gu, e, pack_expert(torch.cat([g, u]), fmt, self.Kp_h))
            store_expert(self.dn, e, pack_expert(d, fmt, self.Kp_i))
        self.ready(threads)

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
            _n.forward(*self._wargs, x.data_ptr(), ids.data_ptr(), w.data_ptr(), out.data_ptr(), T, k)
        else:
            out.zero_()
        return out.to(hidden.dtype)

    def _weight_args(self) -> tuple:
        return (self.path, self.fmt, self.num_experts, self.intermediate, self.hidden, self.Kp_h, self.Kp_i,
                *map(_ptr, self.gu), *map(_ptr, self.dn))

    def forward_part(self, hidden: int, hidden_bf16: bool, ids: int, weights: int, out: int, out_bf16: bool,
                     T: int, k: int, defer: int, part: int) -> None:
        """The exchange ring's entry: raw addresses (hidden [T, H] bf16|fp32, ids [T, k] int32, weights
        [T, k] fp32, out [T, H]) that the caller has bounds-checked; part 0 = the immediate experts, 1 =
        the deferred ones (moe_core/routing.py's rule, applied in C++). Raises ValueError on bad ids or
        non-finite inputs."""
        _n.forward_part(*self._wargs, hidden, hidden_bf16, ids, weights, out, out_bf16, T, k, defer, part)
