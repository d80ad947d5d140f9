"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) on the HTTP server of openai_api.py.

A Responses body becomes the transport-neutral chat request (admission.GenerateInput), so the chat template, tool
parsers, forced-call grammars, structured outputs and their checks are chat/completions' own. Items map to chat
messages: instructions -> a system message; message items (input_text / output_text parts) -> their role's message
(developer -> system); function_call items -> the assistant's tool_calls (consecutive ones one message);
function_call_output -> a tool message; reasoning items -> the next assistant message's reasoning_content. tools
(flat function tools, strict), tool_choice, parallel_tool_calls, text.format (json_schema / json_object),
max_output_tokens, temperature, top_p, vLLM's chat_template_kwargs as chat's (reasoning.effort: the template variable
reasoning_effort). The answer's items: reasoning (where the family's parser yields
it), message (output_text), function_call; streamed as the semantic events, each with its sequence_number.

store (default true, as OpenAI's) keeps a response for GET, DELETE and previous_response_id (the conversation so far
continued: its input and output, less its instructions) in a bounded in-memory store: at most STORE_BYTES of
responses, each for STORE_TTL seconds, least recently used dropped first; a response is visible to the tenant that
created it only.
"""
from __future__ import annotations

import collections
import json
import threading
import time
import uuid

from aiohttp import web

from gpu_service.api import sse
from gpu_service.api.admission import GenerateInput
from gpu_service.api.constraints import ConstraintSpec
from gpu_service.api.tools import ToolChoice
from gpu_service.engine.sampling import SamplingParams
from gpu_service.engine.scheduler import Failure
from moe_core.errors import http_status

PATH = "/v1/responses"
STORE_BYTES = 64 << 20  # most bytes of stored responses (their JSON and conversations)
STORE_TTL = 3600.0      # seconds a stored response is kept
MAX_METADATA = 16       # OpenAI's: at most 16 keys of at most 64 characters, values of at most 512
FIELDS = {"input": "input", "messages": "input", "messages.role": "input", "constraint": "text.format",
          "max_tokens": "max_output_tokens", "sampling.temperature": "temperature", "sampling.top_p": "top_p"}


def _api_error(status: int, message: str, param: str | None = None):
    from gpu_service.api.openai_api import ApiError  # (openai_api imports this module)
    return ApiError(status, message, param)


def bad(param: str, message: str):
    return _api_error(400, f"{param}: {message}", param.split("[")[0])


def _str(v, param: str, what: str = "a string") -> str:
    if not isinstance(v, str):
        raise bad(param, f"expected {what}")
    return v


# -- the request -----------------------------------------------------------------------------------
def _parts_text(content, param: str, kinds: tuple[str, ...]) -> str:
    """A message item's content: a string, or parts of the given types' text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(param, "expected a string or a list of content parts")
    out = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in kinds:
            raise bad(f"{param}[{j}].type", f"expected one of {', '.join(kinds)} (got "
                      f"{p.get('type') if isinstance(p, dict) else type(p).__name__!r})")
        out.append(_str(p.get("text"), f"{param}[{j}].text"))
    return "".join(out)


def _items(items, param: str = "input") -> list[dict]:
    """Input items as chat messages (openai_api's chat message form)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad(param, "expected a string or a non-empty list of items")
    out, reasoning = [], []

    def assistant() -> dict:
        """The assistant message function calls join: the last one, or a new one."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]
    for i, it in enumerate(items):
        at = f"{param}[{i}]"
        if not isinstance(it, dict):
            raise bad(at, "expected an item object")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"{at}.role", "expected user, system, developer or assistant")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            msg = {"role": "system" if role == "developer" else role,
                   "content": _parts_text(it.get("content"), f"{at}.content", kinds)}
            if role == "assistant" and reasoning:
                msg["reasoning_content"] = "".join(reasoning)
                reasoning = []
            out.append(msg)
        elif kind == "function_call":
            msg = assistant()
            if reasoning:
                msg["reasoning_content"] = msg.get("reasoning_content", "") + "".join(reasoning)
                reasoning = []
            msg.setdefault("tool_calls", []).append({
                "id": _str(it.get("call_id"), f"{at}.call_id"), "type": "function",
                "function": {"name": _str(it.get("name"), f"{at}.name"),
                             "arguments": _str(it.get("arguments"), f"{at}.arguments", "a JSON object's text")}})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _str(it.get("call_id"), f"{at}.call_id"),
                        "content": _parts_text(it.get("output"), f"{at}.output", ("input_text", "output_text"))})
        elif kind == "reasoning":
            parts = it.get("content") or it.get("summary") or []  # its text, else its summary
            reasoning.append(_parts_text(parts, f"{at}.content", ("reasoning_text", "summary_text")))
        else:
            raise bad(f"{at}.type", f"{kind!r} is not supported (message, function_call, function_call_output, "
                      "reasoning)")
    return out


