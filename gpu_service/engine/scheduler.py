"""The engine: one thread that owns the model, the KV caches and the expert exchange, and runs
steps over all active requests (continuous batching: new prompts are prefilled in the same step
as the running sequences decode). Each step carries at most `step_tokens` tokens: every running
decode's one token first, then prompts in arrival order, cut into chunks of what is left (vLLM's
chunked prefill), so a long prompt neither overflows the expert service's per-request limit nor
stalls the running streams by more than one chunk. Talks to the gRPC layer only through Request.emit.

KV memory comes from one pool of blocks (kv_pool.py), reserved before each step for the tokens it carries. When
the pool has no room, a prompt chunk shrinks to what fits; otherwise the most recently arrived request is set
aside (preempted, vLLM's recompute policy): its blocks go back, full ones stay cached, and it waits at the head of
the queue to resume, recomputing only what the prefix cache no longer holds. Requests are never failed for room."""
from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Callable

import numpy as np
import torch

from moe_core import serving
from moe_core.errors import Status

from gpu_service import metrics
from gpu_service.api.answer import AnswerParser
from gpu_service.api.constraints import mask_rows
from moe_exchange.dispatch import ExpertServiceError
from moe_exchange.protocol import Experts, Span
from gpu_service.model import native_loop
from gpu_service.engine import block_names, prefix_cache
from gpu_service.engine.kv_pool import BLOCK, KVPool, SeqCache
from gpu_service.model.model import Model, Segment
from gpu_service.engine.sampling import SamplingParams, sample, token_logprobs
from gpu_service.api.text import DetokenizeStream, TextCodec

log = logging.getLogger("gpu_service.engine.scheduler")
TRIM_AFTER = 1024  # tokens of context: a request this long returns freed memory to the OS when it ends
# Steps' metrics are recorded a batch at a time: at least this often, when a request ends and when the engine goes
# idle. Between the layers' weight streams every numpy call runs from cold caches: a step's take ~0.3 ms alone.
METRICS_EVERY_S = 0.25


@dataclasses.dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # None | "length" | "stop" | "eos" | "tool_calls" (stop or eos after a call)
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    elapsed_s: float
    spans: list[Span] | None = None  # the request's profile, on the last chunk when asked for
    logprobs: list | None = None  # per token: (id, logprob, [(id, logprob) of the top ones]), when asked for
    reasoning: str = ""  # the thinking's delta, apart from text, when the request separates them
    tool_calls: list = dataclasses.field(default_factory=list)  # tools.ToolCallDelta: the calls' new pieces
    cached_tokens: int = 0  # prompt tokens the prefix cache had (not computed)
    stop_sequence: str | None = None  # finish "stop": the stop string that ended it (None: the constraint's end)


@dataclasses.dataclass
class Failure:
    status: Status
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
    skip_deferred: bool = False  # drop the deferred experts instead (accuracy baseline)
    score_only: bool = False
    logprobs_only: bool = False  # score_only: per-position logprobs instead of the logits
    profile: bool = False
    logprobs: int | None = None  # set: each token's logprob and this many top alternatives
    constraint: object = None  # constraints.Matcher: structured output (the sampler sees only what it allows)
    parser: AnswerParser | None = None  # set: reasoning and tool calls come apart from the text (chat)
    constrain_reasoning: bool = False  # the constraint covers the reasoning too (harmony's forced call)
    deadline: float | None = None  # time.perf_counter() value after which the client has gone
    cancelled: bool = False
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    # engine state
    cache: object = None
    cached_tokens: int = 0  # of the prompt, from the prefix cache
    output: list[int] = dataclasses.field(default_factory=list)
    detok: DetokenizeStream | None = None
    gen: torch.Generator | None = None
    score_parts: list = dataclasses.field(default_factory=list)  # score_only: the chunks' results so far
    first_token_at: float | None = None
    last_token_at: float | None = None
    spans: list[Span] = dataclasses.field(default_factory=list)
    cache_scope: tuple = ()  # (tenant, cache_salt): its prefix-cache namespace (Admission._cache_scope)


