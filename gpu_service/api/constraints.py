"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a choice of strings, a
Lark or GBNF grammar) compiled into a matcher that masks each step's logits to the tokens that can still lead
to a valid answer, and that says when the answer is complete.

The grammar library is llguidance (guidance-ai; also behind vLLM's, SGLang's and llama.cpp's structured
outputs). Chosen over xgrammar because it takes the checkpoint's tokenizer.json as it is (xgrammar wants a
transformers tokenizer or a hand-built vocabulary), compiles lazily (an Earley parser over lexemes: no
per-schema automaton to build up front, so a large schema costs microseconds, not seconds) with explicit
resource limits (LLParserLimits: what bounds a hostile schema), and computes a mask in ~50 us for a 128k
vocabulary. Its grammar syntax (Lark, with GBNF converted) is what the `grammar` constraint accepts.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
import threading

import llguidance
import numpy as np
import torch

from moe_core.errors import BadRequest

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 << 10  # a schema, regex or grammar longer than this is refused before it is compiled
MAX_CHOICES = 1024
# the parser's resource bounds (llguidance's defaults, the grammar size and the first mask's lexer fuel tightened): a
# constraint that needs more is refused at admission, or ends its request, never stalls the engine. The default
# initial fuel let one nested counted repetition ("(x{1000}){1000}") spend ~1 s and ~250 MB on its first mask; a
# tenth of it bounds that to tens of ms with the same masks for ordinary schemas (llguidance then builds the
# lexer lazily)
LIMITS = llguidance.LLParserLimits(max_grammar_size=200_000, initial_lexer_fuel=100_000)
# a regex whose nested counted repetitions expand past this many positions is refused before it is compiled: its
# lexer's states grow with the product of the counts (one level, "[a-z]{1,10000}", is cheap)
MAX_REGEX_POSITIONS = 100_000
# compact JSON: whitespace is not free, so a schema with bounded values always ends (no unbounded runs of spaces)
JSON_OPTIONS = {"whitespace_flexible": False}
CACHED_GRAMMARS = 256


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
    """What the client asked for. value: the schema (JSON text), regex, grammar; choice: a JSON list of strings;
    json_object: ignored. within: a Lark grammar around the answer, which it names @answer (gpt-oss's harmony
    puts the answer in its final channel, after the reasoning: harmony.answer_grammar)."""
    kind: str
    value: str = ""
    within: str = ""

    @staticmethod
    def choice(options: list[str]) -> "ConstraintSpec":
        return ConstraintSpec("choice", json.dumps(list(options)))


def first_line(error: str, limit: int = 200) -> str:
    """llguidance's error without the parser state it appends (token state, statistics, the grammar): what a client
    may be told."""
    line = error.strip().split("\n", 1)[0].strip()
    return line if len(line) <= limit else line[:limit] + "..."


def regex_positions(rx: str) -> int:
    """How many positions a regex expands to when its counted repetitions are written out (Python's parser: the
    syntax llguidance shares with it); 0 where Python cannot parse it (llguidance judges those alone)."""
    try:
        import re._parser as parser  # CPython's own; only constrained requests pay for the import
        tree = parser.parse(rx)
    except Exception:
        return 0

    def size(seq) -> int:
        total = 0
        for op, av in seq:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                lo, hi, sub = av
                total += size(sub) * max(1, lo if hi == parser.MAXREPEAT else hi)
            elif name == "SUBPATTERN":
                total += size(av[-1])
            elif name == "BRANCH":
                total += max(size(b) for b in av[1])
            elif name in ("ASSERT", "ASSERT_NOT"):
                total += size(av[1])
            else:
                total += 1
        return total
    return size(tree)


