"""Tokenization, chat templates, and streaming detokenization with stop strings.
Knows nothing about the model's forward pass."""
from __future__ import annotations

import datetime
import json
import pathlib

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from moe_core import tiktoken_vocab
from moe_core.config import ModelConfigError

from gpu_service.api.tools import Arguments

PIECE = 1 << 15  # characters tokenized at a time while a long prompt is checked against the context


class PromptTooLong(ValueError):
    """The text has more than `limit` tokens; `at_least`: how many were counted before stopping."""

    def __init__(self, at_least: int, limit: int):
        super().__init__(f"prompt has at least {at_least} tokens; the context limit is {limit}")
        self.at_least, self.limit = at_least, limit


def _pieces(text: str):
    """text in pieces of about PIECE characters, cut after whitespace where there is some nearby (most
    pre-tokenizers split there, so the pieces' token counts add up to about the whole's)."""
    i = 0
    while i < len(text):
        j = min(i + PIECE, len(text))
        if j < len(text):
            k = max(text.rfind(" ", i + PIECE // 2, j), text.rfind("\n", i + PIECE // 2, j))
            j = k + 1 if k >= 0 else j
        yield text[i:j]
        i = j


class TextCodec:
    def __init__(self, model_dir: str | pathlib.Path):
        d = pathlib.Path(model_dir)
        path = d / "tokenizer.json"
        if path.exists():
            self.tok = Tokenizer.from_file(str(path))
        elif (d / tiktoken_vocab.FILE).exists():  # Kimi-K2's: a tiktoken rank file and its class's pattern
            self.tok = tiktoken_vocab.load(d)
        else:
            raise ModelConfigError(f"{path} not found: the GPU service needs the checkpoint's tokenizer.json (or "
                                   f"a {tiktoken_vocab.FILE} of a known tokenizer class)")
        tc = d / "tokenizer_config.json"
        self.config = json.loads(tc.read_text()) if tc.exists() else {}
        self.chat_template = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"), None)
        jinja = d / "chat_template.jinja"
        if self.chat_template is None and jinja.exists():
            self.chat_template = jinja.read_text()
        # bytes of text one token can stand for, at most (a vocabulary entry's UTF-8 length bounds it: byte-level
        # and SentencePiece entries spell a byte in one or more characters): a prompt of more characters than
        # max_token_chars x the context limit cannot fit, whatever it tokenizes to
        self.max_token_chars = max((len(t.encode()) for t in self.tok.get_vocab(with_added_tokens=True)), default=1)

    def added_tokens(self) -> dict[str, int]:
        """The vocabulary's added tokens (special or not: control tokens, tool-call markers), content -> id."""
        return {t.content: i for i, t in self.tok.get_added_tokens_decoder().items()}

    def _special(self, key: str) -> str:
        v = self.config.get(key)
        return (v.get("content", "") if isinstance(v, dict) else v) or ""

    def encode(self, text: str, limit: int | None = None, add_special_tokens: bool = True) -> list[int]:
        """text's ids. limit: raise PromptTooLong as soon as it is clear they number more than that, without
        tokenizing all of a huge text (10 MB took 7-12 s and ~1 GB): too many characters for the limit is
        refused at once, a long text is counted a piece at a time first (a few tokens of slack per cut), and
        only a text that fits is tokenized whole (the exact ids)."""
        if limit is not None:
            if len(text) > limit * self.max_token_chars:
                raise PromptTooLong(len(text) // self.max_token_chars, limit)
            if len(text) > 2 * PIECE:
                n = 0
                for i, piece in enumerate(_pieces(text)):
                    n += len(self.tok.encode(piece, add_special_tokens=False).ids)
                    if n > limit + 4 * (i + 1):
                        raise PromptTooLong(n - 4 * (i + 1), limit)
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], limit: int | None = None, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, **template_kwargs) -> list[int]:
        """The chat template's prompt, as ids (limit: as in encode; checked on the messages' text before
        rendering, then on the rendered prompt; add_special_tokens: the tokenizer's own on top of the template's,
        as vLLM's /tokenize can ask)."""
        return self.encode(self.render_chat_text(messages, limit, add_generation_prompt, **template_kwargs), limit,
                           add_special_tokens=add_special_tokens)

    def render_chat_text(self, messages: list[dict], limit: int | None = None, add_generation_prompt: bool = True,
                         **template_kwargs) -> str:
        """The chat template's prompt as text (add_generation_prompt: ending with the assistant's turn opened);
        template_kwargs reach the template as transformers' apply_chat_template passes them (enable_thinking, ...)."""
        if not self.chat_template:
            raise ValueError("chat: this checkpoint has no chat template")
        chars = sum(len(m.get("content") or "") for m in messages)
        if limit is not None and chars > limit * self.max_token_chars:
            raise PromptTooLong(chars // self.max_token_chars, limit)
        def raise_exception(msg):
            raise ValueError(f"chat: {msg}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            x = x.obj if isinstance(x, Arguments) else x  # an earlier call's arguments: the object
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        # what transformers' apply_chat_template gives templates (gpt-oss's harmony template uses
        # strftime_now, others loop controls and a tojson that keeps non-ASCII text)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        # the template places the special tokens it wants (no more are added when it is tokenized)
        try:
            return env.from_string(self.chat_template).render(
                **template_kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._special("bos_token"), eos_token=self._special("eos_token"))
        except (jinja2.TemplateError, TypeError, AttributeError, KeyError) as e:  # the messages are not what it reads
            raise ValueError(f"chat: the chat template cannot render these messages: {e}") from None


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of text that could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class DetokenizeStream:
    """Turns a growing token list into text deltas that never split a UTF-8 character, and
    applies stop strings (the match and everything after it are never emitted). symbols: token ids written as
    the given text instead of being decoded (tool-call and channel markers, which may be special tokens that
    decoding would drop)."""

    def __init__(self, codec: TextCodec, prompt_ids: list[int], stop: list[str], symbols: dict[int, str] | None = None):
        self.codec = codec
        self.symbols = symbols or {}
        self.ids = list(prompt_ids[-4:])  # a little context, so leading-space merges decode right
        self.prefix = len(self.ids)       # tokens before the ones whose text is not yet out
        self.read = len(self.ids)
        self.stop = [s for s in stop if s]
        self.held = ""                    # decoded text kept back: it could start a stop string
        self.stopped = False
        self.matched: str | None = None   # the stop string that ended it (the first in the text, then in the list)

    def push(self, token: int) -> str:
        """Add one token; return the text that may be shown now (possibly empty)."""
        if token in self.symbols:  # what is pending comes out as it is, then the symbol; decoding starts afresh
            pending = self.codec.decode(self.ids[self.prefix:])[len(self.codec.decode(self.ids[self.prefix:self.read])):]
            self.ids, self.prefix, self.read = [], 0, 0
            return self._apply_stop(pending + self.symbols[token])
        self.ids.append(token)
        prefix_text = self.codec.decode(self.ids[self.prefix:self.read])
        full = self.codec.decode(self.ids[self.prefix:])
        if full.endswith("\ufffd") or len(full) <= len(prefix_text):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        new = full[len(prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        return self._apply_stop(new)

    def _apply_stop(self, new: str) -> str:
        if not self.stop:
            return new
        text = self.held + new
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            self.stopped, self.held = True, ""
            return text[:at]
        # hold back the longest tail that is a prefix of some stop string
        keep = max(partial_tail(text, s) for s in self.stop)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """At the end of generation: what was held back (no stop string completed)."""
        out, self.held = self.held, ""
        return "" if self.stopped else out
