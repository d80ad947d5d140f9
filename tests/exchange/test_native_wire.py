"""native/exchange/wire.cpp, the expert exchange's second reader and writer of LayerRequest / LayerResult,
against the protobuf library: what it takes, what it leaves to protobuf, and byte-equal answers."""
from __future__ import annotations

import random
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moe_experts.kernels import MoELayer
from moe_exchange import codec, wire
from moe_exchange.wire import head as wire_head
from moe_core.routing import split_deferred
from protos import expert_pb2, tensor_pb2

pytestmark = pytest.mark.skipif(not hasattr(MoELayer(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(2, 8, 4),
                                                     "bf16", 1), "exchange_part"), reason="native kernels not built")
E, I, H = 8, 40, 96


def request(T=3, k=4, dtype=torch.bfloat16, step=7, layer=2, defer=0, seed=0) -> expert_pb2.LayerRequest:
    g = torch.Generator().manual_seed(seed)
    return expert_pb2.LayerRequest(
        step=step, layer=layer, defer=defer, hidden=codec.encode(torch.randn(T, H, generator=g).to(dtype)),
        topk_ids=codec.encode(torch.randint(0, E, (T, k), dtype=torch.int32, generator=g)),
        topk_weights=codec.encode(torch.rand(T, k, generator=g)))


