"""The OpenAI-compatible HTTP API: GET /v1/models, POST /v1/completions and /v1/chat/completions
(plain JSON or Server-Sent Events; n choices), vLLM's /tokenize and /detokenize, GET /health; on the same server
OpenAI's Responses API (responses_api.py) and Anthropic's Messages API (anthropic_api.py). It is a translation
layer only: each HTTP request
becomes a GenerateInput (admission.py, as gRPC's do) and goes through GenerateServicer.submit, so
validation, chat templates, sampling, stop strings and limits are the gRPC API's, and both share one engine.

aiohttp, not FastAPI/uvicorn: it runs on the event loop the gRPC server already owns (AppRunner)
without a second server lifecycle or its own signal handling, streams with plain writes, and can
cancel a handler when its client disconnects (which frees the request's slot at the next step)."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid

from aiohttp import web

from moe_core.errors import BadRequest, http_status
from moe_core.security import ServerSecurity, presented_token

from gpu_service import metrics
from gpu_service.api import anthropic_api, responses_api, sse
from gpu_service.api.admission import MAX_CACHE_SALT, GenerateInput, TokenizeInput
from gpu_service.api.choices import MAX_N, Choices
from gpu_service.api.constraints import ConstraintSpec
from gpu_service.engine.scheduler import Failure
from gpu_service.engine.sampling import MAX_LOGPROBS
from gpu_service.api.grpc_api import GenerateServicer
from gpu_service.api.tools import ToolChoice

log = logging.getLogger("gpu_service.http")
_SURROGATE = re.compile("[\ud800-\udfff]")

FINISH = {"length": "length", "stop": "stop", "eos": "stop", "tool_calls": "tool_calls"}
# the transport-neutral request's field names as these endpoints spell them (sampling's are flat here)
HTTP_FIELDS = {"messages.role": "messages", "token_ids": "prompt"}
ERROR_TYPE = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}
MAX_DEPTH = 32      # nesting of a request body (the deepest real one, a content part, is 3)
PARSE_INLINE = 1 << 16  # bodies up to this many bytes are parsed on the event loop; larger ones on a thread


def error_type(status: int) -> str:
    return ERROR_TYPE.get(status, "invalid_request_error" if status < 500 else "internal_error")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    """OpenAI's error shape."""
    return web.json_response({"error": {"message": message, "type": error_type(status),
                                        "param": param, "code": code}}, status=status)