def _tools(body: dict) -> tuple[list[dict] | None, ToolChoice]:
    tools = body.get("tools")
    out = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "expected a list")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise bad(f"tools[{i}].type", "only function tools are served")
            out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                            "strict") if t.get(k) is not None}})
    v = body.get("tool_choice")
    if v is None:
        return out, ToolChoice("auto" if out else "none")
    if isinstance(v, str) and v in ("auto", "none", "required"):
        return out, ToolChoice(v)
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
        return out, ToolChoice("function", v["name"])
    raise bad("tool_choice", 'expected "auto", "none", "required" or {"type": "function", "name": ...}')


def _format(body: dict) -> ConstraintSpec | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text", "expected an object")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind == "json_schema" and isinstance(fmt.get("schema"), (dict, bool)):
        return ConstraintSpec("json_schema", json.dumps(fmt["schema"]))
    raise bad("text.format", 'expected {"type": "text" | "json_object"} or {"type": "json_schema", "name": ..., '
              '"schema": {...}}')


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad(name, f"expected a number in [{lo}, {hi}]")
    return float(v)


def _template_kwargs(body: dict) -> dict | None:
    """vLLM's chat_template_kwargs, and reasoning.effort as the template variable reasoning_effort (gpt-oss's
    templates read it)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "expected an object")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else 0
        if effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
            raise bad("reasoning", 'expected {"effort": "none" | "minimal" | "low" | "medium" | "high" | "xhigh"}')
        if effort is not None:
            kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    return kwargs


def _metadata(body: dict) -> dict:
    m = body.get("metadata") or {}
    if not isinstance(m, dict) or len(m) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in m.items()):
        raise bad("metadata", f"at most {MAX_METADATA} string keys (<= 64 characters) to strings (<= 512)")
    return m


# -- the store -------------------------------------------------------------------------------------
class Store:
    """Stored responses, bounded in bytes and time: id -> (tenant, response, conversation, bytes, expiry)."""

    def __init__(self, max_bytes: int = STORE_BYTES, ttl: float = STORE_TTL):
        self.max_bytes, self.ttl = max_bytes, ttl
        self.items: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self.bytes = 0
        self.checked = 0.0
        self.lock = threading.Lock()

    def put(self, rid: str, tenant: str, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        with self.lock:
            self._expire()
            if size > self.max_bytes:
                return
            while self.bytes + size > self.max_bytes:
                _, old = self.items.popitem(last=False)
                self.bytes -= old[3]
            self.items[rid] = (tenant, response, conversation, size, time.monotonic() + self.ttl)
            self.bytes += size

    def get(self, rid: str, tenant: str) -> tuple[dict, list[dict]] | None:
        with self.lock:
            self._expire()
            e = self.items.get(rid)
            if e is None or e[0] != tenant:
                return None
            self.items.move_to_end(rid)
            return e[1], e[2]

    def delete(self, rid: str, tenant: str) -> bool:
        with self.lock:
            e = self.items.get(rid)
            if e is None or e[0] != tenant:
                return False
            del self.items[rid]
            self.bytes -= e[3]
            return True

    def _expire(self) -> None:
        now = time.monotonic()
        if now < self.checked + 1.0:  # (a scan of every entry at most once a second)
            return
        self.checked = now
        for k in [k for k, v in self.items.items() if v[4] <= now]:
            self.bytes -= self.items.pop(k)[3]


# -- the answer ------------------------------------------------------------------------------------
class Answer:
    """One response being built from the engine's chunks: its output items (reasoning, message, function_call) and
    the streamed events, numbered."""

    def __init__(self, rid: str, head: dict):
        self.id, self.head = rid, head
        self.items: list[dict] = []
        self.open: str | None = None  # the type of the item deltas go to
        self.calls: dict[int, int] = {}  # a call's index -> its item's
        self.seq = 0
        self.prompt = self.cached = self.output = 0
        self.finish: str | None = None

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def response(self, status: str) -> dict:
        done = status != "in_progress"
        return {**self.head, "id": self.id, "status": status,
                "output": [self._final(it) for it in self.items] if done else [],
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": {"input_tokens": self.prompt, "input_tokens_details": {"cached_tokens": self.cached},
                          "output_tokens": self.output, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": self.prompt + self.output} if done else None}

    @staticmethod
    def _final(it: dict) -> dict:
        return {**it, "status": "completed"} if it["type"] != "reasoning" else it

    def _open_item(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self.open = item["type"]
        i = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=i, item={**item, "status": "in_progress"}
                                 if item["type"] != "reasoning" else item))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=i,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        i, it = len(self.items) - 1, self.items[-1]
        events = []
        if it["type"] == "message":
            part = it["content"][0]
            events += [self.event("response.output_text.done", item_id=it["id"], output_index=i, content_index=0,
                                  text=part["text"]),
                       self.event("response.content_part.done", item_id=it["id"], output_index=i, content_index=0,
                                  part=part)]
        elif it["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=it["id"], output_index=i,
                                     content_index=0, text=it["content"][0]["text"]))
        self.open = None
        return events + [self.event("response.output_item.done", output_index=i, item=self._final(it))]

    def _close_call(self, k: int) -> list[dict]:
        it = self.items[k]
        return [self.event("response.function_call_arguments.done", item_id=it["id"], output_index=k,
                           arguments=it["arguments"], name=it["name"])]

    def add(self, ev) -> list[dict]:
        self.prompt, self.cached, self.output = ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens
        events = []
        if ev.reasoning:
            if self.open != "reasoning":
                events += self._open_item({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                                           "content": [{"type": "reasoning_text", "text": ""}]})
            self.items[-1]["content"][0]["text"] += ev.reasoning
            events.append(self.event("response.reasoning_text.delta", item_id=self.items[-1]["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=ev.reasoning))
        if ev.text:
            if self.open != "message":
                events += self._open_item({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                                           "content": [{"type": "output_text", "text": "", "annotations": []}]})
            self.items[-1]["content"][0]["text"] += ev.text
            events.append(self.event("response.output_text.delta", item_id=self.items[-1]["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=ev.text))
        for d in ev.tool_calls:
            if d.id is not None:
                if self.open == "function_call":
                    events += self._close_call(len(self.items) - 1)
                events += self._open_item({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": d.id,
                                           "name": d.name, "arguments": ""})
                self.calls[d.index] = len(self.items) - 1
            k = self.calls[d.index]
            self.items[k]["arguments"] += d.arguments
            if d.arguments:
                events.append(self.event("response.function_call_arguments.delta", item_id=self.items[k]["id"],
                                         output_index=k, delta=d.arguments))
        if ev.finish_reason:
            self.finish = ev.finish_reason
            if self.open == "function_call":
                events += self._close_call(len(self.items) - 1)
            events += self._close()
        return events

    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def conversation(self) -> list[dict]:
        """The output as chat messages, for a next turn's previous_response_id."""
        msg = {"role": "assistant", "content": ""}
        for it in self.items:
            if it["type"] == "reasoning":
                msg["reasoning_content"] = msg.get("reasoning_content", "") + it["content"][0]["text"]
            elif it["type"] == "message":
                msg["content"] += it["content"][0]["text"]
            else:
                msg.setdefault("tool_calls", []).append({"id": it["call_id"], "type": "function", "function": {
                    "name": it["name"], "arguments": it["arguments"]}})
        return [msg]


