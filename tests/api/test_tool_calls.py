"""Tool calling (gpu_service/api/tools.py, tool_formats.py, harmony.py, answer.py): each family's call syntax parsed
from token ids, whole and streamed; forced calls (tool_choice required / named) that always parse and validate;
the OpenAI client's tool loop and gRPC's tool fields on tiny checkpoints that speak each syntax."""
from __future__ import annotations

import json

import grpc
import jsonschema
import numpy as np
import openai
import pytest

import tool_templates as tt
from gpu_service.api.answer import AnswerFormat
from gpu_service.api.admission import Admission, GenerateInput
from gpu_service.api.constraints import ConstraintSpec, Grammars, Matcher
from gpu_service.api.text import DetokenizeStream, TextCodec
from gpu_service.api.tool_formats import FORMATS, CallStream, Markers
from gpu_service.api.tools import ToolChoice, history_call
from harness import ROOT, Services, free_port
from moe_core.errors import BadRequest
from protos import generate_pb2
from tiers import some

SYNTAXES = list(tt.FAMILIES)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Köln"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": TIME}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALLS = [("get_weather", {"city": "Köln", "days": 3}), ("get_time", {"zone": "UTC"})]


@pytest.fixture(scope="module")
def codecs(tmp_path_factory) -> dict[str, TextCodec]:
    root = tmp_path_factory.mktemp("tok")
    for s in SYNTAXES:
        tt.tokenizer(s, root / s)
    return {s: TextCodec(root / s) for s in SYNTAXES}


def answer_format(codec: TextCodec) -> AnswerFormat:
    return AnswerFormat(codec.chat_template, codec.tok.get_vocab(), codec.added_tokens())


def parse_ids(codec: TextCodec, ids: list[int], tools=TOOLS, choice=ToolChoice("auto"), prompt_tail: str = ""):
    """ids through the detokenizer and a request's answer parser, one token at a time: -> (content, reasoning,
    {index: [id, name, arguments]})."""
    p = answer_format(codec).parser(prompt_tail, tools, choice)
    detok = DetokenizeStream(codec, [], [], p.symbols)
    content, reasoning, calls = [], [], {}

    def take(parsed):
        content.append(parsed.text)
        reasoning.append(parsed.reasoning)
        for d in parsed.tool_calls:
            if d.id is not None:
                assert d.index == len(calls) and d.name
                calls[d.index] = [d.id, d.name, ""]
            calls[d.index][2] += d.arguments
    for i in ids:
        take(p.push(detok.push(i)))
    take(p.push(detok.flush(), final=True))
    return "".join(content), "".join(reasoning), calls


def rendered_answer(codec: TextCodec, syntax: str, content: str, calls) -> str:
    """The assistant turn as the syntax's template renders an earlier answer with these calls (the text the model
    was trained to write), cut where the turn ends."""
    user = [{"role": "user", "content": "What is the weather?"}]
    turn = {"role": "assistant", "content": content,
            "tool_calls": [history_call({"id": f"c{i}", "function": {"name": n, "arguments": json.dumps(a)}}, "")
                           for i, (n, a) in enumerate(calls)]}
    prefix = codec.render_chat_text(user, tools=TOOLS)
    full = codec.render_chat_text(user + [turn], tools=TOOLS)
    assert full.startswith(prefix), syntax
    out = full[len(prefix):]
    ends = [out.find(e) for e in tt.FAMILIES[syntax][4] + ["<|assistant|>"] if out.find(e) >= 0]
    return out[:min(ends)] if ends else out


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_calls_rendered_by_the_template_parse_back(codecs, syntax):
    codec = codecs[syntax]
    calls = CALLS[:1] if syntax == "harmony" else CALLS  # harmony: a call ends the turn (<|call|> is an EOS)
    text = rendered_answer(codec, syntax, "" if syntax == "harmony" else "Let me look.", calls)
    ids = codec.tok.encode(text, add_special_tokens=False).ids
    content, reasoning, got = parse_ids(codec, ids)
    assert [(n, json.loads(a)) for _, n, a in got.values()] == calls, text
    assert content.strip() == ("" if syntax == "harmony" else "Let me look."), text
    assert not reasoning
    assert len({i for i, _, _ in got.values()}) == len(got)
    if syntax == "kimi_k2":  # the ids the model wrote, which its template renders results under
        assert [i for i, _, _ in got.values()] == [f"functions.{n}:{k}" for k, (n, _) in enumerate(calls)]
    else:
        assert all(i.startswith("call_") for i, _, _ in got.values())


