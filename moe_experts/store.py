"""Load the routed experts (and nothing else) of every MoE layer from a checkpoint into DRAM,
one operator per layer, packed expert by expert: at most one expert's source tensors exist beside
the packed weights, and the checkpoint's memory-mapped pages are let go every few experts (a mapped
page read once stays in the process's RSS until its file is closed)."""
from __future__ import annotations

import logging
import threading
import time

import torch
from tqdm import tqdm

from moe_core.checkpoint import Checkpoint
from moe_core.config import FP8_BLOCK, SILU, ModelConfig, check_shape
from moe_core.gguf_model import layer_formats
from moe_core.shards import Shard
from moe_kernels.packing import Fp8, Mx4

from moe_experts import kernels
from moe_experts.packed_cache import PackedCache

log = logging.getLogger("moe_experts.store")

RELEASE_EVERY = 8  # experts between closing the shards (reopening one costs a few ms: its header)


class LoadCancelled(Exception):
    """Loading stopped on request (SIGTERM while loading)."""


def fused_expert(cfg: ModelConfig, ckpt: Checkpoint, layer: int, e: int) -> tuple:
    """Every expert of a layer in one tensor per projection -> expert e's (gate [I, H], up [I, H],
    down [H, I]), floats or Mx4 (kept bit for bit).
    gpt-oss: gate_up_proj [E, H, 2I] with gate and up columns interleaved, down_proj [E, I, H]; as
    published, MXFP4 _blocks [E, rows, K/32, 16] and _scales [E, rows, K/32] of the transposed matrices
    ([2I, H] with gate and up rows interleaved, [H, I]).
    Qwen3.5 as published (transformers' own layout): gate_up_proj [E, 2I, H], gate rows then up rows,
    down_proj [E, H, I]."""
    gate_up_name, down_name = cfg.stacked_expert_names(layer)
    if not cfg.fused_experts:
        gu, I = ckpt.get_row(gate_up_name, e), cfg.moe_intermediate_size
        return gu[:I], gu[I:], ckpt.get_row(down_name, e)
    if cfg.mxfp4_experts:
        gu, dn = (Mx4.from_blocks(ckpt.get_row(n + "_blocks", e), ckpt.get_row(n + "_scales", e))
                  for n in (gate_up_name, down_name))
        return Mx4(gu.codes[0::2], gu.exps[0::2]), Mx4(gu.codes[1::2], gu.exps[1::2]), dn
    gu = ckpt.get_row(gate_up_name, e)  # [H, 2I]
    return gu[:, 0::2].T, gu[:, 1::2].T, ckpt.get_row(down_name, e).T


def expert_tensor(cfg: ModelConfig, ckpt: Checkpoint, name: str, fmt: str):
    """One expert matrix: FP8 kept as published (packing.Fp8) for the fp8 format; int4 checkpoints' and GGUF
    blocks the format holds exactly (packing.Int4, UInt4, Iq4, Q8: the checkpoint's get_published); else floats."""
    if fmt == "fp8" and ckpt.fp8_block == (FP8_BLOCK, FP8_BLOCK):
        published = ckpt.get_fp8(name)
        if published is not None:
            return Fp8(*published)
    published = ckpt.get_published(name, fmt)  # None where the checkpoint has nothing fmt keeps
    if published is not None:
        return published
    t = ckpt.get(name)
    check_shape(cfg, name, tuple(t.shape))
    return t


def expert_weights(cfg: ModelConfig, ckpt: Checkpoint, layer: int, e: int, fmts: tuple[str, str]) -> tuple:
    """Expert e of a layer as the operators take it: (gate [I, H], up [I, H], down [H, I]), floats or kept as
    published where the layer's formats (gate/up's, down's: gguf_model.layer_formats) keep them (fused_expert,
    expert_tensor)."""
    if cfg.fused_experts or cfg.stacked_expert_names(layer)[0] in ckpt:
        return fused_expert(cfg, ckpt, layer, e)
    return tuple(expert_tensor(cfg, ckpt, n, f) for n, f in zip(cfg.expert_tensor_names(layer, e), (fmts[0], *fmts)))


def expert_biases(cfg: ModelConfig, ckpt: Checkpoint, layer: int, experts) -> tuple:
    """gpt-oss: (gate/up bias [E, 2I] as the kernels take it, gate then up; down bias [E, H]) of these
    experts (a shard's, the GPU side's hot ones), in their order; else none."""
    if not cfg.expert_bias:
        return None, None
    gate_up_name, _, down_name = cfg.expert_tensor_names(layer, 0)
    mine = list(experts)
    b = ckpt.get(gate_up_name + "_bias")[mine]  # [E, 2I], interleaved like the weight's columns
    return torch.cat([b[:, 0::2], b[:, 1::2]], dim=1), ckpt.get(down_name + "_bias")[mine]


def load_expert_layers(cfg: ModelConfig, ckpt: Checkpoint, fmt: str, threads: int,
                       progress: bool | None = None, cancel: threading.Event | None = None,
                       cache: PackedCache | None = None, shard: Shard = Shard()) -> dict[int, object]:
    """-> {layer index: MoELayer}. progress: a progress bar (None = when stderr is a terminal; a log line
    per layer either way, for containers). cancel: set it to stop between two experts (LoadCancelled).
    cache: take each layer from the packed-weight cache when it holds a valid copy, else pack it from
    the checkpoint and write it there (native formats only). shard: only its experts, in local order
    (moe_core.shards)."""
    layers = {}
    hits = 0
    if cache is not None:
        cache.sweep()
    t0 = time.perf_counter()
    mine = shard.experts(cfg.n_routed_experts)
    E, I, H = len(mine), cfg.moe_intermediate_size, cfg.hidden_size
    bar = tqdm(total=len(cfg.moe_layers) * E, unit="expert", desc=f"experts -> {fmt}", dynamic_ncols=True,
               disable=None if progress is None else not progress)  # None: only on a terminal
    def check_cancel() -> None:
        if cancel is not None and cancel.is_set():
            raise LoadCancelled()

    with bar:
        for i, layer in enumerate(cfg.moe_layers):
            def load(local: int, layer=layer):
                check_cancel()
                if local % RELEASE_EVERY == 0:
                    ckpt.close()
                bar.update(1)
                return expert_weights(cfg, ckpt, layer, mine[local], fmts)

            check_cancel()
            fmts = layer_formats(cfg, ckpt, layer, fmt)
            op = cache.load(layer, E, I, H, threads, fmts) if cache is not None else None
            cached = op is not None
            if cached:
                hits += 1
                bar.update(E)
            else:
                op = kernels.MoELayerFromExperts(E, I, H, load, fmt=fmts[0], threads=threads, down_fmt=fmts[1])
                if cache is not None:
                    check_cancel()  # before a write of the whole layer
                    cache.save(layer, op)
            if cfg.expert_bias or cfg.expert_act != SILU:  # small: read each start, never cached
                op.set_extras(cfg.expert_act, *expert_biases(cfg, ckpt, layer, mine))
            layers[layer] = op
            log.info("loaded MoE layer %d (%d/%d), %d experts%s as %s%s, %.1fs", layer, i + 1, len(cfg.moe_layers), E,
                     f" (shard {shard})" if shard.count > 1 else "",
                     "/".join(dict.fromkeys(fmts)), " from the packed-weight cache" if cached else "",
                     time.perf_counter() - t0)
    ckpt.close()
    log.info("loaded %d MoE layers in %.1fs (%d from the packed-weight cache%s)", len(layers),
             time.perf_counter() - t0, hits, f" in {cache.dir}" if cache is not None else ": off")
    return layers
