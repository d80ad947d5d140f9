"""Reasoning models (gpu_service/api/reasoning.py): <think> blocks come back apart from the answer, streamed and
whole, over HTTP (reasoning_content) and gRPC (GenerateChunk.reasoning); chat_template_kwargs reach the
template (Qwen3's enable_thinking)."""
from __future__ import annotations

import json
import shutil

import openai
import pytest

from gpu_service.api.reasoning import ReasoningSplitter, opens_thinking, uses_think_tags
from harness import ROOT, Services, free_port
from protos import generate_pb2

TEXT = "<think>first, the plan</think>\n\nthe answer <b>bold</b> <thin"


def split_whole(text: str, inside: bool = False) -> tuple[str, str]:
    s = ReasoningSplitter(inside)
    r, a = s.push(text)
    f = s.flush()
    return r + f[0], a + f[1]


@pytest.mark.parametrize("inside", [False, True])
def test_any_chunking_gives_the_same_split(inside):
    want = split_whole(TEXT, inside)
    if not inside:
        assert want == ("first, the plan", "\n\nthe answer <b>bold</b> <thin")
    for cut in range(len(TEXT) + 1):
        for cut2 in range(cut, len(TEXT) + 1, 3):
            s = ReasoningSplitter(inside)
            parts = [s.push(p) for p in (TEXT[:cut], TEXT[cut:cut2], TEXT[cut2:])] + [s.flush()]
            assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == want, (cut, cut2)


def test_a_template_that_opens_the_block():
    assert split_whole("step 1, step 2</think>the answer", inside=True) == ("step 1, step 2", "the answer")
    assert split_whole("no tags at all") == ("", "no tags at all")
    assert opens_thinking("<|Assistant|><think>\n") and not opens_thinking("<think>\n\n</think>\n\n")
    assert not opens_thinking("# assistant:\n")
    assert uses_think_tags("{{ '<think>' }}...{{ '</think>' }}", {}) and not uses_think_tags("plain", {"a": 1})
    assert uses_think_tags(None, {"<think>": 5, "</think>": 6})


# the default model's template, as a reasoning model's: Qwen3's switch, DeepSeek-R1's opened block
TEMPLATE = ("{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
            "# assistant:\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    d = tmp_path_factory.mktemp("thinker") / "model"
    shutil.copytree(ROOT / "models" / "default", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    s = Services(d, tmp_path_factory.mktemp("svc"), gpu_args=("--http-listen", f"127.0.0.1:{free_port()}",
                                                               "--served-model-name", "default"))
    yield s
    s.stop()


def client(svc) -> openai.OpenAI:
    port = svc.gpu_args[1].rsplit(":", 1)[1]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


MSGS = [{"role": "user", "content": "Sort a list"}]


def test_thinking_is_apart_from_the_answer(svc):
    c = client(svc)
    r = c.chat.completions.create(model="default", messages=MSGS, max_tokens=24, temperature=0)
    thought = r.choices[0].message.model_extra["reasoning_content"]
    # the block opened by the template never closes in 24 tokens of this model: all of it is thinking
    assert thought and "<think>" not in thought and not r.choices[0].message.content
    streamed = [ch.choices[0].delta for ch in c.chat.completions.create(model="default", messages=MSGS, max_tokens=24,
                                                                      temperature=0, stream=True) if ch.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in streamed) == thought
    assert not "".join(d.content or "" for d in streamed)
    chunks = list(svc.stub.Generate(generate_pb2.GenerateRequest(
        chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content="Sort a list")]),
        max_tokens=24, sampling=generate_pb2.SamplingParams(temperature=0)), timeout=60))
    assert "".join(ch.reasoning for ch in chunks) == thought and not "".join(ch.text for ch in chunks)


def test_chat_template_kwargs_switch_thinking_off(svc):
    c = client(svc)
    r = c.chat.completions.create(model="default", messages=MSGS, max_tokens=24, temperature=0,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content and r.choices[0].message.model_extra["reasoning_content"] is None
    chunks = list(svc.stub.Generate(generate_pb2.GenerateRequest(
        chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content="Sort a list")]),
        max_tokens=24, sampling=generate_pb2.SamplingParams(temperature=0),
        chat_template_kwargs=json.dumps({"enable_thinking": False})), timeout=60))
    assert "".join(ch.text for ch in chunks) == r.choices[0].message.content
    assert not "".join(ch.reasoning for ch in chunks)
    # completions are raw text: nothing is split
    t = c.completions.create(model="default", prompt="<think>x</think>y", max_tokens=4, temperature=0)
    assert t.choices[0].text is not None


@pytest.mark.parametrize("kwargs", [["enable_thinking"], {"messages": []}, {"not an identifier": 1}])
def test_bad_template_kwargs_are_400s(svc, kwargs):
    with pytest.raises(openai.BadRequestError) as e:
        client(svc).chat.completions.create(model="default", messages=MSGS, max_tokens=4,
                                            extra_body={"chat_template_kwargs": kwargs})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_a_constraint_binds_the_answer_not_the_thinking(svc):
    """Structured output on a reasoning model: the <think> block is free; the grammar starts with the answer."""
    c = client(svc)
    choices = {"structured_outputs": {"choice": ["red", "green", "blue"]}}
    r = c.chat.completions.create(model="default", messages=MSGS, max_tokens=12, temperature=0, extra_body=choices)
    # this model never closes the block the template opened: thinking only, never forced into the choice
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.model_extra["reasoning_content"]
    assert not r.choices[0].message.content
    r = c.chat.completions.create(model="default", messages=MSGS, max_tokens=12, temperature=0,
                                  extra_body={**choices, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content in ("red", "green", "blue")
