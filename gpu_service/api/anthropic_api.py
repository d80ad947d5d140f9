"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) on the HTTP server of openai_api.py.

A Messages body becomes the transport-neutral chat request (admission.GenerateInput): the same chat template, tool
parsers, forced-call grammars and checks as /v1/chat/completions. Blocks map as the chat messages have them: system
text -> a system message; a user's text -> its content and its tool_result blocks -> tool messages (before the text,
is_error marked "Error: "); an assistant's text -> content, tool_use -> tool_calls, thinking -> reasoning_content;
tools' input_schema -> parameters; tool_choice auto / any / tool / none -> auto / required / the named function /
none (disable_parallel_tool_use -> parallel_tool_calls); thinking enabled / disabled -> the template's
enable_thinking (adaptive: its default); output_config.format -> the json_schema constraint; temperature, top_p and
top_k as older clients send them. The engine's chunks come back as content blocks (thinking with a signature,
text, tool_use) and, streamed, as Anthropic's events. Usage follows Anthropic: input_tokens excludes the prompt's
cached part (cache_read_input_tokens); OpenAI's prompt_tokens includes it. Errors in Anthropic's shape.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import uuid

from aiohttp import web

from gpu_service.api import sse
from gpu_service.api.admission import GenerateInput, TokenizeInput
from gpu_service.api.constraints import ConstraintSpec
from gpu_service.api.tools import ToolChoice
from gpu_service.engine.sampling import SamplingParams
from gpu_service.engine.scheduler import Failure
from moe_core.errors import BadRequest, http_status

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "api_error"}
# the neutral request's field names as this API spells them
FIELDS = {"input": "messages", "messages.role": "messages", "stop": "stop_sequences",
          "constraint": "output_config.format", "sampling.temperature": "temperature", "sampling.top_p": "top_p",
          "sampling.top_k": "top_k"}
STOP_REASON = {"length": "max_tokens", "tool_calls": "tool_use", "eos": "end_turn"}
PATH = "/v1/messages"


class MessagesError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def bad(message: str) -> MessagesError:
    return MessagesError(400, message)


def error_response(status: int, message: str) -> web.Response:
    """Anthropic's error shape."""
    return web.json_response({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                         "message": message}}, status=status)


def signature(thinking: str) -> str:
    """A thinking block's signature: opaque to the client, which sends the block back unchanged in its history."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


# -- the request -----------------------------------------------------------------------------------
def _typed(v, kinds, name: str, what: str):
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
        raise bad(f"{name}: expected {what}")
    return v


def _number(body: dict, name: str, lo: float, hi: float):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad(f"{name}: expected a number in [{lo}, {hi}]")
    return float(v)


def _blocks(content, where: str) -> list[dict]:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    _typed(content, (list,), f"{where}.content", "a string or a list of content blocks")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad(f"{where}.content[{j}]: expected a content block with a type")
    return content


def _text(block: dict, where: str) -> str:
    return _typed(block.get("text"), (str,), f"{where}.text", "a string")


def _result_text(block: dict, where: str) -> str:
    """A tool_result's content: a string or text blocks (images are not read by this server)."""
    c = block.get("content", "")
    parts = [c] if isinstance(c, str) else None
    if parts is None:
        for j, b in enumerate(_typed(c, (list,), f"{where}.content", "a string or a list of text blocks")):
            if not isinstance(b, dict) or b.get("type") != "text":
                raise bad(f"{where}.content[{j}]: only text blocks are supported in a tool result")
        parts = [_text(b, f"{where}.content[{j}]") for j, b in enumerate(c)]
    text = "".join(parts)
    return "Error: " + text if block.get("is_error") is True else text


