"""The GPU side's way to its routed experts at start: connect to the expert service(s) while this side's
weights load, check that they serve this model and cover every shard once, put them in shard order; or, with
`--experts local`, load the experts into this process. What comes out is an Experts (experts.py)."""
from __future__ import annotations

import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_core.shards import Shard, check_coverage
from protos import expert_pb2

from moe_exchange.dispatch import RemoteExperts, identity
from moe_exchange.protocol import Experts
from gpu_service.experts.sharded import ShardedExperts
from moe_experts import packed_cache
from moe_experts.loading import open_cache, weight_format
from moe_experts.store import LoadCancelled, load_expert_layers

log = logging.getLogger("gpu_service")


def expert_is_up(experts: RemoteExperts) -> bool:
    """Whether the expert service's process answers at all (its health service: SERVING or not)."""
    try:
        health_pb2_grpc.HealthStub(experts.channel).Check(health_pb2.HealthCheckRequest(), timeout=2,
                                                          metadata=experts.security.metadata)
        return True
    except grpc.RpcError:
        return False


def wait_for_experts(experts: RemoteExperts, timeout: float, cancel):
    """ExpertInfo once the expert service is ready; ConnectionError (the message for serving.fail) if it
    refuses us or does not answer for `timeout` seconds (while it answers and loads, we wait); None
    once `cancel` is set."""
    deadline, delay, loading = time.monotonic() + timeout, 0.1, False
    while not cancel.is_set():
        try:
            return experts.info(timeout=5)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise ConnectionError(f"expert service at {experts.target} refused us: {e.details()}") from None
            # it answers (its health service), so it is loading: waited for however long that takes, and said at
            # once (a fast load can end before `timeout` would have passed)
            if expert_is_up(experts):
                if not loading:
                    log.info("expert service at %s is up and still loading its experts: waiting for it",
                             experts.target)
                loading = True
                deadline = time.monotonic() + timeout
            elif time.monotonic() > deadline:
                raise ConnectionError(f"expert service at {experts.target} not ready after {timeout:g}s: "
                                      f"{e.code().name}: {e.details()}") from None
            cancel.wait(delay)
            delay = min(delay * 2, 2.0)


def check_same_model(remotes: list[RemoteExperts], infos: list[expert_pb2.ExpertInfo], fp: str, model: str) -> None:
    """ConnectionError unless every expert service serves this checkpoint and together they cover each shard
    exactly once."""
    for r, info in zip(remotes, infos):
        if info.model_fingerprint != fp:
            raise ConnectionError(
                f"model mismatch: this GPU service serves {model} (fingerprint {fp}), the expert service at "
                f"{r.target} serves a {info.architecture} model with fingerprint {info.model_fingerprint}; point "
                f"both at the same checkpoint")
    try:
        check_coverage({r.target: Shard(i.shard_index, i.shard_count or 1) for r, i in zip(remotes, infos)})
    except ValueError as e:
        raise ConnectionError(f"--experts {','.join(r.target for r in remotes)}: {e}") from None


def connect_and_load(wait, check, load, cancel: threading.Event):
    """-> (ExpertInfo, Model): this side's weights load (load()) while another thread waits for the
    expert service (wait(), then check(info)), since a cold expert start of a large model takes minutes.
    An expert service that refuses us, never answers or serves another model (ConnectionError) stops
    the load at once through `cancel`, and the error is raised."""
    got: dict = {}

    def waiter() -> None:
        try:
            info = wait()
            if info is not None:
                check(info)
            got["info"] = info
        except ConnectionError as e:
            got["error"] = e
            cancel.set()

    t = threading.Thread(target=waiter, name="wait-for-experts", daemon=True)
    t.start()
    try:
        model = load()
    except InterruptedError:
        if "error" not in got:
            raise  # stopped: unless_stopped turns it into Stopped
        model = None
    t.join()
    if "error" in got:
        raise got["error"]
    return got.get("info"), model


def connect_remote(remotes: list[RemoteExperts], fp: str, model_dir: str, timeout: float, load_model,
                   cancel: threading.Event):
    """-> (their ExpertInfos, the Model load_model() gave), the remotes checked (check_same_model) and each told
    what it must stay across restarts (identity). ConnectionError as wait_for_experts and check_same_model say;
    InterruptedError once cancelled."""
    def wait_for_all():
        infos = []
        for r in remotes:
            infos.append(wait_for_experts(r, timeout, cancel))
            if infos[-1] is None:
                return None
        return infos

    infos, model = connect_and_load(wait_for_all, lambda infos: check_same_model(remotes, infos, fp, model_dir),
                                    load_model, cancel)
    for r, i in zip(remotes, infos or ()):
        r.expected = identity(i)
    return infos, model


def in_shard_order(remotes: list[RemoteExperts], infos: list[expert_pb2.ExpertInfo]) -> tuple[Experts, list]:
    """-> (the Experts to run on: one service directly, several as ShardedExperts; the remotes in shard order,
    for the health watchers)."""
    ordered = [r for _, r in sorted(zip((i.shard_index for i in infos), remotes), key=lambda p: p[0])]
    return (ordered[0] if len(ordered) == 1 else ShardedExperts(ordered)), ordered


def load_local(args, cfg, ckpt, fp: str, load_model, cancel: threading.Event):
    """--experts local: -> (Model, {layer: MoELayer}, weight format): the routed experts in this process, on
    the native pool the dense layers use, packed (and cached) as an expert service would hold them."""

    fmt = weight_format(args.weight_format, cfg)
    model = load_model()
    cache = open_cache(args.cache_dir or str(packed_cache.default_dir()), ckpt, fp, fmt)
    try:
        layers = load_expert_layers(cfg, ckpt, fmt, args.threads, cancel=cancel, cache=cache)
    except LoadCancelled:
        raise InterruptedError("loading cancelled") from None
    return model, layers, fmt


