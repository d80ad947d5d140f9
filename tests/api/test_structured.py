"""Structured outputs (gpu_service/api/constraints.py): an answer under a constraint parses and validates, on every
family and through both APIs, and ends by itself when the schema's values are bounded; a bad constraint is a
400 / INVALID_ARGUMENT naming it, never a 500."""
from __future__ import annotations

import concurrent.futures
import json
import time
import queue
import re

import grpc
import jsonschema
import openai
import pytest

import tiny_models
from gpu_service.api.admission import Admission, GenerateInput
from gpu_service.api.constraints import MAX_SPEC_CHARS, ConstraintSpec, Grammars
from gpu_service.engine.scheduler import Failure
from gpu_service.engine.sampling import SamplingParams
from gpu_service.api.text import TextCodec
from harness import ROOT, Services, free_port, greedy_request, local_engine, status_mib
from moe_core.config import load_config
from moe_core.errors import BadRequest
from protos import generate_pb2

DEFAULT = ROOT / "models" / "default"
# every value bounded: any weights must end such an answer within a few dozen tokens
BOUNDED = {"type": "object", "additionalProperties": False, "required": ["answer", "count", "ok"],
           "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                          "count": {"type": "integer", "minimum": 0, "maximum": 99},
                          "ok": {"type": "boolean"}}}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def grammars():
    cfg, text = load_config(DEFAULT), TextCodec(DEFAULT)
    return Grammars(text.tok, cfg.vocab_size, list(cfg.eos_token_ids))


@pytest.mark.parametrize("spec, words", [
    (ConstraintSpec("json_schema", "{not json"), "not valid JSON"),
    (ConstraintSpec("json_schema", '{"type": "objectx"}'), "does not compile"),
    (ConstraintSpec("json_schema", "[1, 2]"), "JSON object"),
    (ConstraintSpec("regex", "a(b"), "does not compile"),
    (ConstraintSpec("grammar", "start: ("), "grammar"),
    (ConstraintSpec.choice([]), "choice"),
    (ConstraintSpec.choice(["a", ""]), "choice"),
    (ConstraintSpec("xml", "<a/>"), "unknown kind"),
    (ConstraintSpec("regex", "a" * (MAX_SPEC_CHARS + 1)), "at most"),
])
def test_bad_constraints_are_refused_by_name(grammars, spec, words):
    with pytest.raises(BadRequest) as e:
        grammars.matcher(spec)
    assert e.value.field == "constraint" and words in str(e.value)


def _deep(n: int) -> dict:
    schema = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("schema", [_deep(200), {"type": "integer", "minimum": -10**30, "maximum": 10**30},
                                    {"enum": [f"value {i}" for i in range(40000)]}])
def test_hostile_schemas_are_400s(grammars, schema):
    """Past the parser's bounds (nesting, numeric ranges it cannot express, size): refused, not a stall or a 500."""
    with pytest.raises(BadRequest) as e:
        grammars.matcher(ConstraintSpec("json_schema", json.dumps(schema)))
    assert e.value.field == "constraint"


def test_a_matcher_masks_and_ends(grammars):
    m = grammars.matcher(ConstraintSpec.choice(CHOICES))
    text = TextCodec(DEFAULT)
    ids = text.encode("green", 100)
    first = m.allowed()
    assert first[ids[0]] and first.sum() < first.numel() / 10  # a handful of tokens, not the vocabulary
    for t in ids:
        assert m.allowed()[t]
        m.consume(t)
    assert m.done
    m2 = grammars.matcher(ConstraintSpec.choice(CHOICES))
    refused = int((~m2.allowed()).nonzero()[0])
    with pytest.raises(RuntimeError, match="refused token"):
        m2.consume(refused)


def test_compiled_grammars_are_cached(grammars):
    spec = ConstraintSpec("json_schema", json.dumps(BOUNDED))
    grammars.matcher(spec)
    hits = grammars._checked.cache_info().hits
    grammars.matcher(spec)
    assert grammars._checked.cache_info().hits == hits + 1


