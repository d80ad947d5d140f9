"""Model config: parse a Hugging Face config.json into the one description both services use.

Supported families (transformers' implementations are the numerical reference):
deepseek_v3, deepseek_v2 (MLA attention, shared experts, grouped routing), deepseek_v32 and glm_moe_dsa (GLM-5:
MLA behind DeepSeek Sparse Attention's lightning indexer), kimi_k2 and kimi_k25 (DeepSeek-V3's arithmetic), glm4_moe,
deepseek_v4 (DeepSeek-V4: a sliding window beside compressed key entries, the lightning indexer over them, hyper-connected
residual streams, hash-routed first layers), minimax_m2, minimax_m3_vl (MiniMax-M3's text model: GQA beside block-sparse attention behind a block lightning indexer,
clamped SwiGLU everywhere), gpt_oss (attention sinks, sliding windows, expert biases, clamped SwiGLU), qwen3_next and qwen3_5_moe
(gated DeltaNet linear attention beside gated full attention; Qwen3.5's text model, published inside
its vision-language wrapper), qwen3_moe, qwen2_moe (gated shared expert), mixtral. Anything else is
refused with a clear message.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib

from moe_core.errors import ModelConfigError
from moe_core.int4_checkpoints import int4_scheme


SUPPORTED = ("deepseek_v3", "deepseek_v32", "deepseek_v4", "glm5_next", "glm_moe_dsa", "deepseek_v2", "kimi_k2", "kimi_k25", "glm4_moe", "gpt_oss",
             "minimax_m2", "minimax_m3_vl", "mimo_v2_flash", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen2_moe", "mixtral")
# published types whose arithmetic is another family's: Kimi-K2 and K2-Thinking are DeepSeek-V3 (transformers has no
# kimi_k2 type of its own: its Kimi-K2.5 config rewrites one to deepseek_v3), and so is Kimi-K2.5/K2.6's text model;
# DeepSeek-V3.2 is DeepSeek-V3 with the lightning indexer in front of MLA (the index_* fields), and GLM-5 is V3.2 with
# its indexer's rope interleaved and some layers reusing the previous layer's selection
SAME_AS = {"kimi_k2": "deepseek_v3", "kimi_k25": "deepseek_v3", "deepseek_v32": "deepseek_v3",
           "glm_moe_dsa": "deepseek_v3"}
DSA = ("deepseek_v32", "glm_moe_dsa")  # DeepSeek Sparse Attention: the lightning indexer in front of MLA
HYBRID = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")  # gated DeltaNet + gated full attention layers
# vision-language wrappers whose text model is served (text in, text out): its config under text_config; its weights
# renamed (stored prefix -> ours), and the rest under the dropped prefixes (the vision tower, the projector) not loaded
TEXT_IN_WRAPPER = {
    "qwen3_5_moe": ({"model.language_model.": "model."}, ("model.",)),  # model.visual.*: the tower
    "kimi_k25": ({"language_model.model.": "model.", "language_model.lm_head.": "lm_head."},
                 ("vision_tower.", "mm_projector.")),
    "minimax_m3_vl": ({"language_model.model.": "model.", "language_model.lm_head.": "lm_head."},
                      ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")),
    "glm5_next": ({"model.language_model.": "model."}, ("model.",)),  # model.visual.*: the tower
}
MAX_TOP_K = 256  # experts a token may name: native/moe.h's MAX_K (tests check they agree)
MIXTRAL_NAMES = ("mixtral", "minimax_m2", "minimax_m3_vl")  # block_sparse_moe.experts.E.w1 / w3 / w2
QUANT_SUPPORTED = ("fp8 (e4m3 weights with one float32 scale_inv per block, as DeepSeek-V3/R1 publish them), "
                   "mxfp4 (gpt_oss's experts as OpenAI publishes them: _blocks and _scales), "
                   "int4 compressed-tensors (pack-quantized), gptq and awq (gemm)")


FP8_BLOCK = 128  # the FP8 blocks the fp8 weight format keeps as published (DeepSeek-V3's weight_block_size)


def text_weights(raw: dict) -> tuple[dict[str, str], tuple[str, ...]] | None:
    """A vision-language checkpoint's text model's weights: (stored prefix -> ours, the prefixes not loaded); None for
    a text model."""
    return TEXT_IN_WRAPPER.get(raw.get("model_type"))


def is_mxfp4(raw: dict) -> bool:
    """gpt-oss as published: its routed experts in MXFP4 (everything else bf16); DeepSeek-V4 as published: its routed
    experts FP4 (expert_dtype fp4: e2m1 pairs in int8 bytes, an e8m0 scale per 32), its other projections FP8."""
    q = raw.get("quantization_config") or {}
    if raw.get("model_type") == "deepseek_v4":
        return (raw.get("expert_dtype") or q.get("expert_dtype")) == "fp4"
    return str(q.get("quant_method")) == "mxfp4"


def fp8_block(raw: dict) -> tuple[int, int] | None:
    """The checkpoint's quantization: None (plain bf16/fp16/fp32 weights, or gpt-oss's MXFP4 experts) or
    the (rows, cols) of the blocks of an FP8 block-quantized checkpoint. Any other quantization_config is
    refused here, so both services refuse it at start rather than load it wrong."""
    q = raw.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "?"))
    if method == "mxfp4" and raw.get("model_type") == "gpt_oss":
        return None
    if method == "gguf":  # a GGUF file's prepared folder (gguf_model): its tensors say their own types
        return None
    if int4_scheme(q) is not None:  # an int4 checkpoint (its unsupported variants are refused there)
        return None
    if method != "fp8":
        raise ModelConfigError(f"quantization_config.quant_method {method!r} is not supported for model_type "
                               f"{raw.get('model_type')!r}; supported: none (bf16/fp16/fp32 weights) or {QUANT_SUPPORTED}")
    fmt, block = q.get("fmt", "e4m3"), q.get("weight_block_size")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # DeepSeek writes the one, MiniMax-M2 the other
        raise ModelConfigError(f"quantization_config.fmt {fmt!r} is not supported (fp8 checkpoints: e4m3)")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelConfigError(f"quantization_config.weight_block_size {block!r}: fp8 checkpoints need [rows, cols] "
                               "blocks (per-tensor fp8 is not supported)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelConfigError(f"quantization_config.activation_scheme {q.get('activation_scheme')!r} is not "
                               "supported (dynamic)")
    return block[0], block[1]


def _int4(raw: dict):
    return int4_scheme(raw.get("quantization_config") or {})


@dataclasses.dataclass(frozen=True)
class ExpertAct:
    """The routed experts' (MiniMax-M3, DeepSeek-V4: every MLP's) activation: silu(gate) * up, gpt-oss's clamped
    SwiGLU (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), or DeepSeek-V4's clamped SiLU
    silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    kind: str = "silu"  # "silu" | "clamped_swiglu" | "clamped_silu"
    alpha: float = 0.0
    limit: float = 0.0