@pytest.mark.parametrize("syntax", [s for s in SYNTAXES if s != "harmony"])
def test_any_split_of_the_text_gives_the_same_calls(codecs, syntax):
    codec = codecs[syntax]
    text = rendered_answer(codec, syntax, "Let me look.", CALLS)
    fmt = FORMATS[syntax]
    m = Markers(fmt.markers, {})  # as text: the markers may be cut anywhere

    def run(pieces):
        cs = CallStream(fmt, m, SCHEMAS)
        out, calls = [], {}
        for piece in [*pieces, None]:
            c, ds = cs.push(piece) if piece is not None else cs.flush()
            out.append(c)
            for d in ds:
                calls.setdefault(d.index, ["", ""])
                calls[d.index][0] += d.name or ""
                calls[d.index][1] += d.arguments
        return "".join(out), calls
    want = run([text])
    assert [(n, json.loads(a)) for n, a in want[1].values()] == CALLS
    for step in (1, 2, 5, 11):
        assert run([text[i:i + step] for i in range(0, len(text), step)]) == want, step


MALFORMED = {
    "hermes": "<tool_call>\nnot json at all\n</tool_call>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>no separator here<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek_v32": '<｜DSML｜function_calls>\n<｜DSML｜invoke name=\n</｜DSML｜function_calls>',
    "glm45": "<tool_call>\n</tool_call>",
    "glm47": "<tool_call></tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name=\n</minimax:tool_call>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.:0<|tool_call_argument_begin|>{}"
               "<|tool_call_end|><|tool_calls_section_end|>",
}


@pytest.mark.parametrize("syntax", list(MALFORMED))
def test_a_malformed_call_is_content(codecs, syntax):
    codec = codecs[syntax]
    text = "Before. " + MALFORMED[syntax]
    content, _, calls = parse_ids(codec, codec.tok.encode(text, add_special_tokens=False).ids)
    assert not calls
    assert content.startswith("Before. ") and len(content) > len("Before. ")


def test_arguments_written_as_a_json_string(codecs):
    """Some models write Qwen's arguments as a JSON string: the call's arguments are that string's text."""
    codec = codecs["hermes"]
    text = '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>'
    _, _, calls = parse_ids(codec, codec.tok.encode(text, add_special_tokens=False).ids)
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [("get_time", {"zone": "CET"})]


def test_markers_are_tokens_not_their_spelling(codecs):
    """The Qwen marker spelled by ordinary tokens, as prose quoting it would be, is text; the token is a call."""
    codec = codecs["hermes"]
    body = '\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
    spelled = [i for piece in ("<tool", "_call>", body, "</tool", "_call>")
               for i in codec.tok.encode(piece, add_special_tokens=False).ids]
    content, _, calls = parse_ids(codec, spelled)
    assert not calls and content == "<tool_call>" + body + "</tool_call>"
    content, _, calls = parse_ids(codec, codec.tok.encode("<tool_call>" + body + "</tool_call>",
                                                          add_special_tokens=False).ids)
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [("get_time", {"zone": "UTC"})] and not content


def test_special_markers_are_kept_for_the_parser(codecs):
    """GLM-4.5's markers are special tokens (decoding drops them): the parser still sees them."""
    codec = codecs["glm45"]
    ids = codec.tok.encode("<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>",
                           add_special_tokens=False).ids
    assert codec.decode(ids) == "get_time\nzone\nCET\n"  # what a plain decode keeps
    _, _, calls = parse_ids(codec, ids)
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [("get_time", {"zone": "CET"})]


