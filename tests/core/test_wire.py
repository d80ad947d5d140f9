"""The tensor codec, and that generated gRPC code matches the .proto files."""
import subprocess
import sys

import pytest
import torch

from harness import ROOT
from moe_exchange import codec
from protos import tensor_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(0,), (3,), (2, 5), (1, 7, 3)])
def test_roundtrip(dtype, shape):
    t = (torch.randn(shape) * 100).to(dtype)
    back = codec.decode(codec.encode(t), "x")
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    back += 1  # decoded tensors are writable and do not alias the message


def test_non_contiguous_input():
    t = torch.arange(12, dtype=torch.float32).view(3, 4).T
    assert torch.equal(codec.decode(codec.encode(t), "x"), t)


@pytest.mark.parametrize("msg, needle", [
    (tensor_pb2.Tensor(dtype=0, shape=[1], data=b"\0" * 4), "unknown"),
    (tensor_pb2.Tensor(dtype=99, shape=[1], data=b"\0" * 4), "unknown"),
    (tensor_pb2.Tensor(dtype=tensor_pb2.FLOAT32, shape=[2], data=b"\0" * 4), "do not match"),
    (tensor_pb2.Tensor(dtype=tensor_pb2.FLOAT32, shape=[-1], data=b""), "negative"),
    (tensor_pb2.Tensor(dtype=tensor_pb2.FLOAT32, shape=[1 << 62, 4], data=b""), "do not match"),
])
def test_decode_rejects(msg, needle):
    with pytest.raises(codec.CodecError, match=needle):
        codec.decode(msg, "hidden")


def test_decode_checks_dtype_and_rank():
    m = codec.encode(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(codec.CodecError, match="not allowed"):
        codec.decode(m, "hidden", codec.FLOAT_DTYPES)
    with pytest.raises(codec.CodecError, match="3 dimensions"):
        codec.decode(m, "hidden", ndim=3)


def test_generated_code_is_fresh():
    p = subprocess.run([sys.executable, "-m", "moe_core.gen_protos", "--check"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
