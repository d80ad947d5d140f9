"""Whether the expert service(s) can serve now, from two kinds of evidence ordered by time: the health
watcher's probes (one a second per expert service) and the engine's own exchanges. An expert service
counts as up unless its latest probe failed and no exchange has succeeded since that probe began: a probe
that was already under way when the service came back (or that the engine's fresh success has overtaken)
never refuses a request it can serve. A service that comes back is probed for what it serves (model,
shard, weight format, kernel path: dispatch.identity) before it counts as up again."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_core import serving
from protos import expert_pb2, expert_pb2_grpc

from gpu_service import metrics
from moe_exchange.dispatch import RemoteExperts, mismatch

log = logging.getLogger("gpu_service")
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 3.0  # waits for the probe channel's reconnect after a restart (its backoff is at most 2 s)


class ExpertHealth:
    def __init__(self, remotes: list[RemoteExperts], on_change=None):
        """on_change(up: bool): awaited when up() changes (the gRPC health status follows it)."""
        self.remotes, self.on_change = remotes, on_change
        # time.monotonic() at which the latest failing probe of each began; None: its latest probe passed
        self.down_at: dict[str, float | None] = {r.target: None for r in remotes}
        self.published: bool | None = None
        self.mismatch: dict[str, str | None] = {}  # what each service was last found to serve wrongly

    def up_one(self, r: RemoteExperts) -> bool:
        d = self.down_at[r.target]
        return d is None or r.last_ok > d

    def up(self) -> bool:
        return all(self.up_one(r) for r in self.remotes)

    def why_down(self) -> str | None:
        """What the probes found wrong with services that are down but answering (another model, shard,
        format or kernel path), or None: a held request's failure says this rather than the exchange's
        last error, which dates from when the service was gone."""
        why = [f"expert service at {r.target} came back serving {self.mismatch[r.target]}: not using it"
               for r in self.remotes if self.mismatch.get(r.target) and not self.up_one(r)]
        return "; ".join(why) or None

    def watchers(self) -> list[asyncio.Task]:
        return [asyncio.create_task(self._watch(r)) for r in self.remotes]

    async def _publish(self) -> None:
        up = self.up()
        if up != self.published:
            self.published = up
            metrics.EXPERT_UP.set(int(up))
            if self.on_change is not None:
                await self.on_change(up)

    async def _probe(self, stub, info_stub, r: RemoteExperts) -> bool:
        try:
            ok = (await stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S,
                                   wait_for_ready=True)).status == health_pb2.HealthCheckResponse.SERVING
            if ok:  # every time: a restart can fall between two probes
                info = await info_stub.Info(expert_pb2.ExpertInfoRequest(), timeout=5, metadata=r.security.metadata)
                why = mismatch(r.expected, info)
                if why != self.mismatch.get(r.target):  # said once, not every probe
                    self.mismatch[r.target] = why
                    if why:
                        log.error("expert service at %s now serves %s: not serving", r.target, why)
                if why:
                    return False
            return ok
        except grpc.RpcError:
            return False

    async def _watch(self, r: RemoteExperts) -> None:
        async with r.security.aio_channel(r.target, options=serving.RECONNECT) as ch:
            stub, info_stub = health_pb2_grpc.HealthStub(ch), expert_pb2_grpc.ExpertServiceStub(ch)
            was = None
            while True:
                t = time.monotonic()
                self.down_at[r.target] = None if await self._probe(stub, info_stub, r) else t
                # between probes, an exchange that succeeds is news too
                for _ in range(round(PROBE_EVERY_S / 0.05)):
                    now = self.up_one(r)
                    if now != was:
                        if was is not None:
                            log.warning("expert service at %s is %s", r.target, "back" if now else "unavailable")
                        metrics.SHARD_UP.labels(r.target).set(int(now))
                        was = now
                    await self._publish()
                    await asyncio.sleep(0.05)
