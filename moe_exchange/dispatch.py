"""Dispatch: how the GPU side hands a layer's routed experts to an expert service and gets the sums back
(the Experts protocol, experts.py). RemoteExperts: one bidirectional gRPC Exchange stream (kept open across
steps), and with transport shm|auto a shared-memory session (shm_channel.py) that carries every layer request
that fits its slots; larger ones (long prefills) take the gRPC stream.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from moe_exchange import wire
from moe_core.errors import Status
from moe_core.security import ClientSecurity
from moe_core.serving import FINGERPRINT_KEY, RECONNECT, message_options
from protos import expert_pb2, expert_pb2_grpc

from moe_exchange.protocol import PartTiming, ShardWait
from moe_exchange.channel import ShmChannel, ShmError

log = logging.getLogger("moe_exchange.dispatch")
TRANSPORTS = ("grpc", "shm", "auto")
# OpenShm answers that mean "no shared memory with this peer" (another host, disabled, older peer)
NO_SHM = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
          grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


# How long one layer's result may take: the base (--expert-timeout) plus this much per token in the
# step, so a long prefill on a slow CPU is not mistaken for a stuck expert service.
PER_TOKEN_S = 0.01
CONNECT_WAIT_S = 3.0  # opening a stream or a shared-memory session waits this long for the channel


class ExpertServiceError(RuntimeError):
    """The expert service failed or went away; `code` is the gRPC status to report (`status` the same as the
    engine's Status). `retry`: whether a fresh stream may help at once (not after a deadline: the service is
    alive but stuck)."""

    def __init__(self, code: grpc.StatusCode, msg: str, retry: bool = True):
        super().__init__(msg)
        self.code, self.status = code, Status[code.name]
        self.retry = retry


def identity(info: expert_pb2.ExpertInfo) -> dict:
    """What an expert service must keep across a restart for the tokens to stay the same."""
    return {"model fingerprint": info.model_fingerprint, "shard": f"{info.shard_index}/{info.shard_count or 1}",
            "weight format": info.weight_format, "kernel path": info.kernel_path}


def mismatch(want: dict, info: expert_pb2.ExpertInfo) -> str | None:
    """How info differs from the identity `want` (None: it does not)."""
    got = identity(info)
    diff = [f"{k} {got[k]}, not {want[k]}" for k in want if got[k] != want[k]]
    return "; ".join(diff) or None


class Deadline:
    """Cancels a gRPC call that a blocking next() waits on for too long (a stream's next() has no
    timeout of its own). One thread for the process's life; arm() and disarm() take a lock and wake
    the thread only when it sleeps without a deadline."""

    def __init__(self):
        self._cv = threading.Condition()
        self._call = None
        self._at = 0.0
        self._idle = True
        self.fired = False
        threading.Thread(target=self._run, name="exchange-deadline", daemon=True).start()

    def arm(self, call, seconds: float) -> None:
        with self._cv:
            self._call, self._at, self.fired = call, time.monotonic() + seconds, False
            if self._idle:
                self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._call = None

    def _run(self) -> None:
        with self._cv:
            while True:
                self._idle = self._call is None
                if self._idle:
                    self._cv.wait()
                    continue
                left = self._at - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                self.fired = True
                self._call.cancel()
                self._call = None


class RemoteExperts:
    def __init__(self, target: str, fingerprint: str, max_message: int, security: ClientSecurity | None = None,
                 transport: str = "grpc", shm_bytes: int = 64 << 20, timeout_s: float = 30.0):
        assert transport in TRANSPORTS, transport
        self.target, self.fingerprint = target, fingerprint
        self.timeout_s = timeout_s  # per layer result, plus PER_TOKEN_S per token of the step
        self._tokens = 0            # tokens of the step in flight
        self._deadline = Deadline()
        self.transport, self.shm_bytes = transport, shm_bytes
        self.shm: ShmChannel | None = None
        self._shm_out: dict = {}  # layer -> (shape, dtype) of requests that went through shared memory
        self.security = security or ClientSecurity()
        self.channel = self.security.channel(target, options=message_options(max_message) + RECONNECT)
        self.metadata = ((FINGERPRINT_KEY, fingerprint), *self.security.metadata)
        self.stub = expert_pb2_grpc.ExpertServiceStub(self.channel)
        self._requests: queue.Queue | None = None
        self._responses = None
        self._timings: list = []  # (layer, deferred, wire.Timing) since the last drain
        self.expected: dict | None = None  # identity() at the first connect: a stream is opened only to that
        self.last_ok = 0.0  # time.monotonic() of the last result received (the health watcher's stale-probe guard)

    def info(self, timeout: float = 5.0) -> expert_pb2.ExpertInfo:
        return self.stub.Info(expert_pb2.ExpertInfoRequest(), timeout=timeout, metadata=self.security.metadata)

    def start_transport(self) -> str:
        """Choose the data path once the expert service answers: shm when asked for (failing loudly if
        it cannot be had), auto = shm if the peer can map our region (same host), else gRPC."""
        if self.transport != "grpc":
            self._reopen_shm()
        return "shm" if self.shm is not None else "grpc"

    def _reopen_shm(self) -> None:
        """A new session (at start, or after a reset when the expert service restarted). With auto, a
        peer that cannot map our regions (another host, shm turned off) gets gRPC instead."""
        try:
            self._open_shm()
        except ExpertServiceError as e:
            if self.transport == "shm" or e.code not in NO_SHM:
                raise
            log.warning("shared memory with %s not possible (%s): using gRPC", self.target, e)
            self.transport = "grpc"

    def _wait_connected(self) -> None:
        """After the expert service restarted, this channel can still be in its reconnect backoff when the
        health watcher (on a channel of its own) already saw the service back and let requests in: give
        it a moment rather than fail the request that opens the stream."""
        try:  # an Info call that waits for the connection (grpc.channel_ready_future's watcher thread
            # outlives it and trips over the channel's close)
            info = self.stub.Info(expert_pb2.ExpertInfoRequest(), timeout=CONNECT_WAIT_S, wait_for_ready=True,
                                  metadata=self.security.metadata)
        except grpc.RpcError:
            return  # the call that follows fails, with the reason
        # a service restarted with another --weight-format or kernel path would change the tokens silently
        why = self.expected and mismatch(self.expected, info)
        if why:
            raise ExpertServiceError(grpc.StatusCode.UNAVAILABLE, f"expert service at {self.target} came back "
                                     f"serving {why}: not using it")

    def _open_shm(self) -> None:
        self._wait_connected()
        try:
            self.shm = ShmChannel(self.stub, self.metadata, self.shm_bytes, self.timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED:  # our own deadline (ShmChannel)
                raise ExpertServiceError(grpc.StatusCode.UNAVAILABLE, f"expert service at {self.target} did not "
                                         f"answer OpenShm within {self.timeout_s:g}s", retry=False) from None
            raise ExpertServiceError(e.code(), f"expert service at {self.target}, opening shared memory: "
                                     f"{e.details()}") from None
        except OSError as e:
            raise ExpertServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"cannot create a shared region: {e}") from None

    def _open(self):
        self._wait_connected()
        q: queue.Queue = queue.Queue()
        self._requests = q
        # the stream's messages as bytes, written and read by moe_exchange.wire
        self._responses = self.channel.stream_stream(wire.EXCHANGE)(iter(q.get, None), metadata=self.metadata)

    def _limit(self) -> float:
        return self.timeout_s + PER_TOKEN_S * self._tokens

    def _stuck(self, layer: int) -> ExpertServiceError:
        return ExpertServiceError(grpc.StatusCode.UNAVAILABLE, f"expert service at {self.target} did not answer "
                                  f"layer {layer} within {self._limit():.3g}s (--expert-timeout)", retry=False)

    def submit(self, step, layer, x, ids, w, defer):
        self._tokens = x.shape[0]
        if self.transport != "grpc" and self.shm is None:
            self._reopen_shm()
        if self.shm is not None:
            if self.shm.fits(x.shape[0], x.shape[1], x.element_size(), ids.shape[1]):
                try:
                    self.shm.submit(step, layer, x, ids, w, defer)
                except ShmError as e:
                    self.reset()
                    raise ExpertServiceError(e.code, f"expert service at {self.target}: {e}") from None
                self._shm_out[layer] = (tuple(x.shape), x.dtype, x.is_cuda)
                return
        self._shm_out.pop(layer, None)
        if self._responses is None:
            self._open()
        self._requests.put(wire.request(step, layer, x, ids, w, defer))

    def decode_layers(self, run, step, times, T, H, dtype, k) -> bool:
        """The decode loop on the shared-memory ring (not over gRPC: False)."""
        self._tokens = T
        if self.transport != "grpc" and self.shm is None:
            self._reopen_shm()
        if self.shm is None or not self.shm.fits(T, H, dtype.itemsize, k):
            return False
        try:
            self.shm.decode_layers(run, step, T, H, dtype, k, self._limit())
        except TimeoutError as e:
            self.reset()
            raise self._stuck(e.args[0]) from None
        except ShmError as e:
            self.reset()
            raise ExpertServiceError(e.code, f"expert service at {self.target}: {e}") from None
        self.last_ok = time.monotonic()  # (the expert service's timings stay in `times`: native_loop.Record)
        return True

    def result(self, layer, deferred):
        if layer in self._shm_out:
            shape, dtype, pin = self._shm_out[layer]
            try:
                y, timing = self.shm.result(layer, deferred, shape, dtype, self._limit(), pin)
            except TimeoutError:
                self.reset()
                raise self._stuck(layer) from None
            except ShmError as e:
                self.reset()
                raise ExpertServiceError(e.code, f"expert service at {self.target}: {e}") from None
            self._timings.append(PartTiming(layer, deferred, timing))
            self.last_ok = time.monotonic()
            return y
        try:
            data = self._next_response()
        except grpc.RpcError as e:
            self.reset()
            if self._deadline.fired:
                raise self._stuck(layer) from None
            code = e.code()
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION):
                raise ExpertServiceError(code, f"expert service at {self.target} refused: {e.details()}") from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise ExpertServiceError(grpc.StatusCode.UNAVAILABLE,
                                         f"expert service at {self.target} unavailable: {e.details()}") from None
            raise ExpertServiceError(grpc.StatusCode.INTERNAL,
                                     f"expert service at {self.target} failed: {code.name}: {e.details()}") from None
        except StopIteration:
            self.reset()
            raise ExpertServiceError(grpc.StatusCode.UNAVAILABLE,
                                     f"expert service at {self.target} closed the exchange stream") from None
        try:
            got_layer, part, y, timing = wire.result(data)
        except Exception as e:  # DecodeError, CodecError: not a LayerResult we can use
            self.reset()
            raise ExpertServiceError(grpc.StatusCode.INTERNAL, f"expert service at {self.target} sent an unreadable "
                                     f"result ({type(e).__name__}: {e})") from None
        want = expert_pb2.DEFERRED if deferred else expert_pb2.IMMEDIATE
        if got_layer != layer or part != want:
            self.reset()
            raise ExpertServiceError(grpc.StatusCode.INTERNAL, f"exchange out of order: wanted layer {layer} "
                                     f"part {want}, got layer {got_layer} part {part}")
        self._timings.append(PartTiming(layer, deferred, timing))
        self.last_ok = time.monotonic()
        return y

    def _next_response(self):
        """The next message of the Exchange stream, the call cancelled if it takes past the deadline."""
        self._deadline.arm(self._responses, self._limit())
        try:
            return next(self._responses)
        finally:
            self._deadline.disarm()

    def drain_timings(self) -> list[PartTiming]:
        out, self._timings = self._timings, []
        return out

    def drain_waits(self) -> list[ShardWait]:
        return []

    def drain_spans(self) -> list:
        return []

    def reset(self):
        """Drop the stream and the shared-memory session (after an error): the next submit opens fresh ones."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        self._shm_out.clear()
        if self._requests is not None:
            self._requests.put(None)
        if self._responses is not None:
            self._responses.cancel()
        self._requests = self._responses = None

    def close(self):
        self.reset()
        self.channel.close()
