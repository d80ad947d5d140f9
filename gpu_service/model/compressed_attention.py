"""DeepSeek-V4's attention (attention kind "compressed"), on torch: one KV head of head_dim read as both key and value,
over a sliding window of the layer's own keys plus, in a compressed layer, its compressed entries.

A compressed layer folds each window of `rate` positions into one entry: its compressor projects every position to kv
and gate, and an entry is the softmax-gated (per dim, over the window's slots, plus a learned bias per slot) sum of
the kv, normed and rotated at the window's first position. Heavily compressed layers (HCA) use one window; compressed
sparse ones (CSA) two series, the entry of window w reading window w-1's first series and window w's second. A query at
position p sees the entries of the windows closed at or before p; in a CSA layer only the index_topk of them its
lightning indexer scores best (the indexer runs its own compressor at index_dim over the same windows).

The paged pool holds only what grows with the context (kv_pool._rows): a compressed layer's entries (a CSA layer's
indexer's too), each in the block of its window's last position, so every block holds only what its own and earlier
tokens decide and prefix-cache hits, chunked prefill and batching read entries as any cached row. The rest is the
sequence's state (SeqCache.states, replaced by each step, snapshotted for prefix hits as linear attention's): the
window's last sliding_window - 1 keys and the rows of the compressor windows still open (CSA: and the last closed one,
whose first series the next entry reads), a fixed size however long the context.

Numerics as transformers' DeepseekV4Attention / DeepseekV4{CSA,HCA}Compressor / DeepseekV4Indexer (fp32 norm weights
multiplying in fp32, the rope in fp32 on each head's trailing rotary dims in interleaved pairs, layout kept; the
compressors' softmax in fp32; per-head sinks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_core.config import ModelConfig
from moe_kernels import attention as native_attention
from moe_kernels import norm_rope
from moe_kernels.dense import linear_groups

from gpu_service.engine.kv_pool import BLOCK, raw, read
from gpu_service.model.layers import linear, rms_norm, rope_cos_sin

ENTRIES, INDEX_ENTRIES = 0, 1  # a compressed layer's pool buffers (kv_pool._rows): its entries, a CSA layer's indexer's
ROPE = "model.rotary_emb.inv_freq"  # W's entry (Model): the compressed layers' rope, for entries' own positions
SCORE_BYTES = 256 << 20  # most bytes of fp32 attention scores held at once (queries go in row groups)
# most keys a decode row attends on the native kernel (64 heads over one KV head of 512: its fp32 FMAs); beyond, torch's
# bf16 products are as fast (docs/performance/decode_step.md, 2026-12-07)
NATIVE_KEYS = 2048
SPARSE_ENTRIES = 2  # a prompt chunk's CSA rows gather their own kept entries where there are this many times more


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


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native: bool = False,
              eps: float | None = None) -> torch.Tensor:
    """x [t, heads, d] with each head's trailing 2 * cos.shape[-1] dims rotated in interleaved pairs (in fp32, the
    layout kept: K = V, so the values carry it); cos/sin [t, pairs]. eps: each head first through unweighted_norm.
    native: one call on the CPU (moe_kernels.norm_rope.head_rope) into x itself -- every caller here passes a tensor
    it has just made -- for torch's ~10 ops a call (as complex products: half the ops of the pairs' real
    arithmetic)."""
    if native and norm_rope.head_rope_supported(x, cos):
        return norm_rope.head_rope(x, cos, sin, eps, inplace=True)
    if eps is not None:
        x = unweighted_norm(x, eps)
    rd = 2 * cos.shape[-1]
    rot = torch.complex(cos.float(), sin.float())[:, None]
    r = torch.view_as_real(torch.view_as_complex(x[..., -rd:].float().view(*x.shape[:-1], -1, 2)) * rot).flatten(-2)
    out = x.clone()
    out[..., -rd:] = r
    return out


def compressed_attention(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, cos, sin, kv, layer: int,
                         native: bool = False, scale: float | None = None) -> torch.Tensor:
    """x [t, H] (the rows `kv` covers: one sequence's positions kv.start..) -> [t, H]. Writes the entries of the
    windows the rows close and stages the layer's new state."""
    t, nh, D, eps = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    qr = rms_norm(linear(x, W[p + "wq_a.weight"]), W[p + "q_norm.weight"], eps, native=native)
    q = rope_tail(linear(qr, W[p + "wq_b.weight"]).view(t, nh, D), cos, sin, native, eps)
    k = rms_norm(linear(x, W[p + "wkv.weight"]), W[p + "norm.weight"], eps, native=native)
    k = rope_tail(k[:, None], cos, sin, native)[:, 0]
    rate, start, cache = cfg.compress_rates[layer], kv.start, kv.paged
    state = cache.states[layer] if start else None
    if state is None and start:
        raise RuntimeError(f"layer {layer}: no state for a sequence at position {start} (a prefix hit without one)")
    K = torch.cat([state[0], k]) if state is not None else k  # the window's keys, positions start + t - len(K)..
    new = [_rows_from(K, K.shape[0] - (cfg.sliding_window - 1))]
    if not cache.reserve(start + t):
        raise MemoryError(f"the KV pool ({cache.pool.num_blocks} blocks of {BLOCK}) is full")
    parts = [("compressor.", D, ENTRIES, cfg.csa(layer))] if rate else []
    if cfg.csa(layer):
        parts.append(("indexer.compressor.", cfg.index_dim, INDEX_ENTRIES, True))
    for i, (name, d, which, overlap) in enumerate(parts):
        w0, e, rows = _compress(cfg, W, p + name, x, state[1 + 2 * i:3 + 2 * i] if state is not None else None,
                                start, rate, d, overlap)
        if e is not None:
            cache.put(layer, which, *_entry_rows(cache, rate, torch.arange(w0, w0 + e.shape[0], device=x.device)), e)
        new += rows
    cache.stage(layer, *new)
    o = attend(cfg, W, p, x, qr, q, cos, sin, cache, layer, start, K, native)
    o = rope_tail(o, cos, -sin, native).reshape(t, cfg.o_groups, -1)  # the values' turn taken back at the query's
    return linear(grouped(o, W[p + "wo_a.weight"]).reshape(t, -1), W[p + "wo_b.weight"])


def attend(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, cos, sin, cache,
           layer: int, start: int, K: torch.Tensor, native: bool = False) -> torch.Tensor:
    """The queries q [t, nh, D] of positions start.. (their entries written) over the window's keys K [L, D] (the
    positions up to start + t - 1) and the entries each sees (a CSA layer's: those its indexer keeps; x, qr: the rows'
    input and normed low-rank query, which the indexer reads) -> [t, nh, D]. native: a decode row's indexer and
    attention on the native kernels where they take the pool (the attention's tasks 8 query heads each, so the one
    KV head's 64 spread over the threads)."""
    t, rate = x.shape[0], cfg.compress_rates[layer]
    E = seen = top = None
    n = (start + t) // rate if rate else 0  # entries of the windows closed by the chunk's end
    if n:
        at = torch.arange(start, start + t, device=x.device)[:, None]
        seen = torch.arange(n, device=x.device)[None, :] < (at + 1) // rate     # [t, n]: closed at each query
        if cfg.csa(layer) and n > cfg.index_topk:
            kept, top = _index(cfg, W, p + "indexer.", x, qr, cos, sin, cache, layer, start, rate, n, native)
            seen &= kept
        ids = None
        if t == 1:  # a decode row reads only the entries it sees
            ids, seen = (None if seen.all() else seen[0].nonzero()[:, 0]), None
        E = entries(cache, layer, ENTRIES, rate, n, ids, x.dtype)                 # [n or kept, D]
    if native and t == 1 and native_attention.any_dims(K) and K.shape[0] + (0 if E is None else E.shape[0]) <= \
            NATIVE_KEYS:  # a decode row: every key it has is one it sees
        keys = (K if E is None else torch.cat([K, E]))[None]
        o = native_attention.decode_attention(q[0], keys, keys, cfg.head_dim ** -0.5, sinks=W[p + "attn_sink"])
        return o.to(q.dtype)[None]
    # (a prompt's rows over many more entries than each keeps: each row over its own kept ones, gathered)
    sparse = top if t > 1 and top is not None and n > SPARSE_ENTRIES * cfg.index_topk else None
    return _attend(cfg, q, K, E, seen, W[p + "attn_sink"], start, start + t - K.shape[0], sparse)


def first_open(start: int, rate: int, back: int) -> int:
    """The first position whose compressor rows a sequence of `start` positions keeps: its open window's, and `back`
    closed windows' before it (CSA's entries read the previous window's first series)."""
    return max(0, (start // rate - back) * rate)


def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The most bytes a sequence's states take (its keys in `dtype`, the compressors' rows in fp32, as projected)."""
    size, n = torch.empty(0, dtype=dtype).element_size(), 0
    for L, rate in enumerate(cfg.compress_rates):
        n += (cfg.sliding_window - 1) * cfg.head_dim * size
        if rate:  # kv and gate of the rows first_open keeps at most (CSA: two series, the indexer's too)
            csa = cfg.csa(L)
            width = 2 * (cfg.head_dim + cfg.index_dim) if csa else cfg.head_dim
            n += 2 * ((1 + csa) * rate - 1) * width * 4
    return n


def _compress(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, old: tuple | None, start: int, rate: int, d: int,
              overlap: bool) -> tuple[int, torch.Tensor | None, list[torch.Tensor]]:
    """One compressor (prefix p) over the new positions, after its kept rows `old` (kv, gate: positions
    first_open(start, ..)..start - 1) -> (w0, the entries [n, d] of the windows w0.. the new positions close (None if
    none), its rows to keep: kv and gate from first_open(start + t, ..) on)."""
    t, back = x.shape[0], int(overlap)
    kv, gate = projected(x, W[p + "wkv.weight"]), projected(x, W[p + "wgate.weight"])
    if old is not None and old[0].shape[0]:
        kv, gate = torch.cat([old[0], kv]), torch.cat([old[1], gate])
    lo = first_open(start, rate, back)  # the position of the rows' first
    w0, w1 = start // rate, (start + t) // rate
    e = None
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
        e = rope_tail(e[:, None], cos, sin)[:, 0]
    keep = first_open(start + t, rate, back) - lo
    return w0, e, [_rows_from(kv, keep), _rows_from(gate, keep)]


def _rows_from(x: torch.Tensor, i: int) -> torch.Tensor:
    """x's rows from i on, to keep in a state: a view where it holds at least as many rows as it drops, else a copy (a
    view keeps its whole tensor alive: a prompt chunk's keys and compressor rows, held by a prefix snapshot too)."""
    i = max(0, i)
    return x[i:] if i <= x.shape[0] - i else x[i:].clone()


def _entry_rows(cache, rate: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the entries of windows w live in a layer's entry buffers: (block ids, slots); each at the block of its
    window's last position (kv_pool.entry_slots)."""
    last = (w + 1) * rate - 1
    return cache.block_ids()[last // BLOCK], (last % BLOCK) // rate


def entries(cache, layer: int, which: int, rate: int, n: int, w: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """The entries of windows w (a long tensor; None: all n closed ones) of one of a layer's entry buffers ->
    [len(w) or n, dim] of dtype (all of them a view where the slots fill the blocks and the blocks are consecutive)."""
    buf = raw(cache.pool.bufs[layer][which])[0]                                     # [blocks, slots, dim]
    if w is None and BLOCK % rate == 0:
        nb = -(-n // buf.shape[1])
        rows = buf.narrow(0, cache.blocks[0], nb) if cache.consecutive() else \
            buf.index_select(0, cache.block_ids()[:nb])
        return read(rows.reshape(-1, buf.shape[-1])[:n], cache.pool.dtype, dtype)
    if w is None:
        w = torch.arange(n, device=buf.device)
    return read(buf[_entry_rows(cache, rate, w)], cache.pool.dtype, dtype)


def _index(cfg: ModelConfig, W: dict, p: str, x: torch.Tensor, qr: torch.Tensor, cos, sin, cache, layer: int,
           start: int, rate: int, n: int, native: bool = False) -> torch.Tensor:
    """The lightning indexer of a CSA layer: each query's index_topk best entries among the n closed by the chunk's
    end (those after a query's own position never) -> kept [t, n] bool. Scores as transformers' DeepseekV4Indexer:
    sum over heads of weight x relu(q . k) / sqrt(index_dim), in fp32; ties broken towards the earlier entry (the
    same pick whole, chunked or after a prefix-cache hit), and on the torch path each row's picks [t, index_topk]
    (some of them future entries where fewer are closed; None on the native path). native (a decode row): DeepSeek
    Sparse Attention's kernels (dsa_scores, dsa_top_k) over the entries where the pool holds them."""
    t, H, Di = x.shape[0], cfg.index_heads, cfg.index_dim
    q = rope_tail(linear(qr, W[p + "wq_b.weight"]).view(t, H, Di), cos, sin, native).float()
    wp = W[p + "weights_proj.weight"]
    w = linear(x.to(wp.dtype), wp).float() * H ** -0.5                             # [t, H]
    buf = cache.pool.bufs[layer][INDEX_ENTRIES][0]                      # [blocks, entry_slots(rate), Di]
    if native and t == 1 and BLOCK % rate == 0 and native_attention.dsa_supported(buf):
        # (entry e: row e % slots of block e // slots, as the kernel reads a block table's rows)
        ids = native_attention.dsa_top_k(native_attention.dsa_scores(q[0], w[0], buf, cache.table(), n,
                                                                     Di ** -0.5), cfg.index_topk)
        return torch.zeros(1, n, dtype=torch.bool).index_fill_(1, ids.long(), True), None
    keys = entries(cache, layer, INDEX_ENTRIES, rate, n, None, x.dtype).float()                  # [n, Di]
    seen = (torch.arange(start, start + t, device=x.device)[:, None] + 1) // rate   # [t, 1]: entries each query sees
    future = torch.arange(n, device=x.device)[None, :] >= seen                      # [t, n]
    kept = torch.empty(t, n, dtype=torch.bool, device=x.device)
    picks = torch.empty(t, min(n, cfg.index_topk), dtype=torch.long, device=x.device)
    group = max(1, SCORE_BYTES // max(1, H * n * 4))
    for i in range(0, t, group):
        r = slice(i, i + group)
        g = q[r].shape[0]
        s = (F.relu(torch.matmul(q[r].reshape(g * H, Di), keys.T)) * Di ** -0.5).view(g, H, n)
        s = torch.matmul(w[r, None, :], s)[:, 0].masked_fill(future[r], float("-inf"))
        picks[r] = top = s.sort(dim=-1, descending=True, stable=True).indices[:, :cfg.index_topk]
        kept[r] = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, top, True)
    return kept & ~future, picks


def _attend(cfg: ModelConfig, q: torch.Tensor, K: torch.Tensor, E: torch.Tensor | None, seen: torch.Tensor | None,
            sinks: torch.Tensor, start: int, lo: int, top: torch.Tensor | None = None) -> torch.Tensor:
    """q [t, nh, D] at positions start.. over the window's keys K [L, D] (positions lo..) and the entries E [n, D]
    (those `seen` [t, n] marks for each query; None: all), each key its own value; a sink logit per head ->
    [t, nh, D]. Queries go in tiles of about a window, each over only the keys its window reaches (a band: the whole
    chunk's keys for every query made a prompt's attention quadratic in its length) and the entries; top [t, k]: each
    query's candidate entries (the indexer's picks, `seen` saying which count), gathered a row at a time instead of
    every row over all n."""
    t, nh, D = q.shape
    win, ne = cfg.sliding_window, 0 if E is None else E.shape[0]
    cols = ne if top is None else top.shape[1]
    o = torch.empty(t, nh, D, dtype=q.dtype, device=q.device)
    row_bytes = nh * (2 * win + cols) * 4 + (0 if top is None else cols * D * E.element_size())
    tile = max(1, min(max(win, 16), SCORE_BYTES // max(1, row_bytes)))
    for i in range(0, t, tile):  # (2-D products where they can be: torch's batched ones are slower on a CPU)
        g = min(tile, t - i)
        k0 = max(lo, start + i - win + 1)  # the first key the tile's first query sees
        Kw = K[k0 - lo:start + i + g - lo]
        pos = torch.arange(start + i, start + i + g, device=q.device)[:, None]
        j = torch.arange(k0, k0 + Kw.shape[0], device=q.device)[None, :]
        allowed = (j <= pos) & (j > pos - win)                                     # [g, window keys]
        qi = q[i:i + g]
        if top is not None:
            Es = E[top[i:i + g]]                                                   # [g, k, D]: each row's picks
            s = torch.cat([torch.matmul(qi.reshape(g * nh, D), Kw.T).view(g, nh, -1),
                           torch.bmm(qi, Es.transpose(1, 2))], dim=-1).float() * D ** -0.5
            allowed = torch.cat([allowed, seen[i:i + g].gather(1, top[i:i + g])], dim=1)
        else:
            keys = Kw if E is None else torch.cat([Kw, E])
            s = (torch.matmul(qi.reshape(g * nh, D), keys.T).float() * D ** -0.5).view(g, nh, -1)
            if E is not None:
                allowed = torch.cat([allowed, seen[i:i + g] if seen is not None else allowed.new_ones(g, ne)], dim=1)
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
        s = torch.cat([s, sinks.float().view(1, nh, 1).expand(g, nh, 1)], dim=-1)
        pr = s.softmax(dim=-1)[..., :-1].to(q.dtype)
        if top is not None:
            kw = Kw.shape[0]
            o[i:i + g] = (torch.matmul(pr[..., :kw].reshape(g * nh, kw), Kw).view(g, nh, D) +
                          torch.bmm(pr[..., kw:], Es))
        else:
            o[i:i + g] = torch.matmul(pr.reshape(g * nh, -1), keys).view(g, nh, D)
    return o
