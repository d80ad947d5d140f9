"""A table of bad requests for every RPC of both services: each gets the exact status code and a
message naming the field, and the service still answers a good request afterwards. Plus random
bytes and random messages (hypothesis) against the codec and every RPC."""

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from harness import Services
from moe_exchange import codec
from moe_core.serving import FINGERPRINT_KEY
from protos import expert_pb2, expert_pb2_grpc, generate_pb2, tensor_pb2

H, E, K = 64, 16, 4  # the tiny deepseek_v3 checkpoint


@pytest.fixture(scope="module")
def svc(checkpoints, tmp_path_factory):
    s = Services(checkpoints["deepseek_v3"], tmp_path_factory.mktemp("bad"), expert_args=("--max-tokens", "64"))
    s.expert_channel = grpc.insecure_channel(f"127.0.0.1:{s.expert_port}")
    s.expert_stub = expert_pb2_grpc.ExpertServiceStub(s.expert_channel)
    s.fp = s.stub.Info(generate_pb2.ServerInfoRequest(), timeout=10).model_fingerprint
    yield s
    s.expert_channel.close()
    s.stop()


def layer(T=2, layer=1, hidden=None, ids=None, w=None, defer=0):
    hidden = hidden if hidden is not None else codec.encode(torch.randn(T, H))
    ids = ids if ids is not None else codec.encode(torch.randint(0, E, (T, K), dtype=torch.int32))
    w = w if w is not None else codec.encode(torch.rand(T, K))
    return expert_pb2.LayerRequest(layer=layer, hidden=hidden, topk_ids=ids, topk_weights=w, defer=defer)


def raw(dtype, shape, data):
    return tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data)


F32, I32 = tensor_pb2.FLOAT32, tensor_pb2.INT32
IA, FP = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION

LAYER_CASES = [  # (name, request, code, text in the message)
    ("dense layer", layer(layer=0), IA, "not an MoE layer"),
    ("layer past the end", layer(layer=7), IA, "not an MoE layer"),
    ("huge layer", layer(layer=2**31), IA, "not an MoE layer"),
    ("hidden size", layer(hidden=codec.encode(torch.randn(2, H + 1))), IA, "hidden size"),
    ("hidden 1-D", layer(hidden=codec.encode(torch.randn(H))), IA, "hidden.shape"),
    ("hidden int dtype", layer(hidden=codec.encode(torch.zeros(2, H, dtype=torch.int32))), IA, "hidden.dtype"),
    ("hidden no dtype", layer(hidden=raw(0, [2, H], b"\0" * 2 * H * 4)), IA, "hidden.dtype"),
    ("hidden short bytes", layer(hidden=raw(F32, [2, H], b"\0" * 10)), IA, "hidden.data"),
    ("hidden negative dim", layer(hidden=raw(F32, [-2, H], b"")), IA, "hidden.shape"),
    ("hidden overflowing shape", layer(hidden=raw(F32, [2**40, 2**40], b"")), IA, "hidden.data"),
    ("hidden NaN", layer(hidden=codec.encode(torch.full((2, H), float("nan")))), IA, "non-finite"),
    ("hidden inf", layer(hidden=codec.encode(torch.full((2, H), float("inf")))), IA, "non-finite"),
    ("too many tokens", layer(T=65), IA, "exceed"),
    ("ids float", layer(ids=codec.encode(torch.zeros(2, K))), IA, "topk_ids.dtype"),
    ("ids wrong rows", layer(ids=codec.encode(torch.zeros(3, K, dtype=torch.int32))), IA, "topk_ids"),
    ("ids negative", layer(ids=codec.encode(torch.full((2, K), -2, dtype=torch.int32))), IA, "expert ids"),  # -1: none
    ("ids too large", layer(ids=codec.encode(torch.full((2, K), E, dtype=torch.int32))), IA, "expert ids"),
    ("ids k=0", layer(ids=codec.encode(torch.zeros(2, 0, dtype=torch.int32)), w=codec.encode(torch.zeros(2, 0))),
     IA, "k=0"),
    ("k above the model's top-k", layer(ids=codec.encode(torch.randint(0, E, (2, K + 1), dtype=torch.int32)),
                                        w=codec.encode(torch.rand(2, K + 1))), IA, "num_experts_per_tok"),
    ("weights shape", layer(w=codec.encode(torch.rand(2, K + 1))), IA, "topk_weights"),
    ("weights int", layer(w=codec.encode(torch.zeros(2, K, dtype=torch.int32))), IA, "topk_weights.dtype"),
    ("weights NaN", layer(w=codec.encode(torch.full((2, K), float("nan")))), IA, "non-finite"),
    ("defer = k", layer(defer=K), IA, "defer"),
]