def _schema_patterns(schema) -> list[str]:
    """The regexes a JSON schema hands the lexer: its patterns and patternProperties' keys, at any depth."""
    found, todo = [], [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found += [k for k in node["patternProperties"] if isinstance(k, str)]
            todo += node.values()
        elif isinstance(node, list):
            todo += node
    return found


def _grammar_text(spec: ConstraintSpec) -> str:
    """The llguidance grammar of a spec (not validated yet); BadRequest for what is malformed on its face."""
    if spec.kind not in KINDS:
        raise BadRequest("constraint", f"unknown kind {spec.kind!r} (one of {', '.join(KINDS)})")
    if len(spec.value) > MAX_SPEC_CHARS:
        raise BadRequest("constraint", f"{spec.kind} of {len(spec.value)} characters; at most {MAX_SPEC_CHARS}")
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except ValueError as e:
            raise BadRequest("constraint", f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise BadRequest("constraint", "json_schema must be a JSON object")
        for rx in _schema_patterns(schema):
            _check_regex("json_schema pattern", rx)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
        except ValueError as e:
            raise BadRequest("constraint", f"json_schema: {e}") from None
    if spec.kind == "regex":
        _check_regex("regex", spec.value)
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        options = json.loads(spec.value)
        if not options or len(options) > MAX_CHOICES or not all(isinstance(o, str) and o for o in options):
            raise BadRequest("constraint", f"choice: 1 to {MAX_CHOICES} non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    for rx in re.findall(r"/((?:[^/\\\n]|\\.)+)/", spec.value):  # its /.../ terminals
        _check_regex("grammar", rx)
    try:
        return llguidance.grammar_from("grammar", spec.value)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise BadRequest("constraint", f"grammar: {e}") from None


def _check_regex(what: str, rx: str) -> None:
    n = regex_positions(rx)
    if n > MAX_REGEX_POSITIONS:
        raise BadRequest("constraint", f"{what} {rx[:80]!r} expands to {n} positions through nested counted "
                         f"repetition; at most {MAX_REGEX_POSITIONS}")


def nest(outer: str, grammar: str) -> str:
    """One llguidance grammar: the Lark outer, whose @answer is grammar (a Lark text or llguidance's JSON)."""
    inner = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    inner = [dict(g) for g in inner]
    inner[0]["name"] = "answer"
    return json.dumps({"grammars": [{"lark_grammar": outer}, *inner]})


class Grammars:
    """Compiles and checks constraints for one tokenizer; the compiled grammars are cached by their text."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        """tokenizer: the checkpoint's (a tokenizers.Tokenizer); vocab_size: the model's logits (may be padded
        past the tokenizer's ids); eos_ids: where an answer may end (those the tokenizer has)."""
        self._args = (tokenizer, vocab_size, eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self._checked = functools.lru_cache(CACHED_GRAMMARS)(self._check)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built on first use: only constrained requests pay for it
            if self._tokenizer is None:
                tok, n, eos = self._args
                known = [e for e in eos if e < tok.get_vocab_size(with_added_tokens=True)]
                try:
                    self._tokenizer = llguidance.LLTokenizer(tok.to_str(), n_vocab=n, eos_token=known or None)
                except ValueError as e:
                    raise BadRequest("constraint", f"structured outputs cannot run on this checkpoint's "
                                     f"tokenizer: {e}") from None
            return self._tokenizer

    def _check(self, spec: ConstraintSpec) -> str:
        """The spec's grammar, compiled and its first mask computed (under LIMITS, off the GIL): what would fail at
        the answer's first token (a schema with no finite value: "$ref": "#", a cycle of $defs) fails here."""
        answer = _grammar_text(spec)
        grammar = nest(spec.within, answer) if spec.within else answer
        for g in (answer, grammar) if spec.within else (grammar,):  # the answer alone: its first token comes later
            error = llguidance.LLMatcher.validate_grammar(g, self.tokenizer, limits=LIMITS)
            if error:
                raise BadRequest("constraint", f"{spec.kind} does not compile: {first_line(error)}")
            m = llguidance.LLMatcher(self.tokenizer, g, log_level=0, limits=LIMITS)
            bits = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)
            executor().unsafe_compute_mask_ptr([(m, 0)], bits.ctypes.data, bits.shape[1] * 4, 1)
            if m.is_error():
                hint = " (a schema whose references never end, such as \"$ref\": \"#\", has no finite value)" \
                    if spec.kind == "json_schema" else ""
                raise BadRequest("constraint", f"{spec.kind} admits no answer: {first_line(m.get_error())}{hint}")
            if not bits.any():
                raise BadRequest("constraint", f"{spec.kind} admits no answer: no token can start one")
        return grammar

    def check(self, spec: ConstraintSpec) -> None:
        """BadRequest (field "constraint") when spec would not run; cached as matcher()'s compilation is."""
        self._checked(spec)

    def matcher(self, spec: ConstraintSpec) -> "Matcher":
        """A fresh matcher for one request; BadRequest (field "constraint") names what is wrong with spec. Takes
        milliseconds for a large schema: call it off the event loop."""
        return Matcher(llguidance.LLMatcher(self.tokenizer, self._checked(spec), log_level=0, limits=LIMITS),
                       self.vocab_size)


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def executor() -> llguidance.LLExecutor:
    """llguidance's pool that computes masks off the GIL (made on first use)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


def mask_rows(matchers: list["Matcher"], logits: torch.Tensor) -> torch.Tensor:
    """logits [B, vocab] of B requests with their matchers -> a copy with every token a request's grammar forbids
    at -inf: the masks computed in parallel (llguidance's executor, off the GIL) and applied in one operation (one
    copy to the logits' device). A matcher that fails here is in error afterwards (Matcher.error)."""
    B, V = logits.shape
    bits = np.zeros((B, (V + 31) // 32), dtype=np.int32)  # bit i of word w: token 32 w + i
    # what llguidance.torch.fill_next_token_bitmask_par does (without importing its torch.compile'd helpers)
    executor().unsafe_compute_mask_ptr([(m.m, i) for i, m in enumerate(matchers)], bits.ctypes.data, bits.shape[1] * 4, B)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, count=V, bitorder="little").view(np.bool_)
    return torch.where(torch.from_numpy(allowed).to(logits.device), logits, float("-inf"))


class Matcher:
    """One request's place in its grammar: mask the next token's logits, consume the sampled token."""

    def __init__(self, m: llguidance.LLMatcher, vocab_size: int):
        self.m, self.vocab_size = m, vocab_size

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next (EOS where the answer may end)."""
        packed = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)  # bit i of the mask: token i
        return torch.from_numpy(np.unpackbits(packed, count=self.vocab_size, bitorder="little").view(np.bool_))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] with every token the grammar forbids at -inf (a new tensor)."""
        allowed = self.allowed().to(logits.device)
        return torch.where(allowed, logits, float("-inf"))

    @property
    def error(self) -> str | None:
        return first_line(self.m.get_error()) if self.m.is_error() else None

    def consume(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise RuntimeError(f"structured output: the grammar refused token {token}: {first_line(self.m.get_error())}")

    @property
    def done(self) -> bool:
        """The answer is complete and nothing more may follow."""
        return self.m.is_stopped()