SILU = ExpertAct()


@dataclasses.dataclass(frozen=True)
class DeltaNet:
    """The gated DeltaNet (linear attention) layers' shape (Qwen3-Next): q/k heads of k_dim, v heads
    of v_dim (v_heads a multiple of k_heads), a causal depthwise conv of conv_kernel taps over q, k, v."""
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int                      # GQA head dim; for MLA the rope dim
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_type: str                     # "default" | "yarn"
    rope_params: dict                  # the raw rope parameters (yarn factors...)
    rope_interleave: bool              # DeepSeek: rotate (x0,x1),(x2,x3)... pairs
    # attention
    attention: str                     # "gqa" | "mla"
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_full: bool = False         # MiniMax-M2: one RMSNorm over all heads' q (k), not one per head
    rotary_dim: int = 0                # GQA: rotate only the first rotary_dim dims of a head (GLM); 0 = all
    attn_sinks: bool = False           # gpt-oss: a learned per-head logit in every softmax (self_attn.sinks)
    sliding_window: int = 0            # gpt-oss: a query sees its last sliding_window keys in the layers ...
    layer_types: tuple[str, ...] = ()  # ... that layer_types marks "sliding_attention" (others: all keys);
                                       # Qwen3-Next: "linear_attention" (gated DeltaNet) | "full_attention"
    linear_attn: DeltaNet | None = None  # Qwen3-Next's linear attention layers
    attn_output_gate: bool = False     # Qwen3-Next: q_proj also gives a per-head gate, o *= sigmoid(gate)
    norm_offset: bool = False          # Qwen3-Next: zero-centred RMSNorm weights, x_normed * (1 + w)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # feed-forward
    intermediate_size: int = 0         # dense MLP layers
    moe_intermediate_size: int = 0     # one routed expert
    moe_layers: tuple[int, ...] = ()
    n_routed_experts: int = 0
    top_k: int = 0
    shared_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False   # Qwen2-MoE: sigmoid(gate(x)) * shared(x)
    expert_act: ExpertAct = SILU       # the routed experts' activation
    mlp_act: ExpertAct = SILU          # the dense MLPs' and shared experts' (MiniMax-M3: the experts' clamped SwiGLU)
    expert_bias: bool = False          # gpt-oss: biases on the routed experts' projections
    # routing
    scoring: str = "softmax"           # "softmax" | "sigmoid" | "topk_softmax" (gpt-oss: softmax of the top-k logits)
    router_name: str = "gate"          # <ffn prefix>.<router_name>.weight (gpt-oss: router, with a bias)
    topk_method: str = "greedy"        # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    mxfp4_experts: bool = False        # gpt-oss as published: expert weights as MXFP4 _blocks / _scales
    fp8_block: tuple[int, int] | None = None  # FP8 block-quantized as published: (rows, cols) of a scale's block
    int4: object | None = None         # an int4 checkpoint's scheme (int4_checkpoints.Int4Scheme)
    gguf_expert_types: tuple[str, ...] = ()  # a GGUF file's routed experts' quant types (gguf_model)
    published_type: str = ""           # the checkpoint's own model_type where model_type is its arithmetic's (SAME_AS)
    # DeepSeek Sparse Attention (DeepSeek-V3.2): a lightning indexer picks each query's index_topk keys for MLA
    index_heads: int = 0
    index_dim: int = 0                 # its key per position, cached beside MLA's latent and rotary key
    index_topk: int = 0                # 0: no indexer (dense attention)
    index_rope_interleave: bool = False  # GLM-5 rotates the indexer's pairs; V3.2 its halves
    index_shared: tuple[int, ...] = ()  # GLM-5: layers that reuse the previous layer's selection (no indexer)
    index_kpool: int = 0               # GLM-5.3-Flash: the indexer scores pools of index_kpool keys (gated sums), keeps
                                       # index_topk / index_kpool of them and the query's unfinished pool
    # MiniMax-M3: in the layers layer_types marks minimax_m3_sparse, a block lightning indexer (index_heads query heads
    # of index_dim, one key a position, cached) max-pools each query's scores over blocks of index_block keys and keeps
    # index_topk_blocks of them per indexer head (a KV group's query heads), index_local_blocks before it always
    index_block: int = 0               # 0: no block indexer
    index_topk_blocks: int = 0
    index_local_blocks: int = 0
    # MiMo-V2-Flash: its sliding-window layers' KV heads (0: num_kv_heads) and rope base (0: rope_theta); values
    # scaled by value_scale before they are cached; a GQA value head of v_head_dim (0: head_dim)
    sliding_kv_heads: int = 0
    sliding_rope_theta: float = 0.0
    value_scale: float = 1.0
    # DeepSeek-V4 (attention "compressed"): per layer the rate its compressor folds keys at (0: the sliding window
    # alone; a CSA layer's entries pass its lightning indexer, index_heads x index_dim keeping index_topk), the window
    # in every layer; the main rope (rope_theta...) is the compressed layers', sliding_rope_theta the window-only
    # layers'; outputs through o_groups grouped projections of o_lora_rank; hc_mult residual streams mixed by
    # hyper-connections (hc_iters Sinkhorn iterations); hash_layers route by a token id -> experts table
    compress_rates: tuple[int, ...] = ()
    o_groups: int = 0
    o_lora_rank: int = 0
    hc_mult: int = 0                   # 0: one plain residual stream
    hc_iters: int = 0
    hc_eps: float = 0.0
    hash_layers: tuple[int, ...] = ()
    linear_bound: float = 0.0          # GLM-5.3-Flash's KDA: its forget gate's lower bound (its decay's floor)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def has_indexer(self, layer: int) -> bool:
        """A DeepSeek Sparse Attention layer that runs its own indexer (and caches its keys)."""
        return bool(self.index_topk) and layer not in self.index_shared

    def block_sparse(self, layer: int) -> bool:
        """A MiniMax-M3 sparse layer: GQA over the blocks its block lightning indexer picks."""
        return bool(self.index_block) and self.layer_types[layer] == "minimax_m3_sparse"

    @property
    def architecture(self) -> str:
        """The checkpoint's model_type, as it says (kimi_k25), where model_type is its arithmetic's (deepseek_v3)."""
        return self.published_type or self.model_type

    @property
    def text_only(self) -> bool:
        """A vision-language checkpoint whose text model alone is served."""
        return self.architecture in TEXT_IN_WRAPPER

    def kv_heads(self, layer: int) -> int:
        """A GQA layer's KV heads (MiMo-V2-Flash's sliding layers have more)."""
        return self.sliding_kv_heads if self.sliding_kv_heads and self.window(layer) else self.num_kv_heads

    @property
    def sinks_name(self) -> str:
        """The attention sinks' tensor under self_attn (MiMo-V2-Flash publishes them as attention_sink_bias)."""
        return "attention_sink_bias" if self.model_type == "mimo_v2_flash" else "sinks"

    @property
    def value_dim(self) -> int:
        """A GQA value head's width (MiMo-V2-Flash's is narrower than its query and key heads)."""
        return self.v_head_dim or self.head_dim

    def window(self, layer: int) -> int:
        """Keys a query of this layer sees (itself and the ones before it); 0 = all. (DeepSeek-V4: every layer's window,
        beside its compressed entries.)"""
        if self.compress_rates:
            return self.sliding_window
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else 0

    def sliding_rope(self, layer: int) -> bool:
        """Whether the layer rotates with the sliding layers' rope (sliding_rope_theta) rather than the main one."""
        if self.compress_rates:  # DeepSeek-V4: its window-only layers
            return self.compress_rates[layer] == 0
        return bool(self.sliding_rope_theta and self.window(layer))

    def attention_prefix(self, layer: int) -> str:
        """The layer's attention weights' prefix under model.layers.N.: DeepSeek-V4's attn., Qwen3-Next's linear layers'
        linear_attn. (GLM-5.3-Flash's KDA layers are under self_attn. as its other layers)."""
        if self.attention == "compressed":
            return "attn."
        return "linear_attn." if self.is_linear_attention(layer) and self.model_type != "glm5_next" else "self_attn."

    @property
    def block_norms(self) -> tuple[str, str]:
        """The names of a layer's norms before its attention and before its MLP (DeepSeek-V4's own)."""
        return ("attn_norm", "ffn_norm") if self.attention == "compressed" else \
            ("input_layernorm", "post_attention_layernorm")

    def csa(self, layer: int) -> bool:
        """A DeepSeek-V4 compressed sparse attention layer: its entries pass the lightning indexer."""
        return bool(self.compress_rates) and self.layer_types[layer] == "compressed_sparse_attention"

    def is_linear_attention(self, layer: int) -> bool:
        return self.linear_attn is not None and self.layer_types[layer] == "linear_attention"

    def expert_tensor_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """Checkpoint names of one routed expert's (gate [I,H], up [I,H], down [H,I]) weights (gpt-oss:
        every expert's in one tensor each: gate_up_proj [E, H, 2I], gate and up columns interleaved,
        and down_proj [E, I, H]; moe_experts.store slices them)."""
        if self.fused_experts:
            gate_up, down = self.stacked_expert_names(layer)
            return gate_up, gate_up, down
        if self.model_type in MIXTRAL_NAMES or self.model_type == "deepseek_v4":
            p = f"model.layers.{layer}.{self.ffn_prefix}.experts.{expert}."
            return p + "w1.weight", p + "w3.weight", p + "w2.weight"
        p = f"model.layers.{layer}.mlp.experts.{expert}."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"

    @property
    def fused_experts(self) -> bool:
        """Every expert of a layer in one tensor per projection (gpt-oss), not one tensor per expert.
        (Qwen3.5 publishes its experts stacked too, though transformers saves them one by one: the
        expert service looks at the checkpoint, moe_experts.store.)"""
        return self.model_type == "gpt_oss"

    def stacked_expert_names(self, layer: int) -> tuple[str, str]:
        """A layer's experts stacked in one tensor per projection: (gate_up_proj, down_proj)."""
        p = f"model.layers.{layer}.mlp.experts."
        return p + "gate_up_proj", p + "down_proj"

    @property
    def ffn_prefix(self) -> str:
        """An MoE layer's feed-forward weights' prefix (under model.layers.N)."""
        return "block_sparse_moe" if self.model_type in MIXTRAL_NAMES else "ffn" if self.model_type == "deepseek_v4" \
            else "mlp"

    def ffn(self, layer: int) -> str:
        """A layer's feed-forward weights' prefix (MiniMax-M3's dense layers: mlp)."""
        return self.ffn_prefix if self.is_moe_layer(layer) or self.model_type != "minimax_m3_vl" else "mlp"