class Engine:
    def __init__(self, model: Model, experts: Experts, text: TextCodec, max_batch: int, max_context: int,
                 step_tokens: int = 0, expert_wait: float = 0.0, experts_ready: Callable[[], bool] = lambda: True,
                 experts_why: Callable[[], str | None] = lambda: None, kv_pool: KVPool | None = None,
                 namespace: str = ""):
        """experts_why: what the health watchers found wrong with a service that answers (ExpertHealth.why_down);
        kv_pool: the KV cache's blocks (default: the model's own, without prefix caching); namespace: what
        the prefix chain's root names besides each request's settings (prefix_cache.py)."""
        self.model, self.experts, self.text = model, experts, text
        self.pool = kv_pool or model.kv_pool()
        self.namespace = namespace
        self.max_batch, self.max_context = max_batch, max_context
        # most tokens one step may carry (0 = no limit): prompts go in chunks of what decodes leave
        self.step_tokens = step_tokens
        # an unreachable expert service: hold the steps this long (seconds), retrying once experts_ready()
        # (the health watchers' view: up, and serving the same model, shard, format and kernel path)
        self.expert_wait, self.experts_ready, self.experts_why = expert_wait, experts_ready, experts_why
        self.holding: str | None = None  # why steps are held now (for /health), or None
        self.eos = set(model.cfg.eos_token_ids)
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.running: list[Request] = []
        self.waiting: collections.deque[Request] = collections.deque()  # admitted once, set aside for room
        self.steps = itertools.count()
        self._stop = threading.Event()
        self._closed: str | None = None   # close(): new requests fail with this
        self._aborted: str | None = None  # abort(): every request fails with this at the next step
        self._unrecorded: list[tuple[list[Span], float, list | None]] = []  # steps whose metrics wait
        self._recorded_at = time.perf_counter()
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)

    def submit(self, req: Request) -> None:
        if self._closed:
            req.emit(Failure(Status.UNAVAILABLE, self._closed))
            return
        self.inbox.put(req)

    def close(self, reason: str) -> None:
        """Start nothing new: queued requests that have not started and later submits fail with `reason`
        (UNAVAILABLE); the running ones go on."""
        self._closed = reason

    def abort(self, reason: str) -> None:
        """End every request, running or held, with `reason` (UNAVAILABLE) at the next step boundary."""
        self._closed = self._closed or reason
        self._aborted = reason

    def busy(self) -> bool:
        return bool(self.running) or bool(self.waiting) or not self.inbox.empty()

    # -- the loop ---------------------------------------------------------------------------------
    def _admit(self) -> list[Request]:
        new = []
        if self._closed:
            self._fail_waiting(self._closed)
            if self._aborted:
                self._fail([r for r in self.running + list(self.waiting) if not r.cancelled], Status.UNAVAILABLE,
                           self._aborted)
                self.running = []
                self.waiting.clear()
            if not self.running and not self.waiting:
                self._stop.wait(0.05)
                return new
        elif not self.running and not self.waiting:
            try:
                new.append(self.inbox.get(timeout=0.2))
            except queue.Empty:
                return new
        while len(self.running) + len(new) < self.max_batch:
            if self.waiting:  # set aside for room: before anything new
                new.append(self.waiting.popleft())
                continue
            if self._closed:
                break
            try:
                new.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for r in new:
            self._open(r)
        return new

    def _open(self, r: Request) -> None:
        """r's cache: the longest cached prefix of what it must hold (its prompt, or after a preemption its prompt
        and answer so far); a first admission also sets up its detokenizer and sampler."""
        ids = context(r)
        root = block_names.root(self.namespace, prefix_key(r))
        r.cache = prefix_cache.lookup(self.pool, ids, root) if not r.score_only else SeqCache(self.pool, root)
        r.cache.keep_at = (len(ids) - 1) // BLOCK * BLOCK  # linear attention: a state kept there (prefix_cache.py)
        if r.detok is None:
            r.cached_tokens = r.cache.length
            r.detok = DetokenizeStream(self.text, r.prompt_ids, r.stop, r.parser.symbols if r.parser else None)
            r.gen = r.sampling.generator()

    def _expired(self, r: Request, now: float) -> bool:
        if r.deadline is not None and now > r.deadline and not r.cancelled:
            r.cancelled = True
            r.emit(Failure(Status.DEADLINE_EXCEEDED, "deadline exceeded"))
        return r.cancelled

    def _loop(self) -> None:
        while not self._stop.is_set():
            new = self._admit()
            now = time.perf_counter()
            for r in self.running + new:
                if self._expired(r, now):
                    self._free(r)
            self.running = [r for r in self.running if r.cache is not None]
            new = [r for r in new if r.cache is not None]
            metrics.RUNNING.set(len(self.running) + len(new))
            metrics.WAITING.set(self.inbox.qsize() + len(self.waiting))
            if not self.running and not new:
                self._record_metrics()
                continue
            batch = self.running + new
            self.running = batch  # counted as running from their first step on (Info reads it meanwhile)
            plan = self._reserve(self._plan(batch), batch)
            # one forward per distinct deferral setting: a request's result never depends on its neighbours
            for defer, skip in sorted({(r.defer, r.skip_deferred) for r, _ in plan}):
                self._step_or_fail([(r, n) for r, n in plan if (r.defer, r.skip_deferred) == (defer, skip)], defer, skip)
            for r in batch:
                if r.cancelled:
                    self._free(r)
            self.running = [r for r in batch if r.cache is not None]
            alive = {id(r) for r in self.running}
            if any(len(r.prompt_ids) + len(r.output) >= TRIM_AFTER for r in batch if id(r) not in alive):
                serving.trim_heap()  # a long context just ended: its activations go back (the KV pool keeps its pages)
        self._record_metrics()
        metrics.RUNNING.set(0)

    def _record_metrics(self) -> None:
        if self._unrecorded:
            steps, self._unrecorded = self._unrecorded, []
            record_step_metrics(steps)
        self._recorded_at = time.perf_counter()

    def _plan(self, batch: list[Request]) -> list[tuple[Request, int]]:
        """This step's tokens of each request: every decode's one, then prompt chunks in arrival order
        within what is left of the step's budget (a prompt that gets nothing waits for the next step)."""
        budget = self.step_tokens or float("inf")
        plan = []
        for r in batch:
            if context_len(r) - r.cache.length == 1:  # decoding
                plan.append((r, 1))
                budget -= 1
        keep = self.pool.stateful and self.pool.caching
        for r in batch:
            rest = context_len(r) - r.cache.length
            if rest > 1 and budget > 0:
                n = int(min(rest, budget))
                if keep and r.cache.length < r.cache.keep_at:
                    n = min(n, r.cache.keep_at - r.cache.length)  # end a step where the state is kept
                plan.append((r, n))
                budget -= n
        return plan

    def _reserve(self, plan: list[tuple[Request, int]], batch: list[Request]) -> list[tuple[Request, int]]:
        """The plan with each request's KV blocks reserved: a prompt chunk that does not fit shrinks to what does;
        otherwise the latest-arrived request holding blocks (r itself last) is set aside until room returns."""
        out: list[tuple[Request, int]] = []
        for r, n in plan:
            while r.cache is not None and not r.cache.reserve(r.cache.length + n):
                room = r.cache.room() - r.cache.length
                if n > 1 and room >= 1:
                    n = room
                    continue
                later = [v for v in batch if v is not r and v.cache is not None and v.cache.blocks
                         and v.arrival > r.arrival]
                victim = max(later, key=lambda v: v.arrival) if later else r
                self._preempt(victim)
                out = [(v, k) for v, k in out if v is not victim]
            if r.cache is not None:
                out.append((r, n))
        return out

    def _preempt(self, r: Request) -> None:
        """Set r aside: its blocks back to the pool (full ones cached), and r to the waiting queue in arrival order."""
        log.info("KV pool full (%d blocks): request of %d tokens set aside, resumes when there is room",
                 self.pool.num_blocks, context_len(r))
        metrics.PREEMPTIONS.inc()
        self._free(r)
        at = bisect.bisect([w.arrival for w in self.waiting], r.arrival)
        self.waiting.insert(at, r)

    def _free(self, r: Request) -> None:
        if r.cache is not None:
            r.cache.release()
            r.cache = None

    def _fail_waiting(self, reason: str) -> None:
        """Fail what waits in the inbox (not started yet) with UNAVAILABLE."""
        while True:
            try:
                r = self.inbox.get_nowait()
            except queue.Empty:
                break
            if not r.cancelled:
                r.emit(Failure(Status.UNAVAILABLE, reason))

    def _step_or_fail(self, group: list[tuple[Request, int]], defer: int, skip: bool) -> None:
        # An expert service that went away (restarted, crashed, loading): retry the step on a fresh stream, at
        # once (a stream broken while idle fails on first use) and then whenever the health watchers see it
        # back, for up to --expert-wait. Safe: a step writes its KV entries at fixed positions and commits
        # nothing else before its forward pass completes, so a retried step gives the same tokens.
        held_since, tries = None, 0
        while True:
            try:
                return self._step(group, defer, skip)
            except ExpertServiceError as e:
                if e.status != Status.UNAVAILABLE or not e.retry:  # refused, or stuck past --expert-timeout
                    log.warning("step failed: %s", e)
                    return self._fail([r for r, _ in group], e.status, str(e))
                self.experts.reset()
                if held_since is None:
                    held_since = time.monotonic()
                    log.warning("expert exchange failed (%s): holding %d request(s) for up to %gs (--expert-wait)",
                                e, len(group), self.expert_wait)
                    continue  # once at once: a stream broken while idle
                group = self._hold(group, held_since, e, tries)
                tries += 1
                if not group:
                    return
            except Exception as e:  # a bug, or one request's inputs: keep it to the request it belongs to
                self.experts.reset()
                if len(group) > 1:
                    log.exception("a step of %d requests failed; running them one by one", len(group))
                    for r, n in group:
                        if not r.cancelled:
                            self._step_or_fail([(r, n)], defer, skip)
                    return
                log.exception("step failed")
                return self._fail([r for r, _ in group], Status.INTERNAL, f"internal error: {e}")

    def _hold(self, group: list[tuple[Request, int]], since: float, err: ExpertServiceError, tries: int):
        """Wait until the expert service looks back (-> what is left of the group, to retry), or fail the
        group once --expert-wait has passed since `since` (-> []). Requests whose client left or whose
        deadline passed drop out meanwhile; abort() and stop() end the wait."""
        self.holding = f"waiting for the expert service: {err}"
        try:
            while True:
                now = time.perf_counter()
                group = [(r, n) for r, n in group if not self._expired(r, now)]
                if self._aborted or self._stop.is_set():
                    self._fail([r for r, _ in group], Status.UNAVAILABLE, self._aborted or "stopped")
                    return []
                if not group:
                    return []
                if time.monotonic() - since > self.expert_wait:
                    # a service back in the wrong format is never retried, so err can date from its absence
                    why = self.experts_why() or err
                    msg = (f"{why}; still unavailable after {self.expert_wait:g}s (--expert-wait)"
                           if self.expert_wait else str(why))
                    log.warning("step failed: %s", msg)
                    self._fail([r for r, _ in group], Status.UNAVAILABLE, msg)
                    return []
                if self.experts_ready():
                    # the watchers' view can be a moment old: retry soon, but don't hammer a dead port
                    self._stop.wait(min(0.05 * 2 ** tries, 1.0))
                    return group
                self._stop.wait(0.05)
        finally:
            self.holding = None

    def _fail(self, reqs: list[Request], status: Status, msg: str) -> None:
        for r in reqs:
            self._free(r)
            r.emit(Failure(status, msg))

    def _step(self, plan: list[tuple[Request, int]], defer: int, skip: bool) -> None:
        segs, reqs = [], [r for r, _ in plan]
        for r, n in plan:
            s0, P = r.cache.length, len(r.prompt_ids)
            ids = r.prompt_ids[s0:s0 + n] + r.output[max(0, s0 - P):max(0, s0 + n - P)]  # context(r)[s0:s0 + n]
            toks = torch.tensor(ids, dtype=torch.long)
            if s0 < P:  # a prompt chunk
                metrics.PROMPT_TOKENS.inc(min(n, P - s0))
            targets = torch.tensor(r.prompt_ids[s0 + 1:s0 + n + 1], dtype=torch.long) if r.logprobs_only else None
            segs.append(Segment(r.cache, toks, s0, all_logits=r.score_only and not r.logprobs_only,
                                logprobs=r.logprobs_only, targets=targets))
        step = next(self.steps)
        spans: list = []
        profiled = any(r.profile for r in reqs)
        records = None if profiled else []  # the decode loop's figures, as arrays unless a profile wants its spans
        t0 = time.perf_counter()
        logits = self.model.forward(segs, self.experts, step=step, defer=defer, spans=spans, skip=skip,
                                    exact_spans=profiled, records=records)
        spans += expert_spans(self.experts, step)
        now = time.perf_counter()
        t_sample = time.time_ns()
        rows = list(itertools.accumulate((0 if r.logprobs_only else s.tokens.shape[0] if r.score_only else 1
                                          for r, s in zip(reqs, segs)), initial=0))
        masked = self._mask(reqs, rows, logits)
        ended = False  # a request had its last event
        for r, s, row, end in zip(reqs, segs, rows, rows[1:]):
            n = end - row
            complete = r.cache.length >= context_len(r)  # this step computed all it must hold: a next token
            try:
                if r.score_only:
                    r.score_parts.append(s.scored if r.logprobs_only else logits[row:row + n].cpu())
                    if complete:
                        if r.logprobs_only:
                            r.emit(Scores(None, *(torch.cat(p) for p in zip(*r.score_parts))))
                        else:
                            r.emit(Scores(torch.cat(r.score_parts)))
                        self._free(r)
                        ended = True
                elif complete:
                    ended |= self._advance(r, logits[row], masked.get(id(r)), now, spans, t_sample)
                else:
                    if r.profile:
                        r.spans += spans
            except Exception as e:  # sampling or detokenizing this request: the others go on
                log.exception("request failed after the forward pass")
                self._fail([r], Status.INTERNAL, f"internal error: {e}")
        self._unrecorded.append((spans, time.perf_counter() - t0, records))
        if ended or time.perf_counter() - self._recorded_at >= METRICS_EVERY_S:
            self._record_metrics()

    @staticmethod
    def _mask(reqs: list[Request], rows: list[int], logits: torch.Tensor) -> dict[int, torch.Tensor | Exception]:
        """The constrained requests' next-token logits, masked for the whole batch at once: id(request) -> row.
        A constraint applies once the answer has begun (a reasoning model's <think> block is free text), or from
        the start where its grammar covers the reasoning too."""
        on = [(r, row) for r, row in zip(reqs, rows) if r.constraint is not None and not r.score_only
              and r.cache.length >= context_len(r)
              and (r.constrain_reasoning or r.parser is None or not r.parser.thinking)]
        if not on:
            return {}
        try:
            out = mask_rows([r.constraint for r, _ in on], logits[[row for _, row in on]])
            return {id(r): out[i] for i, (r, _) in enumerate(on)}
        except Exception:  # one at a time: what fails fails its own request only (in _advance)
            log.exception("batched token masks failed")
            masked = {}
            for r, row in on:
                try:
                    masked[id(r)] = r.constraint.mask(logits[row])
                except Exception as e:
                    masked[id(r)] = e
            return masked

    def _advance(self, r: Request, logits: torch.Tensor, masked: torch.Tensor | Exception | None, now: float,
                 spans: list, t_sample: int) -> bool:
        """r's next token sampled and emitted: -> whether it was r's last."""
        # logprobs stay the model's own distribution; the sample is drawn from what the constraint allows
        if isinstance(masked, Exception):
            raise masked
        constrained = masked is not None
        if constrained and r.constraint.error:
            raise RuntimeError(f"structured output: {r.constraint.error}")
        tok = sample(masked if constrained else logits, r.sampling, r.gen, r.prompt_ids, r.output)
        lps = None if r.logprobs is None else [token_logprobs(logits, tok, r.logprobs)]
        if constrained:
            r.constraint.consume(tok)
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
            if r.detok.stopped or (constrained and r.constraint.done):
                finish = "stop"
        if finish is None and (len(r.output) >= r.max_tokens or len(r.prompt_ids) + len(r.output) >= self.max_context):
            finish = "length"
        if finish in ("length", "eos") or (finish == "stop" and not r.detok.stopped):
            text += r.detok.flush()
        thought, calls = "", []
        if r.parser is not None:
            parsed = r.parser.push(text, final=finish is not None)
            text, thought, calls = parsed.text, parsed.reasoning, parsed.tool_calls
            if finish in ("stop", "eos") and r.parser.called:
                finish = "tool_calls"
        if r.profile:
            r.spans += spans
            r.spans.append(Span("sampling", "gpu", -1, spans[0].step if spans else 0, t_sample, time.time_ns()))
        r.emit(Chunk(text, [tok], finish, len(r.prompt_ids), len(r.output), r.first_token_at - r.arrival,
                     now - r.arrival, r.spans if (finish and r.profile) else None, lps, thought, calls,
                     r.cached_tokens, r.detok.matched if finish else None))
        if finish is not None:
            self._free(r)  # its full blocks stay cached: the answer too (a chat's next turn resends it)
        return finish is not None