def test_harmony_channels(codecs):
    codec = codecs["harmony"]
    text = ("<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Rome\", \"days\": 2}")
    content, reasoning, calls = parse_ids(codec, codec.tok.encode(text, add_special_tokens=False).ids)
    assert reasoning == "User wants weather." and not content
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == [("get_weather", {"city": "Rome", "days": 2})]
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hello there"
    assert parse_ids(codec, codec.tok.encode(text, add_special_tokens=False).ids)[:2] == ("Hello there", "Think.")
    # without tools the reasoning is still apart; a call is then content
    p = answer_format(codec).parser("", None, ToolChoice("none"))
    assert p.harmony is not None and not p.harmony.tools
    # a model that does not write harmony at all: its text is the content
    assert parse_ids(codec, codec.tok.encode("plain words", add_special_tokens=False).ids)[:2] == ("plain words", "")


def random_walk(codec: TextCodec, spec: ConstraintSpec | Matcher, seed: int, steps: int = 3000) -> list[int]:
    """Token ids drawn at random from what the grammar allows at each step, until it is done (a model with
    random weights under the constraint), favouring the markers so that free text ends."""
    m = spec if isinstance(spec, Matcher) else Grammars(codec.tok, codec.tok.get_vocab_size(), [1]).matcher(spec)
    rng = np.random.default_rng(seed)
    special = set(codec.added_tokens().values())
    ids = []
    for _ in range(steps):
        if m.done:
            return ids
        allowed = np.nonzero(m.allowed().numpy())[0]
        marked = [int(i) for i in allowed if int(i) in special]
        if allowed.size == 1 and allowed[0] == 1:
            return ids  # only the end of sequence is left
        tok = int(rng.choice(marked)) if marked and rng.random() < 0.3 else int(rng.choice(allowed))
        if tok == 1:
            return ids
        ids.append(tok)
        m.consume(tok)
    raise AssertionError(f"no end after {steps} tokens")


@pytest.mark.parametrize("syntax", SYNTAXES)
@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "get_time")])
def test_a_forced_call_always_parses_and_validates(codecs, syntax, choice):
    codec = codecs[syntax]
    af = answer_format(codec)
    for parallel in (True, False):
        spec = ConstraintSpec("grammar", af.forced_grammar(TOOLS, choice, parallel))
        for seed in range(4):
            ids = random_walk(codec, spec, seed)
            content, _, calls = parse_ids(codec, ids, choice=choice)
            text = codec.tok.decode(ids, skip_special_tokens=False)
            assert calls and not content.strip(), text
            assert parallel and choice.mode == "required" or len(calls) == 1, text
            for _, name, args in calls.values():
                assert choice.mode != "function" or name == choice.name
                jsonschema.validate(json.loads(args), SCHEMAS[name])


def admission(codec: TextCodec) -> Admission:
    return Admission(vocab_size=codec.tok.get_vocab_size(), top_k=2, text=codec, max_context=4096,
                     max_tokens_limit=64, default_defer=0, eos_ids=(1,))


def test_harmony_puts_a_constrained_answer_in_the_final_channel(codecs):
    """gpt-oss with response_format: the reasoning may come first, the answer is the final channel's and valid."""
    codec = codecs["harmony"]
    for seed in range(4):
        r = admission(codec).generate(GenerateInput(messages=[{"role": "user", "content": "hi"}],
                                                    constraint=ConstraintSpec("json_schema", json.dumps(TIME))),
                                      lambda ev: None)
        assert r.constrain_reasoning
        ids = random_walk(codec, r.constraint, seed)
        content, reasoning, calls = parse_ids(codec, ids, tools=None, choice=ToolChoice("none"))
        jsonschema.validate(json.loads(content), TIME)
        assert not calls


