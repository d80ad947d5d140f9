"""Generate behaviour through both services: seeded sampling, stop strings and EOS, UTF-8-safe
deltas, concurrent streams, bad requests."""
import concurrent.futures

import grpc
import pytest

from protos import generate_pb2


@pytest.fixture(scope="module")
def svc(checkpoints, tmp_path_factory):
    from harness import Services
    s = Services(checkpoints["qwen3_moe"], tmp_path_factory.mktemp("gen"), gpu_args=("--max-batch", "4"))
    yield s
    s.stop()


def run(stub, **kw):
    sampling = kw.pop("sampling", generate_pb2.SamplingParams(temperature=0))
    req = generate_pb2.GenerateRequest(max_tokens=kw.pop("max_tokens", 24), sampling=sampling, **kw)
    return list(stub.Generate(req, timeout=120))


def ids_of(chunks):
    return [t for c in chunks for t in c.token_ids]


def test_seeded_sampling_is_reproducible(svc):
    sp = lambda seed: generate_pb2.SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed)  # noqa: E731
    a = ids_of(run(svc.stub, prompt="def fib(n):", sampling=sp(7), ignore_eos=True))
    b = ids_of(run(svc.stub, prompt="def fib(n):", sampling=sp(7), ignore_eos=True))
    c = ids_of(run(svc.stub, prompt="def fib(n):", sampling=sp(8), ignore_eos=True))
    assert a == b and len(a) == 24
    assert a != c


def test_chunks_carry_usage_and_finish(svc):
    chunks = run(svc.stub, prompt="The quick brown fox", max_tokens=5, ignore_eos=True)
    assert len(chunks) == 5
    assert all(c.finish_reason == 0 for c in chunks[:-1])
    assert chunks[-1].finish_reason == generate_pb2.LENGTH
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens > 0
    assert chunks[-1].elapsed_s >= chunks[0].time_to_first_token_s > 0


def test_text_deltas_are_whole_characters(svc):
    # sampled text from a random byte-level model is full of partial multi-byte sequences
    sp = generate_pb2.SamplingParams(temperature=1.0, seed=3)
    chunks = run(svc.stub, prompt="Grüße aus Köln — 東京", sampling=sp, max_tokens=48, ignore_eos=True)
    from gpu_service.api.text import TextCodec
    codec = TextCodec(svc.model_dir)
    full = codec.decode(ids_of(chunks))
    assert "".join(c.text for c in chunks) == full
    sent = ""
    for c in chunks:
        c.text.encode("utf-8")  # every delta is valid UTF-8 on its own (no surrogates)
        sent += c.text
        # never sent ahead of the bytes: a partial character held back, not sent as U+FFFD and then
        # decoded differently once its remaining bytes came
        assert full.startswith(sent)


def test_stop_string_ends_generation_without_the_match(svc):
    base = run(svc.stub, prompt="def fib(n):", max_tokens=24, ignore_eos=True)
    text = "".join(c.text for c in base)
    assert len(text) > 6
    stop = text[3:6]
    chunks = run(svc.stub, prompt="def fib(n):", max_tokens=24, ignore_eos=True, stop=[stop])
    out = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == generate_pb2.STOP
    assert out == text[:text.find(stop)]


def test_concurrent_streams_equal_solo_runs(svc):
    prompts = ["def fib(n):", "The quick brown fox", "Grüße aus Köln", "return fib(n - 1)", "lazy dog"]
    solo = [ids_of(run(svc.stub, prompt=p, ignore_eos=True)) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(lambda p: ids_of(run(svc.stub, prompt=p, ignore_eos=True)), prompts))
    assert together == solo


def test_chat_template(svc):
    req = generate_pb2.GenerateRequest(max_tokens=3, chat=generate_pb2.Chat(messages=[
        generate_pb2.ChatMessage(role="user", content="hi")]), sampling=generate_pb2.SamplingParams(temperature=0))
    chunks = list(svc.stub.Generate(req, timeout=60))
    from gpu_service.api.text import TextCodec
    want = len(TextCodec(svc.model_dir).encode("<|user|>hi\n<|assistant|>"))
    assert chunks[-1].usage.prompt_tokens == want


def test_chat_templates_get_what_transformers_gives_them(checkpoints, tmp_path):
    """strftime_now (gpt-oss's harmony template dates its system message), loop controls, a tojson that
    keeps non-ASCII text: rendered as transformers' apply_chat_template renders them."""
    import json
    import shutil

    import transformers

    from gpu_service.api.text import TextCodec
    d = tmp_path / "tpl"
    shutil.copytree(checkpoints["qwen3_moe"], d)
    template = ("{{ strftime_now('%Y') }}|{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                "{{ m['content'] | tojson }};{% endfor %}")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    messages = [{"role": "user", "content": "Grüße"}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": "never"}]
    want = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json")).apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    codec = TextCodec(d)
    assert codec.tok.decode(codec.render_chat(messages)) == want and "Grüße" in want and "never" not in want


@pytest.mark.parametrize("kw, field", [
    (dict(prompt="x", max_tokens=0), "max_tokens"),
    (dict(prompt="x", max_tokens=10**6), "max_tokens"),
    (dict(prompt="", max_tokens=4), "prompt"),
    (dict(max_tokens=4), "input"),
    (dict(prompt="x", max_tokens=4, sampling=generate_pb2.SamplingParams(temperature=-1)), "temperature"),
    (dict(prompt="x", max_tokens=4, sampling=generate_pb2.SamplingParams(top_p=0)), "top_p"),
    (dict(prompt="x", max_tokens=4, sampling=generate_pb2.SamplingParams(top_p=1.5)), "top_p"),
    (dict(prompt="x", max_tokens=4, sampling=generate_pb2.SamplingParams(top_k=-2)), "top_k"),
    (dict(token_ids=generate_pb2.TokenIds(ids=[1, 99999]), max_tokens=4), "token_ids"),
    (dict(prompt="x", max_tokens=4, stop=[""]), "stop"),
    (dict(prompt="x", max_tokens=4, stop=["a" * 5000]), "stop"),
    (dict(prompt="x", max_tokens=4, logprobs=21), "logprobs"),
    (dict(prompt="x", max_tokens=4, sampling=generate_pb2.SamplingParams(temperature=float("nan"))), "temperature"),
    (dict(prompt="x", max_tokens=4, sampling=generate_pb2.SamplingParams(repetition_penalty=float("inf"))),
     "repetition_penalty"),
    (dict(prompt="x" * 200_000, max_tokens=4), "context"),
    (dict(chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content="x " * 50_000)]),
          max_tokens=4), "context"),
    (dict(prompt="x", max_tokens=4, defer=5), "defer"),
    (dict(prompt="x " * 600, max_tokens=4), "context"),
    (dict(chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="wizard", content="x")]), max_tokens=4), "role"),
])
def test_bad_requests_are_invalid_argument(svc, kw, field):
    kw.setdefault("sampling", generate_pb2.SamplingParams(temperature=0))
    with pytest.raises(grpc.RpcError) as e:
        list(svc.stub.Generate(generate_pb2.GenerateRequest(**kw), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    assert len(run(svc.stub, prompt="still serving", max_tokens=2)) == 2
