"""A small tiktoken vocabulary in Kimi-K2's layout, made here: a rank file (every byte, then merges learned on a corpus
of awkward text split by Kimi's pattern) and the tokenizer_config.json its published class reads, with Kimi's special
tokens at their published offsets after the ranks."""
from __future__ import annotations

import collections
import pathlib

import regex

from moe_core import tiktoken_vocab
from moe_core.tiktoken_vocab import KIMI_PATTERN

CORPUS = ("The quick brown fox jumps over the lazy dog. It's 2026; we've 12345678 tokens, don't we?\n"
          "東京都は日本の首都です。中文分词测试，数字１２３和123456。  Ünïcödé Grüße — ✓ emoji 🙂🙂\n"
          "def fib(n):\n\tif n < 2:\n\t\treturn n\n    return fib(n - 1) + fib(n - 2)\n\n\n   spaces   and\ttabs\r\n"
          "HTTPServerError XMLHttpRequest camelCase snake_case ALLCAPS Mixed123Digits 3.14159 -42 +1e-9\n") * 4
# the special tokens Kimi's template and tool calls use, at offsets after the ranks (gaps: reserved ids, named
# <|reserved_token_ID|> by the class)
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
            7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
            12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
            15: "<|tool_call_end|>", 17: "<|im_middle|>", 18: "<think>", 19: "</think>", 255: "[PAD]"}
RESERVED = 256


def ranks(merges: int = 400) -> dict[bytes, int]:
    """Every byte, then `merges` merged tokens, most frequent pair first, within the pattern's pieces."""
    words = collections.Counter(m.encode() for m in regex.findall(KIMI_PATTERN, CORPUS))
    seqs = {w: [bytes([b]) for b in w] for w in words}
    out = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs: collections.Counter = collections.Counter()
        for w, s in seqs.items():
            for a, b in zip(s, s[1:]):
                pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        out[a + b] = len(out)
        for w, s in seqs.items():
            i, merged = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(s[i])
                    i += 1
            seqs[w] = merged
    return out


def write(out: pathlib.Path, chat_template: str | None = None) -> dict[bytes, int]:
    """tiktoken.model and tokenizer_config.json (Kimi's class, its special tokens) into out -> the ranks."""
    r = ranks()
    out.mkdir(parents=True, exist_ok=True)
    extra = {"tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]"}
    if chat_template is not None:
        extra["chat_template"] = chat_template
    tiktoken_vocab.write(out, r, "tokenization_kimi.TikTokenTokenizer",
                         {len(r) + k: c for k, c in SPECIALS.items()}, extra)
    return r


def reference(r: dict[bytes, int]):
    """tiktoken's own Encoding of these ranks with Kimi's pattern and specials (what the published class builds)."""
    import tiktoken

    n = len(r)
    specials = {SPECIALS.get(k, f"<|reserved_token_{n + k}|>"): n + k for k in range(RESERVED)}
    return tiktoken.Encoding("kimi-tiny", pat_str=KIMI_PATTERN, mergeable_ranks=r, special_tokens=specials)