def check_shape(cfg: "ModelConfig", name: str, shape: tuple) -> None:
    """ModelConfigError when a tensor's shape is not what the config says it must be, for the tensors whose shape
    every family shares (embeddings, lm_head, the hidden-size norms, one routed expert's matrices): a model file
    whose tensors do not match its own config is refused at start, naming the tensor, not run."""
    H, V, inter = cfg.hidden_size, cfg.vocab_size, cfg.moe_intermediate_size
    want = None
    if name in ("model.embed_tokens.weight", "lm_head.weight", "head.weight"):
        want = (V, H)
    elif name == "model.norm.weight" or name.endswith((".input_layernorm.weight", ".post_attention_layernorm.weight",
                                                       ".attn_norm.weight", ".ffn_norm.weight")):
        want = (H,)
    elif ".experts." in name and name.endswith((".gate_proj.weight", ".up_proj.weight", ".w1.weight", ".w3.weight")):
        want = (inter, H)
    elif ".experts." in name and name.endswith((".down_proj.weight", ".w2.weight")):
        want = (H, inter)
    if want is not None and tuple(shape) != want:
        raise ModelConfigError(f"tensor {name}: shape {list(shape)}, where config.json's sizes make it {list(want)}")


def is_routed_expert_tensor(name: str) -> bool:
    """True for the tensors only the expert service may hold."""
    return ".experts." in name


