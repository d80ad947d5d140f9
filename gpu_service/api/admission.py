"""What a client asks for, in one transport-neutral form, and the one check every request passes before the
engine sees it. gRPC's Generate and Score and the HTTP API each translate their own message into a
GenerateInput or ScoreInput; Admission checks it (BadRequest names the field) and makes the engine's Request.

    gRPC GenerateRequest ─┐
                          ├─> GenerateInput ─> Admission.generate ─> engine.Request
    HTTP JSON body ───────┘
"""
from __future__ import annotations

import dataclasses
import json
import math

from moe_core.errors import BadRequest

from gpu_service.api.answer import AnswerFormat
from gpu_service.api.constraints import ConstraintSpec, Grammars
from gpu_service.engine.scheduler import Request
from gpu_service.engine.sampling import MAX_LOGPROBS, SamplingParams
from gpu_service.api.text import PromptTooLong, TextCodec
from gpu_service.api.tools import ToolChoice, check_choice, check_tools, history_call

MAX_STOP = 16
MAX_STOP_CHARS = 1024  # a stop string is matched against every text delta: keep it short
ROLES = {"system", "user", "assistant", "tool"}
MAX_LOGIT_BIAS = 1024  # ids a request may bias
MAX_CACHE_SALT = 1024


@dataclasses.dataclass
class GenerateInput:
    """One generation as asked: exactly one of prompt, messages or token_ids. messages (chat): [{"role",
    "content"}], an assistant's with "tool_calls" ([{"id", "function": {"name", "arguments"}}]) and
    "reasoning_content" where it had them, a tool result's with "tool_call_id" (and "name")."""
    prompt: str | None = None
    messages: list[dict] | None = None
    token_ids: list[int] | None = None
    max_tokens: int = 16
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    logprobs: int | None = None  # set: each token's logprob and this many top alternatives
    stop: list[str] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    defer: int | None = None  # None: the server's --defer
    skip_deferred: bool = False  # drop the deferred experts instead of merging them (accuracy baseline)
    profile: bool = False
    constraint: ConstraintSpec | None = None  # structured output
    chat_template_kwargs: dict | None = None  # extra variables for the chat template (enable_thinking, ...)
    tools: list[dict] | None = None  # offered to the model (chat): OpenAI's [{"type": "function", "function"}]
    tool_choice: ToolChoice = dataclasses.field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True  # a forced call may be several
    cache_salt: str = ""  # vLLM's: only requests with the same salt share prefix-cache blocks
    tenant: str = ""  # whose credentials sent it (security.ServerSecurity.tenant_of), set by the front end


@dataclasses.dataclass
class TokenizeInput:
    """vLLM's /tokenize: exactly one of prompt (the tokenizer's special tokens added unless add_special_tokens is
    False) or messages, rendered by the chat template with tools and chat_template_kwargs as a chat request's are
    (add_generation_prompt: ending with the assistant's turn opened; add_special_tokens: the tokenizer's own on top of
    the template's, off unless asked, as vLLM's)."""
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None


@dataclasses.dataclass
class ScoreInput:
    """Logits (or per-position logprobs) of a sequence of token ids."""
    token_ids: list[int]
    logprobs_only: bool = False
    defer: int = 0
    skip_deferred: bool = False
    cache_salt: str = ""
    tenant: str = ""


