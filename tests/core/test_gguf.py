"""GGUF files: the tiny Qwen3-MoE checkpoint written as llama.cpp names and lays it out (the gguf package's
writer and quantizers, ours where it has none (gguf_blocks): routed experts in a block type, the rest F32), served
with `--model FILE.gguf`. On the exact path the greedy tokens are transformers' own on the same file (its GGUF
loader dequantizes it); experts of the block types a kernel format keeps (Q4_0, Q4_1, Q4_K, IQ4_NL, IQ4_XS) start on
it by default, their numbers equal to what the gguf package dequantizes."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

import gguf_blocks
import tiny_models
from harness import free_port, greedy, refused_at_start, start
from moe_exchange import codec
from protos import generate_pb2
from tiers import some

gguf = pytest.importorskip("gguf")
pytest.importorskip("moe_kernels._native", reason="native extension not built")

# transformers' GGUF config mapping for qwen3_moe has no expert_feed_forward_length and keeps its default 768:
# the reference needs that width
MOE_I = 768
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "deepseek_v3": "deepseek2",
        "deepseek_v2": "deepseek2", "glm4_moe": "glm4moe", "minimax_m2": "minimax-m2", "gpt_oss": "gpt-oss",
        "deepseek_v32": "deepseek32", "glm_moe_dsa": "glm-dsa", "minimax_m3_vl": "minimax-m3"}
# (the gguf package's tensor map for an architecture it does not list yet: DeepSeek-V3.2's tensors are named as GLM-5's,
# MiniMax-M3's but its indexer's as GLM-4.5's; its indexer's names as llama.cpp's constants give them)
TENSOR_MAP_ARCH = {"deepseek32": "glm-dsa", "minimax-m3": "glm4moe"}
M3_INDEXER = {f"self_attn.index_{n}.weight": f"indexer.{n}.weight" for n in ("q_proj", "k_proj", "q_norm", "k_norm")}
EXPERT_NAMES = {f: ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                    "block_sparse_moe.experts.{e}.w2") for f in ("mixtral", "minimax_m2", "minimax_m3_vl")}
WRAPPED = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}  # MiniMax-M3's text model
TOWER = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")  # (the converter's mmproj file has these)


def text_tensors(src: pathlib.Path) -> dict:
    """The checkpoint's text model's tensors under transformers' text names (a vision-language wrapper's renamed,
    its tower left out), as the converter reads them."""
    out = {}
    for name, x in source_tensors(src).items():
        if name.startswith(TOWER):
            continue
        out[next((new + name[len(old):] for old, new in WRAPPED.items() if name.startswith(old)), name)] = x
    return out


def llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to a llama file's q/k rows (its rope rotates adjacent pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def source_tensors(src: pathlib.Path) -> dict:
    t = {}
    for f in sorted(src.glob("*.safetensors")):
        t.update(load_file(str(f)))
    return t


def is_expert(name: str) -> bool:
    return ".experts." in name and ".shared_expert" not in name


def mtp_layers(cfg: dict) -> int:
    """Multi-token-prediction layers the converter writes as further blocks: GLM's (DeepSeek's it skips)."""
    return cfg.get("num_nextn_predict_layers", 0) if cfg["model_type"] == "glm4_moe" else 0


def write_metadata(w, cfg: dict, family: str, mla_split: bool, gating: bool = True) -> None:
    """The keys llama.cpp's converter writes for the family (convert_hf_to_gguf.py's set_gguf_parameters)."""
    if family == "minimax_m3_vl":
        return write_m3_metadata(w, cfg)
    heads = cfg["num_attention_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"] + mtp_layers(cfg))
    w.add_head_count(heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if family.startswith("deepseek") or family == "glm_moe_dsa":
        r, n, v, kv = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
        w.add_head_count_kv(1)  # MLA as MQA
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(kv)
        if mla_split:
            w.add_key_length(kv + r)
            w.add_value_length(kv)
            w.add_key_length_mla(n + r)
            w.add_value_length_mla(v)
        else:  # the older layout: heads of nope + rope keys, v values
            w.add_key_length(n + r)
            w.add_value_length(v)
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg.get("routed_scaling_factor", 1.0))
        if cfg.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        if gating and family != "glm_moe_dsa":  # (the converter writes it only from DeepSeek's scoring_func, which
            # transformers drops; GLM-5's config has none: llama.cpp's glm-dsa routes by sigmoid without it)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if family in ("deepseek_v3", "deepseek_v32")
                                     else gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_rope_dimension_count(r)
        rp = cfg.get("rope_parameters") or {}
        if rp.get("rope_type") == "yarn":  # as the converter writes DeepSeek-V3's
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rp["factor"])
            w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
        if cfg.get("index_topk"):  # DeepSeek Sparse Attention's indexer (GLM-5's types: true = its own indexer)
            arch = ARCH[family]
            w.add_uint32(f"{arch}.attention.indexer.head_count", cfg["index_n_heads"])
            w.add_uint32(f"{arch}.attention.indexer.key_length", cfg["index_head_dim"])
            w.add_uint32(f"{arch}.attention.indexer.top_k", cfg["index_topk"])
            if cfg.get("indexer_types"):
                w.add_array(f"{arch}.attention.indexer.types", [t == "full" for t in cfg["indexer_types"]])
        return
    w.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    if family in ("glm4_moe", "minimax_m2"):  # sigmoid routing with a choice bias; partial rope
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(int(head_dim * partial))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if family == "gpt_oss":
        rp = cfg["rope_parameters"]
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        return
    if family == "minimax_m2":
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        return
    if family == "glm4_moe":
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob")))
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
        w.add_nextn_predict_layers(mtp_layers(cfg))
        return
    if family == "mixtral":
        w.add_expert_count(cfg["num_local_experts"])
        w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        return
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if family == "qwen3_moe":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    else:
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def write_m3_metadata(w, cfg: dict) -> None:
    """MiniMax-M3's (conversion/minimax.py's MiniMaxM3Model over M2's and TextModel's): the text config's fields."""
    t = cfg["text_config"]
    w.add_context_length(t["max_position_embeddings"])
    w.add_embedding_length(t["hidden_size"])
    w.add_feed_forward_length(t["dense_intermediate_size"])
    w.add_block_count(t["num_hidden_layers"])
    w.add_head_count(t["num_attention_heads"])
    w.add_head_count_kv(t["num_key_value_heads"])
    w.add_rope_freq_base(t["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(t["rms_norm_eps"])
    w.add_expert_count(t["num_local_experts"])
    w.add_expert_used_count(t["num_experts_per_tok"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_key_length(t["head_dim"])
    w.add_value_length(t["head_dim"])
    w.add_expert_feed_forward_length(t["intermediate_size"])
    w.add_rope_dimension_count(int(t["head_dim"] * t["rope_parameters"]["partial_rotary_factor"]))
    w.add_expert_shared_count(1)
    w.add_expert_weights_scale(t["routed_scaling_factor"])
    w.add_expert_weights_norm(True)
    w.add_uint32("minimax-m3.attention.indexer.head_count", t["index_n_heads"])
    w.add_uint32("minimax-m3.attention.indexer.key_length", t["index_head_dim"])
    w.add_uint32("minimax-m3.attention.indexer.top_k", t["index_topk_blocks"])
    w.add_uint32("minimax-m3.attention.indexer.block_size", t["index_block_size"])
    w.add_uint32("minimax-m3.attention.indexer.local_blocks", t["index_local_blocks"])
    w.add_leading_dense_block_count(t["mlp_layer_types"].index("sparse"))


def add_tokenizer(w, src: pathlib.Path, n: int, eos: int = 1) -> None:
    """The checkpoint's BPE tokenizer as the converter writes a gpt2-model one (its n ids, merges, added tokens)."""
    tok = json.loads((src / "tokenizer.json").read_text())
    added = {a["id"]: a["content"] for a in tok.get("added_tokens", [])}
    vocab = {i: s for s, i in tok["model"]["vocab"].items()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([added.get(i, vocab.get(i, f"[UNUSED{i}]")) for i in range(n)])
    w.add_token_types([3 if i in added else 1 for i in range(n)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_eos_token_id(eos)


def write_gguf(src: pathlib.Path, out: pathlib.Path, expert_type, arch: str | None = None,
               mla_split: bool = False, split_max_tensors: int = 0, gating: bool = True) -> pathlib.Path:
    """src's checkpoint as llama.cpp's converter writes it: names from the gguf package's own map, experts
    stacked (quantized to expert_type, None = F32), a llama file's q/k permuted, MLA's kv_b split when asked."""
    cfg = json.loads((src / "config.json").read_text())
    family = cfg["model_type"]
    arch = arch or ARCH[family]
    t = text_tensors(src)
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    write_metadata(w, cfg, family, mla_split, gating)
    cfg = {**cfg.get("text_config", {}), **cfg}
    add_tokenizer(w, src, cfg["vocab_size"], cfg.get("eos_token_id") or 1)
    w.add_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    tmap = gguf.get_tensor_name_map(next(a for a, name in gguf.MODEL_ARCH_NAMES.items()
                                         if name == TENSOR_MAP_ARCH.get(arch, arch)), cfg["num_hidden_layers"])

    def add(name, x, qtype=None):
        gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None and arch == "minimax-m3" and name.split(".", 3)[-1] in M3_INDEXER:
            gname = f"blk.{name.split('.')[2]}." + M3_INDEXER[name.split(".", 3)[-1]]
        assert gname is not None or arch != ARCH[family], name
        gname = gname or name  # (another architecture's file, to be refused)
        a = x.float().numpy()
        if qtype is None:
            w.add_tensor(gname, a)
        else:
            w.add_tensor(gname, gguf_blocks.quantize(a, qtype), raw_dtype=qtype)

    for name, x in t.items():
        if family == "gpt_oss" and is_expert(name):  # stacked already: split gate and up, as the converter does
            for part, y in gpt_oss_experts(name, x):
                add(part, y, None if part.endswith(".bias") else expert_type)
            continue
        if name.endswith(".sinks"):
            name += ".weight"
        if is_expert(name):
            continue
        if family == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            x = llama_permute(x, cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"])
        if family == "minimax_m3_vl" and name.endswith("norm.weight"):  # the converter bakes in the 1 of x * (1 + w)
            x = x + 1.0
        if mla_split and name.endswith("kv_b_proj.weight"):
            kv = x.view(cfg["num_attention_heads"], -1, x.shape[-1])
            k_b, v_b = kv.split([cfg["qk_nope_head_dim"], cfg["v_head_dim"]], dim=1)
            add(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2).contiguous())
            add(name.replace("kv_b_proj", "v_b_proj"), v_b.contiguous())
            continue
        add(name.replace("e_score_correction_bias", "e_score_correction.bias"), x)
    E = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    names = EXPERT_NAMES.get(family, ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"))
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        if p + names[0].format(e=0) + ".weight" not in t:
            continue  # a dense layer
        for one in names:
            stacked = torch.stack([t[p + one.format(e=e) + ".weight"] for e in range(E)])
            add(p + one.replace(".{e}", "") + ".weight", stacked, expert_type(L, one) if callable(expert_type) else expert_type)
    for L in range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + mtp_layers(cfg)):
        # GLM's multi-token-prediction layer (transformers leaves it out of the model; llama.cpp keeps it)
        w.add_tensor(f"blk.{L}.nextn.eh_proj.weight", np.ones((cfg["hidden_size"], 2 * cfg["hidden_size"]), np.float32))
        w.add_tensor(f"blk.{L}.attn_norm.weight", np.ones(cfg["hidden_size"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out if not split_max_tensors else sorted(out.parent.glob(out.stem + "-0*-of-*.gguf"))[0]


def gpt_oss_experts(name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """gpt-oss's fused expert tensors as llama.cpp's converter writes them: gate and up apart (their columns
    interleaved in gate_up_proj [E, H, 2I]), every matrix [E, rows, K]."""
    if name.endswith("gate_up_proj_bias"):
        return [(name.replace("gate_up_proj_bias", "gate_proj.bias"), x[..., 0::2]),
                (name.replace("gate_up_proj_bias", "up_proj.bias"), x[..., 1::2])]
    if name.endswith("down_proj_bias"):
        return [(name.replace("down_proj_bias", "down_proj.bias"), x)]
    if name.endswith("gate_up_proj"):
        return [(name.replace("gate_up_proj", "gate_proj.weight"), x[..., 0::2].transpose(1, 2).contiguous()),
                (name.replace("gate_up_proj", "up_proj.weight"), x[..., 1::2].transpose(1, 2).contiguous())]
    return [(name.replace("down_proj", "down_proj.weight"), x.transpose(1, 2).contiguous())]


def stored(x: torch.Tensor, qtype) -> torch.Tensor:
    """What qtype stores of x (rows of K along the last dimension): the gguf package's quantizer, then its
    dequantizer."""
    q = gguf_blocks.quantize(x.float().numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(q, qtype)).to(x.dtype)


def with_experts_as_stored(src: pathlib.Path, out: pathlib.Path, qtype) -> pathlib.Path:
    """src with every routed expert weight replaced by what qtype stores (the gguf package's quantizer and
    dequantizer): transformers on it is the reference for the file."""
    import shutil
    shutil.copytree(src, out)
    for f in sorted(out.glob("*.safetensors")):
        t = load_file(str(f))
        for name, x in t.items():
            if not is_expert(name) or qtype is None or name.endswith("_bias"):
                continue
            if name.endswith("gate_up_proj"):  # gpt-oss: [E, H, 2I], each of gate and up quantized along H
                y = x.clone()
                y[..., 0::2] = stored(x[..., 0::2].transpose(1, 2), qtype).transpose(1, 2)
                y[..., 1::2] = stored(x[..., 1::2].transpose(1, 2), qtype).transpose(1, 2)
                t[name] = y
            elif name.endswith("experts.down_proj"):  # gpt-oss: [E, I, H], quantized along I
                t[name] = stored(x.transpose(1, 2), qtype).transpose(1, 2).contiguous()
            else:
                t[name] = stored(x, qtype)
        from safetensors.torch import save_file
        save_file(t, str(f), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return tiny_models.build("qwen3_moe", tmp_path_factory.mktemp("src") / "q", moe_intermediate_size=MOE_I)


@pytest.fixture(scope="module")
def wide_source(tmp_path_factory):
    """The tiny Qwen3-MoE with rows of 256 (K-quant and IQ4_XS super-blocks)."""
    return tiny_models.build("qwen3_moe", tmp_path_factory.mktemp("wide") / "q", hidden_size=256, moe_intermediate_size=MOE_I)


def q4_k_m(L: int, name: str):
    """A Q4_K_M-like mix, as llama-quantize writes one: Q4_K, except down in Q6_K in some layers (here layer 0)."""
    Q = gguf.GGMLQuantizationType
    return Q.Q6_K if L == 0 and "down" in name else Q.Q4_K


def q5_k_m(L: int, name: str):
    """A Q5_K_M-like mix: Q5_K, down in Q6_K in layer 0."""
    Q = gguf.GGMLQuantizationType
    return Q.Q6_K if L == 0 and "down" in name else Q.Q5_K


def q3_k_m(L: int, name: str):
    """A Q3_K_M-like mix: Q3_K, down in Q4_K in layer 0."""
    Q = gguf.GGMLQuantizationType
    return Q.Q4_K if L == 0 and "down" in name else Q.Q3_K


def q2_k_mix(L: int, name: str):
    """A Q2_K-like mix: Q2_K, down in Q3_K in layer 0."""
    Q = gguf.GGMLQuantizationType
    return Q.Q3_K if L == 0 and "down" in name else Q.Q2_K


def iq2_m_mix(L: int, name: str):
    """An IQ2_M-like mix (llama-quantize's IQ2_M puts some down matrices in a larger grid type): IQ2_S, down in IQ3_S
    in layer 0."""
    Q = gguf.GGMLQuantizationType
    return Q.IQ3_S if L == 0 and "down" in name else Q.IQ2_S


def iq1_m_mix(L: int, name: str):
    """An IQ1_M-like mix: IQ1_M gate / up, IQ2_XXS down."""
    Q = gguf.GGMLQuantizationType
    return Q.IQ2_XXS if "down" in name else Q.IQ1_M


IQ_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")  # random valid blocks (gguf_blocks)
MIXES = {"Q4_K_M": q4_k_m, "Q5_K_M": q5_k_m, "Q3_K_M": q3_k_m, "Q2_K_mix": q2_k_mix, "IQ2_M_mix": iq2_m_mix,
         "IQ1_M_mix": iq1_m_mix}
# the block type -> the expert format that starts by default (a mix: its layer 0's); `kept`: whether it keeps the
# file's numbers
DEFAULTS = {"Q8_0": ("int8g32", True), "Q4_0": ("int4g32", True), "Q4_K": ("q4k", True), "Q6_K": ("q6k", True),
            "IQ4_XS": ("iq4xs", True), "Q4_K_M": ("q4k/q6k", True), "Q5_K_M": ("q5k/q6k", True),
            "Q3_K_M": ("q3k/q4k", True), "Q2_K": ("q2k", True), "Q2_K_mix": ("q2k/q3k", True),
            **{t: (t.lower().replace("_", ""), True) for t in IQ_TYPES}, "IQ2_M_mix": ("iq2s/iq3s", True),
            "IQ1_M_mix": ("iq1m/iq2xxs", True)}


@pytest.mark.parametrize("qtype", some(list(DEFAULTS), fast=["Q4_K_M", "IQ2_XXS"]))
def test_gguf_serves_transformers_greedy_tokens_on_the_same_file(qtype, source, wide_source, tmp_path, services_factory,
                                                                  monkeypatch):
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    src = wide_source if qtype in ("Q4_K", "Q6_K", "IQ4_XS", "Q4_K_M", "Q5_K_M", "Q3_K_M", "Q2_K", "Q2_K_mix",
                                   *IQ_TYPES, "IQ2_M_mix", "IQ1_M_mix") else source
    f = write_gguf(src, tmp_path / f"tiny-{qtype}.gguf", MIXES.get(qtype) or getattr(gguf.GGMLQuantizationType, qtype))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f.name,
                                                            dtype=torch.float32).eval()
    torch.manual_seed(1)
    prompt = torch.randint(2, 200, (20,)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        exact = ref(torch.tensor([prompt])).logits[0].double()
    s = services_factory(f, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    assert greedy(s.stub, prompt, 12) == want, s.logs()
    s.stop()
    fmt, kept = DEFAULTS[qtype]
    s = services_factory(f, gpu_args=("--dtype", "fp32"))  # default formats: the blocks kept
    assert f"as {fmt}" in s.logs(), s.logs()
    assert ("requantized to" in s.logs()) != kept, s.logs()
    if qtype in IQ_TYPES:  # Info names the type's own format, and the experts it holds are the file's bytes
        import grpc
        from protos import expert_pb2, expert_pb2_grpc
        with grpc.insecure_channel(f"127.0.0.1:{s.expert_port}") as ch:
            info = expert_pb2_grpc.ExpertServiceStub(ch).Info(expert_pb2.ExpertInfoRequest(), timeout=10)
        reader = gguf.GGUFReader(str(f))
        file_bytes = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
        assert info.weight_format == fmt and info.weight_bytes == file_bytes, (info.weight_format, info.weight_bytes,
                                                                               file_bytes)
    r = s.stub.Score(generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=prompt)), timeout=60)
    got = codec.decode(r.logits, "logits").double()
    # the kernels' int8 activations cost this random model ~4-6% of a position's logits (the weights themselves are
    # exact: test_kept_block_types_are_bit_for_bit). Read
    # per position: where that small difference tips a router's choice (a random model's scores lie close), one
    # position's logits move by 30-60% (seen for Q4_K and IQ4_XS)
    err = (got - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(err.median()) < (0.08 if kept else 0.15), err


def test_a_mix_runs_each_matrix_in_its_own_block_format_bit_for_bit(wide_source, tmp_path):
    """Q4_K_M: the default (gguf) holds layer 0's Q4_K gate/up as q4k beside its Q6_K down as q6k, layer 1 all q4k; the
    packed experts, unpacked, are the gguf package's dequantized weights bit for bit; the packed-weight cache keeps
    each layer's formats."""
    from moe_experts.packed_cache import PackedCache
    from moe_experts.store import load_expert_layers
    from moe_core import gguf_model
    from moe_core.config import load_config
    from moe_kernels.packing import unpack
    d = gguf_model.prepare(write_gguf(wide_source, tmp_path / "mix.gguf", q4_k_m), tmp_path / "prep")
    cfg, ck = load_config(d), gguf_model.open_checkpoint(d)
    assert gguf_model.expert_format(cfg.gguf_expert_types) == gguf_model.PER_MATRIX == "gguf"
    assert [gguf_model.layer_formats(cfg, ck, L, "gguf") for L in (0, 1)] == [("q4k", "q6k"), ("q4k", "q4k")]
    assert gguf_model.layer_formats(cfg, ck, 0, "int8g32") == ("int8g32", "int8g32")
    assert gguf_model.dequantized_experts(cfg, "gguf") is None  # nothing requantized
    cache = PackedCache(tmp_path / "cache", "fp", "stamp", "gguf")
    for attempt in range(2):  # packed from the file, then read back from the cache
        layers = load_expert_layers(cfg, ck, "gguf", 1, cache=cache)
        for L, op in layers.items():
            assert (op.fmt, op.down_fmt) == gguf_model.layer_formats(cfg, ck, L, "gguf")
            for e in (0, cfg.n_routed_experts - 1):
                g, u, dn = (ck.get(n) for n in cfg.expert_tensor_names(L, e))
                gu = unpack(tuple(None if p is None else p[e:e + 1] for p in op.gu), op.fmt, cfg.hidden_size)[0]
                assert torch.equal(gu, torch.cat([g, u])) and torch.equal(
                    unpack(tuple(None if p is None else p[e:e + 1] for p in op.dn), op.down_fmt, MOE_I)[0], dn)
    assert len(list(cache.dir.glob("layer-*.safetensors"))) == len(layers)
    # the GPU side's hot experts of that layer: the same formats, the same numbers as the expert service's
    from gpu_service.experts.hot_layers import hot_layer
    hot = hot_layer(cfg, ck, 0, [1, 3], "gguf", torch.device("cpu"), 1)
    assert (hot.fmt, hot.down_fmt) == ("q4k", "q6k")
    x, w = torch.randn(3, cfg.hidden_size), torch.rand(3, 2)
    ids = torch.tensor([[1, 3]] * 3, dtype=torch.int32)
    assert torch.equal(hot.forward(x, ids - torch.tensor([1, 2], dtype=torch.int32), w), layers[0].forward(x, ids, w))


def test_the_gguf_format_needs_a_gguf_with_quantized_experts(source):
    from moe_experts.loading import weight_format
    from moe_core.config import ModelConfigError, load_config
    with pytest.raises(ModelConfigError, match="--weight-format gguf keeps .* no quantized GGUF experts"):
        weight_format("gguf", load_config(source))


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_our_block_quantizers_write_what_the_gguf_package_reads(qtype):
    """tests/gguf_blocks.py's layouts: the gguf package's dequantizer gives back the quantized rows (within a 4-bit
    grid's error; a misplaced scale or nibble would be off by the weights' own size)."""
    x = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    t = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf_blocks.quantize(x, t)
    assert raw.shape == (16, 512 // gguf.GGML_QUANT_SIZES[t][0] * gguf.GGML_QUANT_SIZES[t][1])
    back = gguf.quants.dequantize(raw, t)
    # Q3_K: 8 levels, Q2_K: 4
    assert np.linalg.norm(back - x) / np.linalg.norm(x) < {"Q3_K": 0.25, "Q2_K": 0.45}.get(qtype, 0.12)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q8_0",
                                   *IQ_TYPES])
def test_kept_block_types_are_bit_for_bit(qtype, wide_source, tmp_path):
    from moe_core import gguf_model
    from moe_kernels.packing import pack_expert, row_len, unpack
    f = write_gguf(wide_source, tmp_path / "tiny.gguf", getattr(gguf.GGMLQuantizationType, qtype))
    d = gguf_model.prepare(f, tmp_path / "cache")
    assert json.loads((d / "config.json").read_text())["moe_intermediate_size"] == MOE_I
    assert gguf_model.expert_format((qtype,)) == gguf_model.KEEPS[qtype][0]
    ck = gguf_model.open_checkpoint(d)
    for fmt in gguf_model.KEEPS[qtype]:
        for name in ("model.layers.1.mlp.experts.5.down_proj.weight", "model.layers.0.mlp.experts.0.gate_proj.weight"):
            kept = ck.get_published(name, fmt)
            assert torch.equal(kept.dequantize(), ck.get(name))  # = the gguf package's dequantizer
            K = kept.shape[1]  # and packed, the numbers the kernels multiply are those, bit for bit
            packed = [p if p is None else p[None] for p in pack_expert(kept, fmt, row_len(K, fmt))]
            assert torch.equal(unpack(packed, fmt, K)[0], ck.get(name))
            assert ck.get_published(name, "int8") is None
        assert ck.get_published("model.layers.0.self_attn.q_proj.weight", fmt) is None  # F32
    assert np.allclose(ck.get("model.embed_tokens.weight").numpy(), load_file(str(wide_source / "model.safetensors"))[
        "model.embed_tokens.weight"].numpy())


def test_a_tokenizer_the_converter_panics_on_is_refused_by_name(tmp_path):
    """A vocabulary whose one merge's result is not a token: the tokenizers library panics (a pyo3 PanicException, not
    an Exception) while building it; the reader names the file and the cause instead of dying with it."""
    from moe_core import gguf_model
    from moe_core.config import ModelConfigError
    f = tmp_path / "badtok.gguf"
    w = gguf.GGUFWriter(str(f), "qwen3moe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<t{i}>" for i in range(16)])
    w.add_token_types([gguf.TokenType.NORMAL] * 16)
    w.add_token_merges(["<t2> <t3>"])
    w.add_tensor("token_embd.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelConfigError, match="badtok.gguf: its tokenizer cannot be converted: PanicException"):
        gguf_model._tokenizer_files(f, tmp_path / "out")


def test_other_gguf_architectures_are_refused_by_name(source, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    f = write_gguf(source, tmp_path / "other.gguf", None, arch="gemma3")
    log = tmp_path / "expert.log"
    p = start("expert_service", "--model", str(f), "--listen", f"127.0.0.1:{free_port()}", log=log)
    assert p.wait(120) == 2
    text = log.read_text()
    assert "GGUF architecture 'gemma3' is not supported yet" in text and "Traceback" not in text, text


def retyped(f: pathlib.Path, name: str, qtype) -> pathlib.Path:
    """f with one tensor's type field rewritten in place (its bytes left as they are)."""
    r = gguf.GGUFReader(str(f))
    field = next(t.field for t in r.tensors if t.name == name)
    at = field.offset + sum(p.nbytes for p in field.parts[:4])  # name length, name, n_dims, dims: then the type
    b = bytearray(f.read_bytes())
    b[at:at + 4] = int(qtype).to_bytes(4, "little")
    f.write_bytes(bytes(b))
    return f


@pytest.mark.parametrize("name, qtype", [("blk.0.attn_q.weight", gguf.GGMLQuantizationType.F16),  # F32: fewer bytes
                                         ("blk.1.ffn_up_exps.weight", gguf.GGMLQuantizationType.F32),  # Q8_0: more
                                         ("blk.1.ffn_down_exps.weight", gguf.GGMLQuantizationType.Q4_0)])
def test_a_retyped_tensor_is_refused_at_start_by_both_services(source, tmp_path, monkeypatch, name, qtype):
    """A tensor's type changed so that its bytes still lie in the file (more of them, or fewer): both services
    refuse the file at start naming the tensor, instead of serving what its bytes read as."""
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    f = retyped(write_gguf(source, tmp_path / "retyped.gguf", gguf.GGMLQuantizationType.Q8_0), name, qtype)
    for module, extra in (("expert_service", ()), ("gpu_service", ("--experts", "127.0.0.1:1"))):
        err = refused_at_start(module, "--model", str(f), "--listen", f"127.0.0.1:{free_port()}", *extra, timeout=60)
        assert f"tensor {name} ({qtype.name}" in err and "Traceback" not in err, err[-2000:]


# -- the other families: Qwen2-MoE, Mixtral (a llama file with experts), DeepSeek V2 and V3 with both MLA layouts --
FAMILY_FILES = [("qwen2_moe", False), ("mixtral", False), ("deepseek_v2", False), ("deepseek_v3", False),
                ("deepseek_v3", True), ("deepseek_v3_yarn", True), ("glm4_moe", False), ("minimax_m2", False),
                ("gpt_oss", False), ("deepseek_v32", True), ("glm_moe_dsa", True), ("minimax_m3_vl", False)]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


@pytest.fixture(scope="module")
def family_sources(tmp_path_factory, checkpoints):
    """The tiny checkpoints, Qwen2-MoE's without its dense layer (llama.cpp's qwen2moe has none), Mixtral's
    experts 64 wide (quantized blocks hold 32 values)."""
    out = dict(checkpoints)
    out["qwen2_moe"] = tiny_models.build("qwen2_moe", tmp_path_factory.mktemp("src") / "q2", mlp_only_layers=[])
    out["mixtral"] = tiny_models.build("mixtral", tmp_path_factory.mktemp("src") / "mx", intermediate_size=64)
    out["gpt_oss"] = tiny_models.build("gpt_oss", tmp_path_factory.mktemp("src") / "oss",
                                       swiglu_limit=7.0)  # llama.cpp's constant for the family
    out["deepseek_v3_yarn"] = tiny_models.build("deepseek_v3", tmp_path_factory.mktemp("src") / "y",
                                                rope_parameters=YARN)  # DeepSeek-V3's long-context rope
    # MiniMax-M3 as llama.cpp builds it: block-sparse attention in every MoE layer, its constant SwiGLU limit
    out["minimax_m3_vl"] = tiny_models.build("minimax_m3_vl", tmp_path_factory.mktemp("src") / "m3", swiglu_limit=7.0,
                                             layer_types=["full_attention"] + ["minimax_m3_sparse"] * 3)
    return out


@pytest.mark.parametrize("family, mla_split", FAMILY_FILES)
def test_every_tensor_reads_back_as_transformers_names_it(family, mla_split, family_sources, tmp_path):
    """F32 file: each of the checkpoint's tensors, under transformers' name and layout (a llama file's q/k rows
    permuted back, MLA's kv_b joined again, Qwen2's shared-expert gate reshaped), equals the source exactly; the
    config read from the metadata is the source's."""
    from moe_core import gguf_model
    from moe_core.config import load_config
    src = family_sources[family]
    f = write_gguf(src, tmp_path / f"{family}.gguf", None, mla_split=mla_split)
    d = gguf_model.prepare(f, tmp_path / "cache")
    ck = gguf_model.open_checkpoint(d)
    want = text_tensors(src)
    assert sorted(ck.names()) == sorted(want)
    for name, x in want.items():
        if family == "minimax_m3_vl" and name.endswith("norm.weight"):  # (w + 1) - 1: w to the rounding of the 1
            torch.testing.assert_close(ck.get(name), x.float(), rtol=0, atol=2 ** -23)
            continue
        assert torch.equal(ck.get(name), x.float()), name
    got, ref = load_config(d), load_config(src)
    for field in ("model_type", "hidden_size", "num_layers", "num_heads", "head_dim", "n_routed_experts", "top_k",
                  "moe_intermediate_size", "shared_intermediate_size", "moe_layers", "scoring", "norm_topk_prob",
                  "routed_scaling_factor", "rope_theta", "rope_interleave", "attention", "rope_type", "index_heads",
                  "index_dim", "index_topk", "index_rope_interleave", "index_shared", "intermediate_size",
                  "rotary_dim", "norm_offset", "layer_types", "index_block", "index_topk_blocks", "index_local_blocks",
                  "mlp_act", "expert_act"):
        assert getattr(got, field) == getattr(ref, field), field
    if got.rope_type == "yarn":
        from gpu_service.model.layers import rope_inv_freq, softmax_scale
        assert torch.equal(rope_inv_freq(got)[0], rope_inv_freq(ref)[0]) and rope_inv_freq(got)[1] == rope_inv_freq(ref)[1]
        assert softmax_scale(got, 24) == softmax_scale(ref, 24)


@pytest.mark.parametrize("family, mla_split", some(FAMILY_FILES, fast=[]))
def test_family_files_serve_transformers_greedy_tokens(family, mla_split, family_sources, tmp_path,
                                                       services_factory, monkeypatch):
    """Q8_0 experts: on the exact path the greedy tokens of transformers' own model on the weights the file
    stores (the experts through the gguf package's quantizer and dequantizer), both services on the file."""
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    # gpt-oss's files keep its MXFP4 experts
    q = gguf.GGMLQuantizationType.MXFP4 if family == "gpt_oss" else gguf.GGMLQuantizationType.Q8_0
    src = family_sources[family]
    f = write_gguf(src, tmp_path / f"{family}.gguf", q, mla_split=mla_split)
    ref_dir = with_experts_as_stored(src, tmp_path / "ref", q)
    ref = tiny_models.reference_model(str(ref_dir))
    prompt = [5, 17, 30, 41, 7, 99, 3, 250, 12, 64]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    s = services_factory(f, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    assert greedy(s.stub, prompt, 12) == want, s.logs()


def test_gpt_oss_mxfp4_experts_are_kept_bit_for_bit(family_sources, tmp_path):
    """A gpt-oss file's MXFP4 experts: shown as the published blocks and scales (nibbles back in transformers'
    order), whose values are what the gguf package dequantizes; the mxfp4 format is the default."""
    from moe_experts.loading import weight_format
    from moe_core import gguf_model
    from moe_core.config import load_config
    from moe_kernels.packing import Mx4
    f = write_gguf(family_sources["gpt_oss"], tmp_path / "oss.gguf", gguf.GGMLQuantizationType.MXFP4)
    d = gguf_model.prepare(f, tmp_path / "cache")
    cfg, ck = load_config(d), gguf_model.open_checkpoint(d)
    assert cfg.mxfp4_experts and weight_format("auto", cfg) == "mxfp4"
    gate_up, down = cfg.stacked_expert_names(1)
    from gguf import GGUFReader, dequantize
    r = {t.name: t for t in GGUFReader(str(f)).tensors}
    for e in (0, 5):
        gu = Mx4.from_blocks(ck.get_row(gate_up + "_blocks", e), ck.get_row(gate_up + "_scales", e)).dequantize()
        g, u = (torch.from_numpy(dequantize(np.asarray(r[f"blk.1.ffn_{p}_exps.weight"].data[e]), gguf.GGMLQuantizationType.MXFP4))
                for p in ("gate", "up"))
        assert torch.equal(gu[0::2], g) and torch.equal(gu[1::2], u)
        dn = Mx4.from_blocks(ck.get_row(down + "_blocks", e), ck.get_row(down + "_scales", e)).dequantize()
        assert torch.equal(dn, torch.from_numpy(dequantize(np.asarray(r["blk.1.ffn_down_exps.weight"].data[e]),
                                                           gguf.GGMLQuantizationType.MXFP4)))


@pytest.mark.slow
def test_split_files_serve_as_one(family_sources, tmp_path, services_factory, monkeypatch):
    """A split set (gguf-split's -0000N-of-0000M names, the gguf package's writer): given its first file, both
    services read every part, with the tokens of the whole file; a later part or a set with one missing is refused,
    naming the file."""
    from moe_core import gguf_model
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    src, q = family_sources["deepseek_v3"], gguf.GGMLQuantizationType.Q8_0
    (tmp_path / "whole").mkdir()
    (tmp_path / "split").mkdir()
    whole = write_gguf(src, tmp_path / "whole" / "ds.gguf", q)
    first = write_gguf(src, tmp_path / "split" / "ds.gguf", q, split_max_tensors=15)
    parts = sorted(first.parent.glob("*.gguf"))
    assert len(parts) >= 3 and first.name.endswith("-00001-of-%05d.gguf" % len(parts))
    a, b = (gguf_model.open_checkpoint(gguf_model.prepare(f, tmp_path / "cache")) for f in (whole, first))
    assert sorted(a.names()) == sorted(b.names()) and len(set(b.weight_map.values())) == len(parts)
    for name in ("model.layers.2.mlp.experts.7.up_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(a.get(name), b.get(name))
    prompt = [5, 17, 30, 41, 7, 99, 3, 250, 12, 64]
    s = services_factory(whole, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    want = greedy(s.stub, prompt, 10)
    s.stop()
    s = services_factory(first, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    assert greedy(s.stub, prompt, 10) == want
    s.stop()
    with pytest.raises(gguf_model.ModelConfigError, match="is part 2 of a split GGUF set: pass its first file"):
        gguf_model.prepare(parts[1], tmp_path / "cache2")
    parts[-1].rename(parts[-1].with_suffix(".moved"))
    with pytest.raises(gguf_model.ModelConfigError, match=f"the split set lacks {parts[-1].name}"):
        gguf_model.prepare(first, tmp_path / "cache3")


def test_a_deepseek_file_that_lost_v3s_gating_is_refused(family_sources, tmp_path):
    """No expert_gating_func (llama.cpp reads softmax) but V3's choice bias: a model neither V2 nor V3, refused
    with what to convert it from."""
    from moe_core import gguf_model
    f = write_gguf(family_sources["deepseek_v3"], tmp_path / "ds.gguf", None, gating=False)
    with pytest.raises(gguf_model.ModelConfigError, match='no sigmoid expert_gating_func.*"scoring_func": "sigmoid"'):
        gguf_model.prepare(f, tmp_path / "cache")


def test_experts_the_kernels_cannot_keep_are_named_at_start():
    from types import SimpleNamespace
    from moe_core.gguf_model import dequantized_experts, expert_format
    cfg = lambda *types: SimpleNamespace(gguf_expert_types=types)  # noqa: E731
    for kept, fmt in (("Q4_0", "int4g32"), ("MXFP4", "mxfp4"), ("Q4_K", "q4k"), ("Q4_K", "uint4g32"),
                      ("IQ4_XS", "iq4nl"), ("IQ4_XS", "iq4xs"), ("Q5_K", "q5k"), ("Q6_K", "q6k"), ("Q3_K", "q3k"),
                      ("Q3_K", "q6k"), ("Q2_K", "q2k")):
        assert dequantized_experts(cfg(kept), fmt) is None
    assert dequantized_experts(cfg(), "bf16") is None  # not a GGUF
    msg = dequantized_experts(cfg("Q4_K", "Q6_K"), "bf16")
    assert "Q4_K, Q6_K" in msg and "held as bf16" in msg and "2.4x the file's bytes" in msg  # 16 / 6.5625
    assert "requantized to int8" in dequantized_experts(cfg("Q8_0"), "int8")
    msg = dequantized_experts(cfg("Q4_K", "Q6_K"), "q4k")  # Q4_K_M: its Q4_K kept, its Q6_K requantized
    assert "(Q6_K)" in msg and "requantized to q4k (Q6_K: 6.56 -> 4.75 bits a weight)" in msg
    # the types' own format where they share one; else each matrix in its own type's (gguf); the types no format
    # keeps: the smallest format with at least their value bits, q3k's 3 at least (IQ2_XS: 3, Q5_0: 5, Q5_1: 5, floats: int8)
    assert expert_format(("Q4_K", "Q6_K")) == "gguf" and expert_format(("Q6_K",)) == "q6k"
    assert expert_format(("Q4_0", "Q4_1")) == "gguf" and expert_format(("IQ4_NL", "IQ4_XS")) == "gguf"
    assert expert_format(("IQ4_XS", "Q5_K")) == "gguf" and expert_format(("Q2_K", "Q4_K")) == "gguf"
    assert expert_format(("Q8_0",)) == "int8g32" and expert_format(("Q2_K",)) == "q2k"
    assert expert_format(("Q8_0", "Q6_K")) == "gguf" and expert_format(("Q5_K", "Q3_K")) == "gguf"
    assert expert_format(("Q5_K",)) == "q5k" and expert_format(("Q3_K", "Q2_K")) == "gguf"
    # the grid types: each its own format (the file's bytes), a mix each matrix in its own type's
    assert expert_format(("IQ2_XS",)) == "iq2xs" and expert_format(("IQ3_XXS", "Q3_K")) == "gguf"
    assert expert_format(("IQ1_M",)) == "iq1m" and expert_format(("IQ2_XXS", "IQ3_S")) == "gguf"
    assert expert_format(("Q5_0",)) == "q5k" and expert_format(("Q5_1",)) == "q5k" and expert_format(("Q3_K",)) == "q3k"
    msg = dequantized_experts(cfg("Q8_0", "Q6_K"), "int8g32")  # the Q8_0 kept, the Q6_K requantized
    assert "(Q6_K)" in msg and "Q8_0" not in msg
    assert dequantized_experts(cfg("Q8_0", "Q6_K"), "gguf") is None  # each kept in its own
    msg = dequantized_experts(cfg("Q3_K", "Q5_0"), "gguf")  # Q3_K_M on rows not of 256: its Q5_0 down in q5k
    assert "(Q5_0)" in msg and "Q3_K" not in msg and "requantized to q5k (Q5_0: 5.5 -> 5.75 bits a weight)" in msg
    assert dequantized_experts(cfg("Q2_K", "Q4_0"), "gguf") is None
    assert dequantized_experts(cfg("IQ2_XS", "Q4_0"), "gguf") is None and dequantized_experts(cfg("IQ1_S"), "iq1s") is None
    msg = dequantized_experts(cfg("IQ2_XS"), "q3k")  # asked for another format: requantized, said so
    assert "(IQ2_XS)" in msg and "requantized to q3k (IQ2_XS: 2.31 -> 3.62 bits a weight)" in msg
    assert expert_format(("Q4_0",)) == "int4g32" and expert_format(("BF16",)) is None

# -- DeepSeek-V4 (deepseek4): its published checkpoint as llama.cpp's converter writes it (conversion/deepseek.py of the
# llama-cpp-python 0.3.36 sdist; bench/check_gguf_converter.py runs the converter itself) --
def write_deepseek4(src: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The converter's file of src (tools/synth_checkpoint's published form): its metadata keys, the tensors under
    llama.cpp's names (its FP8 projections dequantized, here kept F32 where the converter requantizes them to Q8_0),
    the routed experts stacked in ggml's MXFP4 blocks (each 32: the scale byte, then byte j holding elements j and
    j + 16) from the FP4 codes and scales as published, the token id tables I32."""
    from moe_core import gguf_model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    raw, cfg, ck = json.loads((src / "config.json").read_text()), load_config(src), Checkpoint(src)
    arch, n = "deepseek4", cfg.num_layers
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(raw["hidden_size"])
    w.add_block_count(n)
    w.add_head_count(raw["num_attention_heads"])
    w.add_head_count_kv(1)
    w.add_key_length(raw["head_dim"])
    w.add_value_length(raw["head_dim"])
    w.add_rope_freq_base(raw["rope_theta"])
    w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    w.add_expert_count(raw["n_routed_experts"])
    w.add_expert_used_count(raw["num_experts_per_tok"])
    w.add_uint32(f"{arch}.expert_gating_func", 4)  # sqrtsoftplus
    y = raw["rope_scaling"]
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    w.add_float32(f"{arch}.rope.scaling.factor", y["factor"])
    w.add_uint32(f"{arch}.rope.scaling.original_context_length", y["original_max_position_embeddings"])
    w.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", y["beta_fast"])
    w.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", y["beta_slow"])
    for key, v in (("rope.dimension_count", raw["qk_rope_head_dim"]), ("attention.q_lora_rank", raw["q_lora_rank"]),
                   ("attention.sliding_window", raw["sliding_window"]),
                   ("expert_feed_forward_length", raw["moe_intermediate_size"]),
                   ("expert_shared_count", raw["n_shared_experts"]), ("attention.indexer.head_count", raw["index_n_heads"]),
                   ("attention.indexer.key_length", raw["index_head_dim"]), ("attention.indexer.top_k", raw["index_topk"]),
                   ("attention.output_group_count", raw["o_groups"]), ("attention.output_lora_rank", raw["o_lora_rank"]),
                   ("hyper_connection.count", raw["hc_mult"]), ("hyper_connection.sinkhorn_iterations", raw["hc_sinkhorn_iters"]),
                   ("hash_layer_count", raw["num_hash_layers"])):
        w.add_uint32(f"{arch}.{key}", v)
    w.add_float32(f"{arch}.expert_weights_scale", raw["routed_scaling_factor"])
    w.add_bool(f"{arch}.expert_weights_norm", raw["norm_topk_prob"])
    w.add_float32(f"{arch}.attention.compress_rope_freq_base", raw["compress_rope_theta"])
    w.add_float32(f"{arch}.hyper_connection.epsilon", raw["hc_eps"])
    w.add_array(f"{arch}.attention.compress_ratios", raw["compress_ratios"])
    w.add_array(f"{arch}.swiglu_clamp_exp", [raw["swiglu_limit"]] * n)
    add_tokenizer(w, src, raw["vocab_size"])
    theirs = dict([("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
                   *gguf_model.V4_TOP] + [(f"model.layers.{L}.{o}", f"blk.{L}.{t}") for L in range(n)
                                          for o, t in gguf_model.V4_LAYER])
    for name in ck.names(lambda m: ".experts." not in m or "shared" in m):
        if name.endswith(".ffn.gate.bias") and int(name.split(".")[2]) in cfg.hash_layers:
            continue  # (unused beside a token id table: the converter leaves it out)
        x = ck.get(name)
        w.add_tensor(theirs[name], x.to(torch.int32).numpy() if name.endswith("tid2eid") else x.float().numpy())
    for L in range(n):
        for i, proj in enumerate(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            blocks = []
            for e in range(cfg.n_routed_experts):
                m = ck.get_published(cfg.expert_tensor_names(L, e)[i], "mxfp4")
                codes = m.codes.view(m.codes.shape[0], -1, 32)
                blocks.append(torch.cat([m.exps[..., None], codes[..., :16] | (codes[..., 16:] << 4)], -1).flatten(1))
            w.add_tensor(f"blk.{L}.{proj}.weight", torch.stack(blocks).numpy(),
                         raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_deepseek4_files_serve_transformers_greedy_tokens(tmp_path, services_factory, monkeypatch):
    """A DeepSeek-V4 file: every tensor reads back under our names as the checkpoint's (the MXFP4 experts the
    published FP4 numbers, kept as stored: the mxfp4 format by default), the config is the checkpoint's, and on the
    exact path both services on the file give transformers' greedy tokens on the dequantized checkpoint."""
    from moe_core import gguf_model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    from moe_experts.loading import weight_format
    from published import dequantized_copy, synth
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    src = synth("deepseek-v4-flash", tmp_path / "v4", layers=3, compress_rate_hca=128)  # (a file's rates: 0, 4, 128)
    f = write_deepseek4(src, tmp_path / "v4.gguf")
    d = gguf_model.prepare(f, tmp_path / "cache")
    got, ref, ck, published = load_config(d), load_config(src), gguf_model.open_checkpoint(d), Checkpoint(src)
    for field in ("compress_rates", "hc_mult", "hc_iters", "hc_eps", "o_groups", "o_lora_rank", "hash_layers", "rope_params",
                  "sliding_rope_theta", "rotary_dim", "head_dim", "index_topk", "sliding_window", "expert_act",
                  "moe_layers", "top_k", "routed_scaling_factor", "mxfp4_experts"):
        assert getattr(got, field) == getattr(ref, field), field
    assert weight_format("auto", got) == "mxfp4"
    hash_bias = {f"model.layers.{L}.ffn.gate.bias" for L in ref.hash_layers}
    assert sorted(ck.names()) == sorted(set(published.names()) - hash_bias)
    for name in ck.names():
        assert torch.equal(ck.get(name).float(), published.get(name).float()), name
    m = ck.get_published(ref.expert_tensor_names(2, 5)[2], "mxfp4")
    assert torch.equal(m.codes, published.get_published(ref.expert_tensor_names(2, 5)[2], "mxfp4").codes)
    reference = tiny_models.reference_model(str(dequantized_copy(src, tmp_path / "ref")))
    prompt = torch.randint(2, 4000, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    s = services_factory(f, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    assert greedy(s.stub, prompt, 12) == want, s.logs()


# -- GLM-5.3-Flash (glm5-next): its text model as llama.cpp's converter writes it (conversion/glm.py's Glm5NextModel of
# the llama-cpp-python 0.3.36 sdist; bench/check_gguf_converter.py runs the converter itself) --
def write_glm5_next(src: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The converter's file of src: its metadata keys (a KDA layer has no KV heads), the tensors under llama.cpp's
    names (MLA's kv_b split into k_b / v_b, KDA's convs [1, channels, 1, kernel], A_log as -exp(A_log)), the experts
    stacked, F32."""
    from moe_core import gguf_model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    raw, cfg, ck = json.loads((src / "config.json").read_text()), load_config(src), Checkpoint(src)
    t, arch, n = raw["text_config"], "glm5-next", cfg.num_layers
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(t["max_position_embeddings"])
    w.add_embedding_length(t["hidden_size"])
    w.add_feed_forward_length(t["intermediate_size"])
    w.add_block_count(n)
    w.add_head_count(t["num_attention_heads"])
    w.add_head_count_kv([0 if cfg.is_linear_attention(L) else 1 for L in range(n)])
    w.add_layer_norm_rms_eps(t["rms_norm_eps"])
    w.add_expert_count(t["n_routed_experts"])
    w.add_expert_used_count(t["num_experts_per_tok"])
    for key, v in (("ssm.conv_kernel", cfg.linear_attn.conv_kernel), ("kda.head_dim", cfg.linear_attn.k_dim),
                   ("attention.q_lora_rank", cfg.q_lora_rank), ("attention.kv_lora_rank", cfg.kv_lora_rank),
                   ("rope.dimension_count", 0), ("attention.key_length_mla", cfg.qk_nope_head_dim),
                   ("attention.value_length_mla", cfg.v_head_dim), ("attention.indexer.head_count", cfg.index_heads),
                   ("attention.indexer.key_length", cfg.index_dim), ("attention.indexer.top_k", cfg.index_topk),
                   ("attention.indexer.kpool", cfg.index_kpool), ("hyper_connection.count", cfg.hc_mult),
                   ("hyper_connection.sinkhorn_iterations", cfg.hc_iters),
                   ("leading_dense_block_count", min(cfg.moe_layers)),
                   ("expert_feed_forward_length", cfg.moe_intermediate_size), ("expert_shared_count", 1),
                   ("expert_group_count", cfg.n_group), ("expert_group_used_count", cfg.topk_group)):
        w.add_uint32(f"{arch}.{key}", v)
    w.add_float32(f"{arch}.kda.gate_lower_bound", cfg.linear_bound)
    w.add_bool(f"{arch}.attention.indexer.kpool_select_tail", True)
    w.add_array(f"{arch}.attention.indexer.types", [L not in cfg.index_shared for L in range(n)])
    w.add_float32(f"{arch}.hyper_connection.epsilon", cfg.hc_eps)
    w.add_float32(f"{arch}.expert_weights_scale", cfg.routed_scaling_factor)
    w.add_bool(f"{arch}.expert_weights_norm", cfg.norm_topk_prob)
    w.add_array(f"{arch}.swiglu_clamp_exp", [cfg.expert_act.limit] * n)
    add_tokenizer(w, src, t["vocab_size"])
    theirs = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
    for L in range(n):
        theirs.update(dict(gguf_model.layer_names(cfg, L)))
    for name in ck.names(lambda m: ".experts." not in m or "shared" in m):
        x = ck.get(name).float()
        if name.endswith("kv_b_proj.weight"):
            kv = x.view(cfg.num_heads, -1, x.shape[-1])
            k_b, v_b = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
            b = theirs[name].rsplit("attn_kv_b", 1)[0]
            w.add_tensor(b + "attn_k_b.weight", k_b.transpose(1, 2).contiguous().numpy())
            w.add_tensor(b + "attn_v_b.weight", v_b.contiguous().numpy())
            continue
        if name.endswith("_conv1d.weight"):
            x = x.reshape(1, x.shape[0], 1, x.shape[-1])
        if name.endswith(".A_log"):
            x = -x.exp()
        w.add_tensor(theirs[name], x.numpy())
    for L in cfg.moe_layers:
        for i, proj in enumerate(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            w.add_tensor(f"blk.{L}.{proj}.weight", torch.stack([ck.get(cfg.expert_tensor_names(L, e)[i]).float()
                                                                 for e in range(cfg.n_routed_experts)]).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_glm5_next_files_serve_transformers_greedy_tokens(tmp_path, services_factory, monkeypatch):
    """A GLM-5.3-Flash file: its config is the checkpoint's, every tensor reads back under our names as the
    checkpoint's (A_log to an ulp: the file holds -exp(A_log)), and both services on it give transformers' greedy
    tokens on the checkpoint."""
    from moe_core import gguf_model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    from published import NARROW, synth_checkpoint
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    c = synth_checkpoint.config_of("glm-5.3-flash", 5, dict(NARROW["glm-5.3-flash"]))
    c.pop("quantization_config")
    src = synth_checkpoint.write(c, tmp_path / "g53", std=0.1, seed=0, shard_mb=8)
    f = write_glm5_next(src, tmp_path / "g53.gguf")
    d = gguf_model.prepare(f, tmp_path / "cache")
    got, ref, ck, source = load_config(d), load_config(src), gguf_model.open_checkpoint(d), Checkpoint(src)
    for field in ("layer_types", "linear_attn", "linear_bound", "index_kpool", "index_topk", "index_dim", "index_shared",
                  "hc_mult", "hc_eps", "moe_layers", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "expert_act",
                  "routed_scaling_factor", "top_k", "n_routed_experts", "model_type"):
        assert getattr(got, field) == getattr(ref, field), field
    assert sorted(ck.names()) == sorted(source.names())
    for name in ck.names():
        a, b = ck.get(name), source.get(name).float()
        assert torch.allclose(a, b, rtol=1e-6, atol=0) if name.endswith("A_log") else torch.equal(a, b), name
    reference = tiny_models.reference_model(str(src))
    prompt = torch.randint(2, 4000, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    s = services_factory(f, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    assert greedy(s.stub, prompt, 12) == want, s.logs()


# -- MiMo-V2-Flash (mimo2): as llama.cpp's converter writes it (conversion/mimo.py's MimoV2Model over TextModel, the
# llama-cpp-python 0.3.36 sdist; bench/check_gguf_converter.py runs the converter itself) --
NEXTN = 3  # the multi-token-prediction blocks the converter appends (MiMo publishes three)


def write_mimo2(src: pathlib.Path, out: pathlib.Path, expert_type=None, fused_qkv: bool = False) -> pathlib.Path:
    """The converter's file of src: its metadata keys (KV heads and the sliding pattern per block, the MTP blocks'
    entries sliding; the published sliding_window, one less than transformers' window), the tensors under llama.cpp's
    names (the sinks attn_sinks, q/k/v fused in attn_qkv as MiMo-V2.5 publishes them when asked), the experts stacked
    (quantized to expert_type, None = F32), and MTP blocks past the model's layers."""
    from moe_core import gguf_model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    raw, cfg, ck = json.loads((src / "config.json").read_text()), load_config(src), Checkpoint(src)
    arch, n, H = "mimo2", cfg.num_layers, cfg.hidden_size
    pattern = [int(bool(cfg.window(L))) for L in range(n)] + [1] * NEXTN
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(n + NEXTN)
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(raw["intermediate_size"])
    w.add_head_count(raw["num_attention_heads"])
    w.add_head_count_kv([2 * raw["num_key_value_heads"] if p else raw["num_key_value_heads"] for p in pattern])
    w.add_rope_freq_base(raw["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(raw["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    w.add_expert_count(raw["n_routed_experts"])
    w.add_expert_used_count(raw["num_experts_per_tok"])
    w.add_expert_group_count(raw["n_group"])
    w.add_expert_group_used_count(raw["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_key_length(raw["head_dim"])
    w.add_value_length(raw["v_head_dim"])
    w.add_sliding_window(raw["sliding_window"] - 1)  # (the published sliding_window_size)
    w.add_sliding_window_pattern(pattern)
    w.add_expert_feed_forward_length(raw["moe_intermediate_size"])
    w.add_rope_dimension_count(int(raw["head_dim"] * raw["rope_parameters"]["full_attention"]["partial_rotary_factor"]))
    w.add_float32(f"{arch}.attention.value_scale", raw["attention_value_scale"])
    w.add_nextn_predict_layers(NEXTN)
    add_tokenizer(w, src, raw["vocab_size"])
    theirs = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
    for L in range(n):
        theirs.update(dict(gguf_model.layer_names(cfg, L)))
    for name in ck.names(lambda m: ".experts." not in m and not (fused_qkv and m.endswith(("k_proj.weight",
                                                                                            "v_proj.weight")))):
        x = ck.get(name).float()
        if fused_qkv and name.endswith("q_proj.weight"):
            p = name[:-len("q_proj.weight")]
            w.add_tensor(theirs[name].replace("attn_q.", "attn_qkv."),
                         torch.cat([x, ck.get(p + "k_proj.weight").float(), ck.get(p + "v_proj.weight").float()]).numpy())
            continue
        w.add_tensor(theirs[name], x.numpy())
    for L in cfg.moe_layers:
        for i, proj in enumerate(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            x = torch.stack([ck.get(cfg.expert_tensor_names(L, e)[i]).float() for e in range(cfg.n_routed_experts)])
            if expert_type is None:
                w.add_tensor(f"blk.{L}.{proj}.weight", x.numpy())
            else:
                w.add_tensor(f"blk.{L}.{proj}.weight", gguf_blocks.quantize(x.numpy(), expert_type), raw_dtype=expert_type)
    for L in range(n, n + NEXTN):  # MTP blocks (llama.cpp's speculative drafts; this server leaves them out)
        w.add_tensor(f"blk.{L}.nextn.eh_proj.weight", np.ones((H, 2 * H), np.float32))
        w.add_tensor(f"blk.{L}.attn_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


MIMO_FIELDS = ("model_type", "layer_types", "moe_layers", "sliding_window", "sliding_kv_heads", "num_kv_heads",
               "head_dim", "v_head_dim", "value_scale", "rotary_dim", "rope_theta", "sliding_rope_theta", "attn_sinks",
               "scoring", "topk_method", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "top_k",
               "n_routed_experts", "moe_intermediate_size", "intermediate_size", "qkv_bias", "rms_norm_eps")


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_mimo2_files_read_back_as_the_checkpoint(fused_qkv, tmp_path):
    """A MiMo-V2-Flash file (q/k/v apart as V2-Flash publishes them, or fused): its config is the checkpoint's (the
    window one more than the file's sliding_window, twice the KV heads on sliding layers, the dense first layer from its
    missing router), every tensor reads back under transformers' names as the checkpoint's, its MTP blocks left out."""
    from moe_core import gguf_model
    from moe_core.checkpoint import Checkpoint
    from moe_core.config import load_config
    src = tiny_models.build("mimo_v2_flash", tmp_path / "mimo")
    f = write_mimo2(src, tmp_path / "mimo.gguf", fused_qkv=fused_qkv)
    d = gguf_model.prepare(f, tmp_path / "cache")
    got, ref, ck, source = load_config(d), load_config(src), gguf_model.open_checkpoint(d), Checkpoint(src)
    for field in MIMO_FIELDS:
        assert getattr(got, field) == getattr(ref, field), field
    assert sorted(ck.names()) == sorted(source.names())
    for name in ck.names():
        assert torch.equal(ck.get(name), source.get(name).float()), name


def test_a_mimo2_file_whose_kv_heads_are_not_mimos_is_refused(tmp_path):
    """KV heads per layer that are not MiMo's (sliding layers with the full layers' count): refused, naming them."""
    from moe_core import gguf_model
    src = tiny_models.build("mimo_v2_flash", tmp_path / "mimo")
    bad = write_mimo2(src, tmp_path / "bad.gguf")
    reader = gguf.GGUFReader(str(bad), "r+")  # (edits the file in place)
    kv = reader.fields["mimo2.attention.head_count_kv"]
    for i in kv.data:  # every entry 1: the sliding layers' 2 gone
        kv.parts[i][...] = 1
    del reader
    with pytest.raises(gguf_model.ModelConfigError, match=r"KV heads per layer \[1, 1, 1, 1\]"):
        gguf_model.prepare(bad, tmp_path / "cache")


@pytest.mark.parametrize("fused_qkv", some([False, True], fast=[True]))
def test_mimo2_files_serve_transformers_greedy_tokens(fused_qkv, tmp_path, services_factory, monkeypatch):
    """Q8_0 experts: on the exact path both services on the file give transformers' greedy tokens on the weights the
    file stores, over a prompt longer than the sliding window; the default path keeps the experts as stored (int8g32,
    named in Info)."""
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    q = gguf.GGMLQuantizationType.Q8_0
    src = tiny_models.build("mimo_v2_flash", tmp_path / "mimo", moe_intermediate_size=64)  # (blocks of 32 along I)
    f = write_mimo2(src, tmp_path / "mimo.gguf", q, fused_qkv=fused_qkv)
    ref = tiny_models.reference_model(str(with_experts_as_stored(src, tmp_path / "ref", q)))
    prompt = torch.randint(2, 300, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    s = services_factory(f, gpu_args=("--dtype", "fp32"), expert_args=("--weight-format", "fp32"))
    assert greedy(s.stub, prompt, 12) == want, s.logs()
    s.stop()
    import grpc
    from protos import expert_pb2, expert_pb2_grpc
    s = services_factory(f, gpu_args=("--dtype", "fp32"))  # the default format: the blocks kept
    with grpc.insecure_channel(f"127.0.0.1:{s.expert_port}") as ch:
        info = expert_pb2_grpc.ExpertServiceStub(ch).Info(expert_pb2.ExpertInfoRequest(), timeout=10)
    assert info.weight_format == "int8g32" and "requantized to" not in s.logs(), (info.weight_format, s.logs())
