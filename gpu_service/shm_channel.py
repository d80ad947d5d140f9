"""The GPU side of a shared-memory session (layout and checks: moe_core/shm.py): create the
region, register it over gRPC (OpenShm), then per layer write tensors + a request descriptor and
ring the doorbell; results are read in request order from response descriptors.

The OpenShm stream is the session's lifeline: a watcher thread follows it, and when it ends (the
expert service went away) any waiting result() returns with UNAVAILABLE instead of hanging."""
from __future__ import annotations

import ctypes
import logging
import struct
import threading
from collections import deque

import grpc
import torch

from expert_service import _moe_native as native
from moe_core import codec, shm
from moe_core.shm import Layout
from protos import expert_pb2

log = logging.getLogger("gpu_service.shm")

U32 = struct.Struct("<I")
MASK = 0xFFFFFFFF
SPIN_US = 2000        # results usually come within a few ms during decode: spinning beats a futex wake
WAIT_US = 100_000     # check the lifeline this often while waiting
ALIGN = 64
STATUS = {c.value[0]: c for c in grpc.StatusCode}


class ShmError(RuntimeError):
    def __init__(self, code: grpc.StatusCode, msg: str):
        super().__init__(msg)
        self.code = code


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ShmChannel:
    def __init__(self, stub, metadata, size: int):
        self.layout = Layout(size)
        name, nonce, self.mm = shm.create(size)
        self.name = name
        try:
            self.call = stub.OpenShm(expert_pb2.ShmOpen(name=name, size=size, nonce=nonce), metadata=metadata)
            next(self.call)  # ready (or the RpcError saying why not)
        except BaseException:
            self.mm.close()
            raise
        finally:
            shm.unlink(name)  # normally already gone: the expert service unlinks it once mapped
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base = self.buf.data_ptr()
        self.dead: str | None = None
        self.posted = 0       # requests posted
        self.consumed = 0     # responses read
        # per request still being answered: [seq, layer, parts left]
        self.pending: deque = deque()
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
        return need <= self.layout.block_size and len(self.pending) < shm.REQ_SLOTS

    def _pin(self, x: torch.Tensor) -> None:
        # CUDA: page-lock the region once so device<->host copies DMA straight into it
        self._pinned = True
        try:
            torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), self.layout.size, 0)
        except Exception as e:  # works without, only slower
            log.warning("could not pin the shared region for CUDA copies: %s", e)

    def _put(self, off: int, t: torch.Tensor) -> tuple[int, int]:
        n = t.numel() * t.element_size()
        if t.is_cuda:
            self.buf[off: off + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
        else:  # one memmove: a torch copy_ into a view costs several times more for small tensors
            t = t.contiguous()
            ctypes.memmove(self.base + off, t.data_ptr(), n)
        return off, n

    def submit(self, step: int, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, defer: int) -> None:
        if self.dead:
            raise ShmError(grpc.StatusCode.UNAVAILABLE, self.dead)
        if x.is_cuda and not self._pinned:
            self._pin(x)
        T, H = x.shape
        k = ids.shape[1]
        seq = self.posted
        base = self.layout.block(seq)
        hid = _aligned(T * H * x.element_size())
        ids_span = self._put(base + hid, ids if ids.dtype == torch.int32 else ids.to(torch.int32))
        w_span = self._put(base + hid + _aligned(T * k * 4), w if w.dtype == torch.float32 else w.float())
        out = base + hid + 2 * _aligned(T * k * 4)
        x_span = self._put(base, x)
        if x.is_cuda:
            torch.cuda.current_stream(x.device).synchronize()
        out_span, dout_span = (out, x_span[1]), (out + hid, x_span[1])
        shm.REQ_DESC.pack_into(self.mm, Layout.req_desc(seq), seq, step, layer, T, k, defer, codec.TO_WIRE[x.dtype],
                               *x_span, *ids_span, *w_span, *out_span, *(dout_span if defer else (0, 0)))
        self.posted = seq + 1
        self.pending.append([seq, 2 if defer else 1])
        self.expect.append((seq, layer, False))
        if defer:
            self.expect.append((seq, layer, True))
        native.doorbell_ring(self.mm, shm.REQ_SEQ, self.posted & MASK)

    def result(self, layer: int, deferred: bool, shape, dtype) -> tuple[torch.Tensor, expert_pb2.ExpertTiming]:
        j = self.consumed
        while True:
            v = native.doorbell_wait(self.mm, shm.RESP_SEQ, j & MASK, WAIT_US, SPIN_US)
            if v != j & MASK:
                break
            if self.dead or U32.unpack_from(self.mm, shm.CLOSED)[0]:
                raise ShmError(grpc.StatusCode.UNAVAILABLE, self.dead or "the expert service closed the shared-memory ring")
        seq, part, status, off, nbytes, queued_us, compute_us, t0, t1, msg_len = \
            shm.RESP_DESC.unpack_from(self.mm, Layout.resp_desc(j))
        want_seq, want_layer, want_def = self.expect[0]
        if status:
            start = Layout.resp_desc(j) + shm.RESP_DESC.size
            msg = bytes(self.mm[start: start + min(msg_len, shm.MSG_MAX)]).decode(errors="replace")
            raise ShmError(STATUS.get(status, grpc.StatusCode.UNKNOWN), msg)
        if (seq, part) != (want_seq, int(want_def)) or (want_layer, want_def) != (layer, deferred):
            raise ShmError(grpc.StatusCode.INTERNAL, f"shared-memory ring out of order: wanted layer {layer} "
                           f"part {int(deferred)} of request {want_seq}, got part {part} of request {seq}")
        shm.check_span(self.layout, off, nbytes, "output")
        n = shape[0] * shape[1] * dtype.itemsize
        if nbytes != n:
            raise ShmError(grpc.StatusCode.INTERNAL, f"shared-memory output of {nbytes} bytes, expected {n}")
        y = torch.empty(shape, dtype=dtype)
        ctypes.memmove(y.data_ptr(), self.base + off, n)
        self.expect.popleft()
        self.consumed = j + 1
        U32.pack_into(self.mm, shm.RESP_READ, self.consumed & MASK)
        self.pending[0][1] -= 1
        if self.pending[0][1] == 0:
            self.pending.popleft()
        return y, expert_pb2.ExpertTiming(queued_us=queued_us, compute_us=compute_us, start_unix_ns=t0, end_unix_ns=t1)

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