def gen(**kw):
    kw.setdefault("max_tokens", 4)
    kw.setdefault("sampling", generate_pb2.SamplingParams(temperature=0))
    return generate_pb2.GenerateRequest(**kw)


GENERATE_CASES = [
    ("no input", gen(), IA, "input"),
    ("empty prompt", gen(prompt=""), IA, "prompt"),
    ("empty chat", gen(chat=generate_pb2.Chat()), IA, "chat.messages"),
    ("unknown role", gen(chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="root", content="x")])), IA,
     "role"),
    ("empty token ids", gen(token_ids=generate_pb2.TokenIds()), IA, "zero tokens"),
    ("token id negative", gen(token_ids=generate_pb2.TokenIds(ids=[-1])), IA, "token_ids"),
    ("token id past vocab", gen(token_ids=generate_pb2.TokenIds(ids=[320])), IA, "token_ids"),
    ("prompt over context", gen(token_ids=generate_pb2.TokenIds(ids=[5] * 512)), IA, "context"),
    ("max_tokens 0", gen(prompt="x", max_tokens=0), IA, "max_tokens"),
    ("max_tokens huge", gen(prompt="x", max_tokens=2**31), IA, "max_tokens"),
    ("temperature < 0", gen(prompt="x", sampling=generate_pb2.SamplingParams(temperature=-0.1)), IA, "temperature"),
    ("temperature NaN", gen(prompt="x", sampling=generate_pb2.SamplingParams(temperature=float("nan"))), IA,
     "temperature"),
    ("top_p 0", gen(prompt="x", sampling=generate_pb2.SamplingParams(top_p=0)), IA, "top_p"),
    ("top_p > 1", gen(prompt="x", sampling=generate_pb2.SamplingParams(top_p=1.01)), IA, "top_p"),
    ("top_k < 0", gen(prompt="x", sampling=generate_pb2.SamplingParams(top_k=-1)), IA, "top_k"),
    ("empty stop", gen(prompt="x", stop=[""]), IA, "stop"),
    ("too many stops", gen(prompt="x", stop=[str(i) for i in range(17)]), IA, "stop"),
    ("defer too big", gen(prompt="x", defer=K), IA, "defer"),
]

SCORE_CASES = [
    ("score empty", generate_pb2.ScoreRequest(), IA, "token_ids"),
    ("score bad id", generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=[1, 10**6])), IA, "token_ids"),
    ("score too long", generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=[3] * 513)), IA, "context"),
]

MALFORMED = b"\x0a\xff\xff\xff\xff\x0f"          # a length-delimited field longer than the message
BAD_UTF8 = b"\x0a\x02\xc3\x28"                    # GenerateRequest.prompt = invalid UTF-8
RAW_CASES = [  # (service method, bytes, code, text)
    ("/moe.v1.GenerateService/Generate", MALFORMED, IA, "could not be parsed"),
    ("/moe.v1.GenerateService/Generate", BAD_UTF8, IA, "could not be parsed"),
    ("/moe.v1.GenerateService/Score", MALFORMED, IA, "could not be parsed"),
    ("/moe.v1.GenerateService/Info", MALFORMED, IA, "could not be parsed"),
    ("/moe.v1.ExpertService/RunLayer", MALFORMED, IA, "could not be parsed"),
    ("/moe.v1.ExpertService/Info", MALFORMED, IA, "could not be parsed"),
]


def still_serving(svc):
    assert len([c for c in svc.stub.Generate(gen(prompt="ok", max_tokens=2), timeout=30)]) == 2
    svc.expert_stub.RunLayer(layer(), timeout=10)


def expect(call, code, text):
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value.details()
    assert text in e.value.details()