def _rope(raw: dict) -> tuple[float, str, dict]:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", "default") or "default"
    if rope_type not in ("default", "yarn"):
        raise ModelConfigError(f"rope type {rope_type!r} is not supported (supported: default, yarn)")
    return float(params.get("rope_theta", raw.get("rope_theta", 10000.0))), rope_type, params


def _eos(raw: dict, model_dir: pathlib.Path) -> tuple[int, ...]:
    ids = raw.get("eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id", ids)
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (int(ids),)


def _qwen3_next(raw: dict, n_layers: int) -> dict:
    """Qwen3-Next's (and Qwen3.5's) hybrid layers: gated DeltaNet in the layers layer_types marks
    linear_attention (default: three of every full_attention_interval), gated full attention in the rest."""
    mt = raw["model_type"]
    every = int(raw.get("full_attention_interval", 4))
    types = tuple(raw.get("layer_types") or
                  ("full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)))
    if len(types) != n_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ModelConfigError(f"{mt} layer_types {list(types)}: one of linear_attention | full_attention "
                               f"per layer ({n_layers})")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{mt} hidden_act {raw['hidden_act']!r} is not supported (silu)")
    if not raw.get("attn_output_gate", True):
        raise ModelConfigError(f"{mt} with attn_output_gate=false is not supported")
    shape = DeltaNet(int(raw.get("linear_num_key_heads", 16)), int(raw.get("linear_num_value_heads", 32)),
                     int(raw.get("linear_key_head_dim", 128)), int(raw.get("linear_value_head_dim", 128)),
                     int(raw.get("linear_conv_kernel_dim", 4)))
    if shape.v_heads % shape.k_heads or shape.conv_kernel < 1:
        raise ModelConfigError(f"{mt} linear attention: {shape.v_heads} value heads are not a multiple of "
                               f"{shape.k_heads} key heads, or conv kernel {shape.conv_kernel} < 1")
    return dict(layer_types=types, linear_attn=shape, attn_output_gate=True, norm_offset=True)


def _mimo_rope(raw: dict) -> tuple[dict, dict]:
    """MiMo-V2-Flash's rope parameters of its full and its sliding layers: rope_parameters by layer type, else
    transformers' defaults (the published thetas; a published config's own rope fields are not read by it)."""
    per = raw.get("rope_parameters") or {}
    default = {"rope_type": "default", "partial_rotary_factor": 0.334}
    return (dict(per.get("full_attention") or {**default, "rope_theta": 5_000_000.0}),
            dict(per.get("sliding_attention") or {**default, "rope_theta": 10_000.0}))


def _mimo(raw: dict, n_layers: int, head_dim: int) -> tuple[tuple[int, ...], int, dict]:
    """MiMo-V2-Flash: sliding-window layers (twice the KV heads, attention sinks, their own rope base) beside full
    ones (transformers' default: the first and every sixth), a value head narrower than the query's, values scaled
    before they are cached, dense first layers (mlp_layer_types), DeepSeek-V3's sigmoid routing without shared
    experts -> (moe layers, expert width, the fields beyond GQA's)."""
    types = tuple(raw.get("layer_types") or ("full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention"
                                             for i in range(n_layers)))
    if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelConfigError(f"mimo_v2_flash layer_types {list(types)}: one of sliding_attention | full_attention "
                               f"per layer ({n_layers})")
    kinds = list(raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layers - 1))
    if len(kinds) != n_layers or set(kinds) - {"dense", "sparse"}:
        raise ModelConfigError(f"mimo_v2_flash mlp_layer_types {kinds}: one of dense | sparse per layer ({n_layers})")
    # the reference attends to sliding_window_size positions and the query (transformers: sliding_window)
    size = raw.get("sliding_window_size")
    window = int(size) + 1 if size is not None else int(raw.get("sliding_window") or 129)
    fields = dict(layer_types=types, sliding_window=window, attn_sinks=True,
                  sliding_kv_heads=2 * int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
                  sliding_rope_theta=float(_mimo_rope(raw)[1]["rope_theta"]),
                  v_head_dim=int(raw.get("v_head_dim") or head_dim),
                  value_scale=float(raw["attention_value_scale"]) if raw.get("attention_value_scale") is not None else 1.0,
                  scoring="sigmoid", topk_method="noaux_tc", n_group=int(raw.get("n_group") or 1),
                  topk_group=int(raw.get("topk_group") or 1),
                  routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0))
    return tuple(i for i, k in enumerate(kinds) if k == "sparse"), int(raw["moe_intermediate_size"]), fields


