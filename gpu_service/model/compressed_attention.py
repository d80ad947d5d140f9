"""DeepSeek-V4's attention (attention kind "compressed"), on torch: one KV head of head_dim read as both key and value,
over a sliding window of the layer's own keys plus, in a compressed layer, its compressed entries.

A compressed layer folds each window of `rate` positions into one entry: its compressor projects every position to kv
and gate, and an entry is the softmax-gated (per dim, over the window's slots, plus a learned bias per slot) sum of
the kv, normed and rotated at the window's first position. Heavily compressed layers (HCA) use one window; compressed
sparse ones (CSA) two series, the entry of window w reading window w-1's first series and window w's second. A query at
position p sees the entries of the windows closed at or before p; in a CSA layer only the index_topk of them its
lightning indexer scores best (the indexer runs its own compressor at index_dim over the same windows).

The paged pool holds, per position (kv_pool._rows): the window's key; in a compressed layer the compressor's kv and gate
of that position and, at the position that closes a window, the window's entry; a CSA layer the same three for its
indexer. An entry is written at its window's last position, so every block holds only what its own and earlier tokens
decide: prefix-cache hits, chunked prefill and batching read entries as any other cached row.

Numerics as transformers' DeepseekV4Attention / DeepseekV4{CSA,HCA}Compressor / DeepseekV4Indexer (fp32 norm weights
multiplying in fp32, the rope in fp32 on each head's trailing rotary dims in interleaved pairs, layout kept; the
compressors' softmax in fp32; per-head sinks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_core.config import ModelConfig
from moe_kernels import attention as native_attention
from moe_kernels.dense import linear_groups

from gpu_service.engine.kv_pool import BLOCK
from gpu_service.model.layers import linear, rms_norm, rope_cos_sin

KEY, COMPRESSOR, INDEXER = 0, 1, 4  # a layer's pool buffers (kv_pool._rows): its keys; a compressor's kv, gate, entries
ROPE = "model.rotary_emb.inv_freq"  # W's entry (Model): the compressed layers' rope, for entries' own positions
SCORE_BYTES = 256 << 20  # most bytes of fp32 attention scores held at once (queries go in row groups)


class PackedGroups:
    """The grouped output projection (wo_a) packed for the native kernels one group at a time (--dense-format): each
    group's [o_lora_rank, heads x head_dim / o_groups] rows a NativeLinear."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def grouped(o: torch.Tensor, w) -> torch.Tensor:
    """o [t, groups, K] through the grouped projection w ([groups x R, K], or PackedGroups) -> [t, groups, R]."""
    if isinstance(w, PackedGroups):
        return linear_groups(w.parts, o)
    return torch.einsum("tgk,grk->tgr", o, w.view(o.shape[1], -1, w.shape[-1]).to(o.dtype))


def projected(x: torch.Tensor, w) -> torch.Tensor:
    """x through a weight transformers keeps in fp32 (the compressors'): in fp32, packed (its published bf16 values)
    or not."""
    return linear(x.to(w.dtype), w) if isinstance(w, torch.Tensor) else w(x, as_float=True)