@pytest.mark.parametrize("name, req, code, text", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_run_layer(svc, name, req, code, text):
    expect(lambda: svc.expert_stub.RunLayer(req, timeout=10), code, text)
    still_serving(svc)


@pytest.mark.parametrize("name, req, code, text", LAYER_CASES[:8], ids=[c[0] for c in LAYER_CASES[:8]])
def test_exchange_stream(svc, name, req, code, text):
    def call():
        list(svc.expert_stub.Exchange(iter([layer(), req]), timeout=10, metadata=((FINGERPRINT_KEY, svc.fp),)))
    expect(call, code, text)
    still_serving(svc)


@pytest.mark.parametrize("name, req, code, text", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_generate(svc, name, req, code, text):
    expect(lambda: list(svc.stub.Generate(req, timeout=30)), code, text)
    still_serving(svc)


@pytest.mark.parametrize("name, req, code, text", SCORE_CASES, ids=[c[0] for c in SCORE_CASES])
def test_score(svc, name, req, code, text):
    expect(lambda: svc.stub.Score(req, timeout=30), code, text)
    still_serving(svc)


@pytest.mark.parametrize("method, data, code, text", RAW_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(RAW_CASES)])
def test_malformed_bytes(svc, method, data, code, text):
    ch = svc.expert_channel if "Expert" in method else svc.channel
    fn = ch.unary_stream(method) if method.endswith("Generate") else ch.unary_unary(method)
    expect(lambda: list(fn(data, timeout=10)) if method.endswith("Generate") else fn(data, timeout=10), code, text)
    still_serving(svc)


def test_wrong_fingerprint(svc):
    md = ((FINGERPRINT_KEY, "0" * 16),)
    expect(lambda: list(svc.expert_stub.Exchange(iter([layer()]), timeout=10, metadata=md)), FP, "fingerprint")
    expect(lambda: svc.expert_stub.RunLayer(layer(), timeout=10, metadata=md), FP, "fingerprint")
    still_serving(svc)


def test_oversized_message(svc):
    big = layer(hidden=raw(F32, [1, H], b"\0" * (70 * (H * 4 + E * 8) + (1 << 17))))
    expect(lambda: svc.expert_stub.RunLayer(big, timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED, "")
    still_serving(svc)


# -- property-based ------------------------------------------------------------------------------
@given(st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_codec_never_crashes_on_random_bytes(data):
    try:
        msg = tensor_pb2.Tensor.FromString(data)
    except Exception:
        return
    try:
        t = codec.decode(msg, "x")
    except codec.CodecError:
        return
    assert t.numel() * t.element_size() == len(msg.data)


@given(st.sampled_from([F32, I32, tensor_pb2.BFLOAT16, tensor_pb2.INT64, 0, 7]),
       st.lists(st.integers(-3, 2**33), max_size=4), st.binary(max_size=64))
@settings(max_examples=300, deadline=None)
def test_codec_random_messages(dtype, shape, data):
    try:
        t = codec.decode(raw(dtype, shape, data), "x")
    except codec.CodecError:
        return
    assert list(t.shape) == shape


@given(st.binary(max_size=256))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_rpc_survives_random_bytes(svc, data):
    methods = [("/moe.v1.GenerateService/Score", svc.channel), ("/moe.v1.GenerateService/Info", svc.channel),
               ("/moe.v1.ExpertService/RunLayer", svc.expert_channel), ("/moe.v1.ExpertService/Info",
                                                                        svc.expert_channel)]
    for method, ch in methods:
        try:
            ch.unary_unary(method)(data, timeout=10)
        except grpc.RpcError as e:
            assert e.code() in (IA, FP, grpc.StatusCode.RESOURCE_EXHAUSTED), (method, e.code(), e.details())
    try:
        list(svc.channel.unary_stream("/moe.v1.GenerateService/Generate")(data, timeout=30))
    except grpc.RpcError as e:
        assert e.code() == IA, e.details()
    try:  # the exchange parses its own messages (natively when it can): answered, or refused, never INTERNAL
        list(svc.expert_channel.stream_stream("/moe.v1.ExpertService/Exchange")(iter([data]), timeout=10))
    except grpc.RpcError as e:
        assert e.code() in (IA, FP), (e.code(), e.details())


@given(st.builds(generate_pb2.GenerateRequest, prompt=st.text(max_size=20), max_tokens=st.integers(0, 6),
                 stop=st.lists(st.text(max_size=3), max_size=3),
                 sampling=st.builds(generate_pb2.SamplingParams, temperature=st.floats(-1, 3),
                                    top_p=st.floats(-0.5, 1.5), top_k=st.integers(-3, 50), seed=st.integers(0, 2**63))))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_generate_requests(svc, req):
    try:
        chunks = list(svc.stub.Generate(req, timeout=30))
        assert chunks and chunks[-1].finish_reason != 0
    except grpc.RpcError as e:
        assert e.code() == IA, e.details()


def test_malformed_bytes_on_the_exchange_stream(svc):
    """The Exchange stream parses each message itself (a raw method: natively, or with protobuf): garbage
    after a good request ends the stream with INVALID_ARGUMENT, the good one answered."""
    from protos import expert_pb2

    fn = svc.expert_channel.stream_stream("/moe.v1.ExpertService/Exchange",
                                          response_deserializer=expert_pb2.LayerResult.FromString)
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for r in fn(iter([layer().SerializeToString(), MALFORMED]), timeout=10):
            got.append(r)
    assert e.value.code() == IA and "could not be parsed" in e.value.details()
    assert len(got) == 1 and got[0].layer == layer().layer
    still_serving(svc)
