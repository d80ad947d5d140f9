"""Load the routed experts (and nothing else) of every MoE layer from a checkpoint into DRAM,
one operator per layer."""
from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from moe_core.checkpoint import Checkpoint
from moe_core.config import ModelConfig

from . import kernels

log = logging.getLogger("expert_service.store")


def load_expert_layers(cfg: ModelConfig, ckpt: Checkpoint, fmt: str, threads: int,
                       progress: bool | None = None) -> dict[int, object]:
    """-> {layer index: MoELayer}. Reads the shards memory-mapped, one expert tensor at a time, and
    repacks / quantizes layer by layer. progress: a progress bar (None = when stderr is a terminal;
    a log line per layer either way, for containers)."""
    layers = {}
    t0 = time.perf_counter()
    E = cfg.n_routed_experts
    bar = tqdm(total=len(cfg.moe_layers) * E, unit="expert", desc=f"experts -> {fmt}", dynamic_ncols=True,
               disable=None if progress is None else not progress)  # None: only on a terminal
    with bar:
        for i, layer in enumerate(cfg.moe_layers):
            gate, up, down = [], [], []
            for e in range(E):
                g, u, d = cfg.expert_tensor_names(layer, e)
                gate.append(ckpt.get(g)), up.append(ckpt.get(u)), down.append(ckpt.get(d))
            layers[layer] = kernels.MoELayer(torch.stack(gate), torch.stack(up), torch.stack(down), fmt=fmt,
                                             threads=threads)
            bar.update(E)
            log.info("loaded MoE layer %d (%d/%d), %d experts as %s, %.1fs", layer, i + 1, len(cfg.moe_layers), E, fmt,
                     time.perf_counter() - t0)
    log.info("loaded %d MoE layers in %.1fs", len(layers), time.perf_counter() - t0)
    return layers