@pytest.fixture(scope="module")
def op():
    torch.manual_seed(0)
    return MoELayer(torch.randn(E, I, H) * 0.1, torch.randn(E, I, H) * 0.1, torch.randn(E, H, I) * 0.1, "bf16", 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T, k", [(1, 8), (3, 4), (0, 2), (17, 1)])
def test_head_of_what_protobuf_writes(dtype, T, k):
    for step, layer, defer in ((0, 0, 0), (2**64 - 1, 2**32 - 1, 1), (123456789012, 61, 0)):
        req = request(T, k, dtype, step, layer, defer)
        assert fields(wire_head(req.SerializeToString())) == (step, layer, defer, T, H, k, dtype == torch.bfloat16)


def fields(head) -> tuple:
    return (head.step, head.layer, head.defer, head.T, head.H, head.k, head.bf16)


def field(n: int, body: bytes) -> bytes:
    """A length-delimited field n."""
    return _varint(n << 3 | 2) + _varint(len(body)) + body


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7f | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


CHANGES = [  # each makes a request the fast path leaves to protobuf
    lambda r: r.hidden.CopyFrom(codec.encode(torch.zeros(3, H, dtype=torch.float16))),  # fp16: the torch path
    lambda r: r.topk_ids.CopyFrom(codec.encode(torch.zeros(3, 4, dtype=torch.int64))),
    lambda r: r.topk_weights.CopyFrom(codec.encode(torch.zeros(3, 4, dtype=torch.bfloat16))),
    lambda r: r.hidden.CopyFrom(codec.encode(torch.zeros(1, 3, H))),                    # not 2-D
    lambda r: r.topk_ids.CopyFrom(codec.encode(torch.zeros(2, 4, dtype=torch.int32))),  # T differs
    lambda r: r.topk_weights.CopyFrom(codec.encode(torch.zeros(3, 5))),                # k differs
    lambda r: r.hidden.shape.__setitem__(1, H + 1),                                     # bytes != shape
    lambda r: r.hidden.shape.__setitem__(0, -3),
    lambda r: (r.topk_ids.CopyFrom(codec.encode(torch.zeros(3, 0, dtype=torch.int32))),
               r.topk_weights.CopyFrom(codec.encode(torch.zeros(3, 0)))),               # k = 0
    lambda r: r.ClearField("topk_weights"),
]


@pytest.mark.parametrize("i", range(len(CHANGES)))
def test_anything_else_is_left_to_protobuf(i):
    req = request()
    assert wire_head(req.SerializeToString()) is not None
    CHANGES[i](req)
    assert wire_head(req.SerializeToString()) is None


def test_proto3_forms_protobuf_reads_the_same():
    """Unknown fields skipped, fields in any order, the last scalar wins, a repeated message merges,
    shape unpacked: whatever form wire_head takes, protobuf reads the same head from it."""
    req = request(T=2, k=3)
    h = req.hidden
    rest = expert_pb2.LayerRequest(step=7, layer=2, topk_ids=req.topk_ids, topk_weights=req.topk_weights)
    unpacked_shape = bytes([0x08, h.dtype]) + b"".join(bytes([0x10, s]) for s in h.shape) + field(3, h.data)
    forms = [
        req.SerializeToString() + b"\x38\x05" + b"\x45" + b"\0" * 4 + b"\x49" + b"\0" * 8,   # unknown 7, 8, 9
        field(5, req.topk_weights.SerializeToString()) + expert_pb2.LayerRequest(
            step=7, layer=2, hidden=h, topk_ids=req.topk_ids).SerializeToString(),      # weights first
        b"\x10\x05" + req.SerializeToString(),                                          # layer 5, then 2
        field(3, unpacked_shape) + rest.SerializeToString(),
        field(3, bytes([0x08, h.dtype]) + field(2, bytes(h.shape))) + field(3, field(3, h.data)) +
        rest.SerializeToString(),                                                       # hidden in two pieces
    ]
    for data in forms:
        ref = expert_pb2.LayerRequest.FromString(data)
        assert fields(wire_head(data)) == (ref.step, ref.layer, ref.defer, 2, H, 3, True) == (7, 2, 0, 2, H, 3, True)


@given(st.binary(max_size=300), st.integers(0, 2**31))
@settings(max_examples=400, deadline=None)
def test_random_and_damaged_bytes(data, seed):
    """Never a crash; whatever wire_head takes, protobuf parses to the same head."""
    good = bytearray(request(T=1, k=2, dtype=torch.float32).SerializeToString())
    rnd = random.Random(seed)
    for _ in range(rnd.randint(1, 3)):  # damage a good message: flip, cut, insert
        i = rnd.randrange(len(good))
        choice = rnd.randrange(3)
        if choice == 0:
            good[i] ^= 1 << rnd.randrange(8)
        elif choice == 1:
            del good[i:]
            if not good:
                break
        else:
            good[i:i] = bytes([rnd.randrange(256)])
    for candidate in (data, bytes(good)):
        head = wire_head(candidate)
        if head is None:
            continue
        ref = expert_pb2.LayerRequest.FromString(candidate)
        assert (head.step, head.layer, head.defer) == (ref.step, ref.layer, ref.defer)
        assert list(ref.hidden.shape) == [head.T, head.H] and list(ref.topk_ids.shape) == [head.T, head.k]
        codec.decode(ref.hidden, "hidden", ndim=2), codec.decode(ref.topk_ids, "ids", (torch.int32,), ndim=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("defer", [0, 2])
@pytest.mark.parametrize("T", [1, 5])
def test_exchange_part_answers_as_the_tensor_path(op, dtype, defer, T):
    req = request(T=T, k=4, dtype=dtype, step=2**40 + 3, layer=6, defer=defer)
    x = codec.decode(req.hidden, "h")
    ids, w = codec.decode(req.topk_ids, "i"), codec.decode(req.topk_weights, "w")
    parts = [(ids, w)] if defer == 0 else [split_deferred(ids, w, defer)[:2], split_deferred(ids, w, defer)[2:]]
    for part, (p_ids, p_w) in enumerate(parts):
        received = time.time_ns() - 1_000_000  # a millisecond ago
        done = op.exchange_part(req.SerializeToString(), part, received)
        data, t0, t1 = done.result, done.start_unix_ns, done.end_unix_ns
        got = expert_pb2.LayerResult.FromString(data)
        # byte for byte what the protobuf library writes for the same message
        assert data == got.SerializeToString()
        assert (got.step, got.layer, got.part) == (req.step, 6, part)
        assert torch.equal(codec.decode(got.output, "out"), op.forward(x, p_ids.contiguous(), p_w.contiguous()))
        t = got.timing
        assert (t.start_unix_ns, t.end_unix_ns) == (t0, t1) and t1 >= t0
        assert t.compute_us == (t1 - t0) // 1000 and t.queued_us == (t0 - received) // 1000 >= 1000


def test_misaligned_tensors_in_the_message(op):
    """The tensors start wherever the message's headers leave them; an odd offset gives the same answer."""
    req = request(T=2, k=4, dtype=torch.float32)
    base = req.SerializeToString()
    for n in range(4):  # an unknown field of 2 + n bytes in front shifts every offset by 2, 3, 4, 5
        data = field(7, b"\0" * n) + base
        assert wire_head(data) is not None
        out = expert_pb2.LayerResult.FromString(op.exchange_part(data, 0, 0).result).output
        ref = expert_pb2.LayerResult.FromString(op.exchange_part(base, 0, 0).result).output
        assert out.data == ref.data


def test_exchange_part_refuses_bad_values(op):
    req = request(T=2, k=4)
    req.topk_ids.CopyFrom(codec.encode(torch.tensor([[0, 1, 2, E], [0, 1, 2, 3]], dtype=torch.int32)))
    with pytest.raises(ValueError, match="expert ids"):
        op.exchange_part(req.SerializeToString(), 0, 0)
    bad = request(T=2, k=4)
    bad.hidden.shape[1] = H // 2
    bad.hidden.data = bad.hidden.data[: len(bad.hidden.data) // 2]
    with pytest.raises(ValueError, match="hidden size"):
        op.exchange_part(bad.SerializeToString(), 0, 0)
    with pytest.raises(ValueError, match="native exchange"):
        op.exchange_part(b"\x0a\xff", 0, 0)


def test_dtype_codes_are_the_protos():
    """native/exchange/wire.h names FLOAT32, BFLOAT16 and INT32 by value: the heads above would be None were they
    other than tensor.proto's; this names the values in case of doubt."""
    assert (tensor_pb2.FLOAT32, tensor_pb2.BFLOAT16, tensor_pb2.INT32) == (1, 2, 4)


# -- the GPU side's end: requests written, results read ---------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("T", [0, 1, 6])
def test_request_bytes_are_what_protobuf_writes(dtype, T):
    x = torch.randn(H, T).to(dtype).T  # not contiguous
    ids, w = torch.randint(-1, E, (T, 3), dtype=torch.int32), torch.rand(T, 3)
    for step, layer, defer in ((0, 0, 0), (2**63 + 5, 61, 2)):
        ref = expert_pb2.LayerRequest(step=step, layer=layer, hidden=codec.encode(x), topk_ids=codec.encode(ids),
                                      topk_weights=codec.encode(w), defer=defer)
        assert wire.request(step, layer, x, ids, w, defer) == ref.SerializeToString()
    # ids not int32: protobuf writes it (the expert service then says what is wrong)
    ref = expert_pb2.LayerRequest(layer=3, hidden=codec.encode(x), topk_ids=codec.encode(ids.long()),
                                  topk_weights=codec.encode(w))
    assert wire.request(0, 3, x, ids.long(), w, 0) == ref.SerializeToString()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_results_read_as_protobuf_reads_them(dtype):
    out = torch.randn(3, H).to(dtype)
    timing = expert_pb2.ExpertTiming(queued_us=5, compute_us=2**40, start_unix_ns=1, end_unix_ns=2**62)
    msg = expert_pb2.LayerResult(step=9, layer=4, part=1, output=codec.encode(out), timing=timing)
    data = msg.SerializeToString()
    for form in (data, b"\x38\x01" + data + field(5, b"\x08\x07")):  # unknown field; timing merged, queued 7
        layer, part, y, t = wire.result(form)
        assert (layer, part) == (4, 1) and torch.equal(y, out)
        y += 1  # its own memory
        assert (t.queued_us, t.compute_us, t.start_unix_ns, t.end_unix_ns) == (
            5 if form is data else 7, 2**40, 1, 2**62)
    # not one the native reader takes (1-D output): protobuf and the codec read it, and refuse it if bad
    flat = expert_pb2.LayerResult(layer=4, output=codec.encode(torch.ones(5)))
    assert torch.equal(wire.result(flat.SerializeToString())[2], torch.ones(5))
    bad = expert_pb2.LayerResult(layer=4, output=codec.encode(torch.ones(2, 3)))
    bad.output.shape[1] = 4
    with pytest.raises(codec.CodecError):
        wire.result(bad.SerializeToString())
    with pytest.raises(Exception, match="Error parsing"):
        wire.result(b"\x22\xff")
