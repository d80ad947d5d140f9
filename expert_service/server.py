"""gRPC ExpertService: validate each layer request at the edge, compute it (a decode-sized one on the
event loop, an exchange request natively from its bytes where it can), answer IMMEDIATE (then
DEFERRED) results in order."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time

import grpc
import torch

from moe_exchange import codec, shm, wire
from moe_core.errors import BadRequest
from moe_core.config import ModelConfig
from moe_core.routing import split_deferred
from moe_core.edge import parse_or_abort
from moe_core.serving import FINGERPRINT_KEY
from moe_core.shards import Shard
from protos import expert_pb2, expert_pb2_grpc

from expert_service import metrics
from moe_exchange.ring import RingServer

log = logging.getLogger("expert_service")


MAX_SHM_SESSIONS = 16
INLINE_PAIRS = 64  # (token, expert) pairs up to which a layer request is computed on the event loop
# methods whose handlers take and give the messages' bytes (moe_core/edge.py), for the native exchange
RAW_METHODS = (wire.EXCHANGE,)


def all_finite(t: torch.Tensor) -> bool:
    # a finite sum implies finite elements (inf and nan propagate) and costs a third of isfinite().all();
    # only a non-finite sum (or overflow) needs the exact check
    return math.isfinite(float(t.sum(dtype=torch.float32))) or bool(torch.isfinite(t).all())


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    metrics = metrics  # (the shared-memory ring records into the same figures)

    def __init__(self, cfg: ModelConfig, fmt: str, kernel_path: str, threads: int, max_tokens: int,
                 shm_max_bytes: int = 0, shard: Shard = Shard()):
        self.cfg, self.layers, self.fp = cfg, {}, None  # filled by attach() once loaded
        self.shard = shard
        self.n_experts = len(shard.experts(cfg.n_routed_experts))  # the ids requests use: this shard's
        self.active_streams = 0
        self.shm_max_bytes = shm_max_bytes  # 0: no shared-memory sessions
        self.shm_sessions: set = set()
        self.fmt, self.kernel_path, self.threads, self.max_tokens = fmt, kernel_path, threads, max_tokens
        # One compute thread: the kernels parallelize inside; requests are served in arrival order.
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="experts")

    def attach(self, layers: dict, fp: str) -> None:
        self.layers, self.fp = layers, fp

    async def _check_ready(self, context) -> None:
        if self.fp is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "expert service is still loading the model")

    # -- validation ---------------------------------------------------------------------------
    def parse(self, req: expert_pb2.LayerRequest):
        try:
            hidden = codec.decode(req.hidden, "hidden", codec.FLOAT_DTYPES, ndim=2)
            ids = codec.decode(req.topk_ids, "topk_ids", (torch.int32,), ndim=2)
            w = codec.decode(req.topk_weights, "topk_weights", (torch.float32,), ndim=2)
        except codec.CodecError as e:
            raise BadRequest("", str(e)) from None
        if self.runs_native(req.layer, hidden.dtype):  # the C++ part entry checks the values itself
            self.validate_shape(req.layer, *hidden.shape, ids.shape, w.shape, req.defer)
        else:
            self.validate(req.layer, hidden, ids, w, req.defer)
        return hidden, ids, w

    def runs_native(self, layer: int, dtype) -> bool:
        """Whether the layer's requests go straight to the native part entry (deferral split, dtype
        conversion and value checks in C++): native operators, bf16 or fp32 hidden states."""
        return hasattr(self.layers.get(layer), "forward_part") and dtype != torch.float16

    def validate_shape(self, layer: int, T: int, H: int, ids_shape, w_shape, defer: int) -> None:
        """The checks on sizes and settings every layer request passes, whichever transport brought it."""
        cfg = self.cfg
        if layer not in self.layers:
            raise BadRequest("layer", f"{layer} is not an MoE layer of this model (MoE layers: "
                             f"{cfg.moe_layers[0]}..{cfg.moe_layers[-1]})" if cfg.moe_layers else "model has no MoE layers")
        if H != cfg.hidden_size:
            raise BadRequest("hidden.shape", f"hidden size {H} != model hidden_size {cfg.hidden_size}")
        if T > self.max_tokens:
            raise BadRequest("hidden.shape", f"{T} tokens exceed the limit of {self.max_tokens}")
        if ids_shape[0] != T or tuple(w_shape) != tuple(ids_shape):
            raise BadRequest("topk_ids/topk_weights", f"shapes {list(ids_shape)} / {list(w_shape)} must both be [{T}, k]")
        k = ids_shape[1]
        if not 1 <= k <= cfg.top_k:
            raise BadRequest("topk_ids.shape", f"k={k} must be in [1, {cfg.top_k}] (the model's num_experts_per_tok)")
        if defer >= k:
            raise BadRequest("defer", f"{defer} must be < k={k}")

    def validate(self, layer: int, hidden, ids, w, defer: int) -> None:
        """validate_shape, then the values (the native part entry checks these itself)."""
        self.validate_shape(layer, *hidden.shape, ids.shape, w.shape, defer)
        E = self.n_experts
        if hidden.shape[0] and (ids.min() < -1 or ids.max() >= E):
            raise BadRequest("topk_ids", f"expert ids must be in [0, {E}) or -1 (none), got [{int(ids.min())}, "
                             f"{int(ids.max())}]")
        if not all_finite(w):
            raise BadRequest("topk_weights", "non-finite values")
        if not all_finite(hidden):
            raise BadRequest("hidden", "non-finite values")

    # -- compute --------------------------------------------------------------------------------
    def run_part(self, layer: int, part: int, kernel):
        """Run one part's kernel, timed and counted (the native kernels serialize themselves on one
        mutex, shared with the shared-memory rings' C++ loop). -> (kernel's result, ExpertTiming)"""
        t0 = time.time_ns()
        y = kernel()
        t1 = time.time_ns()
        metrics.record_part(layer, part, (t1 - t0) / 1e9)
        return y, expert_pb2.ExpertTiming(compute_us=(t1 - t0) // 1000, start_unix_ns=t0, end_unix_ns=t1)

    def part_jobs(self, layer: int, hidden, ids, w, defer: int):
        """-> [(part, kernel)], immediate first; each kernel() returns that part's weighted sum."""
        op = self.layers[layer]
        if self.runs_native(layer, hidden.dtype):
            T, k = ids.shape
            bf16 = hidden.dtype == torch.bfloat16

            def native(part):
                out = torch.empty_like(hidden)
                op.forward_part(hidden.data_ptr(), bf16, ids.data_ptr(), w.data_ptr(), out.data_ptr(), bf16, T, k,
                                defer, part)
                return out
            return [(p, lambda p=p: native(p)) for p in range(2 if defer else 1)]
        if defer == 0:
            return [(expert_pb2.IMMEDIATE, lambda: op.forward(hidden, ids, w))]
        i_ids, i_w, d_ids, d_w = split_deferred(ids, w, defer)
        return [(expert_pb2.IMMEDIATE, lambda: op.forward(hidden, i_ids, i_w)),
                (expert_pb2.DEFERRED, lambda: op.forward(hidden, d_ids, d_w))]

    def compute(self, layer: int, hidden, ids, w, defer: int):
        """-> [(part, out, ExpertTiming)], immediate first, computed here and now (the shared-memory
        ring's Python path)."""
        return [(part, *self.run_part(layer, part, kernel)) for part, kernel in self.part_jobs(layer, hidden, ids, w, defer)]

    async def _check_peer(self, context) -> None:
        await self._check_ready(context)
        md = dict(context.invocation_metadata() or ())
        theirs = md.get(FINGERPRINT_KEY)
        if theirs is not None and theirs != self.fp:
            metrics.ERRORS.labels("FAILED_PRECONDITION").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"model fingerprint mismatch: expert service serves {self.fp}, caller has {theirs}")

    async def _parts(self, req, context, rpc: str):
        """Validate, then compute the parts, yielding (part, encoded output, ExpertTiming) as each is ready:
        the IMMEDIATE sum goes out while the DEFERRED experts still run. (The protobuf path: RunLayer, and
        what the native exchange does not take.)"""
        t_recv = time.time_ns()
        try:
            hidden, ids, w = self.parse(req)
        except BadRequest as e:
            await self._refuse(context, str(e))
        queued_ns = None
        for part, kernel in self.part_jobs(req.layer, hidden, ids, w, req.defer):
            out, timing = await self._run(context, ids.numel(), self.run_part, req.layer, part, kernel)
            if queued_ns is None:
                queued_ns = max(0, timing.start_unix_ns - t_recv)
            timing.queued_us = queued_ns // 1000
            yield part, codec.encode(out), timing
        metrics.record_request(rpc, hidden.shape[0], queued_ns / 1e9)

    async def Exchange(self, request_iterator, context):
        """A raw method (RAW_METHODS): serialized LayerRequests in, serialized LayerResults out. A request
        native/exchange/wire.h's fast path takes, for a native layer, is parsed, computed and answered in C++ (a
        handful of Python operations a layer); any other goes through protobuf and _parts."""
        await self._check_peer(context)
        self.active_streams += 1
        metrics.STREAMS.set(self.active_streams)
        try:
            async for raw in request_iterator:
                t_recv = time.time_ns()
                head = wire.head(raw)
                op = self.layers.get(head.layer) if head is not None else None
                if not hasattr(op, "exchange_part"):
                    req = await parse_or_abort(expert_pb2.LayerRequest, raw, context)
                    async for part, out, timing in self._parts(req, context, "Exchange"):
                        yield expert_pb2.LayerResult(step=req.step, layer=req.layer, part=part, output=out,
                                                     timing=timing).SerializeToString()
                    continue
                layer, defer, T, H, k = head.layer, head.defer, head.T, head.H, head.k
                try:
                    self.validate_shape(layer, T, H, (T, k), (T, k), defer)
                except BadRequest as e:
                    await self._refuse(context, str(e))
                start = None
                for part in range(2 if defer else 1):
                    done = await self._run(context, T * k, op.exchange_part, raw, part, t_recv)
                    metrics.record_part(layer, part, (done.end_unix_ns - done.start_unix_ns) / 1e9)
                    start = start or done.start_unix_ns
                    yield done.result
                metrics.record_request("Exchange", T, max(0, start - t_recv) / 1e9)
        finally:  # the peer went away or the stream ended: nothing of it stays behind
            self.active_streams -= 1
            metrics.STREAMS.set(self.active_streams)

    async def _run(self, context, pairs: int, fn, *args):
        """fn(*args) for a request of `pairs` (token, expert) pairs. A decode-sized one runs right here: the
        hop to the compute thread and back costs more than its kernel takes to run (bench/bench_exchange.py);
        larger ones leave the event loop free. (Here it may wait for the kernels' mutex behind one layer of
        another caller's: a health check then waits as long, well under the probes' timeouts.) A kernel's own
        check (a ValueError: they raise, never abort the process) ends the call INVALID_ARGUMENT."""
        try:
            if pairs <= INLINE_PAIRS:
                return fn(*args)
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except ValueError as e:
            await self._refuse(context, f"expert kernel refused the request: {e}")

    async def _refuse(self, context, message: str) -> None:
        metrics.ERRORS.labels("INVALID_ARGUMENT").inc()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    async def RunLayer(self, request, context):
        await self._check_peer(context)
        parts = [p async for p in self._parts(request, context, "RunLayer")]
        t = parts[0][2]
        resp = expert_pb2.LayerResponse(immediate=parts[0][1], timing=expert_pb2.ExpertTiming(
            queued_us=t.queued_us, compute_us=sum(p[2].compute_us for p in parts), start_unix_ns=t.start_unix_ns,
            end_unix_ns=parts[-1][2].end_unix_ns))
        if len(parts) > 1:
            resp.deferred.CopyFrom(parts[1][1])
        return resp

    async def Info(self, request, context):
        await self._check_ready(context)
        cfg = self.cfg
        return expert_pb2.ExpertInfo(
            model_fingerprint=self.fp, architecture=cfg.architecture, moe_layers=list(cfg.moe_layers),
            n_routed_experts=cfg.n_routed_experts, hidden_size=cfg.hidden_size,
            moe_intermediate_size=cfg.moe_intermediate_size, top_k=cfg.top_k, weight_format=self.fmt,
            kernel_path=self.kernel_path, threads=self.threads,
            weight_bytes=sum(op.nbytes for op in self.layers.values()),
            transport="grpc,shm" if self.shm_max_bytes else "grpc", active_streams=self.active_streams,
            shm_sessions=len(self.shm_sessions), max_tokens=self.max_tokens, shard_index=self.shard.index,
            shard_count=self.shard.count)

    async def OpenShm(self, request, context):
        await self._check_peer(context)
        if not self.shm_max_bytes:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this expert service does not serve shared memory "
                                "(started with --shm-max-mb 0)")
        if len(self.shm_sessions) >= MAX_SHM_SESSIONS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_SHM_SESSIONS} shared-memory sessions are open")
        try:
            mm = shm.attach(request.name, request.size, bytes(request.nonce), self.shm_max_bytes)
        except shm.RegionError as e:
            metrics.ERRORS.labels(e.code_name).inc()
            await context.abort(getattr(grpc.StatusCode, e.code_name), f"shared memory: {e}")
        ring = RingServer(mm, self, request.name)
        self.shm_sessions.add(ring)
        metrics.SHM_SESSIONS.set(len(self.shm_sessions))
        log.info("shared-memory session %s: %d MiB", request.name, request.size >> 20)
        try:
            ring.start()
            yield expert_pb2.ShmEvent(ready=True)
            await asyncio.wrap_future(ring.done)  # until the peer closes the ring, or this stream ends
        finally:  # the peer went away (stream cancelled) or closed the ring: unmap, nothing stays
            ring.stop()
            await asyncio.to_thread(ring.join)
            self.shm_sessions.discard(ring)
            metrics.SHM_SESSIONS.set(len(self.shm_sessions))
            log.info("shared-memory session %s ended", request.name)
