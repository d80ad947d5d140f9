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

import collections
import dataclasses

import numpy as np

from . import metrics
from .attention import KVCache

MIN_TOKENS = 16  # a shorter common prefix is not worth a lookup's copy
MAX_ENTRIES = 1024  # beyond the byte budget, a bound on the bookkeeping (short prompts of a small model)


@dataclasses.dataclass(eq=False)  # entries are told apart by identity
class Entry:
    tokens: np.ndarray  # the ids whose keys and values the cache holds (positions 0 .. len - 1)
    cache: KVCache      # shares buffers with the request that made it
    key: tuple
    nbytes: int


class PrefixCache:
    def __init__(self, budget_bytes: int, linear_layers: bool):
        """linear_layers: the model has linear-attention layers (Qwen3-Next), whose state exists only at an
        entry's end: a hit must then reuse the entry whole. The engine then prefills a prompt's last token in a
        step of its own and remembers the prompt without it (where a repeat of it resumes), and the entries
        of one conversation are all kept (each is the only place its state exists)."""
        self.budget, self.linear = budget_bytes, linear_layers
        # entries by their key and first MIN_TOKENS ids (only those can give a hit: a lookup reads one group),
        # and all of them from least to most recently used
        self.groups: dict[tuple, list[Entry]] = {}
        self.lru: collections.OrderedDict[int, tuple[tuple, Entry]] = collections.OrderedDict()
        self.nbytes = 0

    @property
    def entries(self) -> list[Entry]:
        return [e for _, e in self.lru.values()]

    @staticmethod
    def _group(key: tuple, ids: np.ndarray) -> tuple:
        return key, ids[:MIN_TOKENS].tobytes()

    def lookup(self, prompt: list[int], key: tuple, new_cache) -> tuple[KVCache, int]:
        """A cache for a new request with this prompt: -> (the cache, the tokens it already holds). The prompt's
        longest remembered prefix (never all of it: its last token is computed for the logits)."""
        p = np.asarray(prompt, dtype=np.int64)
        best, n = None, 0
        for e in self.groups.get(self._group(key, p), ()) if len(p) > MIN_TOKENS else ():
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
        self.lru.move_to_end(id(best))
        metrics.PREFIX_HIT_TOKENS.inc(n)
        return best.cache.fork(n, reserve=len(prompt)), n

    def remember(self, tokens: list[int], cache: KVCache, key: tuple) -> None:
        """Keep cache (its first len(tokens) positions, which hold tokens) for later requests."""
        if self.budget <= 0 or len(tokens) < MIN_TOKENS or cache.length < len(tokens):
            return
        t = np.asarray(tokens, dtype=np.int64)
        g = self._group(key, t)
        # an entry this one extends (its prompt, now with the answer) is superseded; with linear attention only
        # the same tokens are (a shorter entry's state is the only one at its length)
        for e in [e for e in self.groups.get(g, ()) if len(e.tokens) <= len(t) and (
                not self.linear or len(e.tokens) == len(t)) and (e.tokens == t[:len(e.tokens)]).all()]:
            self._drop(g, e)
        snap = cache.snapshot(len(tokens))
        e = Entry(t, snap, key, snap.nbytes)
        self.groups.setdefault(g, []).append(e)
        self.lru[id(e)] = (g, e)
        self.nbytes += e.nbytes
        while self.lru and (self.nbytes > self.budget or len(self.lru) > MAX_ENTRIES):
            self._drop(*next(iter(self.lru.values())))
            metrics.PREFIX_EVICTIONS.inc()
        metrics.PREFIX_BYTES.set(self.nbytes)

    def _drop(self, g: tuple, e: Entry) -> None:
        self.groups[g].remove(e)
        if not self.groups[g]:
            del self.groups[g]
        del self.lru[id(e)]
        self.nbytes -= e.nbytes

    def clear(self) -> None:
        self.groups.clear()
        self.lru.clear()
        self.nbytes = 0
        metrics.PREFIX_BYTES.set(0)