def _minimax_m3(raw: dict, n_layers: int, n_heads: int) -> tuple[tuple[int, ...], int, dict]:
    """MiniMax-M3's text model: full GQA layers beside block-sparse ones (layer_types, else
    sparse_attention_config's sparse_attention_freq), per-head QK-norm and every RMSNorm zero-centred (x * (1 + w)),
    dense layers (mlp_layer_types, else moe_layer_freq) beside MoE layers with one shared expert, the clamped SwiGLU
    (swiglu_alpha, swiglu_limit) in every MLP, sigmoid routing with a correction bias -> (moe layers, expert width,
    the fields beyond GQA's)."""
    sparse = raw.get("sparse_attention_config") or {}
    get = lambda flat, legacy, default: raw.get(flat, sparse.get(legacy, default))  # noqa: E731 (as transformers reads them)
    types = raw.get("layer_types") or (["minimax_m3_sparse" if f else "full_attention"
                                        for f in sparse["sparse_attention_freq"]]
                                       if "sparse_attention_freq" in sparse else ["full_attention"] * n_layers)
    if len(types) != n_layers or set(types) - {"minimax_m3_sparse", "full_attention"}:
        raise ModelConfigError(f"minimax_m3_vl layer_types {list(types)}: one of minimax_m3_sparse | full_attention per "
                               f"layer ({n_layers})")
    kinds = raw.get("mlp_layer_types") or (["sparse" if f else "dense" for f in raw["moe_layer_freq"]]
                                           if raw.get("moe_layer_freq") is not None else ["sparse"] * n_layers)
    if len(kinds) != n_layers or set(kinds) - {"dense", "sparse"}:
        raise ModelConfigError(f"minimax_m3_vl mlp_layer_types {list(kinds)}: one of dense | sparse per layer "
                               f"({n_layers})")
    heads, dim = int(get("index_n_heads", "sparse_num_index_heads", 4)), int(get("index_head_dim", "sparse_index_dim", 128))
    block, topk = int(get("index_block_size", "sparse_block_size", 128)), int(get("index_topk_blocks", "sparse_topk_blocks", 16))
    local = int(get("index_local_blocks", "sparse_local_block", 1))
    if heads < 1 or n_heads % heads or block < 1 or topk < 1 or not 0 <= local <= topk or dim < 1:
        raise ModelConfigError(f"minimax_m3_vl's block indexer: {heads} heads (a divisor of the {n_heads} attention "
                               f"heads), blocks of {block} >= 1 keys, {local} local blocks <= {topk} >= 1 kept blocks")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise ModelConfigError(f"minimax_m3_vl with scoring_func={raw['scoring_func']!r} is not supported (sigmoid)")
    act = ExpertAct("clamped_swiglu", float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0)))
    fields = dict(layer_types=tuple(types), norm_offset=True, expert_act=act, mlp_act=act,
                  shared_intermediate_size=int(raw.get("shared_intermediate_size", 3072)),
                  scoring="sigmoid", topk_method="noaux_tc",
                  routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.0)),
                  index_heads=heads, index_dim=dim, index_block=block, index_topk_blocks=topk,
                  index_local_blocks=local)
    return tuple(i for i, k in enumerate(kinds) if k == "sparse"), int(raw["intermediate_size"]), fields


