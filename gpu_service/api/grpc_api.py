"""gRPC GenerateService: validate requests at the edge, hand them to the engine, stream chunks."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

import grpc
import torch

from moe_core import security
from moe_exchange import codec
from moe_core.errors import BadRequest
from moe_core.serving import GRPC_MAX_MESSAGE
from protos import generate_pb2, generate_pb2_grpc

from gpu_service import metrics
from gpu_service.api.admission import Admission, GenerateInput, ScoreInput, TokenizeInput
from gpu_service.api.choices import MAX_N, Choices
from gpu_service.api.constraints import ConstraintSpec
from gpu_service.api.answer import AnswerFormat
from gpu_service.engine.scheduler import Engine, Failure, Request
from gpu_service.engine.sampling import SamplingParams
from gpu_service.api.text import TextCodec
from gpu_service.api.tools import ToolChoice

log = logging.getLogger("gpu_service")

FINISH = {"length": generate_pb2.LENGTH, "stop": generate_pb2.STOP, "eos": generate_pb2.EOS,
          "tool_calls": generate_pb2.TOOL_CALLS}


def prompt_bytes_limit(max_context: int, text: TextCodec) -> int:
    """The most bytes of text a prompt that fits the context can have (every token stands for at most
    text.max_token_chars of them): the bound for request sizes, above which nothing can be legitimate."""
    return max_context * text.max_token_chars


def template_kwargs(text: str) -> dict | None:
    if not text:
        return None
    try:
        kwargs = json.loads(text)
    except ValueError as e:
        raise BadRequest("chat_template_kwargs", f"not valid JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs", "must be a JSON object")
    return kwargs


def generate_input(req: generate_pb2.GenerateRequest) -> GenerateInput:
    """A GenerateRequest as the transport-neutral request (unset optional fields: None, the server's default)."""
    s = req.sampling
    get = lambda name, default: getattr(s, name) if s.HasField(name) else default  # noqa: E731
    sp = SamplingParams(temperature=get("temperature", 1.0), top_p=get("top_p", 1.0), top_k=get("top_k", 0),
                        min_p=get("min_p", 0.0), presence_penalty=get("presence_penalty", 0.0),
                        frequency_penalty=get("frequency_penalty", 0.0),
                        repetition_penalty=get("repetition_penalty", 1.0), seed=get("seed", None),
                        logit_bias=dict(s.logit_bias) or None)
    kind = req.WhichOneof("input")
    return GenerateInput(
        prompt=req.prompt if kind == "prompt" else None,
        messages=[chat_message(m) for m in req.chat.messages] if kind == "chat" else None,
        token_ids=list(req.token_ids.ids) if kind == "token_ids" else None,
        max_tokens=req.max_tokens, sampling=sp, logprobs=req.logprobs if req.HasField("logprobs") else None,
        stop=list(req.stop), ignore_eos=req.ignore_eos, defer=req.defer if req.HasField("defer") else None,
        skip_deferred=req.skip_deferred, profile=req.profile, constraint=constraint_spec(req.constraint),
        chat_template_kwargs=template_kwargs(req.chat_template_kwargs), tools=tools(req.tools) or None,
        tool_choice=ToolChoice("function", req.tool_choice.function) if req.tool_choice.HasField("function")
        else ToolChoice(req.tool_choice.mode or "auto"),
        parallel_tool_calls=req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True,
        cache_salt=req.cache_salt)


def chat_message(m: generate_pb2.ChatMessage) -> dict:
    out = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    for key, v in (("tool_call_id", m.tool_call_id), ("name", m.name), ("reasoning_content", m.reasoning)):
        if v:
            out[key] = v
    return out


def tools(given) -> list[dict]:
    """GenerateRequest.tools in OpenAI's form (tools.check_tools checks the rest)."""
    out = []
    for i, t in enumerate(given):
        try:
            params = json.loads(t.parameters) if t.parameters else {"type": "object", "properties": {}}
        except ValueError as e:
            raise BadRequest("tools", f"[{i}].parameters: not valid JSON: {e}") from None
        out.append({"type": "function", "function": {"name": t.name, "parameters": params,
                                                      **({"description": t.description} if t.description else {}),
                                                      **({"strict": True} if t.strict else {})}})
    return out


def constraint_spec(c: generate_pb2.Constraint) -> ConstraintSpec | None:
    kind = c.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return ConstraintSpec.choice(list(c.choice.options))
    return ConstraintSpec(kind, "" if kind == "json_object" else getattr(c, kind))


# the transport-neutral request's field names as GenerateRequest / ScoreRequest spell them
PROTO_FIELDS = {"messages": "chat.messages", "messages.role": "chat.messages.role", "token_ids": "token_ids.ids"}


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    """Serves once attach() gave it an engine; until then new requests get UNAVAILABLE at once. While the
    expert service is down they are taken and held, as the running ones are, for up to expert_wait
    seconds (0: refused at once)."""

    def __init__(self, cfg, info: generate_pb2.ServerInfo, default_defer: int, max_tokens_limit: int,
                 expert_wait: float = 0.0, reasoning_parser: str = "auto", tool_parser: str = "auto"):
        self.reasoning_parser, self.tool_parser = reasoning_parser, tool_parser
        self.engine: Engine | None = None
        self.admission: Admission | None = None
        self.cfg, self.info, self.default_defer = cfg, info, default_defer
        self.max_tokens_limit, self.expert_wait = max_tokens_limit, expert_wait
        self.experts_up: Callable[[], bool] = lambda: False
        self.draining = False
        self.tenant_of: Callable[[str], str | None] = lambda token: ""  # the server's (ServerSecurity.tenant_of)
        self.prefix_scope = "tenant"

    def attach(self, engine: Engine, experts_up: Callable[[], bool]) -> None:
        """Serve on `engine`; experts_up(): whether the expert service(s) can serve now (ExpertHealth.up)."""
        text = engine.text
        answers = AnswerFormat(text.chat_template, text.tok.get_vocab(), text.added_tokens(), self.reasoning_parser,
                               self.tool_parser)
        self.admission = Admission(self.cfg.vocab_size, self.cfg.top_k, text, engine.max_context,
                                   self.max_tokens_limit, self.default_defer, tuple(self.cfg.eos_token_ids),
                                   answers=answers, prefix_scope=self.prefix_scope)
        self.engine, self.experts_up = engine, experts_up

    def _experts_down(self) -> str:
        return f"expert service at {self.info.expert_service} is unavailable"

    def unavailable(self) -> str | None:
        """Why new requests are refused right now (gRPC UNAVAILABLE, HTTP 503), or None."""
        if self.draining:
            return "the service is shutting down"
        if self.engine is None:
            return "GPU service is still loading the model"
        if not self.expert_wait and not self.experts_up():
            return self._experts_down()
        return None

    def health_problem(self) -> str | None:
        """Why this service reports itself unhealthy (HTTP /health 503), or None: also while requests are held
        for the expert service, so a load balancer sends new ones elsewhere."""
        why = self.unavailable()
        if why is None and not self.experts_up():
            why = f"{self._experts_down()}; requests wait up to {self.expert_wait:g}s for it (--expert-wait)"
        if why is None and self.engine.holding:
            why = self.engine.holding
        return why

    async def _check_ready(self, context, rpc: str) -> None:
        why = self.unavailable()
        if why:
            await self._abort(context, rpc, grpc.StatusCode.UNAVAILABLE, why)

    async def _abort(self, context, rpc: str, code: grpc.StatusCode, msg: str):
        metrics.REQUESTS.labels(rpc, code.name).inc()
        await context.abort(code, msg)

    @staticmethod
    def _deadline(context) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None else time.perf_counter() + remaining

    async def submit(self, inp: GenerateInput, deadline: float | None = None) -> tuple[Request, asyncio.Queue]:
        """Check inp (BadRequest names what is wrong) and hand it to the engine: -> the engine's request
        (set .cancelled to drop it) and the queue its Chunk / Failure events arrive on. The one way in
        for gRPC's Generate and the HTTP API alike. Tokenizing and rendering the chat template run on a
        worker thread: a huge prompt must not stall the event loop, and with it every other stream."""
        q, emit = self._emitter()
        r = await asyncio.to_thread(self.admission.generate, inp, emit)
        r.deadline = deadline
        self.engine.submit(r)
        return r, q

    def _tenant(self, context) -> str:
        """The tenant whose token the call carries (the interceptor let only known ones through)."""
        md = dict(context.invocation_metadata() or ())
        return self.tenant_of(security.presented_token(md.get("authorization"), md.get("x-api-key"))) or ""

    def _emitter(self):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        return q, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev)

    # -- RPCs -------------------------------------------------------------------------------------
    async def Generate(self, request, context):
        await self._check_ready(context, "Generate")
        deadline = self._deadline(context)
        try:
            n = request.n if request.HasField("n") else 1
            if not 1 <= n <= MAX_N:
                raise BadRequest("n", f"must be in [1, {MAX_N}], got {n}")
            inp = generate_input(request)
            inp.tenant = self._tenant(context)
            r, q = await self.submit(inp, deadline)
        except BadRequest as e:
            await self._abort(context, "Generate", grpc.StatusCode.INVALID_ARGUMENT, e.named(PROTO_FIELDS))
        choices = Choices(lambda x: self.submit(x, deadline), inp, n)
        choices.start(r, q)
        code = "CANCELLED"
        try:
            while choices.running:
                i, ev = await choices.events.get()
                if isinstance(ev, Failure):
                    code = None
                    await self._abort(context, "Generate", grpc.StatusCode[ev.status.name], ev.message)
                chunk = generate_pb2.GenerateChunk(
                    index=i, text=ev.text, token_ids=ev.token_ids, finish_reason=FINISH.get(ev.finish_reason, 0),
                    usage=generate_pb2.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                                             cached_tokens=ev.cached_tokens),
                    time_to_first_token_s=ev.ttft_s, elapsed_s=ev.elapsed_s, reasoning=ev.reasoning,
                    tool_calls=[generate_pb2.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "",
                                                           arguments=d.arguments) for d in ev.tool_calls])
                for tok, lp, top in ev.logprobs or ():
                    chunk.logprobs.add(token_id=tok, logprob=lp,
                                       top=[generate_pb2.TopLogprob(token_id=i, logprob=v) for i, v in top])
                if ev.spans:
                    chunk.profile.spans.extend(
                        generate_pb2.Span(name=n, service=svc, layer=layer, step=step, start_unix_ns=t0, end_unix_ns=t1)
                        for n, svc, layer, step, t0, t1 in ev.spans)
                yield chunk
                if ev.finish_reason:
                    choices.running -= 1
            code = "OK"
        finally:
            choices.cancel()  # client went away or we are done: the engine drops them
            if code:
                metrics.REQUESTS.labels("Generate", code).inc()

    async def Score(self, request, context):
        await self._check_ready(context, "Score")
        inp = ScoreInput(list(request.token_ids.ids), request.logprobs_only,
                         request.defer if request.HasField("defer") else 0, request.skip_deferred,
                         request.cache_salt, self._tenant(context))
        q, emit = self._emitter()
        try:
            r = self.admission.score(inp, emit)
        except BadRequest as e:
            await self._abort(context, "Score", grpc.StatusCode.INVALID_ARGUMENT, e.named(PROTO_FIELDS))
        nbytes = len(inp.token_ids) * self.cfg.vocab_size * 4
        if not inp.logprobs_only and nbytes + (1 << 20) > GRPC_MAX_MESSAGE:
            await self._abort(context, "Score", grpc.StatusCode.INVALID_ARGUMENT,
                              f"token_ids.ids: the logits of {len(inp.token_ids)} positions x {self.cfg.vocab_size} "
                              f"ids are {nbytes / 2**30:.1f} GiB, over gRPC's 2 GiB message limit; set logprobs_only")
        r.deadline = self._deadline(context)
        self.engine.submit(r)
        try:
            ev = await q.get()
        finally:
            r.cancelled = True
        if isinstance(ev, Failure):
            await self._abort(context, "Score", grpc.StatusCode[ev.status.name], ev.message)
        metrics.REQUESTS.labels("Score", "OK").inc()
        if ev.logits is None:
            return generate_pb2.ScoreResponse(token_logprobs=ev.token_logprobs.tolist(),
                                              argmax_ids=ev.argmax_ids.tolist())
        return generate_pb2.ScoreResponse(logits=codec.encode(ev.logits.to(torch.float32)))

    async def Tokenize(self, request, context):
        if self.admission is None:
            await self._abort(context, "Tokenize", grpc.StatusCode.UNAVAILABLE, "starting: the model is not loaded yet")
        kind = request.WhichOneof("input")
        try:
            inp = TokenizeInput(
                prompt=request.prompt if kind == "prompt" else None,
                messages=[chat_message(m) for m in request.chat.messages] if kind == "chat" else None,
                add_special_tokens=request.add_special_tokens if request.HasField("add_special_tokens") else None,
                add_generation_prompt=not request.HasField("add_generation_prompt") or request.add_generation_prompt,
                chat_template_kwargs=template_kwargs(request.chat_template_kwargs), tools=tools(request.tools) or None)
            ids = await asyncio.to_thread(self.admission.tokenize, inp)  # (a long prompt: off the event loop)
        except BadRequest as e:
            await self._abort(context, "Tokenize", grpc.StatusCode.INVALID_ARGUMENT, e.named(PROTO_FIELDS))
        metrics.REQUESTS.labels("Tokenize", "OK").inc()
        return generate_pb2.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.info.max_context)

    async def Detokenize(self, request, context):
        if self.admission is None:
            await self._abort(context, "Detokenize", grpc.StatusCode.UNAVAILABLE,
                              "starting: the model is not loaded yet")
        try:
            text = self.admission.detokenize(list(request.tokens))
        except BadRequest as e:
            await self._abort(context, "Detokenize", grpc.StatusCode.INVALID_ARGUMENT,
                              e.named({**PROTO_FIELDS, "token_ids": "tokens"}))
        metrics.REQUESTS.labels("Detokenize", "OK").inc()
        return generate_pb2.DetokenizeResponse(prompt=text)

    async def Info(self, request, context):
        info = generate_pb2.ServerInfo()
        info.CopyFrom(self.info)
        info.expert_service_ready = self.experts_up()
        info.running_requests = len(self.engine.running) if self.engine else 0
        return info
