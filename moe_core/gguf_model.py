"""GGUF files (what llama.cpp users have on disk) as a model: `--model FILE.gguf`.

prepare(FILE.gguf) writes a small folder beside the cache (config.json from the GGUF's metadata,
tokenizer.json and tokenizer_config.json from its tokenizer and chat template, gguf.json naming the file)
that load_config and TextCodec read as they read a checkpoint folder; GGUFCheckpoint reads the tensors in
place from the mapped file, by llama.cpp's names shown under transformers' names, dequantized by the gguf
package (a routed expert one expert at a time from the stacked [E, rows, K] tensor). Q4_0 experts (a scale per
32, q - 8) are kept bit for bit on the int4g32 kernels; the other quant types are dequantized exactly.
Families: qwen3moe so far; others are refused by name.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

import numpy as np
import torch

from .config import ModelConfigError

MARKER = "gguf.json"
ARCHES = {"qwen3moe": "qwen3_moe"}
# transformers' names of one layer's weights -> llama.cpp's (qwen3moe); experts: the stacked tensors
LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.gate.weight": "ffn_gate_inp.weight"}
EXPERTS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).endswith(".gguf") and pathlib.Path(path).is_file()


def _reader(path: pathlib.Path):
    try:
        from gguf import GGUFReader
    except ImportError as e:  # a dependency; this says what to install where it is missing
        raise ModelConfigError(f"reading {path} needs the gguf package (pip install gguf): {e}") from None
    try:
        return GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001  (a truncated or foreign file: the reader's own error says why)
        raise ModelConfigError(f"{path} is not a readable GGUF file: {e}") from None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_of(reader, path: pathlib.Path) -> dict:
    """config.json fields from the GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHES:
        raise ModelConfigError(f"{path}: GGUF architecture {arch!r} is not supported yet (supported: "
                               f"{', '.join(ARCHES)})")
    if int(_field(reader, "split.count", 1)) > 1:
        raise ModelConfigError(f"{path}: split GGUF files (-0000N-of-0000M) are not supported yet; llama.cpp's "
                               "gguf-split --merge joins them")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    cfg = {"model_type": ARCHES[arch], "architectures": ["Qwen3MoeForCausalLM"],
           "hidden_size": a("embedding_length"), "intermediate_size": a("feed_forward_length"),
           "moe_intermediate_size": a("expert_feed_forward_length"), "num_hidden_layers": a("block_count"),
           "num_attention_heads": a("attention.head_count"), "num_key_value_heads": a("attention.head_count_kv"),
           "head_dim": a("attention.key_length"), "rms_norm_eps": a("attention.layer_norm_rms_epsilon"),
           "rope_theta": a("rope.freq_base", 10000.0), "max_position_embeddings": a("context_length"),
           "num_experts": a("expert_count"), "num_experts_per_tok": a("expert_used_count"),
           "norm_topk_prob": True,  # llama.cpp's qwen3moe normalizes the top-k weights
           "vocab_size": len(tokens), "tie_word_embeddings": "output.weight" not in names,
           "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
           "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
           "torch_dtype": "bfloat16", "mlp_only_layers": [], "decoder_sparse_step": 1,
           # how the routed experts are stored: the expert service's format follows (Q4_0 -> int4g32)
           "quantization_config": {"quant_method": "gguf", "expert_types": sorted(
               {t.tensor_type.name for t in reader.tensors if t.name.endswith("_exps.weight")})}}
    missing = [k for k, v in cfg.items() if v is None and k not in ("bos_token_id", "eos_token_id")]
    if missing:
        raise ModelConfigError(f"{path}: GGUF metadata lacks what {', '.join(missing)} come from")
    return cfg


def _tokenizer_files(path: pathlib.Path, out: pathlib.Path) -> None:
    """tokenizer.json / tokenizer_config.json (with the chat template) from the GGUF's tokenizer, by
    transformers' own GGUF converter."""
    try:
        import transformers
    except ImportError as e:
        raise ModelConfigError(f"converting {path}'s tokenizer needs transformers (pip install transformers): {e}")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001
        raise ModelConfigError(f"{path}: its tokenizer cannot be converted: {e}") from None
    tok.save_pretrained(str(out))


