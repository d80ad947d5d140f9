"""A chat answer taken apart as it streams: the reasoning, the text, the tool calls. Which syntax a checkpoint
writes them in is decided once per server (AnswerFormat: from the chat template, or --reasoning-parser and
--tool-call-parser); each request gets its own AnswerParser, which the engine feeds the detokenized text of
every new token, markers kept (tool_formats.Markers).

    token ids -> DetokenizeStream (markers as symbols) -> AnswerParser -> Parsed(text, reasoning, tool_calls)
                                                            ├─ ReasoningSplitter (<think> blocks)
                                                            ├─ CallStream (the family's tool-call syntax)
                                                            └─ HarmonyStream (gpt-oss: channels carry both)
"""
from __future__ import annotations

import dataclasses

from moe_core.errors import BadRequest

from gpu_service.api import harmony, tool_formats
from gpu_service.api.reasoning import END as THINK_END
from gpu_service.api.reasoning import START as THINK_START
from gpu_service.api.reasoning import ReasoningSplitter, opens_thinking, uses_think_tags
from gpu_service.api.tool_formats import FORMATS, CallStream, Markers
from gpu_service.api.tools import ToolCallDelta, ToolChoice, parameters


@dataclasses.dataclass
class Parsed:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)


def merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call as one delta."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None and d.name is None:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out


class AnswerParser:
    def __init__(self, markers: Markers | None, reasoning: ReasoningSplitter | None = None,
                 calls: CallStream | None = None, harmony_stream: harmony.HarmonyStream | None = None,
                 may_open_thinking: bool = False):
        self.markers, self.reasoning, self.calls, self.harmony = markers, reasoning, calls, harmony_stream
        self.may_open_thinking = may_open_thinking  # the model opens its <think> block itself, if it thinks

    @property
    def symbols(self) -> dict[int, str]:
        """Token id -> the symbol the detokenizer writes for it."""
        return self.markers.ids if self.markers else {}

    @property
    def thinking(self) -> bool:
        """Inside the reasoning now (a constraint on the answer waits until it ends)."""
        if self.harmony is not None:
            return self.harmony.thinking
        return self.reasoning is not None and self.reasoning.inside

    @property
    def called(self) -> bool:
        """The answer has made a call (it finishes with "tool_calls")."""
        stream = self.harmony or self.calls
        return stream is not None and stream.calls > 0

    def push(self, text: str, final: bool = False) -> Parsed:
        if self.harmony is not None:
            thought, answer, calls = self.harmony.push(text, final)
            return Parsed(answer, thought, merge(calls))
        thought, answer = self.reasoning.push(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            more = self.reasoning.flush()
            thought, answer = thought + more[0], answer + more[1]
        calls: list[ToolCallDelta] = []
        if self.calls is not None:
            answer, calls = self.calls.push(answer)
            if final:
                more_text, more_calls = self.calls.flush()
                answer, calls = answer + more_text, calls + more_calls
        restore = self.markers.restore if self.markers else str
        return Parsed(restore(answer), restore(thought), merge(calls))


class AnswerFormat:
    """How this checkpoint writes reasoning and tool calls. reasoning_parser: auto | think | harmony | none;
    tool_parser: auto | a tool_formats.FORMATS name | harmony | none (auto: the chat template decides)."""

    def __init__(self, chat_template: str | None, vocab: dict[str, int], added: dict[str, int],
                 reasoning_parser: str = "auto", tool_parser: str = "auto"):
        template = chat_template or ""
        found = tool_formats.detect(template)
        self.tools = found if tool_parser == "auto" else (None if tool_parser == "none" else tool_parser)
        if reasoning_parser == "auto":
            reasoning_parser = "harmony" if found == "harmony" else (
                "think" if uses_think_tags(chat_template, vocab) else "none")
        self.reasoning = reasoning_parser
        self.harmony = self.tools == "harmony" or reasoning_parser == "harmony"
        self.renders_tools = "tools" in template  # a template that never reads tools cannot offer them
        strings = harmony.MARKERS if self.harmony else FORMATS[self.tools].markers if self.tools else ()
        if self.reasoning == "think":
            strings = (*strings, THINK_START, THINK_END)
        self.markers = Markers(strings, added) if strings else None
        # the tags are tokens: a grammar can let the reasoning come first (its text cannot end the block by accident)
        self.think_tokens = self.reasoning == "think" and {THINK_START, THINK_END} <= set(self.markers.token)

    def parser(self, prompt_tail: str, tools: list[dict] | None, choice: ToolChoice) -> AnswerParser | None:
        """A chat request's parser (None: the answer is all text). prompt_tail: the rendered prompt's end (does
        the template open a <think> block?); tools: offered, calls are parsed unless choice is none."""
        calls_on = bool(tools) and choice.mode != "none" and self.tools is not None
        if self.harmony:
            return AnswerParser(self.markers, harmony_stream=harmony.HarmonyStream(self.markers, calls_on))
        split = None
        if self.reasoning == "think":
            split = ReasoningSplitter(opens_thinking(prompt_tail), self.markers.sym[THINK_START],
                                      self.markers.sym[THINK_END])
        calls = CallStream(FORMATS[self.tools], self.markers, parameters(tools)) if calls_on else None
        if split is None and calls is None:
            return None
        # a template that closed a block for this answer (Qwen3's enable_thinking=False, V3.1's non-thinking mode)
        # switched the thinking off
        may_think = split is not None and not split.inside and THINK_END not in prompt_tail
        return AnswerParser(self.markers, split, calls, may_open_thinking=may_think)

    def around(self, forced: bool, parser: AnswerParser | None) -> str:
        """The Lark grammar around a constraint (which it names @answer) that lets the reasoning come first: a
        harmony analysis message, or a <think> block where its tags are tokens and the model opens it itself.
        "" where the constraint binds the answer alone (the engine then masks only outside the reasoning)."""
        if self.harmony:
            return "" if forced else harmony.answer_grammar(self.markers)  # a forced call has its own
        if self.think_tokens and parser is not None and parser.may_open_thinking:
            start, end = self.markers.lark(THINK_START), self.markers.lark(THINK_END)
            return f"start: think? @answer\nthink: {start} /(?s:.*)/ {end} /[ \t\n]*/"
        return ""

    def check(self, tools: list[dict] | None, choice: ToolChoice) -> None:
        """Whether this checkpoint can take tools at all (BadRequest says why not)."""
        if not tools or choice.mode == "none":
            return
        if not self.renders_tools:
            raise BadRequest("tools", "this checkpoint's chat template does not render tools")
        if self.tools is None:
            raise BadRequest("tools", "the tool-call syntax of this checkpoint is not known (its chat template shows "
                             "none we parse); start the server with --tool-call-parser NAME")

    def forced_grammar(self, tools: list[dict], choice: ToolChoice, parallel: bool) -> str:
        """The Lark grammar that makes the answer a call (choice required or a named function)."""
        if self.tools == "harmony":
            return harmony.grammar(self.markers, tools, choice.name if choice.mode == "function" else None)
        return tool_formats.grammar(FORMATS[self.tools], self.markers, tools, choice, parallel)
