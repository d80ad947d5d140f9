"""gRPC GenerateService: validate requests at the edge, hand them to the engine, stream chunks."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import grpc
import torch

from moe_core import codec
from moe_core.serving import GRPC_MAX_MESSAGE
from protos import generate_pb2, generate_pb2_grpc

from . import metrics
from .engine import Engine, Failure, Request
from .sampling import MAX_LOGPROBS, SamplingParams
from .text import PromptTooLong, TextCodec

log = logging.getLogger("gpu_service")

FINISH = {"length": generate_pb2.LENGTH, "stop": generate_pb2.STOP, "eos": generate_pb2.EOS}
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # a stop string is matched against every text delta: keep it short
ROLES = {"system", "user", "assistant", "tool"}


class BadRequest(ValueError):
    """A request the engine cannot take; the message starts with the field's name. code: a machine-readable
    reason where one exists (OpenAI's "context_length_exceeded")."""

    def __init__(self, msg: str, code: str | None = None):
        super().__init__(msg)
        self.code = code


def prompt_bytes_limit(max_context: int, text: TextCodec) -> int:
    """The most bytes of text a prompt that fits the context can have (every token stands for at most
    text.max_token_chars of them): the bound for request sizes, above which nothing can be legitimate."""
    return max_context * text.max_token_chars


def sampling_params(s: generate_pb2.SamplingParams) -> SamplingParams:
    """The request's sampling settings, checked (BadRequest names the bad one); unset fields: off."""
    get = lambda name, default: getattr(s, name) if s.HasField(name) else default  # noqa: E731
    sp = SamplingParams(temperature=get("temperature", 1.0), top_p=get("top_p", 1.0), top_k=get("top_k", 0),
                        min_p=get("min_p", 0.0), presence_penalty=get("presence_penalty", 0.0),
                        frequency_penalty=get("frequency_penalty", 0.0),
                        repetition_penalty=get("repetition_penalty", 1.0), seed=get("seed", None))
    if not 0 <= sp.temperature < float("inf"):  # below SAMPLING_EPS: greedy (sampling.py)
        raise BadRequest(f"sampling.temperature: must be a finite number >= 0, got {sp.temperature}")
    if not 0 < sp.top_p <= 1:
        raise BadRequest(f"sampling.top_p: must be in (0, 1], got {sp.top_p}")
    if sp.top_k < 0:
        raise BadRequest(f"sampling.top_k: must be >= 0, got {sp.top_k}")
    if not 0 <= sp.min_p <= 1:
        raise BadRequest(f"sampling.min_p: must be in [0, 1], got {sp.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(sp, name) <= 2:
            raise BadRequest(f"sampling.{name}: must be in [-2, 2], got {getattr(sp, name)}")
    if not 0 < sp.repetition_penalty < float("inf"):
        raise BadRequest(f"sampling.repetition_penalty: must be a finite number > 0, got {sp.repetition_penalty}")
    return sp


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    """Serves once attach() gave it an engine; until then new requests get UNAVAILABLE at once. While the
    expert service is down they are taken and held, as the running ones are, for up to expert_wait
    seconds (0: refused at once)."""

    def __init__(self, cfg, info: generate_pb2.ServerInfo, default_defer: int, max_tokens_limit: int,
                 expert_wait: float = 0.0):
        self.engine: Engine | None = None
        self.cfg, self.info, self.default_defer = cfg, info, default_defer
        self.max_tokens_limit, self.expert_wait = max_tokens_limit, expert_wait
        self.experts_up: Callable[[], bool] = lambda: False
        self.draining = False

    def attach(self, engine: Engine, experts_up: Callable[[], bool]) -> None:
        """Serve on `engine`; experts_up(): whether the expert service(s) can serve now (ExpertHealth.up)."""
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

    # -- validation -------------------------------------------------------------------------------
    def _prompt_ids(self, req) -> list[int]:
        try:
            ids = self._tokenize(req)
        except PromptTooLong as e:
            raise BadRequest(f"input: prompt has at least {e.at_least} tokens; the context limit is "
                             f"{self.engine.max_context}", "context_length_exceeded") from None
        if not ids:
            raise BadRequest("input: the prompt tokenizes to zero tokens")
        if len(ids) >= self.engine.max_context:
            raise BadRequest(f"input: prompt has {len(ids)} tokens; the context limit is {self.engine.max_context}",
                             "context_length_exceeded")
        return ids

    def _tokenize(self, req) -> list[int]:
        kind = req.WhichOneof("input")
        limit = self.engine.max_context - 1  # room for one generated token
        if kind == "prompt":
            if not req.prompt:
                raise BadRequest("prompt: must not be empty")
            return self.engine.text.encode(req.prompt, limit)
        if kind == "chat":
            msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
            if not msgs:
                raise BadRequest("chat.messages: must not be empty")
            bad = [m["role"] for m in msgs if m["role"] not in ROLES]
            if bad:
                raise BadRequest(f"chat.messages.role: unknown role {bad[0]!r} (expected one of {sorted(ROLES)})")
            try:
                return self.engine.text.render_chat(msgs, limit)
            except PromptTooLong:
                raise
            except ValueError as e:
                raise BadRequest(str(e)) from None
        if kind == "token_ids":
            ids = list(req.token_ids.ids)
            V = self.cfg.vocab_size
            if any(not 0 <= i < V for i in ids):
                raise BadRequest(f"token_ids.ids: every id must be in [0, {V})")
            return ids
        raise BadRequest("input: one of prompt, chat or token_ids is required")

    def _request(self, req: generate_pb2.GenerateRequest, emit) -> Request:
        ids = self._prompt_ids(req)
        if req.max_tokens <= 0:
            raise BadRequest("max_tokens: must be > 0")
        if req.max_tokens > self.max_tokens_limit:
            raise BadRequest(f"max_tokens: {req.max_tokens} exceeds the limit {self.max_tokens_limit}")
        sp = sampling_params(req.sampling)
        if req.HasField("logprobs") and req.logprobs > MAX_LOGPROBS:
            raise BadRequest(f"logprobs: at most {MAX_LOGPROBS} alternatives per token, got {req.logprobs}")
        stop = list(req.stop)
        if len(stop) > MAX_STOP or any(not 0 < len(x) <= MAX_STOP_CHARS for x in stop):
            raise BadRequest(f"stop: at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")
        defer = req.defer if req.HasField("defer") else self.default_defer
        if defer > self.cfg.top_k - 1:
            raise BadRequest(f"defer: must be <= top_k - 1 = {self.cfg.top_k - 1}, got {defer}")
        return Request(prompt_ids=ids, emit=emit, max_tokens=req.max_tokens, sampling=sp, stop=stop,
                       ignore_eos=req.ignore_eos, defer=defer, skip=req.skip_deferred, profile=req.profile,
                       logprobs=req.logprobs if req.HasField("logprobs") else None)

    async def submit(self, req: generate_pb2.GenerateRequest, deadline: float | None = None
                     ) -> tuple[Request, asyncio.Queue]:
        """Check req (BadRequest names what is wrong) and hand it to the engine: -> the engine's request
        (set .cancelled to drop it) and the queue its Chunk / Failure events arrive on. The one way in
        for gRPC's Generate and the HTTP API alike. Tokenizing and rendering the chat template run on a
        worker thread: a huge prompt must not stall the event loop, and with it every other stream."""
        q, emit = self._emitter()
        r = await asyncio.to_thread(self._request, req, emit)
        r.deadline = deadline
        self.engine.submit(r)
        return r, q

    def _emitter(self):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        return q, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev)

    # -- RPCs -------------------------------------------------------------------------------------
    async def Generate(self, request, context):
        await self._check_ready(context, "Generate")
        try:
            r, q = await self.submit(request, self._deadline(context))
        except BadRequest as e:
            await self._abort(context, "Generate", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        code = "CANCELLED"
        try:
            while True:
                ev = await q.get()
                if isinstance(ev, Failure):
                    code = None
                    await self._abort(context, "Generate", ev.code, ev.message)
                chunk = generate_pb2.GenerateChunk(
                    text=ev.text, token_ids=ev.token_ids, finish_reason=FINISH.get(ev.finish_reason, 0),
                    usage=generate_pb2.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens),
                    time_to_first_token_s=ev.ttft_s, elapsed_s=ev.elapsed_s)
                for tok, lp, top in ev.logprobs or ():
                    chunk.logprobs.add(token_id=tok, logprob=lp,
                                       top=[generate_pb2.TopLogprob(token_id=i, logprob=v) for i, v in top])
                if ev.spans:
                    chunk.profile.spans.extend(
                        generate_pb2.Span(name=n, service=svc, layer=layer, step=step, start_unix_ns=t0, end_unix_ns=t1)
                        for n, svc, layer, step, t0, t1 in ev.spans)
                yield chunk
                if ev.finish_reason:
                    code = "OK"
                    return
        finally:
            r.cancelled = True  # client went away or we are done: the engine drops it
            if code:
                metrics.REQUESTS.labels("Generate", code).inc()

    async def Score(self, request, context):
        await self._check_ready(context, "Score")
        ids = list(request.token_ids.ids)
        V = self.cfg.vocab_size
        if not ids or any(not 0 <= i < V for i in ids):
            await self._abort(context, "Score", grpc.StatusCode.INVALID_ARGUMENT, f"token_ids.ids: 1+ ids in [0, {V}) required")
        if len(ids) > self.engine.max_context:
            await self._abort(context, "Score", grpc.StatusCode.INVALID_ARGUMENT,
                              f"token_ids.ids: {len(ids)} tokens exceed the context limit {self.engine.max_context}")
        defer = request.defer if request.HasField("defer") else 0
        if defer > self.cfg.top_k - 1:
            await self._abort(context, "Score", grpc.StatusCode.INVALID_ARGUMENT,
                              f"defer: must be <= top_k - 1 = {self.cfg.top_k - 1}, got {defer}")
        nbytes = len(ids) * self.cfg.vocab_size * 4
        if not request.logprobs_only and nbytes + (1 << 20) > GRPC_MAX_MESSAGE:
            await self._abort(context, "Score", grpc.StatusCode.INVALID_ARGUMENT,
                              f"token_ids.ids: the logits of {len(ids)} positions x {self.cfg.vocab_size} ids are "
                              f"{nbytes / 2**30:.1f} GiB, over gRPC's 2 GiB message limit; set logprobs_only")
        q, emit = self._emitter()
        r = Request(prompt_ids=ids, emit=emit, score_only=True, logprobs_only=request.logprobs_only, defer=defer,
                    skip=request.skip_deferred, deadline=self._deadline(context))
        self.engine.submit(r)
        try:
            ev = await q.get()
        finally:
            r.cancelled = True
        if isinstance(ev, Failure):
            await self._abort(context, "Score", ev.code, ev.message)
        metrics.REQUESTS.labels("Score", "OK").inc()
        if ev.logits is None:
            return generate_pb2.ScoreResponse(token_logprobs=ev.token_logprobs.tolist(),
                                              argmax_ids=ev.argmax_ids.tolist())
        return generate_pb2.ScoreResponse(logits=codec.encode(ev.logits.to(torch.float32)))

    async def Info(self, request, context):
        info = generate_pb2.ServerInfo()
        info.CopyFrom(self.info)
        info.expert_service_ready = self.experts_up()
        info.running_requests = len(self.engine.running) if self.engine else 0
        return info