def _messages(body: dict) -> list[dict]:
    """system and messages as chat messages (the chat request's form: openai_api's _message)."""
    out = []
    system = body.get("system")
    if system is not None:
        blocks = _blocks(system, "system")
        if any(b["type"] != "text" for b in blocks):
            raise bad("system: only text blocks are supported")
        out.append({"role": "system", "content": "".join(_text(b, "system") for b in blocks)})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages: expected a non-empty list")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role: expected user or assistant")
        blocks = _blocks(m.get("content"), where)
        if m["role"] == "user":
            texts = []
            for j, b in enumerate(blocks):
                at = f"{where}.content[{j}]"
                if b["type"] == "text":
                    texts.append(_text(b, at))
                elif b["type"] == "tool_result":
                    out.append({"role": "tool", "content": _result_text(b, at), "tool_call_id": _typed(
                        b.get("tool_use_id"), (str,), f"{at}.tool_use_id", "the id of the tool_use it answers")})
                else:
                    raise bad(f"{at}.type: {b['type']!r} is not supported in a user message (text, tool_result)")
            if texts or not any(b["type"] == "tool_result" for b in blocks):
                out.append({"role": "user", "content": "".join(texts)})
            continue
        msg = {"role": "assistant", "content": ""}
        calls, thinking = [], []
        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            if b["type"] == "text":
                msg["content"] += _text(b, at)
            elif b["type"] == "tool_use":
                name = _typed(b.get("name"), (str,), f"{at}.name", "the tool's name")
                args = _typed(b.get("input", {}), (dict,), f"{at}.input", "an object")
                calls.append({"id": _typed(b.get("id"), (str,), f"{at}.id", "a string"), "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            elif b["type"] == "thinking":
                thinking.append(_typed(b.get("thinking"), (str,), f"{at}.thinking", "a string"))
            elif b["type"] != "redacted_thinking":  # (opaque: nothing of it reaches the template)
                raise bad(f"{at}.type: {b['type']!r} is not supported in an assistant message "
                          "(text, tool_use, thinking, redacted_thinking)")
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        out.append(msg)
    return out


def _tools(body: dict) -> tuple[list[dict] | None, ToolChoice, bool]:
    """tools (input_schema) and tool_choice as the chat request's: (tools, choice, parallel)."""
    tools = body.get("tools")
    out = None
    if tools is not None:
        out = []
        for i, t in enumerate(_typed(tools, (list,), "tools", "a list")):
            if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
                raise bad(f"tools[{i}]: only custom tools (name, description, input_schema) are supported")
            fn = {"name": t.get("name"), "parameters": t.get("input_schema", {"type": "object", "properties": {}})}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            out.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is None:
        return out, ToolChoice("auto" if out else "none"), True
    kind = choice.get("type") if isinstance(choice, dict) else None
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if kind == "tool":
        tc = ToolChoice("function", _typed(choice.get("name"), (str,), "tool_choice.name", "the tool's name"))
    elif kind in modes:
        tc = ToolChoice(modes[kind])
    else:
        raise bad('tool_choice: expected {"type": "auto" | "any" | "tool" | "none"}')
    parallel = not _typed(choice.get("disable_parallel_tool_use", False), (bool,),
                          "tool_choice.disable_parallel_tool_use", "a boolean")
    return out, tc, parallel


def _thinking(body: dict, max_tokens: int | None) -> dict | None:
    """thinking -> chat_template_kwargs: enabled / disabled -> enable_thinking; adaptive: the template's default."""
    t = body.get("thinking")
    if t is None:
        return None
    kind = t.get("type") if isinstance(t, dict) else None
    if kind == "enabled":
        budget = t.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024 or \
                (max_tokens is not None and budget >= max_tokens):
            raise bad("thinking.budget_tokens: an integer >= 1024 and below max_tokens")
        return {"enable_thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind == "adaptive":
        return None
    raise bad('thinking: expected {"type": "enabled", "budget_tokens": N}, {"type": "disabled"} or '
              '{"type": "adaptive"}')


def _format(body: dict) -> ConstraintSpec | None:
    """output_config.format (json_schema: the answer is JSON that validates, as chat's response_format); effort is
    not a setting here."""
    cfg = body.get("output_config")
    if cfg is None:
        return None
    fmt = _typed(cfg, (dict,), "output_config", "an object").get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad('output_config.format: expected {"type": "json_schema", "schema": {...}}')
    return ConstraintSpec("json_schema", json.dumps(fmt["schema"]))


def messages_request(body: dict, max_tokens_limit: int) -> GenerateInput:
    """A Messages body as the neutral chat request (types and ranges here; what they mean, by admission)."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 < max_tokens <= max_tokens_limit:
        raise bad(f"max_tokens: required, an integer in [1, {max_tokens_limit}] (this server's --max-tokens-limit)")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop_sequences: expected a list of strings")
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= 1 << 30):
        raise bad("top_k: expected a non-negative integer")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or not isinstance(meta.get("user_id", ""), (str, type(None)))):
        raise bad("metadata: expected an object (user_id: a string)")
    temperature, top_p = _number(body, "temperature", 0, 1), _number(body, "top_p", 0, 1)
    tools, choice, parallel = _tools(body)
    return GenerateInput(
        messages=_messages(body), max_tokens=max_tokens, stop=stop,
        sampling=SamplingParams(temperature=1.0 if temperature is None else temperature,
                                top_p=1.0 if top_p is None else top_p, top_k=top_k or 0),
        tools=tools, tool_choice=choice, parallel_tool_calls=parallel, constraint=_format(body),
        chat_template_kwargs=_template_kwargs(body, max_tokens))


def _template_kwargs(body: dict, max_tokens: int | None) -> dict | None:
    """thinking's, over vLLM's chat_template_kwargs where a client sends them."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs: expected an object")
    thinking = _thinking(body, max_tokens)
    return {**(kwargs or {}), **(thinking or {})} or None


# -- the answer ------------------------------------------------------------------------------------
class Answer:
    """One message being built from the engine's chunks: its blocks in order (thinking, text, tool_use), each open
    one's text, and as streamed events."""

    def __init__(self, model: str):
        self.id, self.model = f"msg_{uuid.uuid4().hex}", model
        self.blocks: list[dict] = []
        self.open: str | None = None  # the type of the block deltas now go to
        self.args: dict[int, int] = {}  # a call's index -> its block's
        self.prompt_tokens = self.cached = self.output = 0
        self.finish: str | None = None
        self.stop_sequence: str | None = None

    def usage(self) -> dict:
        return {"input_tokens": self.prompt_tokens - self.cached, "output_tokens": self.output,
                "cache_read_input_tokens": self.cached, "cache_creation_input_tokens": 0}

    def stop_reason(self) -> str:
        if self.finish == "stop":
            return "stop_sequence" if self.stop_sequence is not None else "end_turn"
        return STOP_REASON[self.finish]

    def head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _start(self, block: dict) -> list[dict]:
        """Close the open block, open this one -> the events."""
        events = self._close()
        self.blocks.append(block)
        self.open = block["type"]
        events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                       "content_block": {**block, **({"input": {}} if block["type"] == "tool_use" else {})}})
        return events

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        events, i = [], len(self.blocks) - 1
        if self.open == "thinking":
            sig = self.blocks[i]["signature"] = signature(self.blocks[i]["thinking"])
            events.append({"type": "content_block_delta", "index": i,
                           "delta": {"type": "signature_delta", "signature": sig}})
        self.open = None
        return events + [{"type": "content_block_stop", "index": i}]

    def add(self, ev) -> list[dict]:
        """A chunk in -> the stream's events for it."""
        self.prompt_tokens, self.cached, self.output = ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens
        events = []
        if ev.reasoning:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.blocks[-1]["thinking"] += ev.reasoning
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                           "delta": {"type": "thinking_delta", "thinking": ev.reasoning}})
        if ev.text:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            self.blocks[-1]["text"] += ev.text
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                           "delta": {"type": "text_delta", "text": ev.text}})
        for d in ev.tool_calls:
            if d.id is not None:
                events += self._start({"type": "tool_use", "id": d.id, "name": d.name, "input": ""})
                self.args[d.index] = len(self.blocks) - 1
            k = self.args[d.index]
            self.blocks[k]["input"] += d.arguments
            if d.arguments:
                events.append({"type": "content_block_delta", "index": k,
                               "delta": {"type": "input_json_delta", "partial_json": d.arguments}})
        if ev.finish_reason:
            self.finish, self.stop_sequence = ev.finish_reason, ev.stop_sequence
            events += self._close()
        return events

    def whole(self) -> dict:
        """The message; a tool_use cut off by max_tokens (its input not yet a whole object) is left out."""
        content = []
        for b in self.blocks:
            if b["type"] == "tool_use":
                try:
                    b = {**b, "input": json.loads(b["input"] or "{}")}
                except ValueError:
                    continue
            content.append(b)
        return {**self.head(), "content": content, "stop_reason": self.stop_reason(),
                "stop_sequence": self.matched(), "usage": self.usage()}

    def matched(self) -> str | None:
        return self.stop_sequence if self.finish == "stop" else None