def prepare(path: str | os.PathLike, cache: pathlib.Path) -> pathlib.Path:
    """The folder that stands for the GGUF file (made once per file version, under cache/gguf)."""
    path = pathlib.Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache / "gguf" / f"{path.stem}-{key}"
    if (out / MARKER).exists():
        return out
    reader = _reader(path)
    cfg = config_of(reader, path)  # (an unsupported file is refused before anything is written)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        _tokenizer_files(path, tmp)
        (tmp / MARKER).write_text(json.dumps({"file": str(path)}))
        try:
            tmp.rename(out)
        except OSError:  # another process made it meanwhile
            if not (out / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class GGUFCheckpoint:
    """The Checkpoint interface over a GGUF file (prepare()'s folder)."""

    fp8_block = None
    int4 = None

    def __init__(self, model_dir: pathlib.Path):
        self.dir = pathlib.Path(model_dir)
        self.path = pathlib.Path(json.loads((self.dir / MARKER).read_text())["file"])
        if not self.path.exists():
            raise ModelConfigError(f"{self.path} (named in {self.dir / MARKER}) is missing")
        self.reader = _reader(self.path)
        self.by_name = {t.name: t for t in self.reader.tensors}
        cfg = json.loads((self.dir / "config.json").read_text())
        E = cfg["num_experts"]
        self.where: dict[str, tuple[str, int | None]] = {}  # transformers' name -> (GGUF tensor, expert)
        for ours, theirs in (("model.embed_tokens.weight", "token_embd.weight"),
                             ("model.norm.weight", "output_norm.weight"), ("lm_head.weight", "output.weight")):
            if theirs in self.by_name:
                self.where[ours] = (theirs, None)
        for L in range(cfg["num_hidden_layers"]):
            for ours, theirs in LAYER.items():
                if f"blk.{L}.{theirs}" in self.by_name:
                    self.where[f"model.layers.{L}.{ours}"] = (f"blk.{L}.{theirs}", None)
            for proj, theirs in EXPERTS.items():
                if f"blk.{L}.{theirs}" in self.by_name:
                    for e in range(E):
                        self.where[f"model.layers.{L}.mlp.experts.{e}.{proj}.weight"] = (f"blk.{L}.{theirs}", e)
        unknown = set(self.by_name) - {t for t, _ in self.where.values()}
        if unknown:
            raise ModelConfigError(f"{self.path}: tensors this reader does not place: {sorted(unknown)[:5]}")
        self.weight_map = {n: str(self.path) for n in self.where}  # (the packed cache stamps the file)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def tensors(self) -> list[str]:
        return sorted(self.by_name)

    def meta(self, name: str) -> tuple[list[int], str]:
        t = self.by_name[name]
        return [int(v) for v in reversed(t.shape)], t.tensor_type.name

    def names(self, keep=lambda n: True):
        return (n for n in sorted(self.where) if keep(n))

    def _data(self, name: str):
        theirs, e = self.where.get(name, (None, None))
        if theirs is None:
            raise ModelConfigError(f"tensor {name!r} is not in {self.path}")
        t = self.by_name[theirs]
        return t, (t.data if e is None else t.data[e])

    def get(self, name: str, fp8_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight dequantized exactly to float32 (gguf's dequantizers)."""
        from gguf import GGMLQuantizationType as Q, dequantize
        t, data = self._data(name)
        if t.tensor_type in (Q.F32, Q.F16):
            return torch.from_numpy(np.array(data, dtype=np.float32))
        if t.tensor_type == Q.BF16:
            return torch.from_numpy(np.array(data)).view(torch.bfloat16).float()
        return torch.from_numpy(np.ascontiguousarray(dequantize(np.asarray(data), t.tensor_type)))

    def get_row(self, name: str, i: int) -> torch.Tensor:
        return self.get(name)[i]

    def get_fp8(self, name: str):
        return None

    def get_int4(self, name: str):
        """A Q4_0 weight as packing.Int4 (its fp16 scale per 32 and q - 8: bit for bit); None for other types."""
        from gguf import GGMLQuantizationType as Q
        from moe_kernels.packing import Int4
        t, data = self._data(name)
        if t.tensor_type != Q.Q4_0:
            return None
        b = np.asarray(data)                                  # [rows, blocks * 18]: fp16 scale, 16 bytes of nibbles
        rows = b.shape[0]
        blocks = b.reshape(rows, -1, 18)
        scale = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32))
        qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]))  # byte j: element j (low), j + 16 (high)
        q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(rows, -1)
        return Int4((q.to(torch.int16) - 8).to(torch.int8), scale, 32)

    def close(self) -> None:  # the map stays: a GGUF is read in place
        pass


def resolve(model: str | os.PathLike, cache: pathlib.Path) -> pathlib.Path:
    """--model as a folder: itself, or for a GGUF file prepare()'s folder."""
    return prepare(model, cache) if is_gguf(model) else pathlib.Path(model)


def open_checkpoint(model_dir: str | os.PathLike):
    """A folder's Checkpoint: the safetensors reader, or GGUFCheckpoint for prepare()'s folders."""
    from .checkpoint import Checkpoint
    d = pathlib.Path(model_dir)
    return GGUFCheckpoint(d) if (d / MARKER).exists() else Checkpoint(d)