# -- request fields -------------------------------------------------------------------------------
def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _field(body: dict, name: str, kinds, default=None, check=None, what: str = ""):
    """body[name] if present and not null, of one of `kinds`, passing `check`; else default."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise ApiError(400, f"{name}: expected {what or ' or '.join(k.__name__ for k in kinds)}, got {_short(v)}", name)
    if check is not None and not check(v):
        raise ApiError(400, f"{name}: {what}, got {_short(v)}", name)
    return v


def _int(body: dict, name: str, lo: int, hi: int, default=None):
    """An integer field in [lo, hi] (the protobuf field it goes to holds every such value)."""
    return _field(body, name, (int,), default, lambda v: lo <= v <= hi, f"an integer in [{lo}, {hi}]")


def _num(body: dict, name: str) -> float | None:
    """A number field as a float (its range is the servicer's check); None when absent."""
    v = _field(body, name, (int, float))
    if v is None:
        return None
    if abs(v) > 1e30:  # also keeps float() of a huge integer from overflowing
        raise ApiError(400, f"{name}: out of range, got {_short(v)}", name)
    return float(v)


I32 = 2**31 - 1  # an int32 protobuf field's largest value


def _top(path: str) -> str | None:
    """The top-level field of a path like messages[0].content."""
    return path.split(".")[0].split("[")[0] or None


def _check_body(v, path: str, depth: int = 0) -> None:
    """Nesting and text encodings of a parsed body, before any field is read: JSON's \\uD800 escapes give
    strings that UTF-8 cannot encode (the tokenizer and protobuf would fail on them)."""
    if depth > MAX_DEPTH:
        raise ApiError(400, f"the body is nested more than {MAX_DEPTH} levels deep", _top(path))
    if isinstance(v, str):
        if _SURROGATE.search(v):
            raise ApiError(400, f"{path}: the text has an unpaired UTF-16 surrogate (not valid Unicode)", _top(path))
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_body(x, f"{path}.{k}" if path else k, depth + 1)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_body(x, f"{path}[{i}]", depth + 1)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(data: bytes):
    """JSON -> Python, refusing NaN/Infinity and any nesting Python's parser cannot take (ApiError)."""
    try:
        body = json.loads(data, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, f"the body is nested more than {MAX_DEPTH} levels deep") from None
    _check_body(body, "")
    return body


def _refuse_unsupported(body: dict) -> None:
    _int(body, "n", 1, MAX_N)
    if _field(body, "best_of", (int,), 1) != 1:
        raise ApiError(400, "best_of: only 1 is supported", "best_of")
    _field(body, "user", (str,))
    if body.get("echo"):
        raise ApiError(400, "echo is not supported", "echo")
    if body.get("suffix"):
        raise ApiError(400, "suffix is not supported", "suffix")
    if body.get("functions") or body.get("function_call"):
        raise ApiError(400, "functions and function_call (deprecated) are not supported: use tools and tool_choice",
                       "functions")


def _common(body: dict, req: GenerateInput, max_tokens_default: int, max_tokens_limit: int) -> None:
    """The sampling and stopping fields both endpoints share, into req. Types and sane ranges are checked here;
    what the values mean, by admission (one check for both APIs)."""
    _refuse_unsupported(body)
    for name in ("max_completion_tokens", "max_tokens"):
        v = _field(body, name, (int,), None, lambda v: 0 < v <= max_tokens_limit,
                   f"an integer in [1, {max_tokens_limit}] (this server's --max-tokens-limit)")
        if v is not None:
            req.max_tokens = v
            break
    else:
        req.max_tokens = max_tokens_default
    s = req.sampling
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = _num(body, name)
        if v is not None:
            setattr(s, name, v)
    top_k = _int(body, "top_k", -1, I32)
    if top_k is not None and top_k != -1:  # vLLM: -1 = off
        s.top_k = top_k
    req.cache_salt = _field(body, "cache_salt", (str,), "", lambda v: len(v) <= MAX_CACHE_SALT,
                            f"a string of at most {MAX_CACHE_SALT} characters") or ""
    bias = _field(body, "logit_bias", (dict,))
    if bias:
        try:
            s.logit_bias = {int(k): float(v) for k, v in bias.items()
                            if not isinstance(v, bool) and isinstance(v, (int, float))}
        except ValueError:
            raise ApiError(400, "logit_bias: keys must be token ids (integers as strings)", "logit_bias") from None
        if len(s.logit_bias) != len(bias):
            raise ApiError(400, "logit_bias: values must be numbers in [-100, 100]", "logit_bias")
    seed = _field(body, "seed", (int,))
    if seed is not None:
        s.seed = seed % 2**64
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(x, str) for x in stop)):
        raise ApiError(400, "stop: expected a string or a list of strings", "stop")
    req.stop = list(stop or [])
    req.ignore_eos = bool(_field(body, "ignore_eos", (bool,), False))
    req.constraint = constraint_of(body)


def _schema_text(v, param: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, (dict, bool)):
        return json.dumps(v)
    raise ApiError(400, f"{param}: a JSON schema (an object, or its JSON text) expected, got {_short(v)}", param)


CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def constraint_field(body: dict) -> str:
    """The body field a structured-output constraint came in (for the error's param)."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False)]
        return f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return next((k for k in CONSTRAINT_FIELDS[1:] if body.get(k) is not None), "response_format")


def constraint_of(body: dict) -> ConstraintSpec | None:
    """The structured-output constraint of a body, or None: OpenAI's response_format (text | json_object |
    json_schema), vLLM's structured_outputs {json | regex | choice | grammar | json_object} or its older
    guided_json / guided_regex / guided_choice / guided_grammar. At most one of them (ApiError otherwise)."""
    found = []
    fmt = _field(body, "response_format", (dict,))
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append((ConstraintSpec("json_object"), "response_format"))
        elif kind == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict) or "schema" not in js:
                raise ApiError(400, "response_format.json_schema: an object with a schema is required",
                               "response_format")
            found.append((ConstraintSpec("json_schema", _schema_text(js["schema"], "response_format")),
                          "response_format"))
        elif kind != "text":
            raise ApiError(400, f"response_format.type: text, json_object or json_schema, got {_short(kind)}",
                           "response_format")
    so = _field(body, "structured_outputs", (dict,))
    if so is not None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False)]
        if len(given) != 1:
            raise ApiError(400, "structured_outputs: exactly one of json, regex, choice, grammar, json_object",
                           "structured_outputs")
        found.append((_vllm_spec(given[0], so[given[0]], "structured_outputs"), "structured_outputs"))
    for key, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if body.get(key) is not None:
            found.append((_vllm_spec(kind, body[key], key), key))
    if len(found) > 1:
        raise ApiError(400, f"{found[1][1]}: one structured-output constraint per request ({found[0][1]} is one)",
                       found[1][1])
    return found[0][0] if found else None


def _vllm_spec(kind: str, v, param: str) -> ConstraintSpec:
    if kind == "json":
        return ConstraintSpec("json_schema", _schema_text(v, param))
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind == "choice":
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ApiError(400, f"{param}: choice must be a list of strings", param)
        return ConstraintSpec.choice(v)
    if not isinstance(v, str):
        raise ApiError(400, f"{param}: {kind} must be a string", param)
    return ConstraintSpec(kind, v)


def completion_request(body: dict, max_tokens_limit: int) -> GenerateInput:
    req = GenerateInput()
    if body.get("tools") or body.get("tool_choice"):
        raise ApiError(400, "tools: only /v1/chat/completions offers tools", "tools")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if not all(0 <= i <= I32 for i in prompt):
            raise ApiError(400, "prompt: token ids must be integers >= 0 (and below the vocabulary size)", "prompt")
        req.token_ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "prompt: one prompt per request (a list of several is not supported)", "prompt")
    else:
        raise ApiError(400, "prompt: expected a non-empty string or list of token ids", "prompt")
    _common(body, req, min(16, max_tokens_limit), max_tokens_limit)  # 16: OpenAI's default for completions
    lp = _int(body, "logprobs", 0, MAX_LOGPROBS)
    if lp is not None:
        req.logprobs = lp
    return req


def _content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(400, f"messages[{i}].content: expected a string or a list of text parts", "messages")


def _message(m: dict, i: int) -> dict:
    """A chat message, its text joined; an assistant's tool_calls and a tool result's tool_call_id kept (admission
    checks them)."""
    role = "system" if m["role"] == "developer" else m["role"]
    out = {"role": role, "content": _content(m, i)}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls: expected a list", "messages")
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name", "reasoning_content"):
        v = m.get(key)
        if v is not None and not isinstance(v, str):
            raise ApiError(400, f"messages[{i}].{key}: expected a string", "messages")
        if v:
            out[key] = v
    return out


def _tool_choice(body: dict) -> ToolChoice:
    """OpenAI's tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name"}}."""
    v = body.get("tool_choice")
    if v is None:
        return ToolChoice("auto" if body.get("tools") else "none")
    if isinstance(v, str):
        return ToolChoice(v)
    name = v.get("function", {}).get("name") if isinstance(v, dict) and isinstance(v.get("function"), dict) else None
    if not isinstance(name, str):
        raise ApiError(400, 'tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name"}}',
                       "tool_choice")
    return ToolChoice("function", name)


def chat_request(body: dict, max_tokens_limit: int) -> GenerateInput:
    req = GenerateInput(messages=[])
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages: expected a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}]: expected an object with a role", "messages")
        req.messages.append(_message(m, i))
    _common(body, req, max_tokens_limit, max_tokens_limit)
    req.tools = _field(body, "tools", (list,))
    req.tool_choice = _tool_choice(body)
    req.parallel_tool_calls = _field(body, "parallel_tool_calls", (bool,), True)
    req.chat_template_kwargs = _field(body, "chat_template_kwargs", (dict,))
    if _field(body, "logprobs", (bool,), False):
        req.logprobs = _int(body, "top_logprobs", 0, MAX_LOGPROBS, 0)
    elif body.get("top_logprobs"):
        raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    return req