def run(engine, admission, inp: GenerateInput) -> tuple[str, str]:
    q: queue.Queue = queue.Queue()
    engine.submit(admission.generate(inp, q.put))
    text = []
    while True:
        ev = q.get(timeout=120)
        if isinstance(ev, Failure):
            raise AssertionError(ev.message)
        text.append(ev.text)
        if ev.finish_reason:
            return "".join(text), ev.finish_reason


def check(kind: str, out: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(out), BOUNDED)
    elif kind == "regex":
        assert re.fullmatch(REGEX, out), out
    else:
        assert out in CHOICES, out


SPECS = {"json_schema": ConstraintSpec("json_schema", json.dumps(BOUNDED)), "regex": ConstraintSpec("regex", REGEX),
         "choice": ConstraintSpec.choice(CHOICES)}


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_every_family_answers_within_the_constraint(checkpoints, family):
    """Random weights, sampled and greedy: the answer is valid and ends by itself (finish "stop")."""
    d = checkpoints[family]
    engine = local_engine(d)
    try:
        cfg = load_config(d)
        adm = Admission(cfg.vocab_size, cfg.top_k, engine.text, engine.max_context, 64, 0, tuple(cfg.eos_token_ids))
        for kind, spec in SPECS.items():
            for seed in (None, 1, 2):
                sp = SamplingParams(temperature=0) if seed is None else SamplingParams(temperature=1.0, seed=seed)
                out, finish = run(engine, adm, GenerateInput(prompt="Answer:", max_tokens=64, sampling=sp,
                                                             constraint=spec))
                assert finish == "stop", (kind, out)
                check(kind, out)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = Services(DEFAULT, tmp_path_factory.mktemp("structured"), gpu_args=("--http-listen", f"127.0.0.1:{free_port()}"))
    yield s
    s.stop()


def http(svc) -> openai.OpenAI:
    port = svc.gpu_args[1].rsplit(":", 1)[1]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def test_grpc_constraints(svc):
    for kind, c in (("json_schema", generate_pb2.Constraint(json_schema=json.dumps(BOUNDED))),
                    ("regex", generate_pb2.Constraint(regex=REGEX)),
                    ("choice", generate_pb2.Constraint(choice=generate_pb2.Choices(options=CHOICES)))):
        chunks = list(svc.stub.Generate(greedy_request("def f(x):", 64, constraint=c), timeout=120))
        assert chunks[-1].finish_reason == generate_pb2.STOP
        check(kind, "".join(ch.text for ch in chunks))
    with pytest.raises(grpc.RpcError) as e:
        list(svc.stub.Generate(greedy_request("x", 8, constraint=generate_pb2.Constraint(regex="a(b")), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint" in e.value.details()


def test_openai_response_format_and_structured_outputs(svc):
    client = http(svc)
    msgs = [{"role": "user", "content": "Reply in JSON."}]
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=64, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "a", "schema": BOUNDED, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    check("json_schema", r.choices[0].message.content)
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=64, temperature=0,
                                       extra_body={"structured_outputs": {"choice": CHOICES}})
    check("choice", r.choices[0].message.content)
    r = client.completions.create(model="default", prompt="id:", max_tokens=32, temperature=0,
                                  extra_body={"structured_outputs": {"regex": REGEX}})
    check("regex", r.choices[0].text)
    # streamed: the pieces join to a valid answer
    stream = client.chat.completions.create(model="default", messages=msgs, max_tokens=64, temperature=0, stream=True,
                                            extra_body={"guided_json": BOUNDED})
    check("json_schema", "".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    r = client.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0.8, seed=3,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # any object: it may also run to max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "red"}}, "structured_outputs"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_bad_constraints_are_400s(svc, body, param):
    client = http(svc)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}], max_tokens=8,
                                       extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_a_padded_vocabulary_and_foreign_eos_ids(grammars):
    """The model's logits may outnumber the tokenizer's ids (padding; synthetic checkpoints with another's
    tokenizer), and its EOS ids may lie past them: the mask covers the logits, the padding is never allowed."""
    text = TextCodec(DEFAULT)
    g = Grammars(text.tok, 151936, [151645, 1])
    m = g.matcher(ConstraintSpec.choice(CHOICES))
    allowed = m.allowed()
    assert allowed.numel() == 151936 and not allowed[4096:].any() and allowed.any()