def check_sampling(sp: SamplingParams) -> SamplingParams:
    """The sampling settings' ranges (BadRequest names the bad one)."""
    def bad(name: str, what: str):
        raise BadRequest(f"sampling.{name}", f"must be {what}, got {getattr(sp, name)}")
    if not 0 <= sp.temperature < math.inf:  # below SAMPLING_EPS: greedy (sampling.py)
        bad("temperature", "a finite number >= 0")
    if not 0 < sp.top_p <= 1:
        bad("top_p", "in (0, 1]")
    if sp.top_k < 0:
        bad("top_k", ">= 0")
    if not 0 <= sp.min_p <= 1:
        bad("min_p", "in [0, 1]")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(sp, name) <= 2:
            bad(name, "in [-2, 2]")
    if not 0 < sp.repetition_penalty < math.inf:
        bad("repetition_penalty", "a finite number > 0")
    if sp.logit_bias and (len(sp.logit_bias) > MAX_LOGIT_BIAS or not all(
            -100 <= b <= 100 for b in sp.logit_bias.values())):
        bad("logit_bias", f"at most {MAX_LOGIT_BIAS} ids, each with a bias in [-100, 100]")
    return sp


@dataclasses.dataclass
class Admission:
    """The limits a request is checked against: the model's, the engine's context, the server's settings."""
    vocab_size: int
    top_k: int                # the model's experts per token: defer must leave one immediate
    text: TextCodec
    max_context: int
    max_tokens_limit: int
    default_defer: int
    eos_ids: tuple = ()
    grammars: Grammars | None = None  # built from text and eos_ids when not given
    answers: AnswerFormat | None = None  # how chat answers are taken apart; from the chat template when not given
    prefix_scope: str = "tenant"  # tenant: each tenant its own prefix-cache namespace; global: tenants share blocks

    def __post_init__(self):
        if self.grammars is None:
            self.grammars = Grammars(self.text.tok, self.vocab_size, list(self.eos_ids))
        if self.answers is None:
            self.answers = AnswerFormat(self.text.chat_template, self.text.tok.get_vocab(), self.text.added_tokens())

    def generate(self, inp: GenerateInput, emit) -> Request:
        """inp checked and tokenized (tokenizing a long prompt takes a while: call it off the event loop)."""
        tools = self._tools(inp)
        ids = self._prompt_ids(inp, tools)
        if inp.max_tokens <= 0:
            raise BadRequest("max_tokens", "must be > 0")
        if inp.max_tokens > self.max_tokens_limit:
            raise BadRequest("max_tokens", f"{inp.max_tokens} exceeds the limit {self.max_tokens_limit}")
        sp = check_sampling(inp.sampling)
        if sp.logit_bias and not all(0 <= i < self.vocab_size for i in sp.logit_bias):
            raise BadRequest("sampling.logit_bias", f"token ids must be in [0, {self.vocab_size})")
        if inp.logprobs is not None and not 0 <= inp.logprobs <= MAX_LOGPROBS:
            raise BadRequest("logprobs", f"at most {MAX_LOGPROBS} alternatives per token, got {inp.logprobs}")
        if len(inp.stop) > MAX_STOP or any(not 0 < len(x) <= MAX_STOP_CHARS for x in inp.stop):
            raise BadRequest("stop", f"at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")
        defer = self._defer(self.default_defer if inp.defer is None else inp.defer)
        parser = None
        if inp.messages is not None:  # chat only: a completion is raw text
            parser = self.answers.parser(self.text.tok.decode(ids[-16:], skip_special_tokens=False), tools,
                                         inp.tool_choice)
        spec = inp.constraint
        if inp.tool_choice.forced:
            if spec is not None:
                raise BadRequest("tool_choice", f"{inp.tool_choice.mode!r} and a structured-output constraint "
                                 "cannot both shape the answer")
            self._check_forced_tools(tools, inp.tool_choice)
            spec = ConstraintSpec("grammar", self.answers.forced_grammar(tools, inp.tool_choice, inp.parallel_tool_calls))
        around = self.answers.around(inp.tool_choice.forced, parser) if spec is not None and parser else ""
        if around:
            spec = dataclasses.replace(spec, within=around)
        try:
            constraint = self.grammars.matcher(spec) if spec is not None else None
        except BadRequest as e:
            if inp.tool_choice.forced:  # the grammar is ours: what does not compile is a tool's schema
                raise BadRequest("tools", f"the tools' call grammar does not compile: {e.detail}") from None
            raise
        return Request(prompt_ids=ids, emit=emit, max_tokens=inp.max_tokens, sampling=sp, stop=list(inp.stop),
                       cache_scope=self._cache_scope(inp),
                       ignore_eos=inp.ignore_eos, defer=defer, skip_deferred=inp.skip_deferred, profile=inp.profile,
                       logprobs=inp.logprobs, constraint=constraint, parser=parser,
                       constrain_reasoning=bool(around) or (inp.tool_choice.forced and self.answers.harmony))

    def _check_forced_tools(self, tools: list[dict], choice) -> None:
        """Each tool a forced call may take compiles and has a finite value alone: in the union of a required call
        one tool's schema could otherwise fail only once the model picks it."""
        for i, t in enumerate(tools):
            if choice.mode == "required" or t["function"]["name"] == choice.name:
                try:
                    self.grammars.check(ConstraintSpec("json_schema", json.dumps(t["function"]["parameters"])))
                except BadRequest as e:
                    raise BadRequest(f"tools[{i}].function.parameters", e.detail.removeprefix("json_schema ")) from None

    def _tools(self, inp: GenerateInput) -> list[dict] | None:
        tools = check_tools(inp.tools) if inp.tools else None
        if tools and inp.messages is None:
            raise BadRequest("tools", "tools are offered in chat requests only")
        check_choice(inp.tool_choice, tools)
        self.answers.check(tools, inp.tool_choice)
        return tools

    def score(self, inp: ScoreInput, emit) -> Request:
        ids = inp.token_ids
        if not ids:
            raise BadRequest("token_ids", "at least one id is required")
        self._check_ids(ids)
        if len(ids) > self.max_context:
            raise BadRequest("token_ids", f"{len(ids)} tokens exceed the context limit {self.max_context}",
                             "context_length_exceeded")
        return Request(prompt_ids=list(ids), emit=emit, score_only=True, logprobs_only=inp.logprobs_only,
                       defer=self._defer(inp.defer), skip_deferred=inp.skip_deferred,
                       cache_scope=self._cache_scope(inp))

    def _cache_scope(self, inp: GenerateInput | ScoreInput) -> tuple[str, str]:
        """What, besides the tokens and the numbers' settings, a request's cached blocks are named by: its tenant
        (unless --prefix-cache-scope global) and its cache_salt. Different scopes never share a block: a client
        cannot learn from a hit what another sent."""
        if not isinstance(inp.cache_salt, str) or len(inp.cache_salt) > MAX_CACHE_SALT:
            raise BadRequest("cache_salt", f"a string of at most {MAX_CACHE_SALT} characters")
        return (inp.tenant if self.prefix_scope == "tenant" else "", inp.cache_salt)

    def _defer(self, defer: int) -> int:
        if not 0 <= defer <= self.top_k - 1:
            raise BadRequest("defer", f"must be in [0, top_k - 1 = {self.top_k - 1}], got {defer}")
        return defer

    def _check_ids(self, ids) -> None:
        V = self.vocab_size
        if any(not 0 <= i < V for i in ids):
            raise BadRequest("token_ids", f"every id must be in [0, {V})")

    def _prompt_ids(self, inp: GenerateInput, tools: list[dict] | None) -> list[int]:
        try:
            ids = self._tokenize(inp, tools)
        except PromptTooLong as e:
            raise BadRequest("input", f"prompt has at least {e.at_least} tokens; the context limit is "
                             f"{self.max_context}", "context_length_exceeded") from None
        if not ids:
            raise BadRequest("input", "the prompt tokenizes to zero tokens")
        if len(ids) >= self.max_context:
            raise BadRequest("input", f"prompt has {len(ids)} tokens; the context limit is {self.max_context}",
                             "context_length_exceeded")
        return ids

    def _tokenize(self, inp: GenerateInput, tools: list[dict] | None) -> list[int]:
        given = [name for name in ("prompt", "messages", "token_ids") if getattr(inp, name) is not None]
        if len(given) != 1:
            raise BadRequest("input", "exactly one of prompt, chat messages or token_ids is required")
        limit = self.max_context - 1  # room for one generated token
        if inp.prompt is not None:
            if not inp.prompt:
                raise BadRequest("prompt", "must not be empty")
            return self.text.encode(inp.prompt, limit)
        if inp.messages is not None:
            return self._render(inp.messages, inp.chat_template_kwargs, tools, limit)
        self._check_ids(inp.token_ids)
        return list(inp.token_ids)

    def _render(self, messages: list[dict], kwargs: dict | None, tools: list[dict] | None, limit: int | None,
                add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
        """Chat messages through the chat template, checked as a chat request's are."""
        if not messages:
            raise BadRequest("messages", "must not be empty")
        bad = [m["role"] for m in messages if m["role"] not in ROLES]
        if bad:
            raise BadRequest("messages.role", f"unknown role {bad[0]!r} (expected one of {sorted(ROLES)})")
        kwargs = kwargs or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs) \
                or {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"} & set(kwargs):
            raise BadRequest("chat_template_kwargs", "an object of template variables (not messages, "
                             "add_generation_prompt, bos_token, eos_token or tools)")
        rendered = [self._message(m, i) for i, m in enumerate(messages)]
        check_tool_results(messages)
        try:
            return self.text.render_chat(rendered, limit, add_generation_prompt, add_special_tokens, **kwargs,
                                         **({"tools": tools} if tools else {}))
        except PromptTooLong:
            raise
        except ValueError as e:
            raise BadRequest("messages", str(e)) from None

    def tokenize(self, inp: TokenizeInput) -> list[int]:
        """vLLM's /tokenize: the ids, however many (the count is the answer: a prompt longer than the context is not
        refused here; the front ends bound its bytes)."""
        if (inp.prompt is None) == (inp.messages is None):
            raise BadRequest("input", "exactly one of prompt or messages is required")
        if inp.prompt is not None:
            return self.text.encode(inp.prompt, add_special_tokens=inp.add_special_tokens is not False)
        tools = check_tools(inp.tools) if inp.tools else None
        return self._render(inp.messages, inp.chat_template_kwargs, tools, None, inp.add_generation_prompt,
                            bool(inp.add_special_tokens))

    def detokenize(self, ids: list[int]) -> str:
        """vLLM's /detokenize: the ids' text, special tokens written out (what /tokenize read)."""
        self._check_ids(ids)
        return self.text.tok.decode(list(ids), skip_special_tokens=False)

    @staticmethod
    def _message(m: dict, i: int) -> dict:
        """A chat message as templates read it: earlier calls' arguments as objects (tools.history_call)."""
        out = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            out["tool_calls"] = [history_call(c, f"[{i}].tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if m.get(key):
                out[key] = m[key]
        return out


def check_tool_results(messages: list[dict]) -> None:
    """Each tool message answers a call of the assistant message before it, by that call's id (OpenAI's rule): a
    result without an id, or with no call to answer, is refused rather than rendered as a stray turn."""
    calls: set[str] | None = None  # the ids of the latest assistant turn's calls; None before any call
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            calls = {str(c.get("id")) for c in m.get("tool_calls") or () if isinstance(c, dict) and c.get("id")} \
                if m.get("tool_calls") else None
        elif m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise BadRequest(f"messages[{i}].tool_call_id", "a tool message needs the id of the call it answers")
            if calls is None:
                raise BadRequest(f"messages[{i}]", "a tool message must follow an assistant message with tool_calls")
            if calls and m["tool_call_id"] not in calls:
                raise BadRequest(f"messages[{i}].tool_call_id", f"{m['tool_call_id']!r} names no call of the "
                                 f"assistant message before it ({', '.join(sorted(calls))})")
        elif m["role"] != "system":
            calls = None