def context(r: Request) -> list[int]:
    """The ids r's cache must hold before its next token is sampled: the prompt, then the answer so far (its last
    id is fed back by the next step)."""
    return r.prompt_ids + r.output if r.output else r.prompt_ids


def context_len(r: Request) -> int:
    """len(context(r)), without building the list (the step asks it of every request)."""
    return len(r.prompt_ids) + len(r.output)


def prefix_key(r: Request) -> tuple:
    """What, besides the tokens, names a request's cached blocks within one server: the deferral settings its keys
    and values depend on, and the namespace it may share blocks in (tenant and cache_salt)."""
    return (r.defer, r.skip_deferred, *r.cache_scope)


def expert_spans(experts: Experts, step: int) -> list[Span]:
    """The expert services' compute spans of this step, as they reported them (sharded: one lane per
    shard, "expert-I"), the GPU side's wait on each shard, and its own hot experts' compute."""
    out = [Span("experts_deferred" if t.deferred else "experts_immediate",
                "expert" if t.shard is None else f"expert-{t.shard}", t.layer, step, t.timing.start_unix_ns,
                t.timing.end_unix_ns) for t in experts.drain_timings()]
    out += [Span("shard_wait", f"expert-{w.shard}", w.layer, step, w.start_ns, w.end_ns) for w in experts.drain_waits()]
    return out + experts.drain_spans()


