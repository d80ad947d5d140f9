"""Anthropic's Messages API (gpu_service/api/anthropic_api.py) through Anthropic's own client, both services as real
processes on a tiny checkpoint that speaks the hermes tool syntax: a plain answer, forced tool calls whose input
validates, streamed events that add up to the whole message, a tool result answered, a multi-turn tool loop whose
turns hit the prefix cache (Anthropic's usage: input_tokens without the cached part), stop sequences, count_tokens,
and hostile bodies refused in Anthropic's error shape while the service keeps serving."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

import tool_templates as tt
from harness import Services, free_port

TOKEN = "anthropic-api-test-token"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Köln"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The forecast", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time", "input_schema": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}]
USER = [{"role": "user", "content": "What is the weather in Köln for three days?"}]
# a model with random weights, greedy, no thinking first (it might never end)
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    root = tmp_path_factory.mktemp("anthropic")
    (root / "token").write_text(TOKEN)
    http = free_port()
    (root / "logs").mkdir()
    s = Services(tt.checkpoint("hermes", root / "ckpt"), root / "logs", gpu_args=(
        "--http-listen", f"127.0.0.1:{http}", "--served-model-name", "m", "--auth-token-file", str(root / "token")))
    s.http = http
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(svc):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{svc.http}", api_key=TOKEN, max_retries=0, timeout=120)


GREEDY = {"extra_body": {"temperature": 0}}  # (the client's create has no temperature: older clients send it)


def create(client, **kw):
    return client.messages.create(model="m", **{"max_tokens": 24, "messages": USER, **GREEDY, **kw})


def test_a_plain_answer_and_its_stream(client):
    m = create(client, **NO_THINKING)
    assert m.type == "message" and m.role == "assistant" and m.model == "m" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0 and m.usage.input_tokens > 0
    with client.messages.stream(model="m", max_tokens=24, messages=USER, **GREEDY, **NO_THINKING) as s:
        deltas = "".join(s.text_stream)
        final = s.get_final_message()
    assert deltas == final.content[0].text == m.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    # a stop sequence from inside that answer ends it there, and is named
    cut = m.content[0].text[len(m.content[0].text) // 2:][:3]
    if cut.strip():
        st = create(client, stop_sequences=[cut], **NO_THINKING)
        assert st.stop_reason == "stop_sequence" and st.stop_sequence == cut
        text = m.content[0].text
        assert "".join(b.text for b in st.content) == text[:text.find(cut)]  # (no text block when it is empty)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_forced_tool_use_validates_and_streams_as_input_json(client, choice):
    m = create(client, tools=TOOLS, tool_choice={**choice, "disable_parallel_tool_use": True}, max_tokens=80,
               **NO_THINKING)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    schema = {t["name"]: t["input_schema"] for t in TOOLS}[uses[0].name]
    jsonschema.validate(uses[0].input, schema)
    if choice["type"] == "tool":
        assert uses[0].name == "get_time"
    with client.messages.stream(model="m", max_tokens=80, messages=USER, **GREEDY, tools=TOOLS,
                                tool_choice={**choice, "disable_parallel_tool_use": True}, **NO_THINKING) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert "content_block_start" in kinds and "input_json" in kinds and kinds[-1] == "message_stop"
    got = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in got] == [(u.name, u.input) for u in uses]


def test_a_tool_loop_answers_results_and_hits_the_prefix_cache(client):
    """Five turns: each a forced call answered by a tool result; every turn after the first finds the earlier turns'
    blocks in the prefix cache (cache_read_input_tokens) and its input_tokens exclude them; count_tokens says the
    prompt's size as the turn saw it."""
    messages = list(USER)
    for turn in range(5):
        body = dict(messages=messages, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                    max_tokens=80, **NO_THINKING)
        counted = client.messages.count_tokens(model="m", messages=messages, tools=TOOLS, **NO_THINKING)
        m = create(client, **body)
        assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
        if turn:
            assert m.usage.cache_read_input_tokens >= 16, turn
        use = next(b for b in m.content if b.type == "tool_use")
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": json.dumps({"ok": turn}), "is_error": turn == 2}]}]
    answer = create(client, messages=messages, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=8,
                    **NO_THINKING)
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")
    # thinking blocks come back in the history as they were given
    history = USER + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "Köln, 3 days.",
                                                        "signature": "x"}, {"type": "text", "text": "Sunny."}]},
                      {"role": "user", "content": "And tomorrow?"}]
    assert create(client, messages=history, max_tokens=4, **NO_THINKING).content