def tokenize_request(body: dict) -> TokenizeInput:
    """vLLM's /tokenize body: prompt (a string) or messages (as chat's), add_special_tokens, add_generation_prompt,
    chat_template_kwargs, tools."""
    prompt, msgs = body.get("prompt"), body.get("messages")
    if (prompt is None) == (msgs is None):
        raise ApiError(400, "exactly one of prompt or messages is required", "prompt" if prompt is None else "messages")
    inp = TokenizeInput(add_special_tokens=_field(body, "add_special_tokens", (bool,)),
                        add_generation_prompt=_field(body, "add_generation_prompt", (bool,), True),
                        chat_template_kwargs=_field(body, "chat_template_kwargs", (dict,)),
                        tools=_field(body, "tools", (list,)))
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt: expected a string", "prompt")
        inp.prompt = prompt
        return inp
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages: expected a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}]: expected an object with a role", "messages")
    inp.messages = [_message(m, i) for i, m in enumerate(msgs)]
    return inp


# -- responses ------------------------------------------------------------------------------------
class Api:
    def __init__(self, servicer: GenerateServicer, model_name: str, security: ServerSecurity, max_body: int):
        self.servicer, self.model_name, self.max_body = servicer, model_name, max_body
        self.security = security
        self.created = int(time.time())
        self.active = 0  # requests in flight, for the drain
        self.responses = responses_api.Responses(self)  # (its store outlives an app: tests make several)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=self.max_body)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)  # vLLM's routes and shapes
        app.router.add_post("/detokenize", self.detokenize)
        anthropic_api.Messages(self).add_routes(app)  # Anthropic's /v1/messages
        self.responses.add_routes(app)  # OpenAI's /v1/responses
        return app

    @staticmethod
    def _error(request, status: int, message: str, param: str | None = None, code: str | None = None):
        """An error in the shape of the API the route belongs to (Anthropic's under /v1/messages)."""
        if request.path.startswith(anthropic_api.PATH):
            return anthropic_api.error_response(status, f"{param}: {message}" if param and param not in message
                                                else message)
        return error_response(status, message, param, code)

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        status = 500
        self.active += 1
        try:
            if request.path != "/health":
                tenant = self.security.tenant_of(presented_token(request.headers.get("Authorization"),
                                                                 request.headers.get("x-api-key")))
                if tenant is None:
                    status = 401
                    return self._error(request, 401, "missing or wrong API key (header 'Authorization: Bearer "
                                       "<token>' or 'x-api-key: <token>')", code="invalid_api_key")
                request["tenant"] = tenant
            resp = await handler(request)
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            return self._error(request, e.status, e.message, e.param, e.code)
        except anthropic_api.MessagesError as e:
            status = e.status
            return anthropic_api.error_response(e.status, e.message)
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
            status = e.status
            msg = {404: f"no route {request.method} {request.path}", 405: f"{request.method} is not allowed on "
                   f"{request.path}", 413: f"request body over {self.max_body} bytes (the longest prompt that fits "
                   f"the context, as JSON)"}.get(e.status, e.reason)
            return self._error(request, e.status, msg)
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code)
            raise
        except Exception as e:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return self._error(request, 500, f"internal error: {e}")
        finally:
            self.active -= 1
            metrics.HTTP_REQUESTS.labels(route, str(status)).inc()

    async def health(self, request):
        why = self.servicer.health_problem()
        return web.json_response({"status": "unavailable", "reason": why} if why else {"status": "ok"},
                                 status=503 if why else 200)

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "moe-split",
                "max_model_len": self.servicer.info.max_context}

    async def models(self, request):
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        self._check_model(request.match_info["model"])
        return web.json_response(self._model_card())

    def _check_model(self, name) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}", "model",
                           "model_not_found")

    async def _body(self, request) -> dict:
        data = await request.read()
        body = parse_body(data) if len(data) <= PARSE_INLINE else await asyncio.to_thread(parse_body, data)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        self._check_model(_field(body, "model", (str,), None))
        return body

    async def _submit(self, req: GenerateInput, names: dict[str, str]):
        """req into the engine -> (its request, its queue); refusals as ApiError (the route's API shapes them), a
        field named as the route's body spells it (names: the neutral name -> the body's; sampling's flat)."""
        why = self.servicer.unavailable()
        if why:
            raise ApiError(503, why)
        try:
            return await self.servicer.submit(req)
        except BadRequest as e:
            param = names.get(e.field, e.field.removeprefix("sampling."))
            raise ApiError(400, e.named({**names, e.field: param}), param, e.code) from None

    def _admission(self):
        if self.servicer.admission is None:
            raise ApiError(503, "starting: the model is not loaded yet")
        return self.servicer.admission

    async def tokenize(self, request):
        body = await self._body(request)
        inp = tokenize_request(body)
        strs = _field(body, "return_token_strs", (bool,), False)
        try:
            ids = await asyncio.to_thread(self._admission().tokenize, inp)  # (a long prompt: off the event loop)
        except BadRequest as e:
            raise ApiError(400, e.named(HTTP_FIELDS), HTTP_FIELDS.get(e.field, e.field), e.code) from None
        tok = self.servicer.admission.text.tok
        return web.json_response({"count": len(ids), "max_model_len": self.servicer.info.max_context, "tokens": ids,
                                  "token_strs": [tok.id_to_token(i) for i in ids] if strs else None})

    async def detokenize(self, request):
        body = await self._body(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ApiError(400, "tokens: expected a list of token ids", "tokens")
        try:
            text = self._admission().detokenize(ids)
        except BadRequest as e:
            raise ApiError(400, e.named({"token_ids": "tokens"}), "tokens", e.code) from None
        return web.json_response({"prompt": text})

    async def completions(self, request):
        body = await self._body(request)
        req = completion_request(body, self.servicer.max_tokens_limit)
        return await self._run(request, body, req, chat=False)

    async def chat(self, request):
        body = await self._body(request)
        req = chat_request(body, self.servicer.max_tokens_limit)
        return await self._run(request, body, req, chat=True)

    async def _run(self, request, body: dict, req: GenerateInput, chat: bool):
        req.tenant = request.get("tenant", "")
        stream = bool(_field(body, "stream", (bool,), False))
        usage_chunk = bool(_field(_field(body, "stream_options", (dict,), {}), "include_usage", (bool,), False))
        n = _int(body, "n", 1, MAX_N, 1)
        names = {**HTTP_FIELDS, "input": "messages" if chat else "prompt", "constraint": constraint_field(body)}
        r, q = await self._submit(req, names)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        outs = [Output(self, rid, chat, req.logprobs is not None, i) for i in range(n)]
        choices = Choices(lambda inp: self._submit(inp, names), req, n)
        choices.start(r, q)
        try:
            if stream:
                return await self._stream(request, choices, outs, usage_chunk)
            while choices.running:
                i, ev = await choices.events.get()
                if isinstance(ev, Failure):
                    raise ApiError(http_status(ev.status), ev.message)
                outs[i].add(ev)
                choices.running -= bool(ev.finish_reason)
            return web.json_response({**outs[0].head("whole"), "choices": [o.choice() for o in outs],
                                      "usage": usage(outs)})
        finally:
            choices.cancel()  # done, failed or the client went away: the engine drops them at the next step

    async def _stream(self, request, choices: "Choices", outs: list["Output"], usage_chunk: bool):
        resp, send = await sse.open_stream(request)

        try:
            for out in outs if outs[0].chat else ():
                await send(out.chunk({"role": "assistant", "content": ""}, None, None, usage_chunk))
            while choices.running:
                i, ev = await choices.events.get()
                out = outs[i]
                if isinstance(ev, Failure):  # mid-stream: the status line is gone; the error goes in the stream
                    await send({"error": {"message": ev.message, "type": error_type(http_status(ev.status)),
                                          "param": None, "code": ev.status.name}})
                    break
                out.add(ev)
                lps = out.logprobs_of(ev.logprobs)
                if out.chat and ev.reasoning:
                    await send(out.chunk({"reasoning_content": ev.reasoning}, None, None, usage_chunk))
                if ev.text or lps:
                    await send(out.chunk({"content": ev.text} if out.chat else ev.text, None, lps, usage_chunk))
                if ev.tool_calls:
                    await send(out.chunk({"tool_calls": [call_delta(d) for d in ev.tool_calls]}, None, None,
                                         usage_chunk))
                if ev.finish_reason:
                    await send(out.chunk({} if out.chat else "", FINISH[ev.finish_reason], None, usage_chunk))
                    choices.running -= 1
            else:
                if usage_chunk:
                    await send({**outs[0].head("chunk"), "choices": [], "usage": usage(outs)})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):  # the client left: _run's finally cancels the requests
            pass
        return resp