@pytest.mark.parametrize("syntax", ["hermes", "glm45", "minimax_m2", "kimi_k2"])
@pytest.mark.parametrize("forced", [True, False])
def test_a_thinking_model_may_reason_before_a_constrained_answer(codecs, syntax, forced):
    """Where <think> and </think> are tokens and the model opens the block itself (Qwen3, GLM-4.5, MiniMax-M2, Kimi), a
    forced call or a response_format lets the block come first; the answer after it is bound."""
    codec = codecs[syntax]
    kw = dict(tools=TOOLS, tool_choice=ToolChoice("required")) if forced else \
        dict(constraint=ConstraintSpec("json_schema", json.dumps(TIME)))
    thought = 0
    for seed in range(6):
        r = admission(codec).generate(GenerateInput(messages=[{"role": "user", "content": "hi"}], **kw),
                                      lambda ev: None)
        assert r.constrain_reasoning and r.parser.reasoning is not None
        ids = random_walk(codec, r.constraint, seed)
        content, reasoning, calls = parse_ids(codec, ids, **({} if forced else dict(tools=None)))
        thought += bool(reasoning)
        if forced:
            assert calls and not content.strip(), codec.tok.decode(ids, skip_special_tokens=False)
            for _, name, args in calls.values():
                jsonschema.validate(json.loads(args), SCHEMAS[name])
        else:
            jsonschema.validate(json.loads(content), TIME)
    assert thought  # some walks went through the reasoning
    # thinking switched off by the template (a closed block for this answer: DeepSeek-V3.1's non-thinking mode,
    # Qwen3's enable_thinking=False): the constraint binds from the first token
    for codec, kwargs in [(codecs["deepseek_v31"], {}), (codec, {"enable_thinking": False})]:
        r = admission(codec).generate(GenerateInput(messages=[{"role": "user", "content": "hi"}],
                                                    chat_template_kwargs=kwargs, **kw), lambda ev: None)
        assert not r.constrain_reasoning and r.parser.reasoning is not None and not r.parser.may_open_thinking


def test_tool_requests_are_checked(codecs):
    codec = codecs["hermes"]
    adm = admission(codec)
    chat = [{"role": "user", "content": "hi"}]

    def refused(field, **kw) -> str:
        with pytest.raises(BadRequest) as e:
            adm.generate(GenerateInput(**{"messages": chat, **kw}), lambda ev: None)
        assert e.value.field == field, e.value
        return str(e.value)
    assert "get_date" in refused("tool_choice", tools=TOOLS, tool_choice=ToolChoice("function", "get_date"))
    refused("tool_choice", tool_choice=ToolChoice("required"))
    refused("tool_choice", tools=TOOLS, tool_choice=ToolChoice("sometimes"))
    refused("tools", tools=[{"type": "function", "function": {"name": "bad name!"}}])
    refused("tools", tools=TOOLS + TOOLS[:1])
    refused("tools", prompt="hi", messages=None, tools=TOOLS)
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
                                                                                 {"x": {"type": "no-such-type"}}}}}]
    refused("tools[0].function.parameters", tools=bad_schema, tool_choice=ToolChoice("required"))
    # tool results answer the assistant turn's calls by id, as OpenAI requires
    called = chat + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "function": {"name": "get_time", "arguments": "{}"}}]}]
    refused("messages[1].tool_call_id", messages=chat + [{"role": "tool", "content": "12:00"}], tools=TOOLS)
    refused("messages[1]", messages=chat + [{"role": "tool", "tool_call_id": "c1", "content": "12:00"}], tools=TOOLS)
    refused("messages[2].tool_call_id", messages=called + [{"role": "tool", "content": "12:00"}], tools=TOOLS)
    assert "'c2' names no call" in refused("messages[2].tool_call_id", tools=TOOLS,
                                           messages=called + [{"role": "tool", "tool_call_id": "c2", "content": "x"}])
    refused("messages[4]", tools=TOOLS, messages=called + [{"role": "tool", "tool_call_id": "c1", "content": "x"},
                                                          {"role": "user", "content": "and?"},
                                                          {"role": "tool", "tool_call_id": "c1", "content": "x"}])
    adm.generate(GenerateInput(messages=called + [{"role": "tool", "tool_call_id": "c1", "content": "12:00"}],
                               tools=TOOLS), lambda ev: None)
    refused("tool_choice", tools=TOOLS, tool_choice=ToolChoice("required"), constraint=ConstraintSpec("json_object"))
    refused("messages", messages=chat + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "function": {"name": "get_time", "arguments": "{not json"}}]}], tools=TOOLS)
    r = adm.generate(GenerateInput(messages=chat, tools=TOOLS, tool_choice=ToolChoice("required")), lambda ev: None)
    assert r.constraint is not None and r.parser is not None and r.parser.calls is not None
    # a template that renders no tools cannot offer them
    plain = TextCodec(ROOT / "models" / "default")
    adm2 = Admission(vocab_size=4096, top_k=4, text=plain, max_context=64, max_tokens_limit=8, default_defer=0)
    with pytest.raises(BadRequest, match="does not render tools"):
        adm2.generate(GenerateInput(messages=chat, tools=TOOLS), lambda ev: None)


