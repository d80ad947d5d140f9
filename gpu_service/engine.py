"""The engine: one thread that owns the model, the KV caches and the expert exchange, and runs
steps over all active requests (continuous batching: new prompts are prefilled in the same step
as the running sequences decode). Each step carries at most `step_tokens` tokens: every running
decode's one token first, then prompts in arrival order, cut into chunks of what is left (vLLM's
chunked prefill), so a long prompt neither overflows the expert service's per-request limit nor
stalls the running streams by more than one chunk. Talks to the gRPC layer only through Request.emit."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Callable

import grpc
import torch

from moe_core import serving

from . import metrics
from .dispatch import ExpertServiceError
from .model import Model, Segment
from .sampling import SamplingParams, sample, token_logprobs
from .text import DetokenizeStream, TextCodec

log = logging.getLogger("gpu_service.engine")
TRIM_AFTER = 1024  # tokens of context: a request this long returns freed memory to the OS when it ends


@dataclasses.dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None | "length" | "stop" | "eos"
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    elapsed_s: float
    spans: list | None = None  # the request's profile, on the last chunk when asked for
    logprobs: list | None = None  # per token: (id, logprob, [(id, logprob) of the top ones]), when asked for


@dataclasses.dataclass
class Failure:
    code: grpc.StatusCode
    message: str


@dataclasses.dataclass
class Scores:
    logits: torch.Tensor | None             # [T, V] fp32, or (logprobs_only) None
    token_logprobs: torch.Tensor | None = None  # [T - 1]: log p(next id)
    argmax_ids: torch.Tensor | None = None      # [T]


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    emit: Callable[[object], None]  # thread-safe: called from the engine thread
    max_tokens: int = 16
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    stop: list[str] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    defer: int = 0
    skip: bool = False  # drop the deferred experts instead (accuracy baseline)
    score_only: bool = False
    logprobs_only: bool = False  # score_only: per-position logprobs instead of the logits
    profile: bool = False
    logprobs: int | None = None  # set: each token's logprob and this many top alternatives
    deadline: float | None = None  # time.perf_counter() value after which the client has gone
    cancelled: bool = False
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # engine state
    cache: object = None
    output: list[int] = dataclasses.field(default_factory=list)
    detok: DetokenizeStream | None = None
    gen: torch.Generator | None = None
    score_parts: list = dataclasses.field(default_factory=list)  # score_only: the chunks' results so far
    first_token_at: float | None = None
    last_token_at: float | None = None
    spans: list = dataclasses.field(default_factory=list)


class Engine:
    def __init__(self, model: Model, experts, text: TextCodec, max_batch: int, max_context: int,
                 step_tokens: int = 0):
        self.model, self.experts, self.text = model, experts, text
        self.max_batch, self.max_context = max_batch, max_context
        # most tokens one step may carry (0 = no limit): prompts go in chunks of what decodes leave
        self.step_tokens = step_tokens
        self.eos = set(model.cfg.eos_token_ids)
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.running: list[Request] = []
        self.steps = itertools.count()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)

    def submit(self, req: Request) -> None:
        self.inbox.put(req)

    # -- the loop ---------------------------------------------------------------------------------
    def _admit(self) -> list[Request]:
        new = []
        if not self.running:
            try:
                new.append(self.inbox.get(timeout=0.2))
            except queue.Empty:
                return new
        while len(self.running) + len(new) < self.max_batch:
            try:
                new.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for r in new:
            r.cache = self.model.new_cache()
            r.detok = DetokenizeStream(self.text, r.prompt_ids, r.stop)
            r.gen = r.sampling.generator()
        return new

    def _expired(self, r: Request, now: float) -> bool:
        if r.deadline is not None and now > r.deadline and not r.cancelled:
            r.cancelled = True
            r.emit(Failure(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
        return r.cancelled

    def _loop(self) -> None:
        while not self._stop.is_set():
            new = self._admit()
            now = time.perf_counter()
            self.running = [r for r in self.running if not self._expired(r, now)]
            new = [r for r in new if not self._expired(r, now)]
            metrics.RUNNING.set(len(self.running) + len(new))
            metrics.WAITING.set(self.inbox.qsize())
            if not self.running and not new:
                continue
            batch = self.running + new
            plan = self._plan(batch)
            # one forward per distinct deferral setting: a request's result never depends on its neighbours
            for defer, skip in sorted({(r.defer, r.skip) for r, _ in plan}):
                self._step_or_fail([(r, n) for r, n in plan if (r.defer, r.skip) == (defer, skip)], defer, skip)
            self.running = [r for r in batch if r.cache is not None and not r.cancelled]
            alive = {id(r) for r in self.running}
            if any(len(r.prompt_ids) + len(r.output) >= TRIM_AFTER for r in batch if id(r) not in alive):
                serving.trim_heap()  # a long context just ended: its KV cache and activations go back
        metrics.RUNNING.set(0)

    def _plan(self, batch: list[Request]) -> list[tuple[Request, int]]:
        """This step's tokens of each request: every decode's one, then prompt chunks in arrival order
        within what is left of the step's budget (a prompt that gets nothing waits for the next step)."""
        budget = self.step_tokens or float("inf")
        plan = []
        for r in batch:
            if r.cache.length >= len(r.prompt_ids):  # decoding
                plan.append((r, 1))
                budget -= 1
        for r in batch:
            rest = len(r.prompt_ids) - r.cache.length
            if rest > 0 and budget > 0:
                n = int(min(rest, budget))
                plan.append((r, n))
                budget -= n
        return plan

    def _step_or_fail(self, group: list[tuple[Request, int]], defer: int, skip: bool) -> None:
        # A stream broken while idle (the expert service restarted between steps) fails on first use:
        # retry the step once on a fresh stream. Safe: a step writes its KV entries at fixed positions
        # and commits nothing else before its forward pass completes.
        for attempt in (0, 1):
            try:
                return self._step(group, defer, skip)
            except ExpertServiceError as e:
                if attempt == 0 and e.code == grpc.StatusCode.UNAVAILABLE and e.retry:
                    log.info("expert exchange failed (%s); retrying the step on a new stream", e)
                    continue
                log.warning("step failed: %s", e)
                return self._fail([r for r, _ in group], e.code, str(e))
            except Exception as e:  # a bug, or one request's inputs: keep it to the request it belongs to
                self.experts.reset()
                if len(group) > 1:
                    log.exception("a step of %d requests failed; running them one by one", len(group))
                    for r, n in group:
                        if not r.cancelled:
                            self._step_or_fail([(r, n)], defer, skip)
                    return
                log.exception("step failed")
                return self._fail([r for r, _ in group], grpc.StatusCode.INTERNAL, f"internal error: {e}")

    def _fail(self, reqs: list[Request], code, msg: str) -> None:
        for r in reqs:
            r.cache = None
            r.emit(Failure(code, msg))

    def _step(self, plan: list[tuple[Request, int]], defer: int, skip: bool) -> None:
        segs, reqs = [], [r for r, _ in plan]
        for r, n in plan:
            s0, P = r.cache.length, len(r.prompt_ids)
            if s0 < P:  # a prompt chunk
                toks = torch.tensor(r.prompt_ids[s0:s0 + n], dtype=torch.long)
                metrics.PROMPT_TOKENS.inc(n)
            else:
                toks = torch.tensor([r.output[-1]], dtype=torch.long)
            targets = torch.tensor(r.prompt_ids[s0 + 1:s0 + n + 1], dtype=torch.long) if r.logprobs_only else None
            segs.append(Segment(r.cache, toks, s0, all_logits=r.score_only and not r.logprobs_only,
                                logprobs=r.logprobs_only, targets=targets))
        step = next(self.steps)
        spans: list = []
        t0 = time.perf_counter()
        logits = self.model.forward(segs, self.experts, step=step, defer=defer, spans=spans, skip=skip,
                                    exact_spans=any(r.profile for r in reqs))
        spans += expert_spans(self.experts, step)
        row = 0
        now = time.perf_counter()
        t_sample = time.time_ns()
        for r, s in zip(reqs, segs):
            n = 0 if r.logprobs_only else s.tokens.shape[0] if r.score_only else 1
            prefilled = r.cache.length >= len(r.prompt_ids)  # this step finished (or was past) the prompt
            try:
                if r.score_only:
                    r.score_parts.append(s.scored if r.logprobs_only else logits[row:row + n].cpu())
                    if prefilled:
                        if r.logprobs_only:
                            r.emit(Scores(None, *(torch.cat(p) for p in zip(*r.score_parts))))
                        else:
                            r.emit(Scores(torch.cat(r.score_parts)))
                        r.cache = None
                elif prefilled:
                    self._advance(r, logits[row], now, spans, t_sample)
                elif r.profile:
                    r.spans += spans
            except Exception as e:  # sampling or detokenizing this request: the others go on
                log.exception("request failed after the forward pass")
                self._fail([r], grpc.StatusCode.INTERNAL, f"internal error: {e}")
            row += n
        record_step_metrics(spans, time.perf_counter() - t0)

    def _advance(self, r: Request, logits: torch.Tensor, now: float, spans: list, t_sample: int) -> None:
        tok = sample(logits, r.sampling, r.gen, r.prompt_ids, r.output)
        lps = None if r.logprobs is None else [token_logprobs(logits, tok, r.logprobs)]
        r.output.append(tok)
        if r.first_token_at is None:
            r.first_token_at = now
            metrics.TTFT.observe(now - r.arrival)
        else:
            metrics.ITL.observe(now - r.last_token_at)
        r.last_token_at = now
        metrics.GENERATED_TOKENS.inc()
        finish = None
        if tok in self.eos and not r.ignore_eos:
            text, finish = "", "eos"
        else:
            text = r.detok.push(tok)
            if r.detok.stopped:
                finish = "stop"
        if finish is None and (len(r.output) >= r.max_tokens or len(r.prompt_ids) + len(r.output) >= self.max_context):
            finish = "length"
        if finish in ("length", "eos"):
            text += r.detok.flush()
        if r.profile:
            r.spans += spans
            r.spans.append(("sampling", "gpu", -1, spans[0][3] if spans else 0, t_sample, time.time_ns()))
        r.emit(Chunk(text, [tok], finish, len(r.prompt_ids), len(r.output), r.first_token_at - r.arrival,
                     now - r.arrival, r.spans if (finish and r.profile) else None, lps))
        if finish is not None:
            r.cache = None  # frees the KV cache


