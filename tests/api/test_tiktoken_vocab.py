"""A tiktoken vocabulary read without the checkpoint's Python (gpu_service/api/tiktoken_vocab.py) against tiktoken's
own Encoding of the same ranks, pattern and special tokens (what Kimi's published tokenizer class builds): the same
ids on awkward text, the text back from them, and a clear error for a broken rank file or an unknown class."""
from __future__ import annotations

import json

import pytest

import tiny_tiktoken
from moe_core import tiktoken_vocab
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


def test_a_gguf_of_kimi_gets_its_tokenizer_back(tmp_path):
    """A GGUF of Kimi as llama.cpp's converter writes its vocabulary (conversion/deepseek.py: gpt2 model, pre-tokenizer
    kimi-k2, the ranks as byte-level tokens, special tokens as control, unused ids as [PADi], the ranks' merges): the
    prepared folder tokenizes as tiktoken does, with the template and special tokens."""
    import gguf

    from moe_core import gguf_model

    ranks = tiny_tiktoken.ranks()
    n = len(ranks)
    spell = {b: c for c, b in tiktoken_vocab.byte_level_decoder().items()}
    text = lambda t: "".join(spell[b] for b in t)  # noqa: E731
    tokens, types = [text(t) for t in ranks], [gguf.TokenType.NORMAL] * n
    for i in range(n, n + tiny_tiktoken.RESERVED):
        special = tiny_tiktoken.SPECIALS.get(i - n)
        tokens.append(special or f"[PAD{i}]")
        types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.UNUSED)
    merges = [f"{text(t[:j])} {text(t[j:])}" for t in ranks if len(t) > 1
              for j in range(1, len(t)) if t[:j] in ranks and t[j:] in ranks][:50]
    path = tmp_path / "kimi.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("kimi-k2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(n)
    w.add_eos_token_id(n + 2)
    w.add_chat_template("{% for m in messages %}<|im_user|>{{ m.content }}<|im_end|>{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "prepared"
    out.mkdir()
    gguf_model._tokenizer_files(path, out)
    codec = TextCodec(out)
    ref = tiny_tiktoken.reference(ranks)
    for t in AWKWARD:
        assert codec.encode(t, add_special_tokens=False) == ref.encode(t, allowed_special="all"), t
    assert codec.added_tokens()["<|tool_call_argument_begin|>"] == n + 14
    assert "<|im_user|>" in codec.chat_template