V4_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _deepseek_v4(raw: dict, n_layers: int, n_heads: int) -> dict:
    """DeepSeek-V4's fields as transformers' DeepseekV4Config reads them, its legacy ones too (compress_ratios,
    compress_rate_csa / _hca, num_hash_layers, qk_rope_head_dim, rope_scaling beside rope_theta and
    compress_rope_theta): every layer's attention a window of sliding_window keys, beside compressed entries at its
    type's rate; the main rope (default, rope_theta) rotates the window-only layers, the compress rope (its theta, YaRN
    where given, attention factor 1) the others."""
    rates = dict(raw.get("compress_rates") or {})
    csa = int(rates.get("compressed_sparse_attention", raw.get("compress_rate_csa", 4)))
    hca = int(rates.get("heavily_compressed_attention", raw.get("compress_rate_hca", 128)))
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        try:
            types = [V4_TYPES[int(r)] for r in raw["compress_ratios"]]
        except (KeyError, ValueError):
            raise ModelConfigError(f"deepseek_v4 compress_ratios {raw['compress_ratios']}: each one of 0, 4, 128") from None
    if types is None:
        types = ["heavily_compressed_attention"] * min(n_layers, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(n_layers - 2)]
    types = list(types)[:n_layers]
    if len(types) != n_layers or set(types) - set(V4_TYPES.values()):
        raise ModelConfigError(f"deepseek_v4 layer_types {types}: one of {', '.join(V4_TYPES.values())} per layer "
                               f"({n_layers})")
    rate = {"sliding_attention": 0, "compressed_sparse_attention": csa, "heavily_compressed_attention": hca}
    mlp = raw.get("mlp_layer_types") or (["hash_moe"] * int(raw.get("num_hash_layers", 3)) + ["moe"] * n_layers)
    mlp = list(mlp)[:n_layers]
    if len(mlp) != n_layers or set(mlp) - {"hash_moe", "moe"}:
        raise ModelConfigError(f"deepseek_v4 mlp_layer_types {mlp}: one of hash_moe | moe per layer ({n_layers})")
    head_dim = int(raw.get("head_dim", 512))
    rp = dict(raw.get("rope_parameters") or {})
    main, comp = rp.get("main"), rp.get("compress")
    if not (isinstance(main, dict) and isinstance(comp, dict)):
        partial = raw.get("partial_rotary_factor") or (int(raw["qk_rope_head_dim"]) / head_dim
                                                       if raw.get("qk_rope_head_dim") else 64 / head_dim)
        yarn = {k: v for k, v in (rp or dict(raw.get("rope_scaling") or {})).items() if k not in ("main", "compress")}
        if "type" in yarn and "rope_type" not in yarn:
            yarn["rope_type"] = yarn.pop("type")
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0), "partial_rotary_factor": partial}
        comp = {**yarn, "rope_theta": raw.get("compress_rope_theta", 160000.0), "partial_rotary_factor": partial}
    comp = {"rope_type": "default", **comp}
    if comp["rope_type"] == "yarn":
        comp.setdefault("attention_factor", 1.0)
    if main.get("rope_type", "default") != "default" or comp["rope_type"] not in ("default", "yarn"):
        raise ModelConfigError(f"deepseek_v4 rope types main {main.get('rope_type')!r} / compress "
                               f"{comp['rope_type']!r}: supported default / default or yarn")
    partial = float(comp.get("partial_rotary_factor") or main.get("partial_rotary_factor") or 64 / head_dim)
    rotary = int(head_dim * partial)
    o_groups, o_rank = int(raw.get("o_groups", 8)), int(raw.get("o_lora_rank", 1024))
    window, hc = int(raw.get("sliding_window", 128)), int(raw.get("hc_mult", 4))
    if rotary % 2 or not 0 < rotary <= head_dim or n_heads % o_groups or window < 1 or hc < 1 or \
            (csa in (rate[t] for t in types) and csa < 1) or any(r < 0 for r in (csa, hca)) or \
            (hca < 1 and "heavily_compressed_attention" in types):
        raise ModelConfigError(f"deepseek_v4: rotary dims {rotary} (even, <= head_dim {head_dim}), o_groups {o_groups} "
                               f"(a divisor of {n_heads} heads), sliding_window {window} >= 1, hc_mult {hc} >= 1 and "
                               f"compression rates >= 1 ({csa}, {hca})")
    if raw.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ModelConfigError(f"deepseek_v4 with scoring_func={raw['scoring_func']!r} is not supported (sqrtsoftplus)")
    limit = float(raw.get("swiglu_limit", 10.0))
    act = ExpertAct("clamped_silu", 1.0, limit)
    csa_dsa = {}
    if "compressed_sparse_attention" in types:
        csa_dsa = dict(index_heads=int(raw.get("index_n_heads", 64)), index_dim=int(raw.get("index_head_dim", 128)),
                       index_topk=int(raw.get("index_topk", 512)))
        if csa_dsa["index_dim"] < rotary or min(csa_dsa.values()) < 1:
            raise ModelConfigError(f"deepseek_v4's indexer: {csa_dsa}, its head at least the {rotary} rotary dims")
    return dict(
        rope_theta=float(comp["rope_theta"]), rope_type=comp["rope_type"], rope_params=comp,
        sliding_rope_theta=float(main.get("rope_theta", 10000.0)), head_dim=head_dim, rotary_dim=rotary,
        layer_types=tuple(types), compress_rates=tuple(rate[t] for t in types), sliding_window=window,
        attn_sinks=True, o_groups=o_groups, o_lora_rank=o_rank, hc_mult=hc,
        hc_iters=int(raw.get("hc_sinkhorn_iters", 20)), hc_eps=float(raw.get("hc_eps", 1e-6)),
        hash_layers=tuple(i for i, k in enumerate(mlp) if k == "hash_moe"), expert_act=act, mlp_act=act,
        scoring="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)), **csa_dsa)


def _glm5_next(raw: dict, n_layers: int) -> dict:
    """GLM-5.3-Flash's text model (glm5_next): KDA linear attention (Kimi Delta Attention: per-channel decay, a
    fixed-size state per sequence) in the layers layer_types marks linear_attention, DeepSeek Sparse Attention on a
    NoPE MLA in the others (indexed_attention) whose indexer scores pools of index_kpool keys; hyper-connected
    residual streams; dense first layers; the clamped SiLU everywhere; DeepSeek-V3's sigmoid routing."""
    types = [{"full_attention": "indexed_attention"}.get(t, t) for t in raw.get("layer_types") or
             ("linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n_layers))]
    if len(types) != n_layers or set(types) - {"linear_attention", "indexed_attention"}:
        raise ModelConfigError(f"glm5_next layer_types {types}: one of linear_attention | indexed_attention per layer "
                               f"({n_layers})")
    kinds = list(raw.get("mlp_layer_types") or ["dense"] * min(3, n_layers) + ["sparse"] * (n_layers - 3))
    if len(kinds) != n_layers or set(kinds) - {"dense", "sparse"}:
        raise ModelConfigError(f"glm5_next mlp_layer_types {kinds}: one of dense | sparse per layer ({n_layers})")
    lin = dict(raw.get("linear_attn_config") or {})
    heads, dim = int(lin.get("num_heads", raw.get("linear_num_heads", 64))), int(lin.get("head_dim", raw.get(
        "linear_head_dim", 128)))
    bound = lin.get("gate_lower_bound", raw.get("linear_lower_bound", -5.0))
    kpool, topk = int(raw.get("index_kpool", 16)), int(raw.get("index_topk", 2048))
    if int(raw.get("qk_rope_head_dim", 0)) or raw.get("q_lora_rank") is None or kpool < 1 or topk % kpool or \
            bound is None or not raw.get("index_kpool_always_select_tail", True) or \
            raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError("glm5_next: a NoPE MLA (qk_rope_head_dim 0) with q_lora_rank, index_topk a multiple of "
                               f"index_kpool ({topk}, {kpool}), the KDA gate's lower bound ({bound}), the tail always "
                               "selected and silu are what is supported")
    dsa = _dsa(raw, "glm_moe_dsa", n_layers)
    for L in dsa.get("index_shared", ()):
        if types[L] != "indexed_attention" or types[L - 1] != "indexed_attention":
            raise ModelConfigError(f"glm5_next indexer_types: a shared layer ({L}) must be an indexed_attention layer "
                                   "right after one (transformers hands the selection to the next layer only)")
    limit = float(raw.get("swiglu_limit", 10.0))
    act = ExpertAct("clamped_silu", 1.0, limit)
    return dict(**{**dsa, "index_rope_interleave": False}, index_kpool=kpool, layer_types=tuple(types),
                linear_attn=DeltaNet(heads, heads, dim, dim, int(lin.get("short_conv_kernel_size",
                                                                          raw.get("linear_conv_kernel_dim", 4)))),
                linear_bound=float(bound), hc_mult=int(raw.get("hc_mult", 4)),
                hc_iters=int(raw.get("hc_sinkhorn_iters", 20)), hc_eps=float(raw.get("hc_eps", 1e-6)),
                expert_act=act, mlp_act=act, moe_layers=tuple(i for i, k in enumerate(kinds) if k == "sparse"))


def _dsa(raw: dict, published: str, n_layers: int) -> dict:
    """DeepSeek Sparse Attention's fields: the indexer's shape, its rope, and (GLM-5) which layers share the previous
    full layer's selection: indexer_types, else index_topk_pattern ("FSS..."), else transformers' schedule from
    index_topk_freq and index_skip_topk_offset (every layer full by default)."""
    glm = published == "glm_moe_dsa"
    try:
        dsa = dict(index_heads=int(raw["index_n_heads"]), index_dim=int(raw["index_head_dim"]),
                   index_topk=int(raw["index_topk"]), index_rope_interleave=glm)
    except KeyError as e:
        raise ModelConfigError(f"{published} config.json has no {e.args[0]} (the lightning indexer's shape)") from None
    if raw.get("q_lora_rank") is None or dsa["index_dim"] < int(raw["qk_rope_head_dim"]) or dsa["index_topk"] < 1 \
            or dsa["index_heads"] < 1:
        raise ModelConfigError(f"{published}'s indexer needs q_lora_rank, index_n_heads >= 1, index_head_dim >= "
                               f"qk_rope_head_dim and index_topk >= 1")
    types = raw.get("indexer_types") if glm else None
    if glm and types is None:
        pattern = raw.get("index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
        else:
            freq, offset = max(int(raw.get("index_topk_freq", 1)), 1), int(raw.get("index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    if types is not None:
        types = list(types)
        if len(types) != n_layers or set(types) - {"full", "shared"} or types[0] != "full":
            raise ModelConfigError(f"{published} indexer_types {types}: one of full | shared per layer ({n_layers}), "
                                   f"the first full (a shared layer reuses the previous full layer's selection)")
        dsa["index_shared"] = tuple(i for i, t in enumerate(types) if t == "shared")
    return dsa


def parse_config(raw: dict, model_dir: pathlib.Path | None = None) -> ModelConfig:
    mt = raw.get("model_type")
    if mt not in SUPPORTED:
        raise ModelConfigError(f"unsupported architecture model_type={mt!r}; supported: {', '.join(SUPPORTED)}")
    if mt in TEXT_IN_WRAPPER:  # the text model's config, with what the wrapper sets for the whole model
        if not isinstance(raw.get("text_config"), dict):
            raise ModelConfigError(f"{mt} config.json has no text_config")
        top = {k: raw[k] for k in ("tie_word_embeddings", "quantization_config") if k in raw}
        raw = {**raw["text_config"], **top, "model_type": mt}
    published, mt = mt, SAME_AS.get(mt, mt)
    model_dir = model_dir or pathlib.Path(".")
    n_layers = int(raw["num_hidden_layers"])
    theta, rope_type, rope_params = _rope(raw)
    common = dict(
        model_type=mt, published_type=published, vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
        num_layers=n_layers, num_heads=int(raw["num_attention_heads"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_theta=theta, rope_type=rope_type, rope_params=rope_params,
        intermediate_size=int(raw.get("intermediate_size", 0)),
        top_k=int(raw["num_experts_per_tok"]),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos(raw, model_dir),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"), mxfp4_experts=is_mxfp4(raw),
        fp8_block=fp8_block(raw), int4=_int4(raw),
        gguf_expert_types=tuple((raw.get("quantization_config") or {}).get("expert_types") or ()),
    )
    dsa = _dsa(raw, published, n_layers) if published in DSA else {}
    if mt in ("deepseek_v3", "deepseek_v2"):
        n_exp = int(raw.get("n_routed_experts") or raw.get("num_local_experts") or raw.get("num_experts"))
        k_dense = int(raw.get("first_k_dense_replace", 0))
        freq = int(raw.get("moe_layer_freq", 1))
        moe_layers = tuple(i for i in range(k_dense, n_layers) if i % freq == 0)
        if raw.get("mlp_layer_types"):  # V3.2 and GLM-5 as transformers writes them: "dense" | "sparse" per layer
            kinds = list(raw["mlp_layer_types"])
            if len(kinds) != n_layers or set(kinds) - {"dense", "sparse"}:
                raise ModelConfigError(f"{published} mlp_layer_types {kinds}: one of dense | sparse per layer "
                                       f"({n_layers})")
            moe_layers = tuple(i for i, k in enumerate(kinds) if k == "sparse")
        v3 = mt == "deepseek_v3"
        cfg = ModelConfig(
            **common, attention="mla", num_kv_heads=int(raw["num_attention_heads"]),
            head_dim=int(raw["qk_rope_head_dim"]),
            # (V3.2's and GLM-5's MLA always interleave: transformers reads no flag for them)
            rope_interleave=bool(raw.get("rope_interleave", True)) if v3 and published not in DSA else True,
            q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]), moe_intermediate_size=int(raw["moe_intermediate_size"]),
            moe_layers=moe_layers, n_routed_experts=n_exp,
            shared_intermediate_size=int(raw["moe_intermediate_size"]) * int(raw.get("n_shared_experts") or 0),
            scoring="sigmoid" if v3 else "softmax",
            topk_method="noaux_tc" if v3 else raw.get("topk_method", "greedy"),
            n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if v3 else False,
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)), **dsa,
        )
        if cfg.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ModelConfigError(f"unsupported topk_method {cfg.topk_method!r}")
    elif mt == "glm5_next":  # MLA without rope behind the k-pool indexer, KDA layers, DeepSeek-V3's routing
        inter = int(raw["moe_intermediate_size"])
        cfg = ModelConfig(
            **common, **_glm5_next(raw, n_layers), attention="mla", num_kv_heads=int(raw["num_attention_heads"]),
            head_dim=0, rope_interleave=True, q_lora_rank=int(raw["q_lora_rank"]),
            kv_lora_rank=int(raw["kv_lora_rank"]), qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=0,
            v_head_dim=int(raw["v_head_dim"]), moe_intermediate_size=inter,
            n_routed_experts=int(raw.get("n_routed_experts") or raw.get("num_local_experts") or 288),
            shared_intermediate_size=inter * int(raw.get("n_shared_experts") or 0), scoring="sigmoid",
            topk_method="noaux_tc", n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
    elif mt == "deepseek_v4":  # every layer MoE (hash-routed first), one shared expert, MQA of one 512-wide head
        n_heads = int(raw["num_attention_heads"])
        inter = int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
        common["intermediate_size"] = 0
        cfg = ModelConfig(
            **{**common, **_deepseek_v4(raw, n_layers, n_heads)}, attention="compressed", num_kv_heads=1,
            rope_interleave=True, q_lora_rank=int(raw.get("q_lora_rank", 1024)), moe_intermediate_size=inter,
            moe_layers=tuple(range(n_layers)), n_routed_experts=int(raw.get("n_routed_experts") or
                                                                    raw.get("num_local_experts") or 256),
            shared_intermediate_size=inter * int(raw.get("n_shared_experts", 1)))
    else:
        n_exp = int(raw.get("num_local_experts") or raw.get("num_experts") or raw.get("n_routed_experts") or 0)
        n_heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // n_heads)
        if raw.get("use_sliding_window") or (mt == "mixtral" and raw.get("sliding_window")):
            raise ModelConfigError("sliding-window attention is not supported")
        glm, minimax, oss, nxt = mt == "glm4_moe", mt == "minimax_m2", mt == "gpt_oss", mt in HYBRID
        if mt == "mimo_v2_flash":  # its rope_parameters are per layer type: the full layers' are the model's
            rope_params = _mimo_rope(raw)[0]
            common.update(rope_params=rope_params, rope_theta=float(rope_params["rope_theta"]))
        fields = {}  # what the family sets beyond the common GQA ones
        if oss:  # every layer MoE; attention sinks and alternating sliding windows; biased experts
            moe_layers, moe_inter = tuple(range(n_layers)), int(raw["intermediate_size"])
            types = tuple(raw.get("layer_types") or  # transformers' default: sliding first, then alternating
                          ("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)))
            if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
                raise ModelConfigError(f"gpt_oss layer_types {list(types)}: one of sliding_attention | "
                                       f"full_attention per layer ({n_layers})")
            fields = dict(scoring="topk_softmax", router_name="router", expert_bias=True, attn_sinks=True,
                           sliding_window=int(raw.get("sliding_window") or 0), layer_types=types,
                           expert_act=ExpertAct("clamped_swiglu", float(raw.get("swiglu_alpha", 1.702)),
                                                float(raw.get("swiglu_limit", 7.0))))
        elif minimax:  # every layer MoE, Mixtral's names; sigmoid routing with a correction bias, no groups
            if raw.get("scoring_func", "sigmoid") != "sigmoid":
                raise ModelConfigError(f"minimax_m2 with scoring_func={raw['scoring_func']!r} is not supported (sigmoid)")
            moe_layers, moe_inter = tuple(range(n_layers)), int(raw["intermediate_size"])
            fields = dict(scoring="sigmoid", topk_method="noaux_tc")
        elif glm:  # DeepSeek-V3's MoE (dense first layers, shared experts, noaux_tc sigmoid routing) on GQA
            moe_layers = tuple(range(int(raw.get("first_k_dense_replace", 0)), n_layers))
            moe_inter = int(raw["moe_intermediate_size"])
            fields = dict(shared_intermediate_size=moe_inter * int(raw.get("n_shared_experts") or 0),
                           scoring="sigmoid", topk_method="noaux_tc", n_group=int(raw.get("n_group") or 1),
                           topk_group=int(raw.get("topk_group") or 1),
                           routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
        elif mt == "mimo_v2_flash":
            moe_layers, moe_inter, fields = _mimo(raw, n_layers, head_dim)
        elif mt == "minimax_m3_vl":
            moe_layers, moe_inter, fields = _minimax_m3(raw, n_layers, n_heads)
            common["intermediate_size"] = int(raw.get("dense_intermediate_size", 12288))  # its dense layers'
        elif mt == "mixtral":
            moe_layers, moe_inter = tuple(range(n_layers)), int(raw["intermediate_size"])
        else:
            step = int(raw.get("decoder_sparse_step", 1))
            skip = set(raw.get("mlp_only_layers") or [])
            moe_layers = tuple(i for i in range(n_layers) if i not in skip and (i + 1) % step == 0)
            moe_inter = int(raw["moe_intermediate_size"])
            if mt == "qwen2_moe" or nxt:
                fields = dict(shared_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)))
            if nxt:
                fields.update(_qwen3_next(raw, n_layers))
        partial = float(rope_params.get("partial_rotary_factor") or raw.get("partial_rotary_factor")
                        or (int(raw["rotary_dim"]) / head_dim if raw.get("rotary_dim") else 1.0))
        cfg = ModelConfig(
            **common, attention="gqa", num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=head_dim, rope_interleave=False, rotary_dim=int(head_dim * partial) if partial < 1 else 0,
            qkv_bias=(mt == "qwen2_moe" and bool(raw.get("qkv_bias", True)))
            or ((glm or oss or nxt or mt == "mimo_v2_flash") and bool(raw.get("attention_bias"))),
            qk_norm=mt in ("qwen3_moe", "minimax_m3_vl") or nxt or (glm and bool(raw.get("use_qk_norm"))), qk_norm_full=minimax,
            moe_intermediate_size=moe_inter, moe_layers=moe_layers, n_routed_experts=n_exp,
            shared_expert_gate=mt == "qwen2_moe" or nxt,
            # Qwen3.5's router always renormalizes its top-k (the field is gone from its config)
            norm_topk_prob=True if mt in MIXTRAL_NAMES or mt.startswith("qwen3_5") else bool(raw.get(
                "norm_topk_prob", glm or mt == "mimo_v2_flash")),
            **fields,
        )
    if cfg.index_block and (cfg.rotary_dim or cfg.head_dim) > cfg.index_dim:
        raise ModelConfigError(f"{published}: the rotary dims ({cfg.rotary_dim or cfg.head_dim}) exceed the indexer's "
                               f"head ({cfg.index_dim}), which rotates as many")
    if cfg.n_routed_experts <= 0 or not (0 < cfg.top_k <= min(cfg.n_routed_experts, MAX_TOP_K)):
        raise ModelConfigError(f"bad MoE shape: {cfg.n_routed_experts} experts, top-{cfg.top_k} (top-k must be in "
                               f"[1, {MAX_TOP_K}] and at most the number of experts)")
    if cfg.n_routed_experts % cfg.n_group:
        raise ModelConfigError(f"n_routed_experts={cfg.n_routed_experts} is not divisible by n_group={cfg.n_group}")
    return cfg


def load_config(model_dir: str | pathlib.Path) -> ModelConfig:
    d = pathlib.Path(model_dir)
    if not d.is_dir():
        raise ModelConfigError(f"model directory {str(d)!r} does not exist or is not a directory")
    path = d / "config.json"
    if not path.exists():
        raise ModelConfigError(f"{path} not found: not a Hugging Face checkpoint directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path} is not valid JSON: {e}") from None
    try:
        return parse_config(raw, d)
    except KeyError as e:
        raise ModelConfigError(f"{path} lacks required field {e.args[0]!r}") from None
