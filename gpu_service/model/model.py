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

import torch

from moe_core.checkpoint import Checkpoint
from moe_core.config import FP8_BLOCK, ModelConfig, check_shape, is_routed_expert_tensor
from moe_kernels.dense import NativeLinear  # dispatch's shared-memory channel needs moe_kernels anyway
from moe_kernels.packing import Fp8

from gpu_service.model import cuda_graphs as graphs, native_loop, native_stages, step
from gpu_service.model.attention import QKV
from gpu_service.model.compressed_attention import ROPE, PackedGroups
from moe_exchange.protocol import Experts
from gpu_service.engine.kv_pool import BLOCK, KVPool, SeqCache
from gpu_service.model.layers import GATE_UP, packs_router, rope_cos_sin, rope_inv_freq, softmax_scale
from gpu_service.model.step import Segment

step_forward = step.forward

log = logging.getLogger("gpu_service.model.model")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# weights used as plain x W^T, which --dense-format packs for the native kernels: attention projections
# (not MLA's kv_b_proj, used in absorbed form), dense MLPs and shared experts; lm_head too
DENSE = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|gate_proj|up_proj|down_proj"
                   r"|in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj"
                   r"|indexer\.wq_b|indexer\.wk|index_q_proj|index_k_proj"  # (the indexers' query and key)
                   r"|attn\.wq_a|attn\.wq_b|attn\.wkv|attn\.wo_a|attn\.wo_b|shared_experts\.w[123]"  # (DeepSeek-V4's,
                   r"|compressor\.wkv|compressor\.wgate)\.weight$")  # its wo_a one group at a time: PackedGroups)


# weights that share their input, packed as one matrix for the native kernels (one call instead of
# several): GQA's q/k/v, and gate/up of dense MLPs and shared experts; rows in this order
FUSED = {QKV: ("q_proj", "k_proj", "v_proj"), GATE_UP: ("gate_proj", "up_proj")}
FUSED_PART = re.compile(r"(self_attn\.[qkv]_proj|(gate|up)_proj)\.weight$")
CLOSE_EVERY_BYTES = 256 << 20  # packing dense layers: reopen the checkpoint after this many source bytes


DIRECT_TOKENS = 1 << 16  # positions of the pool new_cache() uses when no engine set one

FP32_ROUTER = ("deepseek_v3", "deepseek_v2", "glm4_moe", "mimo_v2_flash", "glm5_next")


# DeepSeek-V4's tensors transformers keeps in fp32 (its _keep_in_fp32_modules): hyper-connections, sinks, the
# compressors' position biases and projections, the indexer's head weights, the correction bias, every norm's weight
V4_FP32 = re.compile(r"(\.hc_|^model\.hc_head\.|\.attn_sink$|\.ape$|compressor\.(wkv|wgate)\.weight$"
                     r"|indexer\.weights_proj\.weight$|\.gate\.bias$|norm\.weight$)")


