"""The GPU side of a shared-memory session (layout and checks: moe_exchange/shm.py): create the
region, register it over gRPC (OpenShm), then per layer write tensors + a request descriptor and
ring the doorbell; results are read in request order from response descriptors.

The OpenShm stream is the session's lifeline: a watcher thread follows it, and when it ends (the
expert service went away) any waiting result() returns with UNAVAILABLE instead of hanging."""
from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque

import grpc
import torch

from moe_kernels import native as native
from moe_exchange import codec, shm
from moe_exchange.wire import Timing
from moe_exchange.shm import Layout
from protos import expert_pb2

log = logging.getLogger("gpu_service.shm")

U32 = struct.Struct("<I")
MASK = 0xFFFFFFFF
SPIN_US = 2000        # results usually come within a few ms during decode: spinning beats a futex wake
WAIT_US = 100_000     # check the lifeline this often while waiting
ALIGN = shm.SPAN_ALIGN
STATUS = {c.value[0]: c for c in grpc.StatusCode}


class ShmError(RuntimeError):
    def __init__(self, code: grpc.StatusCode, msg: str):
        super().__init__(msg)
        self.code = code


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ShmChannel:
    def __init__(self, stub, metadata, size: int, timeout_s: float = 30.0):
        self.layout = Layout(size)
        name, nonce, self.mm = shm.create(size)
        self.name = name
        try:
            self.call = stub.OpenShm(expert_pb2.ShmOpen(name=name, size=size, nonce=nonce), metadata=metadata)
            # the stream is the session's lifeline (no deadline of its own): a stuck peer must not hang us here
            timer = threading.Timer(timeout_s, self.call.cancel)
            timer.start()
            try:
                next(self.call)  # ready (or the RpcError saying why not; CANCELLED: the timer fired)
            finally:
                timer.cancel()
        except BaseException:
            self.mm.close()
            raise
        finally:
            shm.unlink(name)  # normally already gone: the expert service unlinks it once mapped
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.dead: str | None = None
        self.posted = 0       # requests posted
        self.consumed = 0     # responses read
        self.expect: deque = deque()  # (seq, layer, deferred) of every response still to come, in order
        self._pinned = False
        threading.Thread(target=self._watch, name="shm-lifeline", daemon=True).start()

    def _watch(self) -> None:
        try:
            for _ in self.call:
                pass
            self.dead = "the expert service ended the shared-memory session"
        except grpc.RpcError as e:
            self.dead = f"shared-memory session lost: {e.code().name}: {e.details()}"
        try:
            native.doorbell_wake(self.mm, shm.RESP_SEQ)
        except ValueError:  # closed meanwhile
            pass

    def fits(self, T: int, H: int, itemsize: int, k: int) -> bool:
        need = 3 * _aligned(T * H * itemsize) + 2 * _aligned(T * k * 4)
        # a request's slot is reused only once all its results are read
        in_flight = len({seq for seq, _, _ in self.expect})
        return need <= self.layout.block_size and in_flight < shm.REQ_SLOTS

    def _pin(self) -> None:
        # CUDA: page-lock the region once so device<->host copies DMA straight into it
        self._pinned = True
        try:
            torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.layout.size, 0)
        except Exception as e:  # works without, only slower
            log.warning("could not pin the shared region for CUDA copies: %s", e)

    def _spans(self, seq: int, T: int, H: int, itemsize: int, k: int) -> tuple[int, int, int, int, int]:
        """Where request seq's tensors go in its slot's data block: hidden, ids, weights, the immediate output,
        the deferred output."""
        base = self.layout.block(seq)
        hid, kb = _aligned(T * H * itemsize), _aligned(T * k * 4)
        return base, base + hid, base + hid + kb, base + hid + 2 * kb, base + 2 * hid + 2 * kb

    def submit(self, step: int, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, defer: int) -> None:
        if self.dead:
            raise ShmError(grpc.StatusCode.UNAVAILABLE, self.dead)
        T, H = x.shape
        k = ids.shape[1]
        seq = self.posted
        xn, kn = T * H * x.element_size(), T * k * 4
        *spans, out, deferred_out = self._spans(seq, T, H, x.element_size(), k)  # spans: x, ids, weights
        if x.is_cuda:
            # device -> the pinned region straight (DMA), converting ids/weights on the way; then wait for
            # this stream only (the copies are its last work), never the whole device
            if not self._pinned:
                self._pin()
            for t, dt, off in zip((x, ids, w), (x.dtype, torch.int32, torch.float32), spans):
                self.buf[off: off + t.numel() * dt.itemsize].view(dt).view(t.shape).copy_(t, non_blocking=True)
            torch.cuda.current_stream(x.device).synchronize()
            ptrs = (0, 0, 0)  # already in place
        else:
            x = x.contiguous()
            ids = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
            w = w if w.dtype == torch.float32 and w.is_contiguous() else w.float().contiguous()
            ptrs = (x.data_ptr(), ids.data_ptr(), w.data_ptr())
        # one native call: copies, descriptor, doorbell
        native.ring_submit(self.mm, seq, step, layer, T, k, defer, codec.TO_WIRE[x.dtype], spans[0], xn, spans[1],
                           kn, spans[2], kn, out, xn, *((deferred_out, xn) if defer else (0, 0)),
                           *ptrs, (seq + 1) & MASK)
        self.posted = seq + 1
        self.expect.append((seq, layer, False))
        if defer:
            self.expect.append((seq, layer, True))

    def result(self, layer: int, deferred: bool, shape, dtype, timeout_s: float = float("inf"), pin: bool = False
               ) -> tuple[torch.Tensor, Timing]:
        """The next result, which must be (layer, deferred). TimeoutError after timeout_s without one.
        pin: into page-locked memory, for an asynchronous copy to the GPU (torch's pinned allocator keeps
        the block until that copy is done)."""
        want_seq, want_layer, want_def = self.expect[0]
        if (want_layer, want_def) != (layer, deferred):
            raise ShmError(grpc.StatusCode.INTERNAL, f"results read out of order: wanted layer {layer} part "
                           f"{int(deferred)}, next is layer {want_layer} part {int(want_def)}")
        y = torch.empty(shape, dtype=dtype, pin_memory=pin)
        until = time.monotonic() + timeout_s
        while True:  # the wait, the checks and the copy out happen in C++ without the GIL
            got = native.ring_result(self.mm, self.consumed, want_seq, int(want_def), y.data_ptr(),
                                     y.numel() * y.element_size(), WAIT_US, SPIN_US)
            if got.status >= 0:
                break
            if self.dead or U32.unpack_from(self.mm, shm.CLOSED)[0]:
                raise ShmError(grpc.StatusCode.UNAVAILABLE, self.dead or "the expert service closed the shared-memory ring")
            if time.monotonic() > until:
                raise TimeoutError
        if got.status:
            raise ShmError(STATUS.get(got.status, grpc.StatusCode.UNKNOWN), got.message.decode(errors="replace"))
        self.expect.popleft()
        self.consumed += 1
        return y, Timing(got.queued_us, got.compute_us, got.start_unix_ns, got.end_unix_ns)

    def decode_layers(self, run, step: int, T: int, H: int, dtype: torch.dtype, k: int, timeout_s: float) -> None:
        """A decode step's layers through the native loop (gpu_service/model/native_loop.py), its requests and answers
        on this ring: run(client, first layer, waiting) -> (layer reached, status, message) is called again
        after each wait's slice that ended without an answer, once the lifeline and the layer's deadline
        (timeout_s) are checked. Raises as result() does (TimeoutError(layer) past the deadline);
        posted / consumed / expect stay true whatever happens."""
        if self.dead:
            raise ShmError(grpc.StatusCode.UNAVAILABLE, self.dead)
        if self.expect:  # a step's requests are all answered by its end (its last layer defers nothing)
            raise ShmError(grpc.StatusCode.INTERNAL, "decode loop started with results still outstanding")
        slots = [self._spans(i, T, H, dtype.itemsize, k) for i in range(shm.REQ_SLOTS)]
        x, ids, w, out, deferred = slots[0]
        client = native.RingClient(self.mm, step, self.posted, self.consumed, codec.TO_WIRE[dtype],
                                   [s[0] for s in slots], ids - x, w - x, out - x, deferred - x, WAIT_US, SPIN_US)
        layer, waiting, until = 0, False, 0.0
        try:
            while True:
                got, status, msg = run(client, layer, waiting)
                if status == 0:
                    return
                first_slice = got != layer or not waiting
                layer = got
                if status > 0:
                    raise ShmError(STATUS.get(status, grpc.StatusCode.UNKNOWN), msg.decode(errors="replace"))
                if first_slice:  # of this layer's wait
                    until = time.monotonic() + timeout_s
                if self.dead or U32.unpack_from(self.mm, shm.CLOSED)[0]:
                    raise ShmError(grpc.StatusCode.UNAVAILABLE, self.dead or "the expert service closed the "
                                   "shared-memory ring")
                if time.monotonic() > until:
                    raise TimeoutError(layer)
                waiting = True
        finally:
            self.posted, self.consumed = client.posted, client.consumed
            self.expect.extend(client.outstanding)

    def close(self) -> None:
        if self.mm.closed:
            return
        U32.pack_into(self.mm, shm.CLOSED, 1)
        native.doorbell_wake(self.mm, shm.REQ_SEQ)
        self.call.cancel()
        if self._pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            except Exception:
                pass
        self.buf = None
        try:
            self.mm.close()
        except BufferError:  # an output view escaped; the mapping goes with it
            pass
