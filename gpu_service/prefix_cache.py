"""Automatic prefix caching, per sequence: the KV caches of recent prompts and answers, kept so that a request
that starts with the same tokens (a chat's next turn, an agent resending its history, the same system prompt)
prefills only the rest.

A request's cache is remembered twice: when its prompt is prefilled (so a concurrent or following request with
the same prompt hits it) and when it ends (its answer too: a chat's next turn hits the previous answer). A
remembered cache shares the request's buffers: positions below its length are never written again (a step
writes at and past the cache's length), and linear-attention states are replaced, not changed in place
(attention.KVCache). A hit copies the common prefix into the new request's own cache (a memory copy of the
prefix, against recomputing it), so a remembered cache is never written by another request.

Entries are keyed by what changes the numbers within one server (the model, its formats and kernel paths are
fixed for the process; the expert service is held to the same ones by the health watch): the deferral setting
and whether deferred experts are skipped. Unused entries are dropped least-recently-used beyond the byte budget
(--prefix-cache-gb; an entry's bytes are its buffers', shared with a running request or not). An eviction never
changes an answer: a miss recomputes the same positions.

Not yet paged: the KV cache is one buffer per layer and sequence, so sharing is by copy at a hit, not by
blocks (issue #30's paged pool comes next and replaces the copy)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from . import metrics
from .attention import KVCache

MIN_TOKENS = 16  # a shorter common prefix is not worth a lookup's copy


@dataclasses.dataclass
class Entry:
    tokens: np.ndarray  # the ids whose keys and values the cache holds (positions 0 .. len - 1)
    cache: KVCache      # shares buffers with the request that made it
    key: tuple
    nbytes: int
    used: float


class PrefixCache:
    def __init__(self, budget_bytes: int, linear_layers: bool):
        """linear_layers: the model has linear-attention layers (Qwen3-Next), whose state exists only at an
        entry's end: a hit must then reuse the entry whole. The engine then prefills a prompt's last token in a
        step of its own and remembers the prompt without it (where a repeat of it resumes), and the entries
        of one conversation are all kept (each is the only place its state exists)."""
        self.budget, self.linear = budget_bytes, linear_layers
        self.entries: list[Entry] = []

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def lookup(self, prompt: list[int], key: tuple, new_cache) -> tuple[KVCache, int]:
        """A cache for a new request with this prompt: -> (the cache, the tokens it already holds). The prompt's
        longest remembered prefix (never all of it: its last token is computed for the logits)."""
        p = np.asarray(prompt, dtype=np.int64)
        best, n = None, 0
        for e in self.entries:
            if e.key != key:
                continue
            m = min(len(e.tokens), len(p) - 1)
            same = e.tokens[:m] == p[:m]
            k = m if same.all() else int(np.argmin(same))  # the first difference
            if self.linear and k != len(e.tokens):
                continue  # its linear-attention state is at its end only
            if k > n:
                best, n = e, k
        metrics.PREFIX_QUERY_TOKENS.inc(len(prompt))
        if best is None or n < MIN_TOKENS:
            return new_cache(), 0
        best.used = time.monotonic()
        metrics.PREFIX_HIT_TOKENS.inc(n)
        return best.cache.fork(n, reserve=len(prompt)), n

    def remember(self, tokens: list[int], cache: KVCache, key: tuple) -> None:
        """Keep cache (its first len(tokens) positions, which hold tokens) for later requests."""
        if self.budget <= 0 or len(tokens) < MIN_TOKENS or cache.length < len(tokens):
            return
        t = np.asarray(tokens, dtype=np.int64)
        # an entry this one extends (its prompt, now with the answer) is superseded; with linear attention only
        # the same tokens are (a shorter entry's state is the only one at its length)
        self.entries = [e for e in self.entries if not (e.key == key and len(e.tokens) <= len(t) and (
            not self.linear or len(e.tokens) == len(t)) and (e.tokens == t[:len(e.tokens)]).all())]
        snap = cache.snapshot(len(tokens))
        self.entries.append(Entry(t, snap, key, snap.nbytes, time.monotonic()))
        self._evict()

    def _evict(self) -> None:
        self.entries.sort(key=lambda e: e.used)
        while self.entries and self.nbytes > self.budget:
            self.entries.pop(0)
            metrics.PREFIX_EVICTIONS.inc()
        metrics.PREFIX_BYTES.set(self.nbytes)

    def clear(self) -> None:
        self.entries.clear()
        metrics.PREFIX_BYTES.set(0)
