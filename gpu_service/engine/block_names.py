"""The names of full KV blocks: a hash chain (blake2b of the previous block's name and this block's token ids) from
a root that names everything else that changes the numbers (prefix_cache.py says what goes into it)."""
from __future__ import annotations

import hashlib

import numpy as np


def root(namespace: str, key: tuple) -> bytes:
    return hashlib.blake2b(f"{namespace}|{key!r}".encode(), digest_size=16).digest()


def next_name(prev: bytes, ids: list[int]) -> bytes:
    return hashlib.blake2b(prev + np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()