def _keep_fp32(cfg: ModelConfig, name: str) -> bool:
    # transformers keeps DeepSeek's (and GLM's, the same router) weight and bias in fp32 whatever the model dtype
    if cfg.model_type == "deepseek_v4":
        return bool(V4_FP32.search(name))
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
        decode steps on CUDA as captured graphs where the layers allow (cuda_graphs.py; --cuda-graphs)."""
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
            pack = dense_format and (DENSE.search(name) or name in ("lm_head.weight", "head.weight"))
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
            elif pack and name.endswith(".attn.wo_a.weight"):  # DeepSeek-V4's grouped output projection
                rows = t.shape[0] // cfg.o_groups
                self.W[name] = PackedGroups([NativeLinear(t.rows(g * rows, (g + 1) * rows) if isinstance(t, Fp8)
                                                          else t[g * rows:(g + 1) * rows], fmt)
                                             for g in range(cfg.o_groups)])
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
            elif not t.is_floating_point():  # (DeepSeek-V4's token id -> experts tables)
                self.W[name] = t.to(device=device)
            else:
                self.W[name] = t.to(device=device, dtype=_stored_dtype(cfg, name, dtype, device, dense_format))
        ckpt.close()  # tensors still viewing the map keep their pages; the rest are let go
        self.lm_head = self.W.get("lm_head.weight", self.W.get("head.weight", self.W["model.embed_tokens.weight"]))
        if dense_format and isinstance(self.lm_head, torch.Tensor):  # tied to the embedding, which stays
            self.lm_head = NativeLinear(self.lm_head, "bf16" if dense_format == "fp8" else dense_format)
        self.inv_freq, self.rope_scaling = rope_inv_freq(cfg)
        self.inv_freq = self.inv_freq.to(device)
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of positions 0..n-1 (rope)
        # MiMo-V2-Flash's sliding-window layers rotate with a rope base of their own: their table beside
        # (DeepSeek-V4's window-only layers: the default rope, its compressed ones' the main table's)
        self.sliding_inv_freq = rope_inv_freq(dataclasses.replace(
            cfg, rope_theta=cfg.sliding_rope_theta, **({"rope_type": "default"} if cfg.compress_rates else {})))[0].to(
            device) if cfg.sliding_rope_theta else None
        if cfg.compress_rates:  # the compressed layers' entries rotate at their own positions (compressed_attention)
            self.W[ROPE] = self.inv_freq
        self.sliding_rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        qk_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim
        self.scale = softmax_scale(cfg, qk_dim)
        self.last_moe_layer = cfg.moe_layers[-1] if cfg.moe_layers else -1
        # decode attention on the native kernel too when the dense layers are (on the CPU, where torch's small
        # matmuls and softmax cost several times the bytes they read: docs/performance/kernels.md, "Measured choices")
        self.native_attention = bool(dense_format) and device.type == "cpu"
        # decode steps' attention blocks as one native call each where the layers allow (native_stages.py)
        self.decode_blocks = native_stages.blocks(cfg, self.W, dtype, self.native_attention) \
            if os.environ.get("MOE_DECODE_STEP") != "torch" else {}
        # and their dense MLPs / shared experts (the same numbers in the layer loop and the decode loop)
        self.decode_mlps = native_stages.mlps(cfg, self.W, dtype, self.decode_blocks)
        self._loop: tuple | None = None  # (pool, its native decode loop or None): native_loop.build
        # decode steps as CUDA graphs (cuda_graphs.py) where the model's layers and weights allow: "cuda", "off",
        # or for tests on the CPU "eager" (the same segments, not captured; MOE_DECODE_GRAPHS=eager in a service) or
        # a capture function (a recorder)
        graphable = cuda_graphs and dense_format is None and graphs.eligible(cfg)
        self.graphs = "eager" if graphable and os.environ.get("MOE_DECODE_GRAPHS") == "eager" else \
            "cuda" if graphable and device.type == "cuda" else "off"
        self._graphed: tuple | None = None  # (pool, its GraphedDecode)
        self.kv: KVPool | None = None
        log.info("loaded %d non-expert tensors (%.1f MB) on %s as %s", len(self.W),
                 sum(t.nbytes for t in self.W.values()) / 1e6, device, dtype)
        log.info("decode steps: %s", step.describe(self))

    def _fuse(self, name: str, t: torch.Tensor, pending: dict, fmt: str) -> None:
        prefix, part = name.rsplit(".", 2)[:2]
        kind = QKV if part in FUSED[QKV] else GATE_UP
        fused = prefix + "." + kind
        got = pending.setdefault(fused, {})
        got[part] = t
        if len(got) == len(FUSED[kind]):
            self.W[fused] = NativeLinear([got[n] for n in FUSED[kind]], fmt)
            del pending[fused]

    def kv_pool(self) -> KVPool:
        """The pool the sequences' caches take their blocks from: the service's (set by the engine's maker, sized
        by --kv-cache-gb), else one of DIRECT_TOKENS positions without prefix caching for direct callers (tests,
        benchmarks; on the CPU only its touched pages take memory)."""
        if self.kv is None:
            self.kv = KVPool(self.cfg, self.kv_dtype, self.device, DIRECT_TOKENS // BLOCK)
        return self.kv

    def new_cache(self) -> SeqCache:
        return SeqCache(self.kv_pool())

    def router(self, layer: int) -> tuple:
        """An MoE layer's router weight and its bias (gpt-oss's router's own, DeepSeek's choice-only one, or None)."""
        fp = f"model.layers.{layer}.{self.cfg.ffn_prefix}."
        rp = fp + self.cfg.router_name + "."
        return self.W[rp + "weight"], self.W.get(rp + "bias", self.W.get(
            rp + "e_score_correction_bias", self.W.get(fp + "e_score_correction_bias")))

    def native_loop(self, pool: KVPool):
        """The native loop over every layer (native_loop.py) on `pool`'s layers, None where the model does not fit
        it; built once per pool."""
        if self._loop is None or self._loop[0] is not pool:
            norm = self.W["model.norm.weight"]
            # the step's end too where Model.forward's own would be the same native calls
            head = (norm, self.cfg.rms_norm_eps, self.lm_head) if isinstance(self.lm_head, NativeLinear) and \
                self.native_attention and not self.cfg.norm_offset and norm.dtype in (torch.float32, torch.bfloat16) \
                and norm.is_contiguous() else None
            self._loop = (pool, native_loop.build(self.cfg, self.decode_blocks, self.decode_mlps, pool, head)
                          if os.environ.get("MOE_DECODE_LOOP") != "off" else None)
        return self._loop[1]

    def graph_runner(self, pool: KVPool) -> graphs.GraphedDecode:
        """The graphed decode steps on `pool` (built once per pool)."""
        if self._graphed is None or self._graphed[0] is not pool:
            capture = self.graphs if callable(self.graphs) else None
            if self.graphs == "cuda":
                with torch.cuda.device(self.device):
                    capture = graphs.cuda_capture(torch.cuda.Stream(self.device), torch.cuda.graph_pool_handle())
            self._graphed = (pool, graphs.GraphedDecode(self, pool, capture))
        return self._graphed[1]

    @torch.inference_mode()
    def prepare_decode_graphs(self, pool: KVPool, rows: int, end: int, deferring: bool) -> tuple[int, int]:
        """At start-up: the decode graphs of steps of up to `rows` sequences below position `end` on `pool`, captured
        before any step needs them (GraphedDecode.prepare) -> (buckets, graphs); (0, 0) where decode steps do not run
        as graphs."""
        if self.graphs == "off" or end <= 0:
            return 0, 0
        buckets = self.graph_runner(pool).prepare(rows, end, deferring)
        return len(buckets), sum(g is not None for b in buckets for g in b.graphs)

    def rope(self, positions: torch.Tensor, end: int, sliding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary dim / 2] of positions [T] (all below end): rows of tables of every position so far,
        grown by doubling. rope_cos_sin's numbers (elementwise: a position's row is the same computed alone or
        among others), in two index ops where it takes ~10. sliding: the sliding-window layers' own (MiMo-V2-Flash)."""
        table = self.rope_tables(end, sliding)
        return table[0][positions], table[1][positions]

    def rope_tables(self, end: int, sliding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables rope() indexes: cos, sin [n >= end, rotary dim / 2] of positions 0..n-1."""
        name, inv_freq, scaling = ("sliding_rope_table", self.sliding_inv_freq, 1.0) if sliding else \
            ("rope_table", self.inv_freq, self.rope_scaling)
        table = getattr(self, name)
        if table is None or table[0].shape[0] < end:
            n = max(end, 1024, 2 * (table[0].shape[0] if table else 0))
            table = rope_cos_sin(inv_freq, scaling, torch.arange(n, device=self.device), self.dtype)
            setattr(self, name, table)
        return table

    def forward(self, segments: list[Segment], experts: Experts, step: int = 0, defer: int = 0,
                spans: list | None = None, skip: bool = False, exact_spans: bool = False,
                defer_layers: range | None = None, records: list | None = None) -> torch.Tensor:
        """-> logits [n, vocab] fp32: one row per segment (its last token), or every row of a
        segment with all_logits. `experts`: the Experts protocol (submit / result). With `skip`, the
        `defer` lowest-weighted experts are dropped instead of deferred; `defer_layers`: only in these
        layers (the accuracy harness's depth study; default every MoE layer but the last). `spans`, when given,
        collects (name, service, layer, step, start_ns, end_ns) for the profile and metrics
        (`exact_spans`: synchronize the device at each span, for a profile); `records`, when given, takes the native
        decode loop's measurements as its native_loop.Record instead of its spans. The runner: step.choose."""
        return step_forward(self, segments, experts, step, defer, spans, skip, exact_spans, defer_layers, records)


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