def record_step_metrics(steps: list[tuple[list[Span], float, list | None]]) -> None:
    """The metrics of steps, each (its spans, its seconds, the decode loop's records or None: native_loop.figures),
    a batch at a time (Engine._record_metrics, METRICS_EVERY_S)."""
    wait_layer, waits = [], []  # the GPU side's waits (ns)
    parts, over, records = [], [], []  # (part, service) and ns of each expert part; each round trip over its compute
    total = 0.0
    for spans, step_s, recs in steps:
        metrics.STEP.observe(step_s)
        total += step_s
        records += recs or ()
        submitted, compute, rtt = {}, {}, {}  # layer -> its request handed over; (name, layer) -> the slowest shard's
        for name, service, layer, _, t0, t1 in spans:
            if name == "expert_submit":
                submitted[layer] = t1
            elif name == "expert_wait":
                wait_layer.append(layer)
                waits.append(t1 - t0)
                if layer in submitted:
                    rtt.setdefault(layer, t1 - submitted[layer])
            elif service.startswith("expert") and name != "shard_wait":
                parts.append(((name.removeprefix("experts_"), service), t1 - t0))
                compute[(name, layer)] = max(compute.get((name, layer), 0), t1 - t0)
        over += [max(0, t - compute[("experts_immediate", L)]) for L, t in rtt.items()
                 if ("experts_immediate", L) in compute]
    loop = native_loop.figures(records)
    all_waits = np.concatenate([np.array(waits, np.int64), loop.waits]) / 1e9
    if all_waits.size:
        metrics.EXPERT_WAIT.observe_each(all_waits, [(L,) for L in wait_layer] + [(L,) for L in loop.layers.tolist()])
    if parts:
        labels, ns = zip(*parts)
        metrics.EXPERT_COMPUTE.observe_each(np.array(ns) / 1e9, labels)
    metrics.EXPERT_COMPUTE.observe_many(loop.immediate / 1e9, ("immediate", "expert"))
    metrics.EXPERT_COMPUTE.observe_many(loop.deferred / 1e9, ("deferred", "expert"))
    metrics.EXCHANGE.observe_many(np.concatenate([np.array(over, np.int64), loop.overhead]) / 1e9)
    blocked = float(all_waits.sum())
    metrics.EXPERT_BLOCKED.inc(blocked)
    metrics.GPU_BUSY.inc(max(0.0, total - blocked))  # (each step's waits lie within it)
