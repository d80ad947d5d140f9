"""gpt-oss's answers (OpenAI's harmony format): a sequence of messages, each a header and a body,

    <|channel|>analysis<|message|>the reasoning<|end|><|start|>assistant<|channel|>final<|message|>the answer
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the prompt ends with <|start|>assistant, so the answer opens with a header). The analysis channel is the
reasoning, the final channel (and commentary addressed to no one: preambles) the content, and a message addressed
to=functions.NAME a call whose body is its arguments. <|call|> and <|return|> end the generation (they are the
checkpoint's end-of-sequence ids), so a message may end with the answer itself. The markers are special tokens:
the detokenizer keeps them, as one symbol each (tool_formats.Markers)."""
from __future__ import annotations

import re

from gpu_service.api.text import partial_tail
from gpu_service.api.tool_formats import Markers, json_rule
from gpu_service.api.tools import ToolCallDelta, new_call_id

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
MAX_HEADER = 256  # characters of header without a <|message|>: the model is not writing harmony; the rest is text
RECIPIENT = re.compile(r"to=([^\s<]+)")


def _analysis(m: Markers) -> str:
    """The Lark rule of an analysis message and the next message's start (the reasoning, before the answer)."""
    ch, msg, end, st = (m.lark(t) for t in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
    return f'analysis: {ch} "analysis" {msg} /(?s:.*)/ {end} {st} "assistant"'


def answer_grammar(m: Markers) -> str:
    """The Lark around a constrained answer (@answer): optional reasoning, then the final channel."""
    return f'start: analysis? {m.lark("<|channel|>")} "final" {m.lark("<|message|>")} @answer\n{_analysis(m)}'


def grammar(m: Markers, tools: list[dict], name: str | None) -> str:
    """The forced call's Lark: an optional analysis message, then a call to one of tools (name: that one)."""
    ch, msg, con = (m.lark(t) for t in ("<|channel|>", "<|message|>", "<|constrain|>"))
    calls, rules = [], []
    for i, t in enumerate(x["function"] for x in tools):
        if name is not None and t["name"] != name:
            continue
        calls.append(f"c{i}")
        rules += [f'c{i}: {ch} "commentary to=functions.{t["name"]} " {con} "json" {msg} a{i}',
                  f"a{i}: {json_rule(t.get('parameters') or {})}"]
    return "\n".join(["start: analysis? call", _analysis(m), "call: " + " | ".join(calls), *rules])


class HarmonyStream:
    """Text in (markers as symbols), (reasoning, content, call deltas) out, message by message."""

    def __init__(self, m: Markers, tools: bool):
        self.m, self.tools = m, tools
        self.s = {k: m.sym[k] for k in MARKERS}
        self.state, self.buf, self.kind = "header", "", None
        self.calls, self.index = 0, None

    @property
    def thinking(self) -> bool:
        return self.state == "body" and self.kind == "reasoning"

    def push(self, text: str, final: bool = False) -> tuple[str, str, list[ToolCallDelta]]:
        self.buf += text
        out = {"reasoning": [], "content": [], "args": []}
        deltas: list[ToolCallDelta] = []
        while True:
            if self.state == "header":
                i = self.buf.find(self.s["<|message|>"])
                if i < 0:
                    if final or (len(self.buf) > MAX_HEADER and not any(c in self.buf for c in self.s.values())):
                        self.state, self.kind = "body", "content"  # not harmony: plain text
                        continue
                    break
                self._open(self.buf[:i], deltas)
                self.buf = self.buf[i + len(self.s["<|message|>"]):]
                self.state = "body"
            else:
                ends = [j for j in (self.buf.find(self.s[k]) for k in ("<|end|>", "<|call|>", "<|return|>")) if j >= 0]
                j = min(ends) if ends else -1
                if j < 0:
                    keep = 0 if final else max(partial_tail(self.buf, self.s[k]) for k in ("<|end|>", "<|call|>", "<|return|>"))
                    self._body(self.buf[:len(self.buf) - keep], out, deltas)
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._body(self.buf[:j], out, deltas)
                self.buf = self._after_end(self.buf[j:])
                self.state, self.kind, self.index = "header", None, None
        return "".join(out["reasoning"]), "".join(out["content"]), deltas

    def _after_end(self, rest: str) -> str:
        """What follows a message's end marker (when the markers are text, the marker itself is still there)."""
        for k in ("<|end|>", "<|call|>", "<|return|>"):
            if rest.startswith(self.s[k]):
                return rest[len(self.s[k]):]
        return rest

    def _open(self, header: str, deltas: list[ToolCallDelta]) -> None:
        """A message's header read: what its body is."""
        text = self.m.restore(header)
        to = RECIPIENT.search(text)
        channel = re.search(r"<\|channel\|>\s*(\w+)", text)
        if to and to.group(1).startswith("functions.") and self.tools:
            self.kind, self.index = "call", self.calls
            self.calls += 1
            deltas.append(ToolCallDelta(self.index, new_call_id(), to.group(1).removeprefix("functions."), ""))
        elif channel and channel.group(1) == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _body(self, text: str, out: dict, deltas: list[ToolCallDelta]) -> None:
        if not text:
            return
        if self.kind == "call":
            if deltas and deltas[-1].index == self.index:
                deltas[-1].arguments += text
            else:
                deltas.append(ToolCallDelta(self.index, arguments=text))
        else:
            out[self.kind].append(self.m.restore(text))
