"""How often each routed expert is chosen, per MoE layer, measured online: the counts behind the GPU side's
hot experts (hot_experts.py). Counts decay with a half-life in tokens, so the placement follows what the
current requests use; a saved profile (--gpu-experts-profile) starts a restart where the last run left off.

The engine thread adds each step's choices on the device (one indexed add a layer, no synchronization); the
placement thread folds them into the decayed counts when it looks (snapshot).
"""
from __future__ import annotations

import json
import os
import pathlib
import threading

import torch

PROFILE_VERSION = 1


class ExpertUsage:
    def __init__(self, layers: list[int], n_experts: int, half_life_tokens: float, device: torch.device):
        self.layers, self.n_experts, self.half_life = list(layers), n_experts, float(half_life_tokens)
        self.row = {L: i for i, L in enumerate(self.layers)}
        self.counts = torch.zeros(len(self.layers), n_experts, dtype=torch.float64)  # decayed, on the host
        self.fresh = torch.zeros(len(self.layers), n_experts, dtype=torch.float32, device=device)
        self.fresh_tokens = [0] * len(self.layers)
        self.one = torch.ones((), dtype=torch.float32, device=device)
        self.lock = threading.Lock()

    def observe(self, layer: int, ids: torch.Tensor) -> None:
        """A step's choices for one layer: ids [T, k] (global expert ids)."""
        r = self.row[layer]
        with self.lock:
            self.fresh[r].index_put_((ids.reshape(-1).long(),), self.one, accumulate=True)
            self.fresh_tokens[r] += ids.shape[0]

    def snapshot(self) -> torch.Tensor:
        """-> the decayed counts [layers, experts] (fp64, host), the choices since the last call folded in: every
        layer's old counts halve with each half-life of tokens it has seen since."""
        with self.lock:
            fresh, self.fresh = self.fresh, torch.zeros_like(self.fresh)
            tokens, self.fresh_tokens = self.fresh_tokens, [0] * len(self.layers)
        decay = torch.tensor([0.5 ** (t / self.half_life) for t in tokens], dtype=torch.float64)
        self.counts = self.counts * decay[:, None] + fresh.to("cpu", torch.float64)
        return self.counts.clone()

    def seed(self, counts: dict[int, list[float]]) -> None:
        """Start from saved counts (a profile): {layer: [count per expert]}."""
        for L, c in counts.items():
            self.counts[self.row[L]] = torch.tensor(c, dtype=torch.float64)


def choose(counts: torch.Tensor, current: list[int], n: int, margin: float) -> list[int]:
    """The n experts to keep hot in a layer, from its usage counts [E]: the most used, except that an
    incumbent stays unless a newcomer is used more than `margin` times as much (a swap costs a copy of the
    expert's weights; noise between two near-equal experts must not cause one each refresh). Sorted."""
    E = counts.shape[0]
    n = min(n, E)
    hot = set(current[:n])
    order = sorted(range(E), key=lambda e: (-float(counts[e]), e))  # most used first; ties: lower id
    for e in order:  # fill up to n (a new run, or n grew)
        if len(hot) >= n:
            break
        hot.add(e)
    newcomers = [e for e in order if e not in hot]
    incumbents = sorted(hot, key=lambda e: (float(counts[e]), -e))  # least used first
    for new, old in zip(newcomers, incumbents):
        if not float(counts[new]) > margin * float(counts[old]):
            break
        hot.discard(old)
        hot.add(new)
    return sorted(hot)


# -- the profile file --------------------------------------------------------------------------------------
def load_profile(path: str, fingerprint: str, layers: list[int], n_experts: int) -> tuple[dict, dict]:
    """-> ({layer: hot experts}, {layer: counts}) saved for this model; ValueError naming what does not fit
    (another model, another expert count, a malformed file). A file that does not exist yet: nothing."""
    p = pathlib.Path(path)
    if not p.exists():
        return {}, {}
    try:
        doc = json.loads(p.read_text())
        if doc.get("version") != PROFILE_VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {PROFILE_VERSION}")
        if doc["model_fingerprint"] != fingerprint:
            raise ValueError(f"it was saved for the model with fingerprint {doc['model_fingerprint']}, this one is "
                             f"{fingerprint}")
        hot, counts = {}, {}
        for key, entry in doc["layers"].items():
            L = int(key)
            if L not in layers:
                raise ValueError(f"layer {L} is not an MoE layer of this model")
            c = [float(v) for v in entry["usage"]]
            h = [int(e) for e in entry["hot"]]
            if len(c) != n_experts or any(not 0 <= e < n_experts for e in h) or len(set(h)) != len(h):
                raise ValueError(f"layer {L}: {len(c)} counts and hot experts {h} for a model of {n_experts} experts")
            hot[L], counts[L] = h, c
        return hot, counts
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"malformed ({type(e).__name__}: {e})") from None


def save_profile(path: str, fingerprint: str, hot: dict[int, list[int]], counts: torch.Tensor,
                 layers: list[int]) -> None:
    """Written whole, then renamed over the old one: a crash never leaves half a file."""
    doc = {"version": PROFILE_VERSION, "model_fingerprint": fingerprint,
           "layers": {str(L): {"hot": list(hot.get(L, [])), "usage": [round(float(v), 3) for v in counts[i]]}
                      for i, L in enumerate(layers)}}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
