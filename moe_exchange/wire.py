"""The expert exchange's messages as bytes. The Exchange stream is a raw method on both ends: the
GPU side writes each LayerRequest and reads each LayerResult, the expert service reads and answers
them, with the native reader/writer (native/exchange/wire.cpp) where it can and the protobuf library where
not. protos/expert.proto stays the contract; the bytes are the same either way (tests/exchange/test_native_wire.py).

Why: a decode step sends one request per MoE layer, and each protobuf message, tensor and field built
or read in Python costs microseconds, more so on a core whose caches a kernel has just swept.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from protos import expert_pb2

from moe_exchange import codec

EXCHANGE = f"/{expert_pb2.DESCRIPTOR.services_by_name['ExpertService'].full_name}/Exchange"


class Timing(NamedTuple):  # what the expert service measured, as ExpertTiming's fields (either transport)
    queued_us: int
    compute_us: int
    start_unix_ns: int
    end_unix_ns: int


try:
    from moe_kernels import native as _n
except ImportError:  # no native library: protobuf for everything
    _n = None


def head(request: bytes):
    """The native.WireHead (step, layer, defer, T, H, k, bf16) of a serialized LayerRequest the native exchange
    takes (hidden [T, H] bf16|fp32, ids [T, k] int32, weights [T, k] fp32), else None."""
    return _n.wire_head(request) if _n is not None else None


def request(step: int, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, defer: int) -> bytes:
    """A serialized LayerRequest for hidden x [T, H], ids [T, k], weights [T, k]."""
    if _n is None or ids.dtype != torch.int32 or w.dtype != torch.float32 or x.dtype not in codec.TO_WIRE \
            or x.element_size() not in (2, 4):
        return expert_pb2.LayerRequest(step=step, layer=layer, hidden=codec.encode(x), topk_ids=codec.encode(ids),
                                       topk_weights=codec.encode(w), defer=defer).SerializeToString()
    if x.device.type != "cpu":
        x, ids, w = x.cpu(), ids.cpu(), w.cpu()
    x, ids, w = x.contiguous(), ids.contiguous(), w.contiguous()  # no-ops when they already are
    (T, H), k = x.shape, ids.shape[1]
    return _n.wire_request(step, layer, defer, x.data_ptr(), codec.TO_WIRE[x.dtype], x.element_size(), T, H,
                           ids.data_ptr(), w.data_ptr(), k)


def result(data: bytes) -> tuple[int, int, torch.Tensor, Timing]:
    """A serialized LayerResult -> (layer, part, output tensor of its own, timing). Raises DecodeError
    (protobuf's) or codec.CodecError on what is not a valid one."""
    h = _n.wire_result(data) if _n is not None else None
    dtype = codec.FROM_WIRE.get(h.dtype) if h is not None else None
    if dtype is not None and h.rows >= 0 and h.cols >= 0 and h.rows * h.cols * dtype.itemsize == h.nbytes:
        out = torch.empty((h.rows, h.cols), dtype=dtype)
        _n.wire_result_output(data, out.data_ptr(), h.nbytes)
        return h.layer, h.part, out, Timing(h.queued_us, h.compute_us, h.start_unix_ns, h.end_unix_ns)
    r = expert_pb2.LayerResult.FromString(data)
    t = r.timing
    return r.layer, r.part, codec.decode(r.output, "output"), Timing(t.queued_us, t.compute_us, t.start_unix_ns,
                                                                   t.end_unix_ns)
