"""The native routed-expert operator (C++ in native/, bf16 weights). Same contract as
TorchMoELayer; the kernel path (portable | avx512_bf16) is chosen at import from CPUID and the
OS's XSAVE state, or forced with MOE_KERNEL_PATH."""
from __future__ import annotations

import concurrent.futures
import logging
import os

import torch
import torch.nn.functional as F

from expert_service import _moe_native as _n

log = logging.getLogger("expert_service.kernels")


def choose_path() -> str:
    forced = os.environ.get("MOE_KERNEL_PATH")
    if forced:
        if not _n.path_supported(forced):
            raise RuntimeError(f"MOE_KERNEL_PATH={forced} cannot run on this CPU/OS (features: {_n.cpu_features()})")
        return forced
    return _n.best_path()


PATH = choose_path()
log.info("native MoE kernel path: %s", PATH)


def _row_len(n: int) -> int:
    """Elements per packed row: a multiple of 32 (no tail in the kernels) whose byte stride is not a
    multiple of 512, so the rows a micro-kernel touches together do not all map to one L1 set."""
    n = (n + 31) // 32 * 32
    return n + 32 if (n * 2) % 512 == 0 else n


def to_huge(t: torch.Tensor) -> torch.Tensor:
    """A copy of t on huge-page-advised memory owned by the returned tensor's storage chain."""
    buf = _n.HugeBuffer(t.nbytes)
    out = torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).view(t.shape)
    out.copy_(t)
    out._huge_buffer = buf  # keep the memory alive as long as the tensor
    return out


class NativeMoELayer:
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, fmt: str = "bf16",
                 threads: int | None = None, path: str | None = None):
        if fmt != "bf16":
            raise ValueError(f"the native kernels support bf16 weights, not {fmt!r}")
        E, I, H = gate.shape
        if up.shape != (E, I, H) or down.shape != (E, H, I):
            raise ValueError(f"expert shapes disagree: gate {tuple(gate.shape)}, up {tuple(up.shape)}, down {tuple(down.shape)}")
        self.num_experts, self.intermediate, self.hidden, self.fmt = E, I, H, fmt
        self.path = path or PATH
        # repacked once: gate and up fused so one pass reads both, the reduction dim zero-padded to
        # a multiple of 32 so the kernels need no tail handling
        self.Hp, self.Ip = _row_len(H), _row_len(I)
        self.gate_up = to_huge(F.pad(torch.cat([gate, up], dim=1).to(torch.bfloat16), (0, self.Hp - H)))  # [E, 2I, Hp]
        self.down = to_huge(F.pad(down.to(torch.bfloat16), (0, self.Ip - I)))                           # [E, H, Ip]
        _n.init_pool(threads or os.cpu_count() or 1)
        self._pool = None
        self._future = None

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    @property
    def nbytes_per_expert(self) -> int:
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
            _n.forward_bf16(self.path, self.num_experts, self.intermediate, self.hidden, self.Ip, self.Hp,
                            self.gate_up.data_ptr(),
                            self.down.data_ptr(), x.data_ptr(), ids.data_ptr(), w.data_ptr(), out.data_ptr(), T, k)
        else:
            out.zero_()
        return out.to(hidden.dtype)

    def submit(self, hidden, topk_ids, topk_weights) -> None:
        if self._future is not None:
            raise RuntimeError("submit() called twice without wait()")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moe")
        self._future = self._pool.submit(self.forward, hidden, topk_ids, topk_weights)

    def wait(self) -> torch.Tensor:
        if self._future is None:
            raise RuntimeError("wait() without submit()")
        fut, self._future = self._future, None
        return fut.result()