def unweighted_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, as transformers' DeepseekV4UnweightedRMSNorm rounds it."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [t, heads, d] with each head's trailing 2 * cos.shape[-1] dims rotated in interleaved pairs (in fp32, the
    layout kept: K = V, so the values carry it); cos/sin [t, pairs]."""
    rd = 2 * cos.shape[-1]
    c, s = (a.repeat_interleave(2, dim=-1)[:, None].float() for a in (cos, sin))
    r = x[..., -rd:].float()
    rot = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], (r * c + rot * s).to(x.dtype)], dim=-1)


def compressed_attention(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin, kv, layer: int,
                         native: bool = False, scale: float | None = None) -> torch.Tensor:
    """x [t, H] (the rows `kv` covers: one sequence's positions kv.start..) -> [t, H]."""
    t, nh, D, eps = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    qr = rms_norm(linear(x, W[p + "wq_a.weight"]), W[p + "q_norm.weight"], eps)
    q = rope_tail(unweighted_norm(linear(qr, W[p + "wq_b.weight"]).view(t, nh, D), eps), cos, sin)
    k = rope_tail(rms_norm(linear(x, W[p + "wkv.weight"]), W[p + "norm.weight"], eps)[:, None], cos, sin)
    rate, start, cache = cfg.compress_rates[layer], kv.start, kv.paged
    rows = [k]
    if rate:
        rows += _compress(cfg, W, p + "compressor.", x, cache, layer, start, rate, D, COMPRESSOR, cfg.csa(layer))
    if cfg.csa(layer):
        rows += _compress(cfg, W, p + "indexer.compressor.", x, cache, layer, start, rate, cfg.index_dim, INDEXER, True)
    kv.write(layer, *(r[:, None] if r.dim() == 2 else r for r in rows))
    o = attend(cfg, W, p, x, qr, q, cos, sin, cache, layer, start, native)
    o = rope_tail(o, cos, -sin).reshape(t, cfg.o_groups, -1)  # the values' rotation taken back at the query's position
    return linear(grouped(o, W[p + "wo_a.weight"]).reshape(t, -1), W[p + "wo_b.weight"])


def attend(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, cos, sin, cache,
           layer: int, start: int, native: bool = False) -> torch.Tensor:
    """The queries q [t, nh, D] of positions start.. (their keys and entries written) over the cached window and the
    entries each sees (a CSA layer's: those its indexer keeps; x, qr: the rows' input and normed low-rank query, which
    the indexer reads) -> [t, nh, D]. native: a decode row's indexer on the native kernels where they take the pool."""
    t, rate = x.shape[0], cfg.compress_rates[layer]
    lo = max(0, start - cfg.sliding_window + 1)  # the first key any query of this chunk sees
    K = cache.gather(layer, start + t, lo, x.dtype, only=(KEY,))[0][0]           # [L, D]
    E = seen = None
    n = (start + t) // rate if rate else 0  # entries of the windows closed by the chunk's end
    if n:
        E = cache.gather(layer, n * rate, 0, x.dtype, only=(COMPRESSOR + 2,))[0][0][rate - 1::rate]  # [n, D]
        at = torch.arange(start, start + t, device=x.device)[:, None]
        seen = torch.arange(n, device=x.device)[None, :] < (at + 1) // rate     # [t, n]: closed at each query
        if cfg.csa(layer) and n > cfg.index_topk:
            seen &= _index(cfg, W, p + "indexer.", x, qr, cos, sin, cache, layer, start, rate, n, native)
        if t == 1:  # a decode row reads only the entries it sees
            E, seen = E[seen[0]], None
    # (torch's matmuls, not the native decode attention: 64 query heads over one KV head re-read the keys per group of
    # 8 there; at 32k positions 4x slower than one product: docs/performance/decode_step.md)
    return _attend(cfg, q, K, E, seen, W[p + "attn_sink"], start, lo)


def _compress(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cache, layer: int, start: int, rate: int, d: int,
              first: int, overlap: bool) -> list[torch.Tensor]:
    """One compressor (prefix p) over the new positions: -> [kv, gate, entries] rows for the pool (buffers first..
    first + 2 of the layer): the projections of each position, and each window closed in the chunk its entry at its
    last position (zeros elsewhere). The earlier positions the windows need come from the pool."""
    t = x.shape[0]
    kv, gate = projected(x, W[p + "wkv.weight"]), projected(x, W[p + "wgate.weight"])
    entries = torch.zeros(t, d, dtype=kv.dtype, device=x.device)
    # (CSA: the window before the first too, for its first series)
    w0, w1, lo, (kv, gate) = closing_windows(cache, layer, start, rate, [kv, gate], (first, first + 1), int(overlap))
    if w1 > w0:
        c = kv.shape[1] // d
        ape = W[p + "ape"].float().view(rate, c, d)
        win = lambda a, w: a[w * rate - lo:(w + 1) * rate - lo].view(rate, c, d)  # noqa: E731
        ws = range(w0, w1)
        K = torch.stack([win(kv, w) for w in ws])                                   # [n, rate, c, d]
        G = torch.stack([win(gate, w) for w in ws]).float() + ape
        if overlap:  # slots: window w-1's first series (none before window 0), then window w's second
            prev = [win(kv, w - 1)[:, 0] if w else torch.zeros_like(K[0, :, 0]) for w in ws]
            gprev = [win(gate, w - 1)[:, 0].float() + ape[:, 0] if w else torch.full_like(G[0, :, 0], float("-inf"))
                     for w in ws]
            K = torch.cat([torch.stack(prev), K[:, :, 1]], dim=1)                   # [n, 2 rate, d]
            G = torch.cat([torch.stack(gprev), G[:, :, 1]], dim=1)
        else:
            K, G = K[:, :, 0], G[:, :, 0]
        e = (K * G.softmax(dim=1).to(K.dtype)).sum(dim=1)                           # [n, d]
        e = rms_norm(e, W[p + "norm.weight"], cfg.rms_norm_eps)
        pos = torch.arange(w0, w1, device=x.device) * rate  # each entry rotated at its window's first position
        cos, sin = rope_cos_sin(W[ROPE], 1.0, pos, e.dtype)
        entries[(pos + rate - 1 - start)] = rope_tail(e[:, None], cos, sin)[:, 0].to(entries.dtype)
    return [kv[-t:], gate[-t:], entries]


def closing_windows(cache, layer: int, start: int, rate: int, rows: list, bufs: tuple, back: int = 0) -> tuple:
    """The windows of `rate` positions that new positions start.. close (w0..w1-1: each closes at its last position) and
    the rows they read: `rows` (the new positions', one per pool buffer of `bufs`) after the pool's rows from `back`
    windows before w0 on -> (w0, w1, lo: the first position the rows hold, the rows). DeepSeek-V4's compressors and
    GLM-5.3-Flash's key pools."""
    t = rows[0].shape[0]
    w0, w1 = start // rate, (start + t) // rate
    lo = max(0, (w0 - back) * rate)
    if w1 > w0 and lo < start:
        old = cache.gather(layer, start, lo, rows[0].dtype, only=bufs)
        rows = [torch.cat([o.reshape(-1, o.shape[-1]), r]) for o, r in zip(old, rows)]  # (GQA's [1, n, d], MLA's [n, d])
    return w0, w1, lo, rows


def _index(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, qr: torch.Tensor, cos, sin, cache, layer: int,
           start: int, rate: int, n: int, native: bool = False) -> torch.Tensor:
    """The lightning indexer of a CSA layer: each query's index_topk best entries among the n closed by the chunk's
    end (those after a query's own position never) -> kept [t, n] bool. Scores as transformers' DeepseekV4Indexer:
    sum over heads of weight x relu(q . k) / sqrt(index_dim), in fp32; ties broken towards the earlier entry (the
    same pick whole, chunked or after a prefix-cache hit). native (a decode row): DeepSeek Sparse Attention's kernels
    (dsa_scores, dsa_top_k) over the entries where the pool holds them, every rate-th row of its blocks."""
    t, H, Di = x.shape[0], cfg.index_heads, cfg.index_dim
    q = rope_tail(linear(qr, W[p + "wq_b.weight"]).view(t, H, Di), cos, sin).float()
    wp = W[p + "weights_proj.weight"]
    w = linear(x.to(wp.dtype), wp).float() * H ** -0.5                             # [t, H]
    buf = cache.pool.bufs[layer][INDEXER + 2][0]                                   # [blocks, BLOCK, Di]
    if native and t == 1 and BLOCK % rate == 0 and native_attention.dsa_supported(buf):
        entries = buf[:, rate - 1::rate]  # entry e: row e % (BLOCK / rate) of block e // (BLOCK / rate)
        ids = native_attention.dsa_top_k(native_attention.dsa_scores(q[0], w[0], entries, cache.table(), n,
                                                                     Di ** -0.5), cfg.index_topk)
        return torch.zeros(1, n, dtype=torch.bool).index_fill_(1, ids.long(), True)
    keys = cache.gather(layer, n * rate, 0, x.dtype, only=(INDEXER + 2,))[0][0][rate - 1::rate].float()  # [n, Di]
    seen = (torch.arange(start, start + t, device=x.device)[:, None] + 1) // rate   # [t, 1]: entries each query sees
    future = torch.arange(n, device=x.device)[None, :] >= seen                      # [t, n]
    kept = torch.empty(t, n, dtype=torch.bool, device=x.device)
    group = max(1, SCORE_BYTES // max(1, H * n * 4))
    for i in range(0, t, group):
        r = slice(i, i + group)
        g = q[r].shape[0]
        s = (F.relu(torch.matmul(q[r].reshape(g * H, Di), keys.T)) * Di ** -0.5).view(g, H, n)
        s = torch.matmul(w[r, None, :], s)[:, 0].masked_fill(future[r], float("-inf"))
        top = s.sort(dim=-1, descending=True, stable=True).indices[:, :cfg.index_topk]
        kept[r] = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, top, True)
    return kept & ~future


def _attend(cfg: ModelConfig, q: torch.Tensor, K: torch.Tensor, E: torch.Tensor | None, seen: torch.Tensor | None,
            sinks: torch.Tensor, start: int, lo: int) -> torch.Tensor:
    """q [t, nh, D] at positions start.. over the window's keys K [L, D] (positions lo..) and the entries E [n, D]
    (those `seen` [t, n] marks for each query; None: all), each key its own value; a sink logit per head ->
    [t, nh, D]."""
    t, nh, D = q.shape
    keys = K if E is None else torch.cat([K, E])
    pos = torch.arange(start, start + t, device=q.device)[:, None]
    j = torch.arange(lo, lo + K.shape[0], device=q.device)[None, :]
    allowed = (j <= pos) & (j > pos - cfg.sliding_window)                          # [t, L]
    if E is not None:
        allowed = torch.cat([allowed, seen if seen is not None else allowed.new_ones(t, E.shape[0])], dim=1)
    o = torch.empty(t, nh, D, dtype=q.dtype, device=q.device)
    n = keys.shape[0]
    group = max(1, SCORE_BYTES // max(1, nh * n * 4))
    for i in range(0, t, group):  # (one 2-D product a group: torch's batched ones are far slower on a CPU)
        r = slice(i, i + group)
        g = q[r].shape[0]
        s = (torch.matmul(q[r].reshape(g * nh, D), keys.T).float() * D ** -0.5).view(g, nh, n)
        s = s.masked_fill(~allowed[r, None, :], float("-inf"))
        s = torch.cat([s, sinks.float().view(1, nh, 1).expand(g, nh, 1)], dim=-1)
        pr = s.softmax(dim=-1)[..., :-1].to(keys.dtype)
        o[r] = torch.matmul(pr.reshape(g * nh, n), keys).view(g, nh, D)
    return o
