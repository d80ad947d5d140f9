"""A tiktoken vocabulary read without the checkpoint's Python (gpu_service/api/tiktoken_vocab.py) against tiktoken's
own Encoding of the same ranks, pattern and special tokens (what Kimi's published tokenizer class builds): the same
ids on awkward text, the text back from them, and a clear error for a broken rank file or an unknown class."""
from __future__ import annotations

import json

import pytest

import tiny_tiktoken
from gpu_service.api import tiktoken_vocab
from gpu_service.api.text import TextCodec
from moe_core.errors import ModelConfigError

AWKWARD = [
    tiny_tiktoken.CORPUS[:500],
    "東京タワー中文分词123456789和١٢٣digits 0000 ０１２",          # CJK runs, digit runs in three scripts
    "a  b   c\n\n\n  \t x \r\n\r\n   ",                              # whitespace runs, CRLF, trailing spaces
    "<|im_user|>hi<|im_middle|>x[EOS]<|reserved_token_400|>",       # special tokens inside the text
    "don't I'LL We'Re THEY'VE o'clock",                              # contractions, any case
    "🙂🙂 ünïcödé ＡＢＣ ｆｕｌｌ ŉ ǅ ᾈ Ⅻ",                           # emoji, combining marks, titlecase, numerals
    "mixed中文English混合Text日本語かな",                            # Han next to letters (the pattern splits them)
    "x" * 200 + " " + "12" * 40,
    "",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiktoken")
    return d, tiny_tiktoken.write(d)


def test_the_same_ids_as_tiktoken(folder):
    d, ranks = folder
    ref = tiny_tiktoken.reference(ranks)
    tok = tiktoken_vocab.load(d)
    assert tok.get_vocab_size() == len(ranks) + tiny_tiktoken.RESERVED
    for text in AWKWARD:
        want = ref.encode(text, allowed_special="all")
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, text
        assert tok.decode(got, skip_special_tokens=False) == text
    n = len(ranks)
    for k, content in tiny_tiktoken.SPECIALS.items():
        assert tok.token_to_id(content) == n + k
    assert tok.token_to_id(f"<|reserved_token_{n + 5}|>") == n + 5  # an unnamed id of the reserved range


def test_the_text_codec_serves_it(folder):
    d, ranks = folder
    codec = TextCodec(d)
    assert codec.encode("東京 12345") == tiny_tiktoken.reference(ranks).encode("東京 12345")
    assert codec.added_tokens()["<|tool_call_begin|>"] == len(ranks) + 13


def test_bad_files_are_named(tmp_path):
    d = tmp_path / "v"
    tiny_tiktoken.write(d)
    good = (d / "tiktoken.model").read_text()
    (d / "tiktoken.model").write_text(good + "not-base64!! 9999\n")
    with pytest.raises(ModelConfigError, match=r"tiktoken.model line \d+: not '<base64 token> <rank>'"):
        tiktoken_vocab.load(d)
    (d / "tiktoken.model").write_text("\n".join(good.splitlines()[1:]))  # byte 0 missing, ranks from 1
    with pytest.raises(ModelConfigError, match="ranks are not 0"):
        tiktoken_vocab.load(d)
    (d / "tiktoken.model").write_text(good)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoTokenizer": ["tok.Other", None]}}))
    with pytest.raises(ModelConfigError, match="tokenizer class 'tok.Other', whose split pattern is not known"):
        tiktoken_vocab.load(d)
    bad = {**cfg, "added_tokens_decoder": {"5": {"content": "<x>"}}}
    (d / "tokenizer_config.json").write_text(json.dumps(bad))
    with pytest.raises(ModelConfigError, match="added token '<x>' has id 5, outside the special range"):
        tiktoken_vocab.load(d)