# -- the routes ------------------------------------------------------------------------------------
class Responses:
    """The routes, on the OpenAI API's server (its auth, body limits, model check and engine)."""

    def __init__(self, api, store: Store | None = None):
        self.api, self.store = api, store or Store()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(PATH, self.create)
        app.router.add_get(PATH + "/{id}", self.retrieve)
        app.router.add_delete(PATH + "/{id}", self.delete)

    def _request(self, body: dict, tenant: str) -> tuple[GenerateInput, dict, list[dict]]:
        """-> (the chat request, the response's echo of the settings, the conversation before this turn's output)."""
        instructions = body.get("instructions")
        if instructions is not None:
            _str(instructions, "instructions")
        history = []
        prev = body.get("previous_response_id")
        if prev is not None:
            got = self.store.get(_str(prev, "previous_response_id"), tenant)
            if got is None:
                raise _api_error(404, f"previous_response_id: no stored response {prev!r}", "previous_response_id")
            history = got[1]
        if "input" not in body:
            raise bad("input", "required")
        conversation = history + _items(body["input"])
        tools, choice = _tools(body)
        limit = self.api.servicer.max_tokens_limit
        max_tokens = body.get("max_output_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or not 0 < max_tokens <= limit):
            raise bad("max_output_tokens", f"an integer in [1, {limit}] (this server's --max-tokens-limit)")
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise bad("parallel_tool_calls", "expected a boolean")
        store = body.get("store", True)
        if not isinstance(store, bool):
            raise bad("store", "expected a boolean")
        temperature, top_p = _number(body, "temperature", 0, 2, 1.0), _number(body, "top_p", 0, 1, 1.0)
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
        req = GenerateInput(messages=messages, max_tokens=max_tokens or limit, tools=tools, tool_choice=choice,
                            parallel_tool_calls=parallel, constraint=_format(body), tenant=tenant,
                            sampling=SamplingParams(temperature=temperature, top_p=top_p),
                            chat_template_kwargs=_template_kwargs(body))
        echo = {"object": "response", "created_at": int(time.time()), "model": self.api.model_name,
                "instructions": instructions, "max_output_tokens": max_tokens, "metadata": _metadata(body),
                "parallel_tool_calls": parallel, "previous_response_id": prev, "store": store,
                "temperature": temperature, "top_p": top_p, "tool_choice": body.get("tool_choice", "auto"),
                "tools": body.get("tools") or [], "text": body.get("text") or {"format": {"type": "text"}},
                "reasoning": body.get("reasoning"), "error": None, "truncation": "disabled"}
        return req, echo, conversation

    async def create(self, request):
        body = await self.api._body(request)
        tenant = request.get("tenant", "")
        req, echo, conversation = self._request(body, tenant)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream", "expected a boolean")
        r, q = await self.api._submit(req, FIELDS)
        answer = Answer(f"resp_{uuid.uuid4().hex}", echo)
        try:
            if stream:
                return await self._stream(request, q, answer, conversation)
            while True:
                ev = await q.get()
                if isinstance(ev, Failure):
                    raise _api_error(http_status(ev.status), ev.message)
                answer.add(ev)
                if ev.finish_reason:
                    return web.json_response(self._done(answer, conversation, tenant))
        finally:
            r.cancelled = True

    def _done(self, answer: Answer, conversation: list[dict], tenant: str) -> dict:
        resp = answer.response(answer.status())
        if answer.head["store"]:
            self.store.put(answer.id, tenant, resp, conversation + answer.conversation())
        return resp

    async def _stream(self, request, q, answer: Answer, conversation: list[dict]):
        resp, send = await sse.open_stream(request, named=True)

        try:
            await send(answer.event("response.created", response=answer.response("in_progress")))
            await send(answer.event("response.in_progress", response=answer.response("in_progress")))
            while True:
                ev = await q.get()
                if isinstance(ev, Failure):  # mid-stream: the status line is gone; the error goes in the stream
                    await send(answer.event("error", code=ev.status.name, message=ev.message, param=None))
                    failed = {**answer.response("failed"), "error": {"code": "server_error", "message": ev.message}}
                    await send(answer.event("response.failed", response=failed))
                    break
                for e in answer.add(ev):
                    await send(e)
                if ev.finish_reason:
                    done = self._done(answer, conversation, request.get("tenant", ""))
                    kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
                    await send(answer.event(kind, response=done))
                    break
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):  # the client left: create's finally cancels the request
            pass
        return resp

    async def retrieve(self, request):
        got = self.store.get(request.match_info["id"], request.get("tenant", ""))
        if got is None:
            raise _api_error(404, f"no stored response {request.match_info['id']!r}", "response_id")
        return web.json_response(got[0])

    async def delete(self, request):
        rid = request.match_info["id"]
        if not self.store.delete(rid, request.get("tenant", "")):
            raise _api_error(404, f"no stored response {rid!r}", "response_id")
        return web.json_response({"id": rid, "object": "response", "deleted": True})
