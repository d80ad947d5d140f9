"""Hot experts on the GPU side (gpu-service --gpu-experts N): each MoE layer's N most-used routed experts
computed in this process, on its device, while the expert service(s) compute the other pairs. The Experts
protocol (experts.py), wrapped around the remote one (one expert service or ShardedExperts):

    submit(layer)   the usage counted; pairs split by a per-layer table (global id -> hot slot or -1):
                    the cold ones go to the expert service(s) (hot pairs as id -1, rows with none left
                    out), then, on a GPU, the hot ones run here while the expert service works
    result(layer)   on the CPU, the hot ones run now, after the remote part came in (two thread pools
                    computing at once on the same cores slow both: docs/performance/hot_experts.md);
                    hot part + remote part, added in fp32 in that order, rounded once to the hidden dtype

Deferral: with `defer`, each token's pairs are put in descending weight order first (as ShardedExperts does),
so the last `defer` columns are the deferred pairs on both sides, and the expert service's own split (the same
rule) defers exactly those.

Placement: a background thread folds the usage into decayed counts every `interval` seconds, chooses each
layer's hot set (expert_usage.choose), builds the changed layers' operators (hot_layers.hot_layer, copying
the experts that stay) and hands them over; the engine thread installs them at the next step boundary, so a
step never mixes two placements and nothing waits for a build.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from gpu_service import metrics
from moe_exchange.dispatch import ExpertServiceError
from gpu_service.experts.usage import ExpertUsage, choose
from moe_exchange.protocol import Experts, PartTiming, ShardWait, Span
from gpu_service.experts.hot_layers import expert_bytes
from gpu_service.experts.usage import load_profile, save_profile
from gpu_service.experts.hot_layers import hot_layer

log = logging.getLogger("gpu_service.experts.hot")


class HotExperts:
    def __init__(self, remote: Experts, usage: ExpertUsage, build, placement: dict[int, list[int]],
                 device: torch.device, on_refresh=None):
        """build(layer, experts, old) -> the operator for `experts` of `layer` (old: the (experts, operator)
        it replaces, or None); placement: the hot experts of every MoE layer to start with; on_refresh(planned
        placement, counts): after each refresh and at close (the profile file)."""
        self.remote, self.usage, self.build, self.device = remote, usage, build, device
        self.on_refresh = on_refresh
        self.overlap = device.type != "cpu"
        self.n_experts = usage.n_experts
        self.hot: dict[int, list[int]] = {}
        self.ops: dict[int, object] = {}
        self.table: dict[int, torch.Tensor] = {}
        for L, experts in placement.items():
            self._install(L, experts, build(L, experts, None))
        self.planned = dict(self.hot)   # the refresh thread's view: installed, or built and waiting
        self.pending: dict[int, tuple] = {}
        self.lock = threading.Lock()
        self.out: dict[int, tuple] = {}
        self.step = None
        self.spans: list[Span] = []
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.pairs_hot, self.pairs_remote = metrics.EXPERT_PAIRS.labels("hot"), metrics.EXPERT_PAIRS.labels("remote")

    # -- the Experts protocol ------------------------------------------------------------------------------
    def submit(self, step, layer, x, ids, w, defer):
        if step != self.step:  # a step boundary: nothing of the last step is in flight
            self.step = step
            self._install_pending()
        self.usage.observe(layer, ids)
        if defer:
            order = torch.argsort(w, dim=1, descending=True, stable=True)
            ids, w = ids.gather(1, order), w.gather(1, order)
        T, k = ids.shape
        slot = self.table[layer][ids.long()]
        hot = slot >= 0
        cold_rows = (~hot).any(dim=1)
        n_cold_rows, n_hot = torch.stack([cold_rows.sum(), hot.sum()]).tolist()
        remote_ids = torch.where(hot, -1, ids.to(torch.int32))
        try:
            if n_cold_rows == T:
                self.remote.submit(step, layer, x, remote_ids, w, defer)
                sent = True
            elif n_cold_rows:
                rows = cold_rows.nonzero()[:, 0]
                self.remote.submit(step, layer, x[rows], remote_ids[rows], w[rows], defer)
                sent = rows
            else:
                sent = None
        except ExpertServiceError:
            self.reset()
            raise
        # (op, x, local ids, weights) of the immediate and the deferred part; computed now where this side's
        # device is not the expert service's CPU (a GPU: it overlaps), else once the remote part is in
        # (result), so two thread pools never compete for the same cores
        parts = [None, None]
        if n_hot:
            op, xf, local = self.ops[layer], x.float(), torch.where(hot, slot, -1)
            if defer:
                parts = [(op, xf, local[:, :k - defer], w[:, :k - defer]), (op, xf, local[:, k - defer:], w[:, k - defer:])]
            else:
                parts[0] = (op, xf, local, w)
            if self.overlap:
                parts = [self._compute(step, layer, p) for p in parts]
        self.pairs_hot.inc(n_hot)
        self.pairs_remote.inc(T * k - n_hot)
        self.out[layer] = (step, sent, parts, (T, x.shape[1]), x.dtype, 2 if defer else 1)

    def _compute(self, step, layer, part) -> torch.Tensor | None:
        if part is None or isinstance(part, torch.Tensor):
            return part
        t0 = time.time_ns()
        op, x, ids, w = part
        y = op.forward(x, ids, w)
        self.spans.append(Span("hot_experts", "gpu", layer, step, t0, time.time_ns()))
        return y

    def result(self, layer, deferred):
        step, sent, parts, shape, dtype, left = self.out[layer]
        part = None
        if sent is not None:
            try:
                part = self.remote.result(layer, deferred)
            except ExpertServiceError:
                self.reset()
                raise
        y = self._compute(step, layer, parts[1 if deferred else 0])
        if part is not None:
            part = part.to(self.device, torch.float32)
            if sent is True:
                y = part if y is None else y + part  # hot + remote, in this order
            else:
                if y is None:
                    y = torch.zeros(shape, dtype=torch.float32, device=self.device)
                y.index_add_(0, sent, part)
        if left == 1:
            del self.out[layer]
        else:
            self.out[layer] = (step, sent, parts, shape, dtype, left - 1)
        if y is None:
            return torch.zeros(shape, dtype=dtype, device=self.device)
        return y.to(dtype)

    def drain_timings(self) -> list[PartTiming]:
        return self.remote.drain_timings()

    def drain_waits(self) -> list[ShardWait]:
        return self.remote.drain_waits()

    def drain_spans(self) -> list[Span]:
        out, self.spans = self.spans, []
        return out + self.remote.drain_spans()

    def start_transport(self) -> str:
        return self.remote.start_transport()

    def reset(self):
        self.out.clear()
        self.spans.clear()
        self.remote.reset()

    def close(self):
        self.stop_refresh()
        if self.on_refresh is not None:
            try:
                self.on_refresh(dict(self.planned), self.usage.snapshot())
            except OSError as e:
                log.warning("hot experts: could not save the profile: %s", e)
        self.remote.close()

    # -- placement -------------------------------------------------------------------------------------------
    def _install(self, layer: int, experts: list[int], op) -> None:
        table = torch.full((self.n_experts,), -1, dtype=torch.int32)
        table[experts] = torch.arange(len(experts), dtype=torch.int32)
        self.table[layer], self.ops[layer], self.hot[layer] = table.to(self.device), op, list(experts)

    def _install_pending(self) -> None:
        if not self.pending:
            return
        with self.lock:  # the refresh thread reads hot/ops under it
            pending, self.pending = self.pending, {}
            for L, (experts, op) in pending.items():
                self._install(L, experts, op)
        metrics.HOT_SWAPS.inc(len(pending))

    def refresh(self, n: int, margin: float) -> int:
        """Choose every layer's hot set from the usage so far and build the layers that change (they are
        installed at the next step boundary) -> how many experts came in."""
        counts = self.usage.snapshot()
        came_in = 0
        for i, L in enumerate(self.usage.layers):
            old = self.planned[L]
            new = choose(counts[i], old, n, margin)
            total = float(counts[i].sum())
            share = float(counts[i][new].sum()) / total if total > 0 else 0.0
            metrics.HOT_SHARE.labels(str(L)).set(share)
            for e in range(self.n_experts):
                metrics.EXPERT_USAGE.labels(str(L), str(e)).set(float(counts[i][e]))
            if new == old:
                continue
            with self.lock:  # the operator it replaces: the one waiting, else the installed one
                prev = self.pending.get(L, (self.hot[L], self.ops[L]))
            op = self.build(L, new, prev)
            with self.lock:
                self.pending[L] = (new, op)
            self.planned[L] = new
            came_in += len(set(new) - set(old))
        return came_in

    def start_refresh(self, n: int, interval: float, margin: float) -> None:
        """Refresh every `interval` seconds in a background thread."""
        def loop():
            while not self.stopping.wait(interval):
                try:
                    t0 = time.perf_counter()
                    came_in = self.refresh(n, margin)
                    if came_in:
                        log.info("hot experts: %d swapped in (built in %.2fs, installed at the next step)", came_in,
                                 time.perf_counter() - t0)
                    if self.on_refresh is not None:
                        self.on_refresh(dict(self.planned), self.usage.counts)
                except Exception:  # a failed build leaves the old placement serving
                    log.exception("hot experts: refreshing the placement failed")

        self.thread = threading.Thread(target=loop, name="hot-experts", daemon=True)
        self.thread.start()

    def stop_refresh(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None


# -- gpu-service's options --------------------------------------------------------------------------------
def add_args(ap) -> None:
    ap.add_argument("--gpu-experts", type=int, default=0,
                    help="hot experts: this many routed experts of each MoE layer, the most used, computed on this "
                         "side's device (on a CPU-only host: the native kernels, in the expert service's weight "
                         "format) instead of by the expert service; 0 = none")
    ap.add_argument("--gpu-experts-gb", type=float, default=None,
                    help="instead of --gpu-experts: as many hot experts a layer as fit this many GiB over all MoE layers")
    ap.add_argument("--gpu-experts-profile", default=None, metavar="FILE",
                    help="start from the placement and usage saved in FILE (JSON), and save them there after each "
                         "refresh and at shutdown, so a restart starts where this run left off")
    ap.add_argument("--gpu-experts-refresh", type=float, default=30.0,
                    help="seconds between placement refreshes (the usage counts' top experts swapped in at a step "
                         "boundary, in the background); 0 = keep the starting placement")
    ap.add_argument("--gpu-experts-half-life", type=float, default=8192.0,
                    help="tokens over which an expert's usage count halves: how quickly the placement follows a "
                         "change of workload")


SWAP_MARGIN = 1.25  # a newcomer must be used this many times more than the incumbent it replaces


def check_args(args, local: bool) -> str | None:
    """The message for serving.fail, or None."""
    if args.gpu_experts < 0:
        return f"--gpu-experts must be >= 0, got {args.gpu_experts}"
    if args.gpu_experts_gb is not None and args.gpu_experts:
        return "--gpu-experts and --gpu-experts-gb: give one of them"
    if args.gpu_experts_gb is not None and not 0 <= args.gpu_experts_gb < float("inf"):
        return f"--gpu-experts-gb must be a number >= 0, got {args.gpu_experts_gb}"
    if not 0 <= args.gpu_experts_refresh < float("inf"):
        return f"--gpu-experts-refresh must be a number of seconds >= 0, got {args.gpu_experts_refresh}"
    if not args.gpu_experts_half_life > 0:
        return f"--gpu-experts-half-life must be > 0 tokens, got {args.gpu_experts_half_life}"
    if local and (args.gpu_experts or args.gpu_experts_gb):
        return "--gpu-experts: --experts local computes every routed expert in this process already"
    return None


def experts_per_layer(args, cfg, ckpt, fmt: str, device: torch.device) -> int:
    """--gpu-experts, or how many a layer --gpu-experts-gb holds (at most every expert)."""

    if args.gpu_experts_gb is None:
        return min(args.gpu_experts, cfg.n_routed_experts)
    per_layer = expert_bytes(cfg, ckpt, fmt, device) * len(cfg.moe_layers)
    return min(int(args.gpu_experts_gb * 2**30 // per_layer), cfg.n_routed_experts)


def from_args(args, remote: Experts, cfg, ckpt, fp: str, fmt: str, device: torch.device) -> Experts:
    """`remote` itself without hot experts; else HotExperts around it, its starting placement loaded (the
    profile's, else each layer's first N experts until the first refresh) and its refresh thread started.
    ValueError: the message for serving.fail (a profile of another model, a malformed one)."""

    n = experts_per_layer(args, cfg, ckpt, fmt, device)
    if n == 0:
        return remote
    layers, E = list(cfg.moe_layers), cfg.n_routed_experts
    usage = ExpertUsage(layers, E, args.gpu_experts_half_life, device)
    saved, counts = {}, {}
    if args.gpu_experts_profile:
        try:
            saved, counts = load_profile(args.gpu_experts_profile, fp, layers, E)
        except ValueError as e:
            raise ValueError(f"--gpu-experts-profile {args.gpu_experts_profile}: {e}") from None
        usage.seed(counts)
    placement = {}
    for i, L in enumerate(layers):
        if L in saved and len(saved[L]) == n:
            placement[L] = sorted(saved[L])
        else:  # no saved placement of this size: the most used saved (or the first) n
            placement[L] = choose(usage.counts[i], [], n, SWAP_MARGIN)
    t0 = time.perf_counter()

    def build(L, experts, old):
        return hot_layer(cfg, ckpt, L, experts, fmt, device, args.threads, old)

    def save(planned, counts):
        if args.gpu_experts_profile:
            save_profile(args.gpu_experts_profile, fp, planned, counts, layers)

    hot = HotExperts(remote, usage, build, placement, device, save)
    log.info("hot experts: %d of %d a layer on %s (%s), %s placement, built in %.1fs", n, E, device, fmt,
             "the profile's" if saved else "a first", time.perf_counter() - t0)
    if args.gpu_experts_refresh > 0:
        hot.start_refresh(n, args.gpu_experts_refresh, SWAP_MARGIN)
    return hot
