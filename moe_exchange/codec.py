"""Tensor wire codec: torch.Tensor <-> protos Tensor (raw little-endian bytes + dtype + shape).

decode() validates everything it is given (dtype known and allowed, shape non-negative,
byte length == prod(shape) * itemsize) and raises CodecError naming the field; the services
turn that into INVALID_ARGUMENT.
"""
from __future__ import annotations

import math
import sys

import torch

from protos import tensor_pb2

assert sys.byteorder == "little", "the wire format is little-endian"

TO_WIRE = {
    torch.float32: tensor_pb2.FLOAT32, torch.bfloat16: tensor_pb2.BFLOAT16, torch.float16: tensor_pb2.FLOAT16,
    torch.int32: tensor_pb2.INT32, torch.int64: tensor_pb2.INT64,
}
FROM_WIRE = {v: k for k, v in TO_WIRE.items()}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CodecError(ValueError):
    pass


def encode(t: torch.Tensor) -> tensor_pb2.Tensor:
    code = TO_WIRE.get(t.dtype)
    if code is None:
        raise CodecError(f"dtype {t.dtype} has no wire encoding")
    if t.device.type != "cpu":
        t = t.cpu()
    # view as bytes: works for bf16 too, which numpy lacks (one step per layer: as few ops as it takes)
    data = t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return tensor_pb2.Tensor(dtype=code, shape=t.shape, data=data)


def decode(msg: tensor_pb2.Tensor, field: str, allowed=None, ndim: int | None = None) -> torch.Tensor:
    """Decode and check one tensor; `field` names it in errors. Returns a CPU tensor that
    owns its memory (writable)."""
    dtype = FROM_WIRE.get(msg.dtype)
    shape = list(msg.shape)
    if dtype is None or (allowed is not None and dtype not in allowed) or (ndim is not None and len(shape) != ndim) \
            or (shape and min(shape) < 0):
        raise CodecError(_refusal(msg, field, allowed, ndim))
    data = msg.data  # each access copies the bytes out of the message: once only
    if math.prod(shape) * dtype.itemsize != len(data):
        raise CodecError(f"{field}.data: {len(data)} bytes do not match shape {shape} x {dtype.itemsize} bytes")
    if not data:
        return torch.empty(shape, dtype=dtype)
    # a writable copy; protobuf bytes are immutable
    return torch.frombuffer(bytearray(data), dtype=dtype).view(tuple(shape))


def _refusal(msg: tensor_pb2.Tensor, field: str, allowed, ndim) -> str:
    """What decode() found wrong with a tensor's dtype or shape (off the hot path)."""
    dtype, shape = FROM_WIRE.get(msg.dtype), list(msg.shape)
    if dtype is None:
        return f"{field}.dtype: unknown or unspecified dtype {msg.dtype}"
    if allowed is not None and dtype not in allowed:
        names = ", ".join(tensor_pb2.DType.Name(TO_WIRE[d]) for d in allowed)
        return f"{field}.dtype: {tensor_pb2.DType.Name(msg.dtype)} not allowed here (expected {names})"
    if ndim is not None and len(shape) != ndim:
        return f"{field}.shape: expected {ndim} dimensions, got {shape}"
    return f"{field}.shape: negative dimension in {shape}"
