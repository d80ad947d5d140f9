"""The GPU-side model: every weight except the routed experts, and one forward over a flat
batch of tokens from several sequences (prefill and decode mixed).

Per MoE layer the routed experts go to the expert service through `experts` (experts.Experts); the
shared experts run here while the expert service computes. With deferral, layer L's deferred
sum is added one MoE layer later.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time

import torch
import torch.nn.functional as F

from moe_core.checkpoint import Checkpoint
from moe_core.config import FP8_BLOCK, ModelConfig, check_shape, is_routed_expert_tensor
from moe_core.routing import split_deferred
from moe_kernels.dense import NativeLinear  # dispatch's shared-memory channel needs moe_kernels anyway
from moe_kernels.packing import Fp8

from . import decode_loop, decode_step, graphed_decode
from .attention import QKV, gqa_attention, mla_attention
from .experts import Experts, Span
from .kv_pool import BLOCK, KVPool, SeqCache
from .linear_attention import gated_deltanet
from .layers import (GATE_UP, linear, packs_router, rms_norm, rope_cos_sin, rope_inv_freq, route,
                     softmax_scale, swiglu)

log = logging.getLogger("gpu_service.model")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class Segment:
    """One sequence's share of a step: `tokens` [t] at positions start..start+t-1."""
    cache: SeqCache
    tokens: torch.Tensor
    start: int
    all_logits: bool = False  # logits for every position (scoring), else only the last
    logprobs: bool = False    # scoring: log p(targets[i]) and the argmax at every position, into `scored`
    targets: torch.Tensor | None = None  # logprobs: the next token of each position (one fewer at the end)
    scored: tuple | None = None


# weights used as plain x W^T, which --dense-format packs for the native kernels: attention projections
# (not MLA's kv_b_proj, used in absorbed form), dense MLPs and shared experts; lm_head too
DENSE = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|gate_proj|up_proj|down_proj"
                   r"|in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight$")


# weights that share their input, packed as one matrix for the native kernels (one call instead of
# several): GQA's q/k/v, and gate/up of dense MLPs and shared experts; rows in this order
FUSED = {QKV: ("q_proj", "k_proj", "v_proj"), GATE_UP: ("gate_proj", "up_proj")}
FUSED_PART = re.compile(r"(self_attn\.[qkv]_proj|(gate|up)_proj)\.weight$")
CLOSE_EVERY_BYTES = 256 << 20  # packing dense layers: reopen the checkpoint after this many source bytes


DIRECT_TOKENS = 1 << 16  # positions of the pool new_cache() uses when no engine set one

FP32_ROUTER = ("deepseek_v3", "deepseek_v2", "glm4_moe")


def _keep_fp32(cfg: ModelConfig, name: str) -> bool:
    # transformers keeps DeepSeek's (and GLM's, the same router) weight and bias in fp32 whatever the model dtype
    return cfg.model_type in FP32_ROUTER and (name.endswith("mlp.gate.weight") or name.endswith("e_score_correction_bias"))


def _stored_dtype(cfg: ModelConfig, name: str, dtype: torch.dtype, device: torch.device, dense_format) -> torch.dtype:
    """The dtype a torch-tensor weight is kept in. MLA's kv_b_proj, read whole at every decode step by the native
    absorbed products, stays the checkpoint's bf16 (the same values, half the bytes) under an fp32 model on the CPU."""
    if _keep_fp32(cfg, name):
        return torch.float32
    if (cfg.attention == "mla" and name.endswith("kv_b_proj.weight") and dense_format and device.type == "cpu"
            and dtype == torch.float32 and DTYPES.get(cfg.torch_dtype) == torch.bfloat16):
        return torch.bfloat16
    return dtype


