"""gpu_service.api.text: tokenizing against the context limit without tokenizing a huge text whole."""
from __future__ import annotations

import random

import pytest

from harness import ROOT
from gpu_service.api import text as text_mod
from gpu_service.api.text import PromptTooLong, TextCodec


@pytest.fixture(scope="module")
def codec():
    return TextCodec(ROOT / "models" / "default")


def sample_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["def", "return", "self", "import", "x", "numpy", "  ", "\n", "\t", "for", "in", "é", "漢字", "(", "):"]
    return " ".join(rng.choice(words) for _ in range(n_words))


@pytest.mark.parametrize("n_words", [10, 20_000])
def test_within_the_limit_the_ids_are_the_whole_texts(codec, n_words):
    t = sample_text(n_words)
    assert codec.encode(t, limit=10**6) == codec.tok.encode(t).ids == codec.encode(t)


def test_over_the_limit_it_stops_early(codec, monkeypatch):
    t = sample_text(200_000)  # ~1 MB of text, far over a 1000-token limit
    seen = []
    real = codec.tok.encode
    monkeypatch.setattr(codec, "tok", type("Spy", (), {"encode": lambda self, s, **kw: (seen.append(len(s)),
                                                                                          real(s, **kw))[1]})())
    with pytest.raises(PromptTooLong) as e:
        codec.encode(t, limit=1000)
    assert e.value.at_least > 1000 and e.value.limit == 1000
    assert sum(seen) <= 2 * text_mod.PIECE  # it tokenized a piece or two, not the megabyte


def test_too_many_characters_for_any_tokenization_are_refused_at_once(codec, monkeypatch):
    monkeypatch.setattr(codec, "tok", None)  # any tokenizing would fail
    with pytest.raises(PromptTooLong):
        codec.encode("a" * (codec.max_token_chars * 100 + 1), limit=100)
    with pytest.raises(PromptTooLong):
        codec.render_chat([{"role": "user", "content": "a" * (codec.max_token_chars * 100 + 1)}], limit=100)


def test_a_long_prompt_just_under_the_limit_is_not_refused(codec):
    t = sample_text(30_000)
    n = len(codec.tok.encode(t).ids)
    assert len(t) > 2 * text_mod.PIECE  # counted piece by piece first
    assert len(codec.encode(t, limit=n)) == n
    with pytest.raises(PromptTooLong):
        codec.encode(t, limit=n - 200)