# -- the routes ------------------------------------------------------------------------------------
class Messages:
    """The routes, on the OpenAI API's server (its auth, body limits, model check and engine)."""

    def __init__(self, api):
        self.api = api

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(PATH, self.create)
        app.router.add_post(PATH + "/count_tokens", self.count_tokens)

    def _bad_request(self, e: BadRequest) -> MessagesError:
        return MessagesError(400, e.named(FIELDS))

    async def create(self, request):
        body = await self.api._body(request)  # (its errors: Anthropic's shape here, openai_api._error)
        req = messages_request(body, self.api.servicer.max_tokens_limit)
        req.tenant = request.get("tenant", "")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream: expected a boolean")
        r, q = await self.api._submit(req, FIELDS)  # (its refusals: Anthropic's shape here, openai_api._error)
        answer = Answer(self.api.model_name)
        try:
            if stream:
                return await self._stream(request, q, answer)
            while True:
                ev = await q.get()
                if isinstance(ev, Failure):
                    raise MessagesError(http_status(ev.status), ev.message)
                answer.add(ev)
                if ev.finish_reason:
                    return web.json_response(answer.whole())
        finally:
            r.cancelled = True

    async def _stream(self, request, q: asyncio.Queue, answer: Answer):
        resp, send = await sse.open_stream(request, named=True)

        try:
            ev = await q.get()  # (the prompt's size, for message_start's usage, comes with the first chunk)
            if not isinstance(ev, Failure):
                answer.prompt_tokens, answer.cached = ev.prompt_tokens, ev.cached_tokens
                await send({"type": "message_start", "message": {
                    **answer.head(), "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {**answer.usage(), "output_tokens": 0}}})
                await send({"type": "ping"})
            while True:
                if isinstance(ev, Failure):  # mid-stream: the status line is gone; the error goes in the stream
                    status = http_status(ev.status)
                    await send({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                           "message": ev.message}})
                    break
                for e in answer.add(ev):
                    await send(e)
                if ev.finish_reason:
                    await send({"type": "message_delta", "delta": {"stop_reason": answer.stop_reason(),
                                                                   "stop_sequence": answer.matched()},
                                "usage": {"output_tokens": answer.output}})
                    await send({"type": "message_stop"})
                    break
                ev = await q.get()
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError):  # the client left: create's finally cancels the request
            pass
        return resp

    async def count_tokens(self, request):
        body = await self.api._body(request)  # (its errors: Anthropic's shape here, openai_api._error)
        inp = TokenizeInput(messages=_messages(body), tools=_tools(body)[0],
                            chat_template_kwargs=_template_kwargs(body, None))
        admission = self.api.servicer.admission
        if admission is None:
            raise MessagesError(503, "starting: the model is not loaded yet")
        try:
            ids = await asyncio.to_thread(admission.tokenize, inp)
        except BadRequest as e:
            raise self._bad_request(e) from None
        return web.json_response({"input_tokens": len(ids)})
