"""The GPU side on CUDA against the CPU and transformers, on the embedded (trained, bf16) model:
greedy tokens through both services with the GPU service on --device cpu and on --device cuda, and
transformers' own implementation, for a few prompts. Prints one JSON line per prompt and pair of
runs: how many of the first N tokens agree (runs in different precisions or on different devices
can part ways after a near tie; the tiny fp32 checkpoints' exact checks are tests/, run on CUDA by
scripts/gpu_check.sh).

    python scripts/gpu_agree.py [--tokens 48]      # needs CUDA; scripts/gpu_check.sh runs it
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from harness import Services  # noqa: E402
from protos import generate_pb2  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\nclass ", "    for i in range(len(items)):\n"]


def service_tokens(model: pathlib.Path, device: str, dtype: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    svc = Services(model, pathlib.Path(tempfile.mkdtemp()), gpu_args=("--device", device, "--dtype", dtype))
    try:
        out = []
        for p in prompts:
            req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=p), max_tokens=n, ignore_eos=True,
                                               sampling=generate_pb2.SamplingParams(temperature=0))
            out.append([t for c in svc.stub.Generate(req, timeout=300) for t in c.token_ids])
        return out
    finally:
        svc.stop()


def transformers_tokens(model: pathlib.Path, device: str, dtype: torch.dtype, prompts: list[list[int]], n: int):
    import transformers
    ref = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            g = ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
            out.append(g[0, ids.shape[1]:].tolist())
    return out


def agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=pathlib.Path, default=ROOT / "models" / "default")
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_agree: no CUDA device here")
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(a.model / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    runs = {
        "service cpu bf16": service_tokens(a.model, "cpu", "bf16", prompts, a.tokens),
        "service cuda bf16": service_tokens(a.model, "cuda", "bf16", prompts, a.tokens),
        "transformers cuda bf16": transformers_tokens(a.model, "cuda", torch.bfloat16, prompts, a.tokens),
        "service cpu fp32": service_tokens(a.model, "cpu", "fp32", prompts, a.tokens),
        "service cuda fp32": service_tokens(a.model, "cuda", "fp32", prompts, a.tokens),
        "transformers cpu fp32": transformers_tokens(a.model, "cpu", torch.float32, prompts, a.tokens),
    }
    pairs = [("service cuda bf16", "service cpu bf16"), ("service cuda bf16", "transformers cuda bf16"),
             ("service cuda fp32", "service cpu fp32"), ("service cuda fp32", "transformers cpu fp32")]
    for x, y in pairs:
        for i, p in enumerate(PROMPTS):
            n = agree(runs[x][i], runs[y][i])
            print(json.dumps({"a": x, "b": y, "prompt": i, "tokens": a.tokens, "equal_prefix": n}), flush=True)
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")


if __name__ == "__main__":
    main()
