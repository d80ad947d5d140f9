"""A hyper-connection's mix and expand on the native kernel (native/kernels/hyper_mix.cpp): DeepSeek-V4's and
GLM-5.3-Flash's Sinkhorn-normalised stream mixing in one call instead of ~120 torch ops, and the expand after the block
in one instead of four (gpu_service/model/hyper_connections.py mix and expand, the reference)."""
from __future__ import annotations

import torch

from . import ISA, native


def supported(h: torch.Tensor) -> bool:
    """Whether the kernel takes these streams: bf16 or fp32 on the CPU."""
    return h.device.type == "cpu" and h.dtype in (torch.bfloat16, torch.float32)


def mix(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, norm_eps: float,
        iters: int, isa: str = ISA) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [n, hc, H] (bf16 or fp32), fn [hc (2 + hc), hc H], base [hc (2 + hc)], scale [3] -> (post [n, hc], comb [n, hc,
    hc] fp32, the block's input [n, H] in h's dtype)."""
    n, hc, H = h.shape
    M = hc * (2 + hc)
    if not supported(h) or tuple(fn.shape) != (M, hc * H) or tuple(base.shape) != (M,) or scale.numel() != 3 or iters < 1:
        raise ValueError(f"hyper-connection mix: streams {list(h.shape)} {h.dtype}, fn {list(fn.shape)}, base "
                         f"{list(base.shape)}, scale {list(scale.shape)}, {iters} iterations do not fit")
    h = h.contiguous()
    fn, base, scale = (w.float().contiguous() for w in (fn, base, scale))
    post, comb, x = torch.empty(n, hc), torch.empty(n, hc, hc), torch.empty(n, H, dtype=h.dtype)
    native.hyper_mix(isa, n, hc, H, h.data_ptr(), h.dtype == torch.bfloat16, fn.data_ptr(), base.data_ptr(),
                     scale.data_ptr(), eps, norm_eps, iters, post.data_ptr(), comb.data_ptr(), x.data_ptr())
    return post, comb, x


def expand(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, isa: str = ISA) -> torch.Tensor:
    """The streams h [n, hc, H] after the block whose output is y [n, H] (h's dtype): post [n, hc] spreads y over them,
    comb [n, hc, hc] mixes the old ones -> [n, hc, H] in h's dtype, rounded as hyper_connections.expand's torch ops
    round."""
    n, hc, H = h.shape
    if not supported(h) or y.dtype != h.dtype or tuple(y.shape) != (n, H) or tuple(post.shape) != (n, hc) or \
            tuple(comb.shape) != (n, hc, hc):
        raise ValueError(f"hyper-connection expand: streams {list(h.shape)} {h.dtype}, y {list(y.shape)} {y.dtype}, "
                         f"post {list(post.shape)}, comb {list(comb.shape)} do not fit")
    h, y = h.contiguous(), y.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty_like(h)
    native.hyper_expand(isa, n, hc, H, h.data_ptr(), h.dtype == torch.bfloat16, y.data_ptr(), post.data_ptr(),
                        comb.data_ptr(), out.data_ptr())
    return out