# -- hostile constraints: refused at admission, bounded, the service unaffected ------------------------------------
SELF_REF = {"$ref": "#"}
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
BOMB = "(x{1000}){1000}"
NO_STATE = ("<state>", "Parser:", "compute_time_us", "Tokens:")  # llguidance's state dump, never in a reply


@pytest.mark.parametrize("spec", [ConstraintSpec("json_schema", json.dumps(SELF_REF)),
                                  ConstraintSpec("json_schema", json.dumps(CYCLE)),
                                  ConstraintSpec("regex", BOMB),
                                  ConstraintSpec("json_schema", json.dumps({"type": "string", "pattern": BOMB})),
                                  ConstraintSpec("grammar", f"start: /{BOMB}/")])
def test_specs_without_a_bounded_answer_are_refused_when_compiled(grammars, spec):
    with pytest.raises(BadRequest) as e:
        grammars.matcher(spec)
    assert e.value.field == "constraint" and not any(s in str(e.value) for s in NO_STATE), str(e.value)


def test_a_recursive_schema_with_a_way_out_is_served(grammars):
    tree = {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"},
                                                                      "maxItems": 2}}}}, "$ref": "#/$defs/n"}
    assert grammars.matcher(ConstraintSpec("json_schema", json.dumps(tree))).allowed().any()


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF_REF}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CYCLE}}}, "response_format"),
    ({"structured_outputs": {"json": CYCLE}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": BOMB}}, "structured_outputs.regex"),
])
def test_constraints_without_a_bounded_answer_are_400s_naming_the_field(svc, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        http(svc).chat.completions.create(model="default", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=8, extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    assert not any(s in e.value.body["message"] for s in NO_STATE), e.value.body["message"]


def test_constraints_without_a_bounded_answer_are_invalid_argument_on_grpc(svc):
    for c in (generate_pb2.Constraint(json_schema=json.dumps(SELF_REF)), generate_pb2.Constraint(regex=BOMB)):
        with pytest.raises(grpc.RpcError) as e:
            list(svc.stub.Generate(greedy_request("x", 8, constraint=c), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint" in e.value.details()
        assert not any(s in e.value.details() for s in NO_STATE)


def test_lexer_bombs_leave_a_running_stream_and_the_memory_alone(svc):
    """20 lexer-bomb requests while a greedy stream runs: each a 400, the stream's largest gap between chunks within
    100 ms of its largest gap alone (a liveness bound: the bombs never reach the engine thread), the GPU service's
    RSS within 10% of what it was."""
    def gaps() -> tuple[list[int], float]:
        ids, last, worst = [], time.monotonic(), 0.0
        for ch in svc.stub.Generate(greedy_request("def f(x):", 200), timeout=120):
            now = time.monotonic()
            worst, last = max(worst, now - last), now
            ids += ch.token_ids
        return ids, worst

    alone_ids, alone = gaps()
    rss = status_mib(svc.gpu.pid)
    client = http(svc)

    def bomb(i: int) -> str:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="default", prompt="x", max_tokens=4,
                                      extra_body={"structured_outputs": {"regex": BOMB.replace("x", "xy"[i % 2])}})
        return e.value.body["param"]

    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        stream = ex.submit(gaps)
        params = list(ex.map(bomb, range(20)))
        ids, worst = stream.result()
    assert set(params) == {"structured_outputs.regex"}
    assert ids == alone_ids
    assert worst <= alone + 0.1, (worst, alone)
    assert status_mib(svc.gpu.pid) <= rss * 1.1
