"""gRPC ExpertService: validate each layer request at the edge, run it off the event loop,
answer IMMEDIATE (then DEFERRED) results in order."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

import grpc
import torch

from moe_core import codec
from moe_core.config import ModelConfig
from moe_core.routing import split_deferred
from moe_core.serving import FINGERPRINT_KEY
from protos import expert_pb2, expert_pb2_grpc

from . import metrics

log = logging.getLogger("expert_service")


class BadRequest(ValueError):
    pass


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    def __init__(self, cfg: ModelConfig, fmt: str, kernel_path: str, threads: int, max_tokens: int):
        self.cfg, self.layers, self.fp = cfg, {}, None  # filled by attach() once loaded
        self.active_streams = 0
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
        cfg = self.cfg
        if req.layer not in self.layers:
            raise BadRequest(f"layer: {req.layer} is not an MoE layer of this model (MoE layers: "
                             f"{cfg.moe_layers[0]}..{cfg.moe_layers[-1]})" if cfg.moe_layers else "layer: model has no MoE layers")
        try:
            hidden = codec.decode(req.hidden, "hidden", codec.FLOAT_DTYPES, ndim=2)
            ids = codec.decode(req.topk_ids, "topk_ids", (torch.int32,), ndim=2)
            w = codec.decode(req.topk_weights, "topk_weights", (torch.float32,), ndim=2)
        except codec.CodecError as e:
            raise BadRequest(str(e)) from None
        T, H = hidden.shape
        if H != cfg.hidden_size:
            raise BadRequest(f"hidden.shape: hidden size {H} != model hidden_size {cfg.hidden_size}")
        if T > self.max_tokens:
            raise BadRequest(f"hidden.shape: {T} tokens exceed the limit of {self.max_tokens}")
        if ids.shape[0] != T or w.shape != ids.shape:
            raise BadRequest(f"topk_ids/topk_weights: shapes {list(ids.shape)} / {list(w.shape)} must both be [{T}, k]")
        k = ids.shape[1]
        if not 1 <= k <= cfg.n_routed_experts:
            raise BadRequest(f"topk_ids.shape: k={k} must be in [1, {cfg.n_routed_experts}]")
        if T and (ids.min() < 0 or ids.max() >= cfg.n_routed_experts):
            raise BadRequest(f"topk_ids: expert ids must be in [0, {cfg.n_routed_experts}), "
                             f"got [{int(ids.min())}, {int(ids.max())}]")
        if not torch.isfinite(w).all():
            raise BadRequest("topk_weights: non-finite values")
        if not torch.isfinite(hidden).all():
            raise BadRequest("hidden: non-finite values")
        if req.defer >= k:
            raise BadRequest(f"defer: {req.defer} must be < k={k}")
        return hidden, ids, w

    # -- compute --------------------------------------------------------------------------------
    def compute(self, layer: int, hidden, ids, w, defer: int):
        """-> [(part, out, ExpertTiming)], immediate first. Runs on the compute thread."""
        op = self.layers[layer]
        if defer == 0:
            jobs = [(expert_pb2.IMMEDIATE, ids, w)]
        else:
            i_ids, i_w, d_ids, d_w = split_deferred(ids, w, defer)
            jobs = [(expert_pb2.IMMEDIATE, i_ids, i_w), (expert_pb2.DEFERRED, d_ids, d_w)]
        out = []
        for part, p_ids, p_w in jobs:
            t0 = time.time_ns()
            y = op.forward(hidden, p_ids, p_w)
            t1 = time.time_ns()
            dt = (t1 - t0) / 1e9
            metrics.BUSY.inc(dt)
            metrics.COMPUTE.labels(str(layer), "deferred" if part else "immediate").observe(dt)
            out.append((part, y, expert_pb2.ExpertTiming(compute_us=(t1 - t0) // 1000, start_unix_ns=t0,
                                                         end_unix_ns=t1)))
        metrics.TOKENS.inc(hidden.shape[0])
        return out

    async def _check_peer(self, context) -> None:
        await self._check_ready(context)
        md = dict(context.invocation_metadata() or ())
        theirs = md.get(FINGERPRINT_KEY)
        if theirs is not None and theirs != self.fp:
            metrics.ERRORS.labels("FAILED_PRECONDITION").inc()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"model fingerprint mismatch: expert service serves {self.fp}, caller has {theirs}")

    async def _run(self, req, context):
        t_recv = time.time_ns()
        try:
            hidden, ids, w = self.parse(req)
        except BadRequest as e:
            metrics.ERRORS.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        loop = asyncio.get_running_loop()
        try:
            parts = await loop.run_in_executor(self.pool, self.compute, req.layer, hidden, ids, w, req.defer)
        except ValueError as e:  # a kernel's own check (they raise, never abort the process)
            metrics.ERRORS.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"expert kernel refused the request: {e}")
        queued_ns = parts[0][2].start_unix_ns - t_recv
        metrics.QUEUED.observe(queued_ns / 1e9)
        for _, _, timing in parts:
            timing.queued_us = max(0, queued_ns // 1000)
        return parts

    async def Exchange(self, request_iterator, context):
        await self._check_peer(context)
        self.active_streams += 1
        metrics.STREAMS.set(self.active_streams)
        try:
            async for req in request_iterator:
                metrics.LAYER_REQUESTS.labels("Exchange").inc()
                for part, out, timing in await self._run(req, context):
                    yield expert_pb2.LayerResult(step=req.step, layer=req.layer, part=part,
                                                 output=codec.encode(out), timing=timing)
        finally:  # the peer went away or the stream ended: nothing of it stays behind
            self.active_streams -= 1
            metrics.STREAMS.set(self.active_streams)

    async def RunLayer(self, request, context):
        await self._check_peer(context)
        metrics.LAYER_REQUESTS.labels("RunLayer").inc()
        parts = await self._run(request, context)
        t = parts[0][2]
        resp = expert_pb2.LayerResponse(immediate=codec.encode(parts[0][1]), timing=expert_pb2.ExpertTiming(
            queued_us=t.queued_us, compute_us=sum(p[2].compute_us for p in parts), start_unix_ns=t.start_unix_ns,
            end_unix_ns=parts[-1][2].end_unix_ns))
        if len(parts) > 1:
            resp.deferred.CopyFrom(codec.encode(parts[1][1]))
        return resp

    async def Info(self, request, context):
        await self._check_ready(context)
        cfg = self.cfg
        return expert_pb2.ExpertInfo(
            model_fingerprint=self.fp, architecture=cfg.model_type, moe_layers=list(cfg.moe_layers),
            n_routed_experts=cfg.n_routed_experts, hidden_size=cfg.hidden_size,
            moe_intermediate_size=cfg.moe_intermediate_size, top_k=cfg.top_k, weight_format=self.fmt,
            kernel_path=self.kernel_path, threads=self.threads,
            weight_bytes=sum(op.nbytes for op in self.layers.values()), transport="grpc",
            active_streams=self.active_streams)
