"""OpenAI's Responses API (gpu_service/api/responses_api.py) through the official client, both services as real
processes on a tiny checkpoint that speaks the hermes tool syntax, two tenants: a plain answer and its stream of
semantic events (numbered, in order, adding up to the whole), forced function calls that validate, a tool result
answered through previous_response_id, a tool loop whose turns hit the prefix cache, structured outputs, the store
(GET, DELETE, only the tenant that created a response sees it), and hostile bodies refused naming the field."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

import tool_templates as tt
from harness import Services, free_port

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Köln"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}]
ASK = "What is the weather in Köln for three days?"
# greedy, and no thinking first (a model with random weights might never end it)
KW = dict(model="m", temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    (root / "tenants").write_text("alice alice-token\nbob bob-token\n")
    (root / "token").write_text("shared-token")
    http = free_port()
    (root / "logs").mkdir()
    s = Services(tt.checkpoint("hermes", root / "ckpt"), root / "logs", gpu_args=(
        "--http-listen", f"127.0.0.1:{http}", "--served-model-name", "m", "--tenants-file", str(root / "tenants"),
        "--auth-token-file", str(root / "token")))
    s.http = http
    yield s
    s.stop()


def client_of(svc, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{svc.http}/v1", api_key=token, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(svc):
    return client_of(svc, "alice-token")


def test_a_plain_answer_its_events_and_the_store(svc, client):
    r = client.responses.create(input=ASK, max_output_tokens=16, **KW)
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text and [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0 and r.store
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    events = []
    with client.responses.stream(input=ASK, max_output_tokens=16, **KW) as s:
        for e in s:
            events.append(e)
    final = events[-1].response  # (the client's get_final_response wants response.completed: an answer cut by
    # max_output_tokens ends with response.incomplete, as OpenAI's do)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if final.status == "completed" else "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert final.output_text == r.output_text
    # stored: this tenant reads it back and deletes it; another tenant never sees it
    assert client.responses.retrieve(r.id).output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        client_of(svc, "bob-token").responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client_of(svc, "bob-token").responses.create(input="more", previous_response_id=r.id, **KW)
    assert client.responses.delete(r.id) is None or True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(input=ASK, max_output_tokens=4, store=False, **KW)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_function_calls_validate_and_stream(client, choice):
    r = client.responses.create(input=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                                max_output_tokens=80, **KW)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id and r.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), {t["name"]: t["parameters"] for t in TOOLS}[calls[0].name])
    if isinstance(choice, dict):
        assert calls[0].name == "get_time"
    with client.responses.stream(input=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                                 max_output_tokens=80, **KW) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    got = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls]


def test_a_tool_loop_through_previous_response_id_hits_the_prefix_cache(client):
    """Five turns, each a forced call answered by its result in the next turn's input (the conversation carried by
    previous_response_id): from the second on, the earlier turns' blocks are cached (input_tokens_details); then the
    results answered in text."""
    prev, item = None, {"role": "user", "content": ASK}
    for turn in range(5):
        r = client.responses.create(input=[item], previous_response_id=prev, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=80, **KW)
        if turn:
            assert r.usage.input_tokens_details.cached_tokens >= 16, turn
        call = next(o for o in r.output if o.type == "function_call")
        prev, item = r.id, {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"ok": turn})}
    answer = client.responses.create(input=[item], previous_response_id=prev, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=8, **KW)
    assert answer.output_text and not [o for o in answer.output if o.type == "function_call"]
    assert answer.usage.input_tokens_details.cached_tokens >= 16
    # the same history given as items, not through the store: the same prompt
    history = [{"role": "user", "content": ASK}]
    r1 = client.responses.create(input=history, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=80, **KW)
    call = next(o for o in r1.output if o.type == "function_call")
    items = history + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                        "arguments": call.arguments},
                       {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    direct = client.responses.create(input=items, tools=TOOLS, tool_choice="none", max_output_tokens=4, store=False,
                                     **KW)
    chained = client.responses.create(input=[items[-1]], previous_response_id=r1.id, tools=TOOLS, tool_choice="none",
                                      max_output_tokens=4, **KW)
    assert direct.usage.input_tokens == chained.usage.input_tokens


def test_instructions_and_structured_output(client):
    plain = client.responses.create(input=ASK, max_output_tokens=2, **KW)
    told = client.responses.create(input=ASK, instructions="Answer in one word.", max_output_tokens=2, **KW)
    assert told.usage.input_tokens > plain.usage.input_tokens and told.instructions == "Answer in one word."
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    r = client.responses.create(input=ASK, max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "place", "schema": schema, "strict": True}}, **KW)
    jsonschema.validate(json.loads(r.output_text), schema)


HOSTILE = [  # (body, the param the error names)
    ({}, "input"), ({"input": []}, "input"), ({"input": 5}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"), ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"), ({"input": "x", "tool_choice": "maybe"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"), ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"), ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nonsense"}}}},
     "text.format"),
]


@pytest.mark.parametrize("body,param", HOSTILE, ids=[f"{p}-{i}" for i, (_, p) in enumerate(HOSTILE)])
def test_hostile_bodies_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", cast_to=object, body={"model": "m", **body})
    assert e.value.body["param"] == param, e.value.body
    assert client.responses.create(input="still", max_output_tokens=2, **KW).output_text is not None


def test_an_unknown_previous_response_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="x", previous_response_id="resp_nope", **KW)
    assert e.value.body["param"] == "previous_response_id"


def test_the_answers_items_and_events_from_engine_chunks():
    """Reasoning, text, then a call (as the family's parser gives them) -> a reasoning item, a message, a
    function_call, each opened and done in order with numbered events; the conversation a next turn continues."""
    from gpu_service.api.responses_api import Answer
    from gpu_service.api.tools import ToolCallDelta
    from gpu_service.engine.scheduler import Chunk

    def chunk(text="", reasoning="", calls=(), finish=None):
        return Chunk(text, [7], finish, 40, 3, 0.1, 0.2, reasoning=reasoning, tool_calls=list(calls), cached_tokens=32)
    a = Answer("resp_1", {"store": True})
    events = a.add(chunk(reasoning="Think.")) + a.add(chunk(text="Looking.")) + \
        a.add(chunk(calls=[ToolCallDelta(0, "call_1", "get_time", '{"zone": ')])) + \
        a.add(chunk(calls=[ToolCallDelta(0, None, None, '"UTC"}')], finish="tool_calls"))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done"]
    r = a.response(a.status())
    assert [o["type"] for o in r["output"]] == ["reasoning", "message", "function_call"] and r["status"] == "completed"
    assert r["output"][2]["arguments"] == '{"zone": "UTC"}' and r["output"][2]["call_id"] == "call_1"
    assert r["usage"]["input_tokens"] == 40 and r["usage"]["input_tokens_details"]["cached_tokens"] == 32
    assert a.conversation() == [{"role": "assistant", "content": "Looking.", "reasoning_content": "Think.",
                                 "tool_calls": [{"id": "call_1", "type": "function", "function": {
                                     "name": "get_time", "arguments": '{"zone": "UTC"}'}}]}]


def test_the_store_is_bounded_in_bytes_and_time():
    from gpu_service.api.responses_api import Store

    s = Store(max_bytes=600, ttl=0.2)
    for i in range(5):
        s.put(f"r{i}", "t", {"id": f"r{i}", "pad": "x" * 100}, [])
    assert s.bytes <= 600 and s.get("r0", "t") is None and s.get("r4", "t") is not None
    assert s.get("r4", "other") is None  # another tenant's
    import time
    time.sleep(1.1)  # past the ttl and the once-a-second scan
    assert s.get("r4", "t") is None and s.bytes == 0
