"""What the benchmarks share, in one place: the repository on sys.path, the services as processes (the tests'
harness, tests/harness.py), the machine's name, generation and timing helpers. Every bench script imports
from here, never from another bench script or from tests/conftest.py. No torch at import: some scripts set
OpenMP's environment before torch loads."""
from __future__ import annotations

import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "tests", ROOT / "tools"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import grpc  # noqa: E402

from harness import Services, Sharded, free_port, start, status_mib, terminate_all, wait_healthy  # noqa: E402,F401
from protos import expert_pb2, expert_pb2_grpc, generate_pb2, generate_pb2_grpc  # noqa: E402

__all__ = ["ISAS", "LLAMA_PY", "ROOT", "SHAPES", "build_llama", "convert_to_gguf", "llama_source", "peer_env", "Services", "Sharded", "cpu_name", "decode_rate", "exchange_rtt", "free_port", "generate",
           "start", "status_mib", "synth_model", "terminate_all", "timed", "wait_healthy", "weights", "windows"]
WARMUP = 50  # exchange round trips before the timed ones

SHAPES = {  # name: (E, H, I, k)
    "qwen3": (128, 2048, 768, 8),   # Qwen3-30B-A3B
    "dsv3": (32, 7168, 2048, 8),    # DeepSeek-V3 reduced to 32 experts
    "gptoss": (32, 2880, 2880, 4),  # gpt-oss-20b (MXFP4 as published: --formats mxfp4)
}


def synth_model(arch: str, layers: int, out: pathlib.Path, overrides: dict | None = None,
                shard_mb: int = 1024) -> pathlib.Path:
    """A checkpoint of a published architecture's shapes with random weights (tools/synth_checkpoint.py)."""
    import synth_checkpoint
    return synth_checkpoint.write(synth_checkpoint.config_of(arch, layers, overrides or {}), out, std=0.02, seed=0,
                                  shard_mb=shard_mb)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_ms(f, reps: int) -> float:
    """f once to warm up, then the median of reps calls, in milliseconds."""
    f()
    return statistics.median(timed(f) for _ in range(reps)) * 1e3


def cpu_name() -> str:
    """The CPU model, its vector extensions and the kernel path the expert service picks here."""
    name, flags = platform.processor(), set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    isa = "+".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags)
    try:
        from moe_experts.kernels import NATIVE_ISA
    except ImportError:
        NATIVE_ISA = None
    return f"{name} ({isa}), kernel path {NATIVE_ISA or 'torch'}"


def weights(E, H, I):
    import torch

    g = torch.Generator().manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)  # noqa: E731
    return mk(E, I, H), mk(E, I, H), mk(E, H, I)