def usage(outs: list["Output"]) -> dict:
    """OpenAI's usage of a request's choices: the prompt once (its cached share as the first choice found it), the
    completions' tokens summed."""
    first, done = outs[0], sum(o.completion_tokens for o in outs)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": done, "total_tokens": first.prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


class Output:
    """One response being built: text, logprobs, usage, in OpenAI's shapes for completions and chat."""

    def __init__(self, api: Api, rid: str, chat: bool, logprobs: bool, index: int = 0):
        self.api, self.id, self.chat, self.want_logprobs, self.index = api, rid, chat, logprobs, index
        self.created = int(time.time())
        self.text, self.lps, self.finish, self.prompt_tokens, self.completion_tokens = [], [], None, 0, 0
        self.cached_tokens = 0
        self.reasoning: list[str] = []
        self.calls: list[dict] = []

    def add(self, ev) -> None:
        self.text.append(ev.text)
        self.reasoning.append(ev.reasoning)
        for d in ev.tool_calls:
            if d.index == len(self.calls):
                self.calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
            self.calls[d.index]["function"]["arguments"] += d.arguments
        self.lps += ev.logprobs or []
        self.finish = ev.finish_reason
        self.prompt_tokens, self.completion_tokens = ev.prompt_tokens, ev.completion_tokens
        self.cached_tokens = ev.cached_tokens

    def head(self, kind: str) -> dict:
        obj = ("chat.completion" if self.chat else "text_completion") + (".chunk" if kind == "chunk" and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.api.model_name}

    def _token(self, i: int) -> str:
        return self.api.servicer.engine.text.decode([i])

    def logprobs_of(self, lps: list | None) -> dict | None:
        """Tokens' (id, logprob, top) in the endpoint's shape, or None when not asked for."""
        if not self.want_logprobs or lps is None:
            return None
        if self.chat:
            def entry(i, lp):
                t = self._token(i)
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}
            return {"content": [{**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in top]}
                                for i, lp, top in lps]}
        return {"tokens": [self._token(i) for i, _, _ in lps], "token_logprobs": [lp for _, lp, _ in lps],
                "top_logprobs": [{self._token(j): v for j, v in top} for _, _, top in lps]}

    def chunk(self, delta, finish: str | None, logprobs: dict | None, with_usage: bool) -> dict:
        choice = {"index": self.index, "logprobs": logprobs, "finish_reason": finish}
        choice["delta" if self.chat else "text"] = delta
        out = {**self.head("chunk"), "choices": [choice]}
        if with_usage:
            out["usage"] = None
        return out

    def choice(self) -> dict:
        """The choice, whole."""
        text = "".join(self.text)
        choice = {"index": self.index, "logprobs": self.logprobs_of(self.lps), "finish_reason": FINISH[self.finish]}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text if text or not self.calls else None,
                                 "reasoning_content": "".join(self.reasoning) or None}
            if self.calls:
                choice["message"]["tool_calls"] = self.calls
        else:
            choice["text"] = text
        return choice


def call_delta(d) -> dict:
    """A tools.ToolCallDelta as OpenAI streams it: the first piece of a call has its id, type and name."""
    out = {"index": d.index, "function": {"arguments": d.arguments}}
    if d.id is not None:
        out.update(id=d.id, type="function")
        out["function"]["name"] = d.name
    return out


async def start(api: Api, listen: str, ssl_context=None) -> web.AppRunner:
    """Serve api on host:port on the running loop; -> the runner (stop it with stop())."""
    host, _, port = listen.rpartition(":")
    runner = web.AppRunner(api.app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]") or "0.0.0.0", int(port), ssl_context=ssl_context)
    await site.start()
    return runner


async def stop(api: Api, runner: web.AppRunner, grace: float) -> None:
    """Close the server once the requests in flight have ended (the engine ends them at the drain's
    deadline, with an error event), waiting `grace` seconds at most; what is still open then gets the
    runner's shutdown_timeout (aiohttp's default, a minute, let streams run to their end after SIGTERM)."""
    deadline = time.monotonic() + grace
    while api.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await runner.cleanup()
