"""gpu_service.api.admission: the one check both front ends' requests pass, and the names each front end gives
the fields it refuses."""
from __future__ import annotations

import ast
import pathlib

import grpc
import pytest

from harness import ROOT
from gpu_service.api.admission import Admission, GenerateInput, ScoreInput
from gpu_service.engine.sampling import SamplingParams
from gpu_service.api.grpc_api import PROTO_FIELDS
from gpu_service.api.openai_api import HTTP_FIELDS
from gpu_service.api.text import TextCodec
from moe_core.errors import BadRequest, Status


@pytest.fixture(scope="module")
def admission():
    return Admission(vocab_size=1000, top_k=4, text=TextCodec(ROOT / "models" / "default"), max_context=64,
                     max_tokens_limit=32, default_defer=1)


def refused(fn, *args) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        fn(*args, lambda ev: None)
    return e.value


@pytest.mark.parametrize("inp, field", [
    (GenerateInput(), "input"),
    (GenerateInput(prompt="a", token_ids=[1]), "input"),
    (GenerateInput(prompt=""), "prompt"),
    (GenerateInput(messages=[]), "messages"),
    (GenerateInput(messages=[{"role": "robot", "content": "x"}]), "messages.role"),
    (GenerateInput(token_ids=[1, 5000]), "token_ids"),
    (GenerateInput(token_ids=list(range(64))), "input"),
    (GenerateInput(prompt="a", max_tokens=0), "max_tokens"),
    (GenerateInput(prompt="a", max_tokens=33), "max_tokens"),
    (GenerateInput(prompt="a", sampling=SamplingParams(top_p=0)), "sampling.top_p"),
    (GenerateInput(prompt="a", sampling=SamplingParams(temperature=float("inf"))), "sampling.temperature"),
    (GenerateInput(prompt="a", sampling=SamplingParams(repetition_penalty=0)), "sampling.repetition_penalty"),
    (GenerateInput(prompt="a", logprobs=10**6), "logprobs"),
    (GenerateInput(prompt="a", stop=["x" * 2000]), "stop"),
    (GenerateInput(prompt="a", defer=4), "defer"),
])
def test_generate_names_the_field(admission, inp, field):
    e = refused(admission.generate, inp)
    assert e.field == field and str(e).startswith(f"{field}: " if field else "")


@pytest.mark.parametrize("inp, field", [
    (ScoreInput([]), "token_ids"), (ScoreInput([1, -1]), "token_ids"), (ScoreInput(list(range(65))), "token_ids"),
    (ScoreInput([1, 2], defer=4), "defer"),
])
def test_score_shares_the_checks(admission, inp, field):
    assert refused(admission.score, inp).field == field


def test_one_defer_rule_for_generate_and_score(admission):
    """The same bad value, the same words, whichever RPC carried it."""
    g = refused(admission.generate, GenerateInput(prompt="a", defer=7))
    s = refused(admission.score, ScoreInput([1, 2], defer=7))
    assert str(g) == str(s)


def test_a_good_request_becomes_the_engines(admission):
    r = admission.generate(GenerateInput(prompt="hello", max_tokens=5, stop=["."], logprobs=2), lambda ev: None)
    assert r.prompt_ids and r.max_tokens == 5 and r.stop == ["."] and r.logprobs == 2 and r.defer == 1
    s = admission.score(ScoreInput([1, 2, 3], logprobs_only=True, defer=0), lambda ev: None)
    assert s.score_only and s.logprobs_only and s.prompt_ids == [1, 2, 3] and s.defer == 0


def test_front_ends_rename_fields_without_parsing_messages():
    e = BadRequest("messages.role", "unknown role 'robot'")
    assert e.named(PROTO_FIELDS) == "chat.messages.role: unknown role 'robot'"
    assert e.named(HTTP_FIELDS) == "messages: unknown role 'robot'"
    assert BadRequest("", "bad").named(PROTO_FIELDS) == "bad"


def test_statuses_are_grpcs():
    for s in Status:
        assert grpc.StatusCode[s.name].value[0] == s.value


@pytest.mark.parametrize("module", ["engine/scheduler.py", "api/admission.py"])
def test_the_engine_side_imports_no_transport(module):
    """The engine and the request checks know nothing of gRPC or HTTP (the front ends translate)."""
    tree = ast.parse(pathlib.Path(ROOT / "gpu_service" / module).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"grpc", "aiohttp", "protos"}
