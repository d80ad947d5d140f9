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
from moe_core.serving import FINGERPRINT_KEY
from protos import expert_pb2, expert_pb2_grpc

log = logging.getLogger("expert_service")


class BadRequest(ValueError):
    pass


def split_deferred(ids: torch.Tensor, weights: torch.Tensor, defer: int):
    """Per token, move the `defer` lowest-weighted experts out of the immediate set.
    -> (imm_ids [T,k-d], imm_w, def_ids [T,d], def_w). Stable for ties (earlier slot stays)."""
    order = torch.argsort(weights, dim=1, descending=True, stable=True)
    k = ids.shape[1]
    imm, dfr = order[:, : k - defer], order[:, k - defer:]
    return ids.gather(1, imm), weights.gather(1, imm), ids.gather(1, dfr), weights.gather(1, dfr)


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    def __init__(self, cfg: ModelConfig, fmt: str, kernel_path: str, threads: int, max_tokens: int):
        self.cfg, self.layers, self.fp = cfg, {}, None  # filled by attach() once loaded
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
        """-> [(part, out, compute_us)], immediate first."""
        op = self.layers[layer]
        if defer == 0:
            t = time.perf_counter()
            out = op.forward(hidden, ids, w)
            return [(expert_pb2.IMMEDIATE, out, int((time.perf_counter() - t) * 1e6))]
        i_ids, i_w, d_ids, d_w = split_deferred(ids, w, defer)
        t = time.perf_counter()
        imm = op.forward(hidden, i_ids, i_w)
        t1 = time.perf_counter()
        dfr = op.forward(hidden, d_ids, d_w)
        t2 = time.perf_counter()
        return [(expert_pb2.IMMEDIATE, imm, int((t1 - t) * 1e6)), (expert_pb2.DEFERRED, dfr, int((t2 - t1) * 1e6))]

    async def _check_peer(self, context) -> None:
        await self._check_ready(context)
        md = dict(context.invocation_metadata() or ())
        theirs = md.get(FINGERPRINT_KEY)
        if theirs is not None and theirs != self.fp:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"model fingerprint mismatch: expert service serves {self.fp}, caller has {theirs}")

    async def _run(self, req, context):
        t_recv = time.perf_counter()
        try:
            hidden, ids, w = self.parse(req)
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        loop = asyncio.get_running_loop()
        t_start = time.perf_counter()
        parts = await loop.run_in_executor(self.pool, self.compute, req.layer, hidden, ids, w, req.defer)
        queued = int((t_start - t_recv) * 1e6)
        return parts, queued

    async def Exchange(self, request_iterator, context):
        await self._check_peer(context)
        async for req in request_iterator:
            parts, queued = await self._run(req, context)
            for part, out, us in parts:
                yield expert_pb2.LayerResult(step=req.step, layer=req.layer, part=part, output=codec.encode(out),
                                             timing=expert_pb2.ExpertTiming(queued_us=queued, compute_us=us))

    async def RunLayer(self, request, context):
        await self._check_peer(context)
        parts, queued = await self._run(request, context)
        resp = expert_pb2.LayerResponse(immediate=codec.encode(parts[0][1]),
                                        timing=expert_pb2.ExpertTiming(queued_us=queued,
                                                                       compute_us=sum(p[2] for p in parts)))
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
            weight_bytes=sum(op.nbytes for op in self.layers.values()))
