"""Reasoning models' thinking, apart from their answer: DeepSeek-R1, Qwen3 (thinking mode), GLM-4.5 and other
checkpoints that write their reasoning between <think> and </think>. The split is made on the text as it
streams, so the reasoning and the answer arrive as separate deltas (OpenAI's `reasoning_content`, gRPC's
`GenerateChunk.reasoning`). A template may open the block itself (DeepSeek-R1's ends its generation prompt
with "<think>\\n"): the split then starts inside it. gpt-oss's harmony channels are read by harmony.py.
"""
from __future__ import annotations

from gpu_service.api.text import partial_tail

PARSERS = ("auto", "think", "harmony", "none")  # harmony: gpt-oss's channels (harmony.py)
START, END = "<think>", "</think>"


def uses_think_tags(chat_template: str | None, vocab: dict[str, int]) -> bool:
    """Whether a checkpoint writes <think> blocks: its chat template or its vocabulary knows the tags."""
    return bool(chat_template and END in chat_template) or (START in vocab and END in vocab)


def opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a <think> block (its template opened one for the model)."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


class ReasoningSplitter:
    """Text deltas in, (reasoning, answer) deltas out. A tag split across deltas is held back until it is
    whole; the tags themselves are never shown. start, end: the tags as the text shows them (a symbol where they
    are tokens: tool_formats.Markers)."""

    def __init__(self, inside: bool = False, start: str = START, end: str = END):
        self.inside = inside  # within a <think> block now
        self.held = ""
        self.start, self.end = start, end

    def push(self, text: str) -> tuple[str, str]:
        text = self.held + text
        self.held = ""
        reasoning, answer = [], []
        while text:
            tag = self.end if self.inside else self.start
            i = text.find(tag)
            out = reasoning if self.inside else answer
            if i >= 0:
                out.append(text[:i])
                text = text[i + len(tag):]
                self.inside = not self.inside
                continue
            keep = partial_tail(text, tag)
            out.append(text[:len(text) - keep])
            self.held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """At the end: what was held back (a tag that never completed is text after all)."""
        held, self.held = self.held, ""
        return (held, "") if self.inside else ("", held)