class Model:
    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype,
                 cancel: threading.Event | None = None, dense_format: str | None = None,
                 kv_dtype: torch.dtype | None = None, cuda_graphs: bool = True):
        """Loads every non-expert weight (FP8 ones dequantized, then cast to `dtype`); `cancel` stops it
        between two tensors (InterruptedError). The checkpoint's mapped pages are let go afterwards.
        dense_format (bf16 | int8 | int4 | fp8, CPU only): the DENSE weights and lm_head are packed for the
        native kernels in that format instead of kept as torch tensors (fp8: an FP8 checkpoint's FP8 weights as
        published, its others as bf16). kv_dtype: the KV cache's (default `dtype`; --kv-cache-dtype). cuda_graphs:
        decode steps on CUDA as captured graphs where the layers allow (graphed_decode.py; --cuda-graphs)."""
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.kv_dtype = kv_dtype or dtype
        self.W: dict[str, torch.Tensor] = {}
        packed_since_close = 0
        parts: dict[str, dict[str, torch.Tensor]] = {}  # fused name -> its parts read so far
        for name in ckpt.names(lambda n: not is_routed_expert_tensor(n)):
            if cancel is not None and cancel.is_set():
                raise InterruptedError("loading cancelled")
            if name.startswith("mtp.") or (name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_layers):
                continue  # multi-token-prediction layers (DeepSeek-V3's, Qwen3-Next's mtp.*): not used to decode
            fuse = dense_format and FUSED_PART.search(name) and not (cfg.attention == "mla" and "self_attn" in name)
            pack = dense_format and (DENSE.search(name) or name == "lm_head.weight")
            # the router (and Qwen2-MoE's shared expert gate) in bf16 whatever dense_format says: its logits round
            # to bf16 as torch's bf16 matmul's do (sums in fp32 both), where torch's bf16 matrix-vector product is
            # slow on a CPU
            router = dense_format and (packs_router(cfg) and name.endswith(f".{cfg.router_name}.weight") and
                                       cfg.is_moe_layer(int(name.split(".")[2]))
                                       or name.endswith(".shared_expert_gate.weight"))
            # an FP8 weight is dequantized straight to what it becomes (bf16 packing keeps bf16: the same
            # bits as rounding later; int formats quantize from fp32), never a whole fp32 copy beside it
            want = ((torch.bfloat16 if dense_format in ("bf16", "fp8") else torch.float32) if fuse or pack
                    else _stored_dtype(cfg, name, dtype, device, dense_format))
            # fp8: FP8 weights kept as published; the checkpoint's other weights packed as bf16 (never requantized)
            published = ckpt.get_fp8(name) if dense_format == "fp8" and (fuse or pack) and ckpt.fp8_block == \
                (FP8_BLOCK, FP8_BLOCK) else None
            t = Fp8(*published) if published is not None else ckpt.get(name, want)
            if published is None:
                check_shape(cfg, name, tuple(t.shape))
            fmt = "fp8" if published is not None else "bf16" if dense_format == "fp8" else dense_format
            if fuse:
                self._fuse(name, t, parts, fmt)  # packed once every part is read
            elif router:
                self.W[name] = NativeLinear(t, "bf16")
            elif pack:
                # packed straight from the checkpoint's tensor, a few thousand rows at a time: no
                # second full copy of any weight while starting
                self.W[name] = NativeLinear(t, fmt)
                packed_since_close += self.W[name].nbytes
                if packed_since_close > CLOSE_EVERY_BYTES:  # the source pages read so far leave the RSS
                    del t
                    ckpt.close()
                    packed_since_close = 0
            else:
                self.W[name] = t.to(device=device, dtype=_stored_dtype(cfg, name, dtype, device, dense_format))
        ckpt.close()  # tensors still viewing the map keep their pages; the rest are let go
        self.lm_head = self.W.get("lm_head.weight", self.W["model.embed_tokens.weight"])
        if dense_format and isinstance(self.lm_head, torch.Tensor):  # tied to the embedding, which stays
            self.lm_head = NativeLinear(self.lm_head, "bf16" if dense_format == "fp8" else dense_format)
        self.inv_freq, self.rope_scaling = rope_inv_freq(cfg)
        self.inv_freq = self.inv_freq.to(device)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of positions 0..n-1 (_rope)
        qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim
        self.scale = softmax_scale(cfg, qk_dim)
        self.last_moe_layer = cfg.moe_layers[-1] if cfg.moe_layers else -1
        # decode attention on the native kernel too when the dense layers are (on the CPU, where torch's small
        # matmuls and softmax cost several times the bytes they read: docs/performance/kernels.md, "Measured choices")
        self.native_attention = bool(dense_format) and device.type == "cpu"
        # decode steps' attention blocks as one native call each where the layers allow (decode_step.py)
        self.decode_blocks = decode_step.blocks(cfg, self.W, dtype, self.native_attention) \
            if os.environ.get("MOE_DECODE_STEP") != "torch" else {}
        # and their dense MLPs / shared experts (the same numbers in the layer loop and the decode loop)
        self.decode_mlps = decode_step.mlps(cfg, self.W, dtype, self.decode_blocks)
        self._loop: tuple | None = None  # (pool, its native decode loop or None): decode_loop.build
        # decode steps as CUDA graphs (graphed_decode.py) where the model's layers and weights allow: "cuda", "off",
        # or for tests on the CPU "eager" (the same segments, not captured; MOE_DECODE_GRAPHS=eager in a service) or
        # a capture function (a recorder)
        graphable = cuda_graphs and dense_format is None and graphed_decode.eligible(cfg)
        self.graphs = "eager" if graphable and os.environ.get("MOE_DECODE_GRAPHS") == "eager" else \
            "cuda" if graphable and device.type == "cuda" else "off"
        self._graphed: tuple | None = None  # (pool, its GraphedDecode)
        self.kv: KVPool | None = None
        log.info("loaded %d non-expert tensors (%.1f MB) on %s as %s", len(self.W),
                 sum(t.nbytes for t in self.W.values()) / 1e6, device, dtype)

    def _fuse(self, name: str, t: torch.Tensor, pending: dict, fmt: str) -> None:
        prefix, part = name.rsplit(".", 2)[:2]
        kind = QKV if part in FUSED[QKV] else GATE_UP
        fused = prefix + "." + kind
        got = pending.setdefault(fused, {})
        got[part] = t
        if len(got) == len(FUSED[kind]):
            self.W[fused] = NativeLinear([got[n] for n in FUSED[kind]], fmt)
            del pending[fused]

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the weights under prefix p (a dense MLP or shared experts)."""
        W = self.W
        if p + GATE_UP in W:
            gate, up = linear(x, W[p + GATE_UP]).chunk(2, dim=-1)
            return linear(F.silu(gate) * up, W[p + "down_proj.weight"])
        return swiglu(x, W[p + "gate_proj.weight"], W[p + "up_proj.weight"], W[p + "down_proj.weight"])

    def _token_logprobs(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [n, H] (final-normed), targets [m <= n] -> (log p(targets[i]) at position i < m, argmax id at each
        position), in chunks of positions so that no [n, vocab] tensor exists for long contexts."""
        n, chunk = h.shape[0], max(1, (1 << 24) // self.cfg.vocab_size)
        nxt = targets.to(self.device)
        lps, ams = [torch.zeros(0)], []
        for i in range(0, n, chunk):
            logits = linear(h[i:i + chunk], self.lm_head).float()
            ams.append(logits.argmax(-1).cpu())
            j = min(i + chunk, len(nxt))  # positions whose next token is known
            if j > i:
                lps.append(logits[: j - i].log_softmax(-1).gather(1, nxt[i:j, None])[:, 0].cpu())
        return torch.cat(lps), torch.cat(ams)

    def kv_pool(self) -> KVPool:
        """The pool the sequences' caches take their blocks from: the service's (set by the engine's maker, sized
        by --kv-cache-gb), else one of DIRECT_TOKENS positions without prefix caching for direct callers (tests,
        benchmarks; on the CPU only its touched pages take memory)."""
        if self.kv is None:
            self.kv = KVPool(self.cfg, self.kv_dtype, self.device, DIRECT_TOKENS // BLOCK)
        return self.kv

    def new_cache(self) -> SeqCache:
        return SeqCache(self.kv_pool())

    @staticmethod
    def _per_segment(x, segments: list[Segment], fn) -> torch.Tensor:
        """fn(segment, its rows' slice) for each sequence of the step, concatenated."""
        outs, off = [], 0
        for s in segments:
            t = s.tokens.shape[0]
            outs.append(fn(s, slice(off, off + t)))
            off += t
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _attention(self, p: str, x, cos, sin, segments: list[Segment], layer: int) -> torch.Tensor:
        cfg, W = self.cfg, self.W
        if cfg.attention == "mla":
            return self._per_segment(x, segments, lambda s, sl: mla_attention(
                cfg, W, p, x[sl], cos[sl], sin[sl], s.cache, layer, s.start, self.scale, self.native_attention))
        return self._per_segment(x, segments, lambda s, sl: gqa_attention(
            cfg, W, p, x[sl], cos[sl], sin[sl], s.cache, layer, s.start, self.native_attention))

    def router(self, layer: int) -> tuple:
        """An MoE layer's router weight and its bias (gpt-oss's router's own, DeepSeek's choice-only one, or None)."""
        fp = f"model.layers.{layer}.{self.cfg.ffn_prefix}."
        rp = fp + self.cfg.router_name + "."
        return self.W[rp + "weight"], self.W.get(rp + "bias", self.W.get(
            rp + "e_score_correction_bias", self.W.get(fp + "e_score_correction_bias")))

    def _linear_attention(self, p: str, x, segments: list[Segment], layer: int) -> torch.Tensor:
        return self._per_segment(x, segments, lambda s, sl: gated_deltanet(self.cfg, self.W, p, x[sl], s.cache, layer))

    def _shared(self, p: str, x: torch.Tensor) -> torch.Tensor | None:
        cfg, W = self.cfg, self.W
        if cfg.shared_intermediate_size == 0:
            return None
        if cfg.shared_expert_gate:  # Qwen2-MoE
            s = self._mlp(p + "shared_expert.", x)
            return F.sigmoid(linear(x, W[p + "shared_expert_gate.weight"])) * s
        return self._mlp(p + "shared_experts.", x)

    def _decode_loop(self, pool: KVPool):
        """The native loop over every layer (decode_loop.py) on `pool`'s layers, None where the model does not fit
        it; built once per pool."""
        if self._loop is None or self._loop[0] is not pool:
            norm = self.W["model.norm.weight"]
            # the step's end too where Model.forward's own would be the same native calls
            head = (norm, self.cfg.rms_norm_eps, self.lm_head) if isinstance(self.lm_head, NativeLinear) and \
                self.native_attention and not self.cfg.norm_offset and norm.dtype in (torch.float32, torch.bfloat16) \
                and norm.is_contiguous() else None
            self._loop = (pool, decode_loop.build(self.cfg, self.decode_blocks, self.decode_mlps, pool, head)
                          if os.environ.get("MOE_DECODE_LOOP") != "off" else None)
        return self._loop[1]

    def _graph_runner(self, pool: KVPool) -> graphed_decode.GraphedDecode:
        """The graphed decode steps on `pool` (built once per pool)."""
        if self._graphed is None or self._graphed[0] is not pool:
            capture = self.graphs if callable(self.graphs) else None
            if self.graphs == "cuda":
                with torch.cuda.device(self.device):
                    capture = graphed_decode.cuda_capture(torch.cuda.Stream(self.device), torch.cuda.graph_pool_handle())
            self._graphed = (pool, graphed_decode.GraphedDecode(self, pool, capture))
        return self._graphed[1]

    @torch.inference_mode()
    def prepare_decode_graphs(self, pool: KVPool, rows: int, end: int, deferring: bool) -> tuple[int, int]:
        """At start-up: the decode graphs of steps of up to `rows` sequences below position `end` on `pool`, captured
        before any step needs them (GraphedDecode.prepare) -> (buckets, graphs); (0, 0) where decode steps do not run
        as graphs."""
        if self.graphs == "off" or end <= 0:
            return 0, 0
        buckets = self._graph_runner(pool).prepare(rows, end, deferring)
        return len(buckets), sum(g is not None for b in buckets for g in b.graphs)

    def _rope(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary dim / 2] of positions [T] (all below end): rows of tables of every position so far,
        grown by doubling. rope_cos_sin's numbers (elementwise: a position's row is the same computed alone or
        among others), in two index ops where it takes ~10."""
        if self._rope_table is None or self._rope_table[0].shape[0] < end:
            n = max(end, 1024, 2 * (self._rope_table[0].shape[0] if self._rope_table else 0))
            self._rope_table = rope_cos_sin(self.inv_freq, self.rope_scaling, torch.arange(n, device=self.device),
                                            self.dtype)
        return self._rope_table[0][positions], self._rope_table[1][positions]

    @torch.inference_mode()
    def forward(self, segments: list[Segment], experts: Experts, step: int = 0, defer: int = 0,
                spans: list | None = None, skip: bool = False, exact_spans: bool = False,
                defer_layers: range | None = None, records: list | None = None) -> torch.Tensor:
        """-> logits [n, vocab] fp32: one row per segment (its last token), or every row of a
        segment with all_logits. `experts`: the Experts protocol (submit / result). With `skip`, the
        `defer` lowest-weighted experts are dropped instead of deferred; `defer_layers`: only in these
        layers (the accuracy harness's depth study; default every MoE layer but the last). `spans`, when given,
        collects (name, service, layer, step, start_ns, end_ns) for the profile and metrics
        (`exact_spans`: synchronize the device at each span, for a profile); `records`, when given, takes the native
        decode loop's measurements as its decode_loop.Record instead of its spans."""
        cfg, W = self.cfg, self.W
        # on CUDA a span is only exact if the kernels finished: synchronize for profiles only
        sync = self.device.type == "cuda" and spans is not None and exact_spans
        clock = time.time_ns

        def mark(name: str, layer: int, t0: int) -> int:
            if sync:
                torch.cuda.synchronize(self.device)
            t1 = clock()
            if spans is not None:
                spans.append(Span(name, "gpu", layer, step, t0, t1))
            return t1

        t = clock()
        decoding = all(s.tokens.shape[0] == 1 for s in segments)  # every sequence adds one token
        if decoding and self.graphs != "off" and not (skip and defer) and defer_layers is None and \
                not any(s.logprobs for s in segments):
            runner = self._graph_runner(segments[0].cache.pool)
            key = runner.takes(segments)
            if key is not None:
                clock_at = [t]

                def segment_done(name: str, layer: int) -> None:
                    clock_at[0] = mark(name, layer, clock_at[0])

                logits = runner.run(segments, key, experts, step, defer, segment_done)
                for s in segments:
                    s.cache.commit(s.start + 1, s.tokens.tolist())
                return logits
        tokens = (segments[0].tokens if len(segments) == 1 else torch.cat([s.tokens for s in segments])).to(self.device)
        if decoding:  # one op where the aranges take B + 2: each costs ~10 us between the kernels
            positions = torch.tensor([s.start for s in segments], device=self.device)
        else:
            positions = torch.cat([torch.arange(s.start, s.start + s.tokens.shape[0]) for s in segments]).to(self.device)
        cos, sin = self._rope(positions, max(s.start + s.tokens.shape[0] for s in segments))
        h = F.embedding(tokens, W["model.embed_tokens.weight"])
        # the attention blocks the native step takes run as one call each for all the sequences
        native_seqs = decode_step.sequences([s.cache for s in segments], [s.start for s in segments]) \
            if self.decode_blocks and decoding else None
        t = mark("embed", -1, t)
        layers = range(cfg.num_layers)
        # every layer in one native call where the model and the experts allow (else the loop below)
        loop = self._decode_loop(segments[0].cache.pool) if native_seqs is not None and not (skip and defer) and \
            defer_layers is None else None
        # and the step's end in it, where every row is a segment's last and the layer loop's end would be native too
        logits = torch.empty(len(segments), self.lm_head.rows) if loop is not None and loop.has_head and \
            not any(s.logprobs for s in segments) else None
        if loop is not None and decode_loop.run(loop, experts, step, h, cos, sin, native_seqs, cfg.top_k, defer, t,
                                                spans, records, logits):
            layers, t = range(0), clock()
        else:
            logits = None
        pending = None  # the MoE layer whose deferred result is still outstanding
        for L in layers:
            p = f"model.layers.{L}."
            routed = None  # the router's choice where the native step made it
            if native_seqs is not None and L in self.decode_blocks:
                x, routed = decode_step.run(self.decode_blocks[L], segments[0].cache.pool, L, h, cos, sin, native_seqs,
                                            cfg.top_k)
                t = mark("attention", L, t)
            else:
                x = rms_norm(h, W[p + "input_layernorm.weight"], cfg.rms_norm_eps, cfg.norm_offset,
                             self.native_attention)
                if cfg.is_linear_attention(L):
                    h = h + self._linear_attention(p + "linear_attn.", x, segments, L)
                    t = mark("linear_attention", L, t)
                else:
                    h = h + self._attention(p + "self_attn.", x, cos, sin, segments, L)
                    t = mark("attention", L, t)
                x = rms_norm(h, W[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps, cfg.norm_offset,
                             self.native_attention)
            fp = p + cfg.ffn_prefix + "."
            mlp = self.decode_mlps.get(L) if native_seqs is not None else None  # a decode step's native MLP
            if not cfg.is_moe_layer(L):
                h = h + (decode_step.mlp(mlp, x) if mlp else self._mlp(fp, x))
                t = mark("dense_mlp", L, t)
                continue
            ids, w = routed or route(cfg, x, *self.router(L))
            d = defer if L != self.last_moe_layer and (defer_layers is None or L in defer_layers) else 0
            if skip and d:
                ids, w, _, _ = split_deferred(ids, w, d)
                d = 0
            t = mark("router", L, t)  # the post-attention norm and the routing
            experts.submit(step, L, x, ids, w, d)
            t = mark("expert_submit", L, t)  # the request handed over (wire bytes or the ring, its doorbell)
            shared = decode_step.mlp(mlp, x) if mlp else self._shared(fp, x)  # overlaps the expert service's work
            t = mark("shared_experts", L, t)
            # results arrive in request order: the previous layer's DEFERRED before this IMMEDIATE
            late = experts.result(pending, deferred=True) if pending is not None else None
            y = experts.result(L, deferred=False)
            t = mark("expert_wait", L, t)
            # from pinned memory (shared-memory exchange) these copies to the GPU are asynchronous
            if y.dtype != h.dtype or y.device != h.device:  # (the parse of a no-op .to() costs more than these tests)
                y = y.to(device=self.device, dtype=h.dtype, non_blocking=True)
            if late is not None:
                y = y + late.to(device=self.device, dtype=h.dtype, non_blocking=True)
            pending = L if d else None
            h = h + (y + shared if shared is not None else y)
        if logits is None:  # (else the loop ended the step: the final norm, the lm_head and its span)
            h = self._final_rows(h, segments, decoding)
        for s in segments:  # the step is complete: its linear-attention states replace the old ones
            s.cache.commit(s.start + s.tokens.shape[0], s.tokens.tolist())
        if logits is None:
            logits = self.lm_head(h, as_float=True) if isinstance(self.lm_head, NativeLinear) else \
                linear(h, self.lm_head).float()
            mark("lm_head", -1, t)
        return logits

    def _final_rows(self, h: torch.Tensor, segments: list[Segment], decoding: bool) -> torch.Tensor:
        """The final norm of the rows the lm_head takes (each segment's last, or all of it with all_logits); a
        logprobs segment is scored here instead (Segment.scored)."""
        cfg = self.cfg
        h = rms_norm(h, self.W["model.norm.weight"], cfg.rms_norm_eps, cfg.norm_offset, self.native_attention)
        if not decoding or any(s.logprobs for s in segments):  # else every row is a segment's last: all of h
            rows, off = [torch.zeros(0, dtype=torch.long)], 0
            for s in segments:
                n = s.tokens.shape[0]
                if s.logprobs:
                    s.scored = self._token_logprobs(h[off:off + n], s.targets)
                else:
                    rows.append(torch.arange(off, off + n) if s.all_logits else torch.tensor([off + n - 1]))
                off += n
            h = h[torch.cat(rows).to(self.device)]
        return h


# -- what to load the model as: the --device / --dtype / --dense-format policy (ValueError: the message for the
# command line) -------------------------------------------------------------------------------------------
def pick_device(arg: str) -> torch.device:
    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(arg)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return dev


def native_isa() -> str | None:
    """The native kernels' ISA on this CPU, None when they are not built."""
    try:
        import moe_kernels
    except ImportError:
        return None
    return moe_kernels.ISA


def compute_dtype(arg: str, cfg, device: torch.device) -> torch.dtype:
    """--dtype resolved. auto: the checkpoint's dtype, except fp32 for a bf16/fp16 model on a CPU without
    bf16 arithmetic (kernel path below avx512): torch converts every bf16 op there, and norms, rope and
    attention run several times slower than in fp32 (docs/performance/decode_step.md). The dense weights stay 16-bit
    with --dense-format."""
    if arg != "auto":
        return DTYPES[arg]
    dtype = DTYPES[cfg.torch_dtype]
    if device.type == "cpu" and dtype != torch.float32 and native_isa() not in ("avx512", "amx"):
        return torch.float32
    return dtype


def dense_format(arg: str, device: torch.device, ckpt_dtype: torch.dtype, dtype_arg: str = "auto",
                 fp8_block: tuple | None = None) -> str | None:
    """--dense-format resolved: a native weight format, or None for torch's matmuls. auto: a bf16
    checkpoint's weights packed as bf16 (the same bits) when --dtype is auto or bf16, an FP8 checkpoint's
    (128 x 128 blocks) as fp8 (its FP8 weights as published, the rest bf16); an explicit --dtype fp32/fp16
    keeps torch's matmuls (the kernels round activations to bf16: not exact)."""
    if arg == "torch" or (arg == "auto" and (device.type != "cpu" or ckpt_dtype != torch.bfloat16
                                              or dtype_arg not in ("auto", "bf16"))):
        return None
    if device.type != "cpu":
        raise ValueError(f"--dense-format {arg}: the native kernels run on the CPU, and this service computes on "
                         f"{device}")
    isa = native_isa()
    if isa is None:
        if arg == "auto":
            return None
        raise ValueError(f"--dense-format {arg}: the native kernels are not built")
    if arg == "auto":
        if isa == "portable":
            return None
        return "fp8" if fp8_block == (FP8_BLOCK, FP8_BLOCK) else "bf16"
    return arg
