"""Serves one shared-memory session's request ring (layout: moe_exchange/shm.py) on its own thread.
The hot loop is C++ (native/exchange/ring.cpp: wait on the request doorbell, check the descriptor against the
region, run the native kernels straight on the region, post responses, ring) and never takes the
GIL; it hands back to Python only what it does not run itself: invalid requests (answered here with
INVALID_ARGUMENT and a message, and the ring goes on), fp16 requests and layers on the torch
operator. No gRPC and no event loop on this path."""
from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import struct
import threading
import time

import torch

from moe_exchange import codec, shm
from moe_exchange.shm import Layout, RegionError
from protos import expert_pb2

from moe_kernels import native

log = logging.getLogger("moe_exchange.ring")

U32 = struct.Struct("<I")
SPIN_US = 200          # a request usually follows within microseconds during a forward pass
WAIT_US = 200_000      # come back this often (metrics, stop)
INVALID, INTERNAL = shm.INVALID_ARGUMENT, shm.INTERNAL


class RingServer:
    """servicer: the expert service's (its layers, checks and `metrics`: where the ring records what it served)."""

    def __init__(self, mm, servicer, name: str):
        self.mm, self.servicer, self.name = mm, servicer, name
        self.metrics = servicer.metrics
        self.layout = Layout(len(mm))
        self.buf = torch.frombuffer(mm, dtype=torch.uint8)
        self.native = native.RingServer(mm, servicer.cfg.hidden_size, servicer.max_tokens, servicer.cfg.top_k,
                                        codec.TO_WIRE[torch.float32], codec.TO_WIRE[torch.bfloat16])
        for layer, op in servicer.layers.items():
            if hasattr(op, "native"):  # the torch operator's layers stay on the Python path
                self.native.add_layer(layer, op.native)
        self.done: concurrent.futures.Future = concurrent.futures.Future()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"shm-{name[-8:]}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        if self.native is not None:
            self.native.stop()

    def join(self) -> None:
        self._thread.join()
        self.native = self.buf = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the last one
            pass

    def _run(self) -> None:
        try:
            while not self._stop:
                ev = self.native.serve(WAIT_US, SPIN_US)
                self._observe(ev.parts)
                if ev.kind == native.ServeKind.CLOSED:
                    break
                if ev.kind == native.ServeKind.FOR_PYTHON:
                    self._serve(ev.seq, time.time_ns())
        except Exception:
            log.exception("shared-memory session %s failed", self.name)
        finally:
            if not self.mm.closed:
                U32.pack_into(self.mm, shm.CLOSED, 1)
                native.doorbell_wake(self.mm, shm.RESP_SEQ)  # a waiting peer sees the ring closed
            # the OpenShm handler cancels `done` when its stream ends first (asyncio.wrap_future passes the cancel on)
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                self.done.set_result(None)

    def _observe(self, parts) -> None:
        """Metrics of the parts the C++ loop ran since the last call (it hands them over in batches)."""
        for p in parts:
            self.metrics.record_part(p.layer, p.part, (p.end_ns - p.start_ns) / 1e9)
            if p.part == 0:
                self.metrics.record_request("Shm", p.tokens, p.queued_ns / 1e9)

    # -- one request --------------------------------------------------------------------------
    def _span(self, span, nbytes: int, what: str) -> int:
        off, n = span
        shm.check_span(self.layout, off, n, what)
        if n != nbytes:
            raise RegionError("INVALID_ARGUMENT", f"{what}: {n} bytes, the request's shape needs {nbytes}")
        return off

    def _serve(self, seq: int, t_recv: int) -> None:
        d = shm.REQ_DESC.unpack_from(self.mm, Layout.req_desc(seq))
        r_seq, step, layer, T, k, defer, dtype_code = d[:7]
        spans = list(zip(d[7::2], d[8::2]))  # hidden, ids, weights, immediate out, deferred out
        sv = self.servicer
        try:
            if r_seq != seq:
                raise RegionError("INVALID_ARGUMENT", f"request descriptor carries seq {r_seq}, expected {seq}")
            dtype = codec.FROM_WIRE.get(dtype_code)
            if dtype not in codec.FLOAT_DTYPES:
                raise RegionError("INVALID_ARGUMENT", f"hidden.dtype: {dtype_code} is not a float wire dtype")
            H = sv.cfg.hidden_size
            sv.validate_shape(layer, T, H, (T, k), (T, k), defer)
            xb = T * H * dtype.itemsize
            offs = [self._span(spans[0], xb, "hidden"), self._span(spans[1], T * k * 4, "topk_ids"),
                    self._span(spans[2], T * k * 4, "topk_weights"), self._span(spans[3], xb, "output")]
            if defer:
                offs.append(self._span(spans[4], xb, "deferred_output"))
            op = sv.layers[layer]
            native = sv.runs_native(layer, dtype)
            parts = self._native(op, layer, offs, dtype == torch.bfloat16, T, k, defer) if native \
                else self._generic(layer, offs, dtype, T, H, k, defer)
            queued_us = None
            for part, timing in parts:  # each part is posted as soon as it is computed
                if queued_us is None:
                    queued_us = max(0, (timing.start_unix_ns - t_recv) // 1000)
                timing.queued_us = queued_us
                self._respond(seq, part, 0, spans[3 + part], timing, "")
            self.metrics.record_request("Shm", T, queued_us / 1e6)
        except (RegionError, ValueError) as e:  # BadRequest and the kernels' own checks are ValueErrors
            self.metrics.ERRORS.labels("INVALID_ARGUMENT").inc()
            self._respond(seq, expert_pb2.IMMEDIATE, INVALID, (0, 0), None, str(e))
        except Exception as e:
            log.exception("shared-memory request failed")
            self.metrics.ERRORS.labels("INTERNAL").inc()
            self._respond(seq, expert_pb2.IMMEDIATE, INTERNAL, (0, 0), None, f"internal error: {e}")

    def _native(self, op, layer, offs, bf16: bool, T, k, defer):
        """Straight from the region to the kernels and back: no tensors, no copies. Yields
        (part, timing) as each part is written."""
        base = self.buf.data_ptr()
        x, ids, w = (base + o for o in offs[:3])
        for part in range(2 if defer else 1):
            _, timing = self.servicer.run_part(layer, part, lambda: op.forward_part(
                x, bf16, ids, w, base + offs[3 + part], bf16, T, k, defer, part))
            yield part, timing

    def _generic(self, layer, offs, dtype, T, H, k, defer):
        """Any operator (the torch path): private copies of the inputs (the peer can still write the
        region: what is checked must be what is used), the same checks as gRPC."""
        view = lambda off, n, dt, shape: self.buf[off: off + n].view(dt).view(shape)  # noqa: E731
        xb = T * H * dtype.itemsize
        hidden = view(offs[0], xb, dtype, (T, H)).clone()
        ids = view(offs[1], T * k * 4, torch.int32, (T, k)).clone()
        w = view(offs[2], T * k * 4, torch.float32, (T, k)).clone()
        self.servicer.validate(layer, hidden, ids, w, defer)
        for (part, y, timing), off in zip(self.servicer.compute(layer, hidden, ids, w, defer), offs[3:]):
            view(off, xb, dtype, (T, H)).copy_(y)
            yield part, timing

    def _respond(self, seq: int, part: int, status: int, span, timing, msg: str) -> None:
        t = timing or expert_pb2.ExpertTiming()
        if not self.native.respond(seq, part, status, span[0], span[1], t.queued_us, t.compute_us, t.start_unix_ns,
                                   t.end_unix_ns, msg.encode()[: shm.MSG_MAX].decode(errors="ignore")):
            raise RuntimeError("the ring closed, or its peer stopped reading responses")