def expert_spans(experts, step: int) -> list:
    """The expert services' compute spans of this step, as they reported them (sharded: one lane per
    shard, "expert-I")."""
    out = []
    for layer, deferred, timing, *shard in getattr(experts, "drain_timings", lambda: [])():
        out.append(("experts_deferred" if deferred else "experts_immediate", f"expert-{shard[0]}" if shard else "expert",
                    layer, step, timing.start_unix_ns, timing.end_unix_ns))
    for layer, shard, t0, t1 in getattr(experts, "drain_waits", lambda: [])():  # sharded: the GPU side's wait on each
        out.append(("shard_wait", f"expert-{shard}", layer, step, t0, t1))
    return out


def record_step_metrics(spans: list, step_s: float) -> None:
    metrics.STEP.observe(step_s)
    blocked = 0.0
    submitted = {}
    compute = {}
    for name, service, layer, _, t0, t1 in spans:
        if name == "router":
            submitted[layer] = t1
        elif name == "expert_wait":
            blocked += (t1 - t0) / 1e9
            metrics.EXPERT_WAIT.labels(str(layer)).observe((t1 - t0) / 1e9)
            if layer in submitted:
                compute.setdefault(("rtt", layer), (t1 - submitted[layer]) / 1e9)
        elif service.startswith("expert") and name != "shard_wait":
            metrics.EXPERT_COMPUTE.labels(name.removeprefix("experts_"), service).observe((t1 - t0) / 1e9)
            compute[(name, layer)] = max(compute.get((name, layer), 0.0), (t1 - t0) / 1e9)  # shards: the slowest
    for (kind, layer), rtt in list(compute.items()):
        if kind == "rtt" and ("experts_immediate", layer) in compute:
            metrics.EXCHANGE.observe(max(0.0, rtt - compute[("experts_immediate", layer)]))
    metrics.EXPERT_BLOCKED.inc(blocked)
    metrics.GPU_BUSY.inc(max(0.0, step_s - blocked))
