"""A tiktoken BPE vocabulary (Kimi-K2's `tiktoken.model`) as a tokenizers.Tokenizer, read without running the
checkpoint's own Python (its tokenization_kimi.py): the ranks file, the split pattern the tokenizer class is known to
use, and the special tokens of tokenizer_config.json at their ids.

A rank file line is the token's bytes in base64 and its rank (= its id); tiktoken merges, within each piece the
pattern splits off, the adjacent pair whose concatenation has the lowest rank, and takes a piece that is itself a
token whole. That is a byte-level BPE whose merges are each token's split into two tokens of lower rank, in rank
order, with `ignore_merges` (transformers' TikTokenConverter builds the same; it needs the tiktoken package to read
the file, which this does not). The special tokens follow the ranks: tokenizer_config.json's added_tokens_decoder
names some ids, the rest of the reserved range are <|reserved_token_ID|> as the published class fills them.
"""
from __future__ import annotations

import base64
import binascii
import json
import pathlib
from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.pre_tokenizers import ByteLevel

from moe_core.errors import ModelConfigError

FILE = "tiktoken.model"

# Kimi-K2's split (tokenization_kimi.py; llama.cpp's src/unicode.cpp quotes it for its own Kimi-K2 splitter): Han runs
# alone, then GPT-4-style words whose letters exclude Han, digits by three, punctuation runs, whitespace
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# the published tokenizer classes (tokenizer_config.json's auto_map) -> (their split pattern, special ids reserved)
CLASSES = {"tokenization_kimi.TikTokenTokenizer": (KIMI_PATTERN, 256)}


def read_ranks(path: pathlib.Path) -> dict[bytes, int]:
    """token bytes -> rank, every rank 0..n-1 once (ModelConfigError naming the line otherwise)."""
    ranks: dict[bytes, int] = {}
    for i, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            b64, rank = line.split()
            token, rank = base64.b64decode(b64, validate=True), int(rank)
        except (ValueError, binascii.Error):
            raise ModelConfigError(f"{path} line {i}: not '<base64 token> <rank>'") from None
        if token in ranks or not token:
            raise ModelConfigError(f"{path} line {i}: token {token!r} {'again' if token else 'empty'}")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelConfigError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ModelConfigError(f"{path}: not every single byte is a token (a byte-level BPE needs all 256)")
    return ranks


def _bpe(ranks: dict[bytes, int]) -> BPE:
    to_char = _bytes_to_unicode()
    text = lambda b: "".join(to_char[x] for x in b)  # noqa: E731
    vocab = {text(t): r for t, r in ranks.items()}
    merges = []
    for t, r in ranks.items():
        splits = [(t[:i], t[i:]) for i in range(1, len(t)) if t[:i] in ranks and t[i:] in ranks]
        merges += [(r, ranks[a], ranks[b], a, b) for a, b in splits]
    merges.sort()
    return BPE(vocab, [(text(a), text(b)) for *_, a, b in merges], fuse_unk=False, ignore_merges=True)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer and decoder use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write(out: pathlib.Path, ranks: Iterable[bytes], cls: str, specials: dict[int, str], extra: dict) -> None:
    """A tiktoken vocabulary into out: the rank file (ranks in order) and tokenizer_config.json naming the class, the
    special tokens by id and `extra` (chat template, bos/eos). What prepares a GGUF of Kimi for `load`."""
    (out / FILE).write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    added = {str(i): {"content": c, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
                      "single_word": False} for i, c in sorted(specials.items())}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {**extra, "auto_map": {"AutoTokenizer": [cls, None]}, "added_tokens_decoder": added}, ensure_ascii=False))


def byte_level_decoder() -> dict[str, int]:
    """A byte-level BPE's character -> the byte it spells (GPT-2's map, as GGUF token lists write tokens)."""
    return {c: b for b, c in _bytes_to_unicode().items()}


def load(model_dir: pathlib.Path) -> Tokenizer:
    """The folder's tiktoken.model and tokenizer_config.json as a Tokenizer (ModelConfigError: what is wrong)."""
    path = model_dir / FILE
    tc = model_dir / "tokenizer_config.json"
    config = json.loads(tc.read_text()) if tc.exists() else {}
    cls = ((config.get("auto_map") or {}).get("AutoTokenizer") or [None])[0]
    if cls not in CLASSES:
        raise ModelConfigError(f"{path}: a tiktoken vocabulary of tokenizer class {cls!r}, whose split pattern is not "
                               f"known here (known: {', '.join(CLASSES)})")
    pattern, reserved = CLASSES[cls]
    ranks = read_ranks(path)
    tok = Tokenizer(_bpe(ranks))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                 ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    n = len(ranks)
    named = {}
    for k, v in (config.get("added_tokens_decoder") or {}).items():
        i = int(k)
        if not n <= i < n + reserved:
            raise ModelConfigError(f"{tc}: added token {v.get('content')!r} has id {i}, outside the special range "
                                   f"{n}..{n + reserved - 1} after the {n} ranks of {path.name}")
        named[i] = v
    specials = []
    for i in range(n, n + reserved):
        v = named.get(i, {})
        specials.append(AddedToken(v.get("content") or f"<|reserved_token_{i}|>", special=v.get("special", True),
                                   normalized=False, lstrip=bool(v.get("lstrip")), rstrip=bool(v.get("rstrip")),
                                   single_word=bool(v.get("single_word"))))
    tok.add_special_tokens(specials)
    for i, t in zip(range(n, n + reserved), specials):
        if tok.token_to_id(t.content) != i:
            raise ModelConfigError(f"{tc}: special token {t.content!r} named twice or shadowing a rank of {path.name}")
    return tok
