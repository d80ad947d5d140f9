"""The OpenAI-compatible HTTP API, through the official `openai` client and raw HTTP/SSE, against the
gRPC API of the same service (the embedded default model, both services as real processes)."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import signal
import time
import urllib.request

import grpc
import openai
import pytest
import torch

from harness import ROOT, Services, free_port, status_mib
from protos import generate_pb2

TOKEN = "openai-api-test-token"
MODEL = ROOT / "models" / "default"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    d = tmp_path_factory.mktemp("openai")
    (d / "token").write_text(TOKEN)
    port, mport = free_port(), free_port()
    s = Services(MODEL, d, gpu_args=("--auth-token-file", str(d / "token"), "--http-listen", f"127.0.0.1:{port}",
                                     "--metrics-port", str(mport)))
    s.http, s.metrics = port, mport
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(svc):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{svc.http}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def grpc_text(svc, **kw) -> tuple[str, list]:
    chunks = list(svc.stub.Generate(generate_pb2.GenerateRequest(**kw), metadata=AUTH, timeout=120))
    return "".join(c.text for c in chunks), chunks


def greedy(**kw) -> dict:
    return {"temperature": 0, **kw}


def test_models_are_listed(client):
    assert [m.id for m in client.models.list()] == ["default"]
    assert client.models.retrieve("default").id == "default"


def test_completion_equals_the_grpc_stream(svc, client):
    prompt = "def parse_args(argv):"
    r = client.completions.create(model="default", prompt=prompt, max_tokens=24, **greedy())
    text, chunks = grpc_text(svc, prompt=prompt, max_tokens=24, sampling=generate_pb2.SamplingParams(temperature=0))
    assert r.choices[0].text == text and text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    assert r.usage.completion_tokens == 24 == chunks[-1].usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_streamed_chat_equals_the_plain_answer(client):
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list of dicts."}]
    plain = client.chat.completions.create(model="default", messages=msgs, max_tokens=32, **greedy())
    deltas, finish, usage, roles = [], None, None, []
    for ch in client.chat.completions.create(model="default", messages=msgs, max_tokens=32, stream=True,
                                             stream_options={"include_usage": True}, **greedy()):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            roles += [c.delta.role] if c.delta.role else []
            deltas.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert plain.choices[0].message.role == "assistant" and roles == ["assistant"]
    assert "".join(deltas) == plain.choices[0].message.content and plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason == "length"
    # the same usage, except that the second request found the first one's prompt in the prefix cache
    assert usage is not None and usage.model_dump(exclude={"prompt_tokens_details"}) == \
        plain.usage.model_dump(exclude={"prompt_tokens_details"})
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16  # whole KV blocks


def test_stop_strings_end_the_answer_before_them(client):
    prompt = "import os\nimport sys\n"
    full = client.completions.create(model="default", prompt=prompt, max_tokens=32, **greedy()).choices[0].text
    k = next(i for i in range(4, len(full) - 3) if full.find(full[i:i + 3]) == i and full[i:i + 3].strip())
    stop = full[k:k + 3]
    r = client.completions.create(model="default", prompt=prompt, max_tokens=32, stop=[stop, "\x00never"], **greedy())
    assert r.choices[0].text == full[:k] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="default", prompt=prompt, max_tokens=32, stop=stop, stream=True, **greedy()) if c.choices)
    assert streamed == full[:k]


def test_logprobs_on_http_and_grpc(svc, client):
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hello"}],
                                       max_tokens=8, logprobs=True, top_logprobs=3, **greedy())
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:  # greedy: the chosen token is the most likely one, and its logprob is that one's
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert t.logprob == pytest.approx(tops[0]) and tops[0] <= 0
        assert sum(torch.tensor(tops).exp()) <= 1 + 1e-5
        assert bytes(t.bytes) == t.token.encode()
    _, chunks = grpc_text(svc, prompt="hello", max_tokens=5, logprobs=2,
                          sampling=generate_pb2.SamplingParams(temperature=0))
    got = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in got] == [i for c in chunks for i in c.token_ids]
    # greedy: the chosen token is a most likely one (bf16 logits tie often: compare probabilities, not ids)
    assert all(len(lp.top) == 2 and lp.top[0].logprob == lp.logprob for lp in got)
    legacy = client.completions.create(model="default", prompt="hello", max_tokens=4, logprobs=2, **greedy())
    assert len(legacy.choices[0].logprobs.token_logprobs) == 4


@pytest.mark.parametrize("kw,param", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                      ({"n": 17}, "n"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"),
                                      ({"presence_penalty": 3}, "presence_penalty"),
                                      ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
                                      ({"stop": ["a"] * 17}, "stop")])
def test_bad_parameters_are_400_naming_them(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="x", **kw)
    assert e.value.status_code == 400 and param in e.value.message


def test_auth_model_and_context_errors(svc, client):
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{svc.http}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert "gpt-4" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt=[5] * 2000, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                       top_logprobs=2)
    assert "logprobs" in e.value.message


def raw(svc, method: str, path: str, body: bytes | None = None, token: str | None = TOKEN):
    c = http.client.HTTPConnection("127.0.0.1", svc.http, timeout=60)
    c.request(method, path, body=body, headers={"Authorization": f"Bearer {token}"} if token else {})
    r = c.getresponse()
    return r, c


def test_raw_errors_have_openai_shape(svc):
    for method, path, body, status in [("POST", "/v1/completions", b"{not json", 400),
                                       ("GET", "/v1/nothing", None, 404), ("POST", "/v1/completions", b"[1]", 400),
                                       ("POST", "/v1/chat/completions", b'{"messages": []}', 400)]:
        r, c = raw(svc, method, path, body)
        err = json.loads(r.read())["error"]
        c.close()
        assert r.status == status and err["message"] and err["type"]
    r, c = raw(svc, "GET", "/health", token=None)  # open, for load balancers
    assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    c.close()


def test_raw_sse_stream(svc):
    body = json.dumps({"model": "default", "prompt": "class A:", "max_tokens": 6, "stream": True, "temperature": 0})
    r, c = raw(svc, "POST", "/v1/completions", body.encode())
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    events = r.read().decode().split("\n\n")
    c.close()
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(ch["object"] == "text_completion" and len({ch["id"] for ch in chunks}) == 1 for ch in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])


def running(svc) -> int:
    return svc.stub.Info(generate_pb2.ServerInfoRequest(), metadata=AUTH, timeout=10).running_requests


def test_client_that_disconnects_frees_its_slot(svc):
    body = json.dumps({"model": "default", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True})
    r, c = raw(svc, "POST", "/v1/completions", body.encode())
    assert r.status == 200
    r.fp.readline()  # the first event: it is generating
    assert running(svc) == 1
    c.sock.close()
    c.close()
    deadline = time.monotonic() + 5  # 1000 tokens would take ~10 s: it must stop well before
    while running(svc) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(svc) == 0
    # and a non-streamed request whose client gives up
    body = json.dumps({"model": "default", "prompt": "x", "max_tokens": 1000, "ignore_eos": True})
    c = http.client.HTTPConnection("127.0.0.1", svc.http, timeout=0.5)
    c.request("POST", "/v1/completions", body=body, headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(TimeoutError):
        c.getresponse()
    c.close()
    deadline = time.monotonic() + 5
    while running(svc) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(svc) == 0


def test_sixteen_concurrent_streamed_chats_each_equal_its_solo_run(svc, client):
    prompts = [f"Write a function number {i} that adds {i}." for i in range(16)]

    def chat(p: str, stream: bool) -> str:
        msgs = [{"role": "user", "content": p}]
        if not stream:
            return client.chat.completions.create(model="default", messages=msgs, max_tokens=16,
                                                  **greedy()).choices[0].message.content
        own = openai.OpenAI(base_url=f"http://127.0.0.1:{svc.http}/v1", api_key=TOKEN, max_retries=0, timeout=300)
        return "".join(c.choices[0].delta.content or "" for c in own.chat.completions.create(
            model="default", messages=msgs, max_tokens=16, stream=True, **greedy()) if c.choices)

    solo = [chat(p, False) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        together = list(ex.map(lambda p: chat(p, True), prompts))
    assert together == solo and all(solo)


def test_http_metrics_in_the_same_registry(svc, client):
    client.models.list()
    text = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics}/metrics", timeout=10).read().decode()
    assert 'moe_http_requests_total{route="/v1/models",status="200"}' in text
    assert "moe_requests_total" in text  # gRPC's, beside it


@pytest.mark.slow
def test_503_while_the_expert_service_is_down(services_factory, tmp_path):
    """With --expert-wait 0 new requests are refused while it is down (by default they are held: test_operations)."""
    port = free_port()
    s = services_factory(MODEL, gpu_args=("--http-listen", f"127.0.0.1:{port}", "--expert-wait", "0"))
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    assert c.completions.create(model="default", prompt="x", max_tokens=2).choices[0].text is not None
    s.expert.terminate()
    s.expert.wait(30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
        except urllib.error.HTTPError as e:
            assert e.code == 503 and "expert service" in json.loads(e.read())["reason"]
            break
        time.sleep(0.2)
    else:
        pytest.fail("/health stayed 200 with the expert service down")
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="default", prompt="x", max_tokens=2)
    assert e.value.status_code == 503 and "expert service" in e.value.message


def test_sigterm_drains_http_too(services_factory):
    """Draining: a stream in flight finishes; new requests get 503 (not a refused connection) meanwhile."""
    port = free_port()
    s = services_factory(MODEL, gpu_args=("--http-listen", f"127.0.0.1:{port}", "--grace", "60"))
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    # long enough to be in flight 0.5 s after the signal: the embedded model decodes 150 tokens in under that on
    # the native decode loop (~200 tok/s on a 2-core Zen 3)
    n = 600
    stream = iter(c.completions.create(model="default", prompt="x", max_tokens=n, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    next(stream)
    s.gpu.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model="default", prompt="x", max_tokens=2)
    assert e.value.status_code == 503 and "shutting down" in e.value.message
    rest = list(stream)  # the request in flight still finishes
    assert rest[-2].choices[0].finish_reason == "length" and rest[-1].usage.completion_tokens == n
    assert s.gpu.wait(30) == 0


def post(svc, path: str, body: bytes, timeout: float = 60):
    r, c = raw(svc, "POST", path, body)
    try:
        return r.status, json.loads(r.read())
    finally:
        c.close()


HOSTILE = [  # (route, body, param named in the error or None)
    ("completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 2**32}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 1e30}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ("completions", {"prompt": "x", "top_k": 2**40}, "top_k"),
    ("completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2**40}, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"prompt": "x", "logprobs": 2**40}, "logprobs"),
    ("completions", {"prompt": [1, 2**40]}, "prompt"),
    ("completions", {"prompt": [1, -1]}, "prompt"),
    ("completions", {"prompt": [1, 10**6]}, "prompt"),  # fits int32, not the vocabulary
    ("completions", {"prompt": "x", "temperature": 10**400}, "temperature"),
    ("completions", {"prompt": "x", "temperature": 1e300}, "temperature"),
    ("completions", {"prompt": "x", "top_p": "high"}, "top_p"),
    ("completions", {"prompt": "x", "seed": 1.5}, "seed"),
    ("completions", {"prompt": "x", "stop": ["a" * 5000]}, "stop"),
    ("completions", {"prompt": "x", "stop": 7}, "stop"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
    ("completions", {"prompt": "x", "stream_options": []}, "stream_options"),
    ("completions", {"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ("completions", {"prompt": "x", "user": 5}, "user"),
    ("completions", {"prompt": "x", "model": 5}, "model"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": "a\ud800b"}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages"),
    ("chat", {"messages": "hello"}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "response_format"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "response_format": "json"}, "response_format"),
    ("completions", {"prompt": "x", "structured_outputs": {"json": 5}}, "structured_outputs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 300}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": "3"}, "n"),
]


@pytest.mark.parametrize("route,body,param", HOSTILE, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(HOSTILE)])
def test_every_bad_field_is_a_400_naming_it(svc, route, body, param):
    status, got = post(svc, f"/v1/{route if route == 'completions' else 'chat/completions'}",
                       json.dumps({"model": "default", **body}).encode())
    err = got["error"]
    assert status == 400 and err["type"] == "invalid_request_error", got
    assert err["param"] == param and err["message"], got


@pytest.mark.parametrize("body,what", [
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}", "nested"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "temperature": Infinity}', "Infinity"),
    (b'{"prompt": "\xff\xfe"}', "JSON"),
    (b"", "JSON"),
])
def test_malformed_bodies_are_400(svc, body, what):
    status, got = post(svc, "/v1/completions", body)
    assert status == 400 and what in got["error"]["message"] and got["error"]["type"] == "invalid_request_error"


def test_wrong_method_and_size_have_openai_shape(svc):
    r, c = raw(svc, "GET", "/v1/chat/completions")
    err = json.loads(r.read())["error"]
    c.close()
    assert r.status == 405 and err["type"] == "invalid_request_error" and "GET" in err["message"]
    # a body larger than any prompt that fits the context could be (the embedded model: 1024 tokens)
    status, got = post(svc, "/v1/completions", json.dumps({"prompt": "x" * (8 << 20)}).encode())
    assert status == 413 and got["error"]["type"] == "invalid_request_error"


def test_no_traceback_in_the_log_after_hostile_requests(svc):
    """Runs after the hostile-request tests of this module (same services): every one of them was refused
    at the edge, none reached the catch-all that logs a traceback."""
    assert "Traceback" not in svc.logs()


def test_huge_prompts_are_refused_without_stalling_anyone(svc, client):
    """Prompts far over the context (as big as the body limit lets through, and larger) are refused with
    context_length_exceeded / 413 / RESOURCE_EXHAUSTED while a stream beside them keeps getting tokens and
    /health keeps answering; the service's memory afterwards is what it was."""
    msgs = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    gaps, health_s, stop = [], [], False

    def stream():
        last = time.monotonic()
        for _ in client.completions.create(model="default", prompt="x", max_tokens=120, stream=True,
                                           extra_body={"ignore_eos": True}):
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    # warm what the test runs besides the huge requests (the first 120-token stream takes ~170 MB for good),
    # so RSS compares like with like
    client.chat.completions.create(model="default", messages=msgs("hello " * 50), max_tokens=2)
    stream()
    gaps.clear()
    before = status_mib(svc.gpu.pid)

    def probe():
        while not stop:
            t0 = time.monotonic()
            urllib.request.urlopen(f"http://127.0.0.1:{svc.http}/health", timeout=30).read()
            health_s.append(time.monotonic() - t0)
            time.sleep(0.05)

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        s, h = ex.submit(stream), ex.submit(probe)
        time.sleep(0.3)
        for text in ("word " * 18_000, "x" * 90_000, "漢字 " * 200_000):  # piecewise count, one run, the body cap
            status, got = post(svc, "/v1/chat/completions",
                               json.dumps({"model": "default", "messages": msgs(text)}).encode())
            assert (status, got["error"]["code"]) in ((400, "context_length_exceeded"), (413, None)), got
        with pytest.raises(grpc.RpcError) as e:
            list(svc.stub.Generate(generate_pb2.GenerateRequest(prompt="y" * (20 << 20), max_tokens=1),
                                   metadata=AUTH, timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as e:
            list(svc.stub.Generate(generate_pb2.GenerateRequest(prompt="z " * 40_000, max_tokens=1),
                                   metadata=AUTH, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context limit" in e.value.details()
        s.result(timeout=120)
        stop = True
        h.result(timeout=60)
    # liveness, not speed: a token every ~50 ms here; a stalled event loop showed gaps of 7-12 s
    assert len(gaps) >= 100 and max(gaps) < 2.0, max(gaps)
    assert max(health_s) < 2.0, max(health_s)
    after = status_mib(svc.gpu.pid)
    assert after <= before * 1.10, (before, after)


@pytest.mark.slow
def test_sigterm_ends_every_stream_at_the_grace_deadline(services_factory):
    """--grace 1: after SIGTERM nothing new starts (a queued request fails at once), and at the deadline the
    HTTP stream gets an error event and the gRPC stream UNAVAILABLE, both saying why; then it exits 0."""
    port = free_port()
    s = services_factory(MODEL, gpu_args=("--http-listen", f"127.0.0.1:{port}", "--grace", "1", "--max-batch", "2"))
    body = json.dumps({"model": "default", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", body=body)
    r = c.getresponse()
    assert r.status == 200 and r.read1(65536).startswith(b"data: ")
    g = s.stub.Generate(generate_pb2.GenerateRequest(prompt="x", max_tokens=1000, ignore_eos=True), timeout=60)
    next(g)
    queued = s.stub.Generate(generate_pb2.GenerateRequest(prompt="y", max_tokens=5, ignore_eos=True), timeout=60)
    time.sleep(0.3)  # the batch is full: it waits in the queue
    t0 = time.monotonic()
    s.gpu.send_signal(signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as e:
        list(queued)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(grpc.RpcError) as e:
        list(g)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "--grace 1s" in e.value.details()
    events = r.read().decode().strip().split("\n\n")
    c.close()
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "--grace 1s" in err["message"] and events[-1] == "data: [DONE]"
    assert time.monotonic() - t0 < 6  # 1000 tokens would take ~10 s
    assert s.gpu.wait(30) == 0


def test_logit_bias_steers_the_sample_on_both_apis(svc, client):
    """OpenAI's logit_bias: +100 on an id makes a greedy answer start with it, -100 on the greedy id bans it; the
    logprobs stay the model's own; ids outside the vocabulary, biases outside [-100, 100] and non-numeric keys are
    400s naming logit_bias (INVALID_ARGUMENT naming sampling.logit_bias on gRPC)."""
    def first(**kw):
        r = client.completions.create(model="default", prompt="def fib(n):", max_tokens=1, logprobs=1,
                                      **greedy(), extra_body=kw)
        return r.choices[0].logprobs
    plain = first()
    ids = svc.stub.Generate(generate_pb2.GenerateRequest(prompt="def fib(n):", max_tokens=1, sampling=generate_pb2.
                                                         SamplingParams(temperature=0)), metadata=AUTH, timeout=60)
    top = list(ids)[-1].token_ids[0]
    forced = 7 if top != 7 else 8
    got = [list(c.token_ids) for c in svc.stub.Generate(generate_pb2.GenerateRequest(
        prompt="def fib(n):", max_tokens=1, sampling=generate_pb2.SamplingParams(temperature=0, logit_bias={forced: 100})),
        metadata=AUTH, timeout=60)]
    assert got[-1] == [forced]
    banned = list(svc.stub.Generate(generate_pb2.GenerateRequest(
        prompt="def fib(n):", max_tokens=1, sampling=generate_pb2.SamplingParams(temperature=0, logit_bias={top: -100})),
        metadata=AUTH, timeout=60))[-1].token_ids[0]
    assert banned != top
    biased = first(logit_bias={str(forced): 100})
    assert biased.tokens != plain.tokens and biased.token_logprobs[0] < plain.token_logprobs[0]  # the model's own
    for bad in ({"abc": 1}, {str(forced): 101}, {"99999999": 1}, {str(forced): "x"}, ["1"]):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="default", prompt="x", max_tokens=1, extra_body={"logit_bias": bad})
        assert e.value.body["param"] == "logit_bias", (bad, e.value.body)
    with pytest.raises(grpc.RpcError) as e:
        list(svc.stub.Generate(generate_pb2.GenerateRequest(prompt="x", max_tokens=1, sampling=generate_pb2.
                                                            SamplingParams(logit_bias={-3: 1})), metadata=AUTH, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.logit_bias" in e.value.details()


def post_json(svc, path: str, body) -> tuple[int, dict]:
    return post(svc, path, json.dumps(body).encode())


def test_tokenize_and_detokenize_in_vllms_shapes_and_on_grpc(svc, client):
    """/tokenize: a prompt's ids as a completion reads them, a chat's as a chat completion renders it (the count is
    the chat's prompt_tokens), with the context limit; /detokenize gives the prompt back; gRPC's Tokenize and
    Detokenize say the same; bad bodies are 400s naming the field, in OpenAI's error shape."""
    prompt = "def fib(n):\n    return n"
    status, tok = post_json(svc, "/tokenize", {"model": "default", "prompt": prompt, "return_token_strs": True})
    info = svc.stub.Info(generate_pb2.ServerInfoRequest(), metadata=AUTH, timeout=10)
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 3 and tok["max_model_len"] == info.max_context
    r = client.completions.create(model="default", prompt=prompt, max_tokens=1, **greedy())
    assert r.usage.prompt_tokens == tok["count"] and len(tok["token_strs"]) == tok["count"]
    assert post_json(svc, "/detokenize", {"tokens": tok["tokens"]}) == (200, {"prompt": prompt})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    status, chat = post_json(svc, "/tokenize", {"messages": messages})
    r = client.chat.completions.create(model="default", messages=messages, max_tokens=1, **greedy())
    assert status == 200 and chat["count"] == r.usage.prompt_tokens and chat["token_strs"] is None
    _, bare = post_json(svc, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]
    g = svc.stub.Tokenize(generate_pb2.TokenizeRequest(chat=generate_pb2.Chat(messages=[
        generate_pb2.ChatMessage(**m) for m in messages])), metadata=AUTH, timeout=30)
    assert list(g.tokens) == chat["tokens"] and g.count == chat["count"] and g.max_model_len == info.max_context
    assert svc.stub.Detokenize(generate_pb2.DetokenizeRequest(tokens=tok["tokens"]), metadata=AUTH,
                               timeout=30).prompt == prompt
    for path, body, field in (("/tokenize", {"prompt": "x", "messages": messages}, "messages"),
                              ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
                              ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens")):
        status, err = post_json(svc, path, body)
        assert status == 400 and err["error"]["param"] == field, (path, body, err)
    with pytest.raises(grpc.RpcError) as e:
        svc.stub.Detokenize(generate_pb2.DetokenizeRequest(tokens=[-1]), metadata=AUTH, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens" in e.value.details()
    assert post_json(svc, "/tokenize", {"prompt": "still serving"})[0] == 200


def test_n_choices_share_one_prefill_and_sample_apart(svc, client):
    """n > 1: n choices, each sampled with its own generator (seed + index: choice 0 is the n=1 answer with the seed),
    the same again with the same seed and on gRPC; streamed deltas add up per index; greedy choices agree; usage counts
    the prompt once and every choice's tokens; the prompt is prefilled once (the others hit its blocks in the prefix
    cache)."""
    from harness import scrape

    prompt = "def fibonacci(n):\n    " + "# compute the n-th Fibonacci number iteratively\n    " * 4
    kw = dict(model="default", prompt=prompt, max_tokens=12, temperature=1.0, seed=11)
    hits = lambda: scrape(svc.metrics)["moe_prefix_cache_hit_tokens"].samples[0].value  # noqa: E731
    before = hits()
    r = client.completions.create(n=3, **kw)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # sampled apart
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens > 32
    assert hits() - before >= 2 * ((r.usage.prompt_tokens - 1) // 16 * 16) > 0  # choices 1 and 2 hit choice 0's
    again = client.completions.create(n=3, **kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    assert client.completions.create(n=1, **kw).choices[0].text == texts[0]
    # gRPC: the same choices, chunks by index, each with its own last chunk
    chunks = list(svc.stub.Generate(generate_pb2.GenerateRequest(
        prompt=prompt, max_tokens=12, n=3, sampling=generate_pb2.SamplingParams(temperature=1.0, seed=11)),
        metadata=AUTH, timeout=120))
    assert ["".join(c.text for c in chunks if c.index == i) for i in range(3)] == texts
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]
    with pytest.raises(grpc.RpcError) as e:
        list(svc.stub.Generate(generate_pb2.GenerateRequest(prompt=prompt, max_tokens=1, n=17), metadata=AUTH,
                               timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n: must be in [1, 16]" in e.value.details()
    streamed = {}
    for ch in client.completions.create(n=3, stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts
    msgs = [{"role": "user", "content": "Count to five."}]
    one = client.chat.completions.create(model="default", messages=msgs, max_tokens=8, **greedy())
    two = client.chat.completions.create(model="default", messages=msgs, max_tokens=8, n=2, **greedy())
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    deltas = {}
    for ch in client.chat.completions.create(model="default", messages=msgs, max_tokens=8, n=2, stream=True,
                                             stream_options={"include_usage": True}, **greedy()):
        for c in ch.choices:
            deltas[c.index] = deltas.get(c.index, "") + (c.delta.content or "")
        if ch.usage:
            assert ch.usage.completion_tokens == two.usage.completion_tokens
    assert deltas == {0: one.choices[0].message.content, 1: one.choices[0].message.content}