# -- the services ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both services per syntax, on a tiny checkpoint that speaks it, started when first asked for."""
    running, made = [], {}
    root = tmp_path_factory.mktemp("tools")

    def get(syntax: str):
        if syntax not in made:
            http = free_port()
            (root / f"{syntax}-logs").mkdir()
            svc = Services(tt.checkpoint(syntax, root / syntax), root / f"{syntax}-logs", gpu_args=(
                "--http-listen", f"127.0.0.1:{http}", "--served-model-name", "m"))
            running.append(svc)
            made[syntax] = (openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0),
                            svc.stub)
        return made[syntax]
    yield get
    for svc in running:
        svc.stop()


USER = [{"role": "user", "content": "What is the weather in Köln for three days?"}]


def streamed(client, **kw):
    content, calls, finish = [], {}, None
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            content.append(c.delta.content or "")
            for d in c.delta.tool_calls or ():
                if d.id is not None:
                    assert d.index == len(calls) and d.type == "function" and d.function.name
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return "".join(content), [tuple(v) for v in calls.values()], finish


@pytest.mark.parametrize("syntax", some(SYNTAXES, fast=SYNTAXES[:1]))
def test_a_tool_loop_with_the_openai_client(servers, syntax):
    client, stub = servers(syntax)
    # one call: a model with random weights, greedy, may repeat its call for ever when several are allowed
    # (test_a_forced_call_always_parses_and_validates draws several)
    # and no thinking first: it might never end (where the template has the switch; MiniMax-M2 always thinks)
    kw = dict(model="m", messages=USER, tools=TOOLS, max_tokens=80, temperature=0, parallel_tool_calls=False,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = client.chat.completions.create(tool_choice="required", **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls and not msg.content
    for c in msg.tool_calls:
        assert c.id.startswith("functions." if syntax == "kimi_k2" else "call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    # streamed: the same calls, the name first and the arguments in pieces
    content, calls, finish = streamed(client, tool_choice="required", **kw)
    assert finish == "tool_calls" and not content.strip()
    assert calls == [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    # a named function
    r2 = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw)
    assert [c.function.name for c in r2.choices[0].message.tool_calls] == ["get_time"]
    # the result goes back; the template renders the call and the result, and the answer is text
    history = USER + [msg.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": '{"forecast": "sunny"}'} for c in msg.tool_calls]
    r3 = client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8,
                                        temperature=0)
    assert r3.choices[0].finish_reason in ("length", "stop") and not r3.choices[0].message.tool_calls
    assert r3.usage.prompt_tokens > r.usage.prompt_tokens
    # gRPC: the same request, the same calls
    req = generate_pb2.GenerateRequest(
        chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content=USER[0]["content"])]),
        max_tokens=80, sampling=generate_pb2.SamplingParams(temperature=0),
        tools=[generate_pb2.Tool(name=t["function"]["name"], description=t["function"]["description"],
                                 parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS],
        tool_choice=generate_pb2.ToolChoice(mode="required"), parallel_tool_calls=False,
        chat_template_kwargs=json.dumps({"enable_thinking": False}))
    chunks = list(stub.Generate(req, timeout=120))
    got = {}
    for ch in chunks:
        for d in ch.tool_calls:
            got.setdefault(d.index, ["", ""])
            got[d.index][0] += d.name
            got[d.index][1] += d.arguments
    assert [tuple(v) for v in got.values()] == calls
    assert chunks[-1].finish_reason == generate_pb2.TOOL_CALLS
    # and the history in gRPC's fields renders the same prompt as over HTTP
    hist = generate_pb2.GenerateRequest(
        chat=generate_pb2.Chat(messages=[
            generate_pb2.ChatMessage(role="user", content=USER[0]["content"]),
            generate_pb2.ChatMessage(role="assistant", tool_calls=[
                generate_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                for c in msg.tool_calls]),
            *[generate_pb2.ChatMessage(role="tool", tool_call_id=c.id, content='{"forecast": "sunny"}')
              for c in msg.tool_calls]]),
        max_tokens=8, sampling=generate_pb2.SamplingParams(temperature=0), tools=req.tools,
        tool_choice=generate_pb2.ToolChoice(mode="none"))
    last = list(stub.Generate(hist, timeout=120))[-1]
    assert last.usage.prompt_tokens == r3.usage.prompt_tokens


def fn(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def test_bad_tool_requests_are_400s(servers):
    client, stub = servers("hermes")
    for kw, param in [(dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                      (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools"),
                      (dict(tool_choice="required"), "tool_choice"),
                      (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
                       "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=USER, max_tokens=4, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="x", max_tokens=4, extra_body={"tools": TOOLS})
    # a forced call whose schema has no finite value: refused at admission, naming the tool (never a 500 later)
    loop, cycle = {"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    for tools, choice, param in [([*TOOLS, fn("loop", loop)], "required", f"tools[{len(TOOLS)}].function.parameters"),
                                 ([fn("cycle", cycle)], {"type": "function", "function": {"name": "cycle"}},
                                  "tools[0].function.parameters")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=USER, max_tokens=4, tools=tools, tool_choice=choice)
        assert e.value.body["param"] == param and "<state>" not in e.value.body["message"], e.value.body
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generate_pb2.GenerateRequest(
            chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content="x")]), max_tokens=4,
            tools=[generate_pb2.Tool(name="loop", parameters=json.dumps(loop))],
            tool_choice=generate_pb2.ToolChoice(mode="required")), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools[0].function.parameters" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generate_pb2.GenerateRequest(
            chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content="x")]), max_tokens=4,
            tools=[generate_pb2.Tool(name="f", parameters="{not json")]), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools" in e.value.details()
    # a tool result that answers no call: OpenAI's 400, and INVALID_ARGUMENT on gRPC
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", max_tokens=4, tools=TOOLS,
                                       messages=USER + [{"role": "tool", "tool_call_id": "c1", "content": "x"}])
    assert e.value.body["param"] == "messages[1]", e.value.body
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(generate_pb2.GenerateRequest(chat=generate_pb2.Chat(messages=[
            generate_pb2.ChatMessage(role="user", content="x"), generate_pb2.ChatMessage(role="tool", content="y")]),
            max_tokens=4), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages[1].tool_call_id" in e.value.details()
    # and it still serves
    assert client.chat.completions.create(model="m", messages=USER, max_tokens=2).choices[0].finish_reason


@pytest.mark.parametrize("syntax", some([s for s in SYNTAXES if s != "harmony"], fast=["glm47"]))
def test_a_forced_call_through_responses_and_messages(servers, syntax):
    """Every family's syntax through the two agent APIs (both services): a forced call to a named tool whose input
    validates (Responses' function_call item, Messages' tool_use block), the same call as chat/completions forces."""
    import anthropic

    client, _ = servers(syntax)
    kw = dict(messages=USER, tools=TOOLS, max_tokens=80, temperature=0, parallel_tool_calls=False,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    chat = client.chat.completions.create(model="m", tool_choice={"type": "function", "function": {"name": "get_time"}},
                                          **kw).choices[0].message.tool_calls
    r = client.responses.create(model="m", input=USER[0]["content"], max_output_tokens=80, temperature=0,
                                tools=[{"type": "function", **t["function"]} for t in TOOLS], parallel_tool_calls=False,
                                tool_choice={"type": "function", "name": "get_time"},
                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in chat]
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_time"])
    ac = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"), api_key="x", max_retries=0)
    m = ac.messages.create(model="m", max_tokens=80, messages=USER, tool_choice={
        "type": "tool", "name": "get_time", "disable_parallel_tool_use": True}, tools=[{
            "name": t["function"]["name"], "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"]} for t in TOOLS],
        extra_body={"temperature": 0, "chat_template_kwargs": {"enable_thinking": False}})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and [(u.name, u.input) for u in uses] == [(c.name, json.loads(c.arguments))
                                                                                 for c in calls]