HOSTILE = [  # (body changes, what the message names)
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": "8"}, "max_tokens"), ({"max_tokens": 10 ** 9}, "max_tokens"),
    ({"messages": "hi"}, "messages"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"temperature": 1.5}, "temperature"), ({"top_k": -1}, "top_k"), ({"stop_sequences": "x"}, "stop_sequences"),
    ({"tools": [{"type": "web_search_20250305", "name": "s"}]}, "tools"), ({"tool_choice": {"type": "all"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "budget_tokens"), ({"system": [{"type": "image"}]}, "system"),
    ({"model": "other"}, "other"), ({"output_config": {"format": {"type": "json_schema"}}}, "output_config"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "output_config.format"),
]


@pytest.mark.parametrize("change,named", HOSTILE, ids=[n for _, n in HOSTILE])
def test_hostile_bodies_are_refused_in_anthropics_shape(client, change, named):
    body = {"model": "m", "max_tokens": 8, "messages": USER, **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(anthropic.APIStatusError) as e:
        client.post("/v1/messages", cast_to=object, body=body)
    err = e.value.body
    assert e.value.status_code in (400, 404) and err["type"] == "error" and named in err["error"]["message"], err
    assert err["error"]["type"] == ("not_found_error" if e.value.status_code == 404 else "invalid_request_error")
    assert create(client, max_tokens=2, **NO_THINKING).content  # still serving


def test_structured_output_validates(client):
    """output_config.format: the answer is JSON that validates against the schema (the same grammar as chat's)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    m = create(client, max_tokens=60, output_config={"format": {"type": "json_schema", "schema": schema}},
               **NO_THINKING)
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_auth_by_x_api_key_or_bearer(svc, client):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=f"http://127.0.0.1:{svc.http}", api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=f"http://127.0.0.1:{svc.http}", auth_token=TOKEN, max_retries=0)
    assert bearer.messages.create(model="m", max_tokens=2, messages=USER, **GREEDY, **NO_THINKING).content


def test_the_answers_blocks_and_events_from_engine_chunks():
    """Reasoning, then text, then a call (as the family's parser gives them) -> a thinking block with its signature
    (a signature_delta before the block's stop when streamed), a text block, a tool_use block built from
    input_json deltas; stop_reason tool_use; input_tokens without the cached prompt tokens."""
    from gpu_service.api.anthropic_api import Answer, signature
    from gpu_service.api.tools import ToolCallDelta
    from gpu_service.engine.scheduler import Chunk

    def chunk(text="", reasoning="", calls=(), finish=None, n=1):
        return Chunk(text, [7], finish, 40, n, 0.1, 0.2, reasoning=reasoning, tool_calls=list(calls), cached_tokens=32)
    a = Answer("m")
    events = a.add(chunk(reasoning="Köln: ")) + a.add(chunk(reasoning="three days.", n=2)) + \
        a.add(chunk(text="Looking.", n=3)) + \
        a.add(chunk(calls=[ToolCallDelta(0, "call_1", "get_weather", '{"city": "Köln", ')], n=4)) + \
        a.add(chunk(calls=[ToolCallDelta(0, None, None, '"days": 3}')], finish="tool_calls", n=5))
    kinds = [(e["type"], e.get("delta", e.get("content_block", {})).get("type")) for e in events]
    assert kinds == [("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
                     ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
                     ("content_block_stop", None), ("content_block_start", "text"), ("content_block_delta", "text_delta"),
                     ("content_block_stop", None), ("content_block_start", "tool_use"),
                     ("content_block_delta", "input_json_delta"), ("content_block_delta", "input_json_delta"),
                     ("content_block_stop", None)]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    m = a.whole()
    assert m["content"] == [{"type": "thinking", "thinking": "Köln: three days.", "signature": signature("Köln: three days.")},
                            {"type": "text", "text": "Looking."},
                            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Köln", "days": 3}}]
    assert m["stop_reason"] == "tool_use" and m["stop_sequence"] is None
    assert m["usage"] == {"input_tokens": 8, "output_tokens": 5, "cache_read_input_tokens": 32,
                          "cache_creation_input_tokens": 0}
    cut = Answer("m")
    cut.add(chunk(calls=[ToolCallDelta(0, "call_2", "get_time", '{"zo')], finish="length"))
    assert cut.whole()["content"] == [] and cut.whole()["stop_reason"] == "max_tokens"  # a call cut off: left out
