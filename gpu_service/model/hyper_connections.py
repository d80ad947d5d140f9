"""DeepSeek-V4's manifold-constrained hyper-connections: the residual is hc_mult streams [n, hc, H]. Before each block a
hyper-connection reads the streams and gives the block's input (their `pre`-weighted sum), and how the block's output
goes back: `post` spreads it over the streams, `comb` (a Sinkhorn-normalised, near doubly stochastic matrix) mixes the
streams themselves. The model's end collapses the streams once more (`head`). Numerics as transformers'
DeepseekV4HyperConnection / DeepseekV4HyperHead: the weights in fp32, the mix in fp32, the streams in the model dtype."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from moe_core.config import ModelConfig
from moe_kernels import hyper as native_hyper


@dataclasses.dataclass(slots=True)
class Streams:
    """The residual streams [n, hc, H], and the `post` [n, hc] and `comb` [n, hc, hc] (fp32) of the hyper-connection
    in front of the block whose output comes next (merge)."""
    h: torch.Tensor
    post: torch.Tensor | None = None
    comb: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.h.dtype

    @property
    def device(self) -> torch.device:
        return self.h.device


def streams(cfg: ModelConfig, x: torch.Tensor) -> Streams:
    """The embeddings [n, H] as hc_mult equal streams."""
    return Streams(x[:, None].expand(-1, cfg.hc_mult, -1).contiguous())


def _flat_normed(h: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row's streams as one vector, RMS-normed without a weight, in fp32."""
    flat = h.reshape(h.shape[0], -1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def mix(cfg: ModelConfig, W: dict, p: str, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hyper-connection under prefix p (p + fn / base / scale) over the streams h [n, hc, H] -> (post [n, hc],
    comb [n, hc, hc], the block's input [n, H])."""
    n, hc = h.shape[:2]
    eps = cfg.hc_eps
    if native_hyper.supported(h):  # one native call for the ~120 small ops below
        return native_hyper.mix(h, W[p + "fn"], W[p + "base"], W[p + "scale"], eps, cfg.rms_norm_eps, cfg.hc_iters)
    m = F.linear(_flat_normed(h, cfg.rms_norm_eps), W[p + "fn"].float())
    pre_w, post_w, comb_w = m.split([hc, hc, hc * hc], dim=-1)
    base, scale = W[p + "base"].float(), W[p + "scale"].float()
    pre = torch.sigmoid(pre_w * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + base[hc:2 * hc])
    comb = torch.softmax(comb_w.view(n, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_iters - 1):  # Sinkhorn: rows, then columns
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return post, comb, (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)


def expand(s: Streams, y: torch.Tensor) -> torch.Tensor:
    """The streams after the block whose output is y [n, H]: post spreads y over them, comb mixes the old ones."""
    dt = s.h.dtype
    if native_hyper.supported(s.h):  # one native call for the four ops below, their roundings
        return native_hyper.expand(s.h, y.to(dt), s.post, s.comb)
    return s.post.to(dt).unsqueeze(-1) * y.to(dt).unsqueeze(-2) + torch.matmul(s.comb.to(dt).transpose(-1, -2), s.h)


def head(cfg: ModelConfig, W: dict, h: torch.Tensor) -> torch.Tensor:
    """The final collapse of the streams [n, hc, H] -> [n, H] (before the final norm): DeepSeek-V4's weighted one, or
    (GLM-5.3-Flash, no hc_head weights) their mean."""
    if "model.hc_head.hc_fn" not in W:
        return h.mean(dim=1)
    m = F.linear(_flat_normed(h, cfg.rms_norm_eps), W["model.hc_head.hc_fn"].float())
    pre = torch.sigmoid(m * W["model.hc_head.hc_scale"].float() + W["model.hc_head.hc_base"].float()) + cfg.hc_eps
    return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