def generate(port, prompt, n) -> tuple[float, float]:
    """-> (time to first token s, decode tokens/s) of one greedy request of n tokens."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=n, ignore_eos=True,
                                           sampling=generate_pb2.SamplingParams(temperature=0))
        chunks = list(generate_pb2_grpc.GenerateServiceStub(ch).Generate(req, timeout=3600))
    last = chunks[-1]
    decode = (last.usage.completion_tokens - 1) / (last.elapsed_s - last.time_to_first_token_s) if n > 1 else 0.0
    return last.time_to_first_token_s, decode


def decode_rate(chunks) -> float:
    """Decode tokens/s of a finished stream (its first token's time left out)."""
    last = chunks[-1]
    return (last.usage.completion_tokens - 1) / (last.elapsed_s - last.time_to_first_token_s)


def windows(model_dir: str, n: int, length: int) -> list[list[int]]:
    """n windows of `length` token ids of held-out text (Python's standard library, as the default model saw none
    of it in training)."""
    from gpu_service.api.text import TextCodec
    from tools.train_default_model import read, split, stdlib_files

    text = TextCodec(model_dir)
    ids: list[int] = []
    for f in split(stdlib_files())[1]:
        ids += text.encode(read(f)) + [1]
        if len(ids) > n * length:
            break
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def client_rtt(port, transport, layer, x, ids, w, n) -> tuple[list[float], list[float], list[tuple]]:
    """-> (round trip us, compute us, (to the service, queued there, back) us): the GPU side's own client
    (moe_exchange/dispatch.py), one layer request at a time, as decode sends them. The legs come from the
    service's clock readings (ExpertTiming), the same clock on one host."""
    from moe_exchange.dispatch import RemoteExperts

    probe = expert_pb2_grpc.ExpertServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    fp = probe.Info(expert_pb2.ExpertInfoRequest(), timeout=10).model_fingerprint
    experts = RemoteExperts(f"127.0.0.1:{port}", fp, 64 << 20, transport=transport, shm_bytes=16 << 20)
    rtt, compute, legs = [], [], []
    try:
        assert experts.start_transport() == transport
        for i in range(n + WARMUP):
            t0, u0 = time.perf_counter(), time.time_ns()
            experts.submit(i, layer, x, ids, w, 0)
            y = experts.result(layer, False)
            dt, u1 = (time.perf_counter() - t0) * 1e6, time.time_ns()
            (timing,) = [t.timing for t in experts.drain_timings()]
            if i >= WARMUP:
                rtt.append(dt)
                compute.append(timing.compute_us)
                received = timing.start_unix_ns - timing.queued_us * 1000
                legs.append(((received - u0) / 1e3, timing.queued_us, (u1 - timing.end_unix_ns) / 1e3))
    finally:
        experts.close()
    assert y.shape == x.shape
    return rtt, compute, legs


def exchange_rtt(port: int, transport: str, layer: int, hidden: int, n_experts: int, top_k: int, dtype, n: int):
    import torch

    x = torch.randn(1, hidden).to(dtype)
    ids = torch.randperm(n_experts)[:top_k].to(torch.int32).view(1, -1)
    w = torch.rand(1, top_k)
    return client_rtt(port, transport, layer, x, ids, w, n)


# -- llama.cpp, the peer: built from the llama-cpp-python sdist on PyPI (nothing of it is committed) ----------
LLAMA_PY = "llama-cpp-python==0.3.36"
AVX2_ONLY = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF"]
# per --isa: llama.cpp's CMake flags, and our side's environment (kernel path, torch's ISA limits)
ISAS = {"avx2": (AVX2_ONLY + ["-DGGML_AVX_VNNI=OFF"],
                 {"MOE_KERNEL_PATH": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}),
        "avxvnni": (AVX2_ONLY + ["-DGGML_AVX_VNNI=ON"],
                    {"MOE_KERNEL_PATH": "avxvnni", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI", "ATEN_CPU_CAPABILITY": "avx2"}),
        # llama.cpp with AVX-512 (VNNI, BF16) but not its AMX code: built by GCC 12 that dies in its first
        # tile instruction (SIGILL at tilezero; it fills a stack tile config as we once did, see
        # native/kernels/amx/gemm_amx.cpp); ours on its default path (amx where the CPU has it)
        "avx512": (["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                    "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"], {}),
        "native": (["-DGGML_NATIVE=ON"], {})}


def llama_source(work: pathlib.Path) -> pathlib.Path:
    """-> the llama.cpp source tree: the llama-cpp-python sdist's vendored copy, downloaded and unpacked in
    `work` once."""
    import subprocess
    src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if src is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_PY,
                        "-d", str(work)], check=True)
        tar = next(work.glob("llama_cpp_python-*.tar.gz"))
        subprocess.run(["tar", "xzf", str(tar), "-C", str(work)], check=True)
        src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return src


def peer_env() -> dict[str, str]:
    """The environment a peer (llama.cpp) runs in: this one without what importing our services set for their own
    torch (OMP_WAIT_POLICY=PASSIVE, which would make llama.cpp's OpenMP threads sleep between its ops)."""
    from moe_core.openmp import environ_for_others
    return environ_for_others()


def build_llama(work: pathlib.Path, isa: str, targets=("llama-bench", "llama-quantize")) -> pathlib.Path:
    """-> llama_source(work), with build-<isa>/bin/<targets>."""
    import subprocess
    src = llama_source(work)
    build = src / f"build-{isa}"
    if not all((build / "bin" / t).exists() for t in targets):
        flags = ISAS[isa][0]
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", *flags], check=True)
        subprocess.run(["ninja", "-C", str(build), *targets], check=True)
    return src


def convert_to_gguf(src: pathlib.Path, model: pathlib.Path, out: pathlib.Path, outtype: str = "bf16") -> None:
    """llama.cpp's converter (src: llama_source()) on the checkpoint, as outtype (its BPE pre-tokenizer hash check
    answered "default"), from a copy of the config as DeepSeek publishes it: MLA ignores num_key_value_heads,
    which the default model's config leaves at transformers' default 128 but the converter splits kv_b_proj by;
    and the converter writes V3's sigmoid gating only from DeepSeek's scoring_func, which transformers does not
    save. CalledProcessError carries the converter's output."""
    import json
    import shutil
    import subprocess
    fixed = out.parent / f"{model.name}-for-convert"
    shutil.rmtree(fixed, ignore_errors=True)
    # links, not copies: a real checkpoint's weights would double its disk space
    shutil.copytree(model, fixed, copy_function=lambda a, b: os.symlink(os.path.abspath(a), b))
    cfg = json.loads((fixed / "config.json").read_text())
    (fixed / "config.json").unlink()  # (a link to the original, which must not be written)
    if cfg.get("model_type", "").startswith("deepseek"):
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if cfg.get("model_type") in ("deepseek_v3", "deepseek_v32"):  # as DeepSeek's config.json says (transformers drops it)
        cfg.setdefault("scoring_func", "sigmoid")
    if cfg.get("model_type") == "minimax_m3_vl":  # the legacy fields MiniMax publishes and the converter reads, which
        t = cfg["text_config"]                  # transformers' config folds into its own
        t.update(scoring_func="sigmoid", n_shared_experts=1, moe_layer_freq=[int(k == "sparse") for k in t["mlp_layer_types"]],
                 rotary_dim=int(t["head_dim"] * t["rope_parameters"]["partial_rotary_factor"]),
                 sparse_attention_config={"sparse_attention_freq": [int(k == "minimax_m3_sparse") for k in t["layer_types"]],
                                          "sparse_num_index_heads": t["index_n_heads"],
                                          "sparse_index_dim": t["index_head_dim"],
                                          "sparse_block_size": t["index_block_size"],
                                          "sparse_topk_blocks": t["index_topk_blocks"],
                                          "sparse_local_block": t["index_local_blocks"]})
    if cfg.get("model_type") == "mimo_v2_flash":  # the fields Xiaomi publishes and the converter reads (its pinned
        sliding = [int(t == "sliding_attention") for t in cfg["layer_types"]]  # transformers does not know the model)
        rope = cfg["rope_parameters"]
        cfg.update(hybrid_layer_pattern=sliding, moe_layer_freq=[int(k == "sparse") for k in cfg["mlp_layer_types"]],
                   swa_head_dim=cfg["head_dim"], swa_v_head_dim=cfg["v_head_dim"],
                   swa_num_attention_heads=cfg["num_attention_heads"],
                   swa_num_key_value_heads=2 * cfg["num_key_value_heads"],
                   sliding_window=cfg["sliding_window"] - 1, sliding_window_size=cfg["sliding_window"] - 1,
                   rope_theta=rope["full_attention"]["rope_theta"], swa_rope_theta=rope["sliding_attention"]["rope_theta"],
                   partial_rotary_factor=rope["full_attention"]["partial_rotary_factor"],
                   layernorm_epsilon=cfg["rms_norm_eps"], topk_method="noaux_tc", scoring_func="sigmoid",
                   add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False)
        for k in ("layer_types", "mlp_layer_types", "rope_parameters"):
            cfg.pop(k)
    (fixed / "config.json").write_text(json.dumps(cfg, indent=1))
    model = fixed
    patch = "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'; "
    glm = {"glm4_moe": "Glm4MoeModel", "glm_moe_dsa": "GlmMoeDsaModel", "glm5_next": "Glm5NextModel"}.get(
        cfg.get("model_type"))
    if glm and "[gMASK]" not in (fixed / "tokenizer.json").read_text():
        # a tokenizer that is not GLM's (the tests' tiny ones): the converter's GLM vocabulary wants its specials
        patch += f"import conversion.glm as g; g.{glm}.set_vocab = TextModel._set_vocab_gpt2; "
    if cfg.get("model_type") in ("minimax_m3_vl", "mimo_v2_flash"):  # the config.json as written, not transformers'
        # reading of it (which folds away the legacy fields the converter reads)
        patch += "import conversion.base as b; b.AutoConfig = None; "
    if cfg.get("model_type") == "deepseek_v32":  # its vocabulary as its converter writes it, less the check that
        # the tokenizer adds a BOS (the tests' tiny one is no class that says so)
        patch += "import conversion.deepseek as d; d.DeepseekV32Model.set_vocab = TextModel._set_vocab_gpt2; "
    code = ("import sys; sys.argv = sys.argv[1:]; sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0]); "
            "import convert_hf_to_gguf as c; from conversion.base import TextModel; " + patch + "c.main()")
    subprocess.run([sys.executable, "-c", code, str(src / "convert_hf_to_gguf.py"), str(model), "--outtype", outtype,
                    "--outfile", str(out)], check=True, capture_output=True, text=True, cwd=str(src))


def expert_bytes(fmt: str, H: int, I: int) -> int:
    """Bytes one expert's gate/up and down hold in a packed format: weights, scales, mins, sums (row padding not
    counted): what a token reads per routed expert."""
    import torch
    from moe_kernels.packing import layout
    return sum(torch.Size(shape).numel() * dtype.itemsize for rows, K in ((2 * I, H), (H, I))
               for part in layout(fmt, 1, rows, K) if part is not None for shape, dtype in [part])
