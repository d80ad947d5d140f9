"""Accuracy harness: what expert deferral costs, against simply skipping the same experts.

    python bench/accuracy.py [--model models/default] [--windows 24] [--len 256]

Runs held-out text (the default model's held-out split of Python's standard library: every 20th
file, never trained on) through both services (real processes, fp32 so the comparison with the
reference is exact), with Score for each mode: exact (defer 0), deferral d = 1, 2, 3 (of top-k),
and skipping those d experts. Reports perplexity, greedy next-token agreement with the exact mode,
and next-token accuracy, plus transformers' own perplexity on the same windows as the reference.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import Services  # noqa: E402
from gpu_service.text import TextCodec  # noqa: E402
from moe_core import codec  # noqa: E402
from moe_core.config import load_config  # noqa: E402
from protos import generate_pb2  # noqa: E402
from tools.train_default_model import read, split, stdlib_files  # noqa: E402


def windows(model_dir: str, n: int, length: int) -> list[list[int]]:
    text = TextCodec(model_dir)
    ids: list[int] = []
    for f in split(stdlib_files())[1]:
        ids += text.encode(read(f)) + [1]
        if len(ids) > n * length:
            break
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def score(stub, win, defer, skip):
    req = generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=win), defer=defer, skip_deferred=skip)
    return codec.decode(stub.Score(req, timeout=600).logits, "logits")


def evaluate(all_logits, wins, exact_argmax=None):
    nll, n, agree, correct, argmaxes = 0.0, 0, 0, 0, []
    for logits, win in zip(all_logits, wins):
        target = torch.tensor(win[1:])
        lp = logits[:-1].log_softmax(-1)
        nll += float(-lp.gather(1, target[:, None]).sum())
        am = logits[:-1].argmax(-1)
        argmaxes.append(am)
        correct += int((am == target).sum())
        n += len(target)
    if exact_argmax is not None:
        agree = sum(int((a == b).sum()) for a, b in zip(argmaxes, exact_argmax))
    return {"ppl": math.exp(nll / n), "agree": agree / n if exact_argmax is not None else 1.0, "acc": correct / n,
            "tokens": n}, argmaxes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--max-defer", type=int, default=3)
    a = ap.parse_args()
    cfg = load_config(a.model)
    wins = windows(a.model, a.windows, a.len)
    svc = Services(a.model, pathlib.Path(tempfile.mkdtemp()), gpu_args=("--dtype", "fp32"),
                   expert_args=("--weight-format", "fp32"))
    rows = []
    try:
        exact, exact_am = evaluate([score(svc.stub, w, 0, False) for w in wins], wins)
        rows.append({"mode": "exact (defer 0)", **exact})
        for d in range(1, min(a.max_defer, cfg.top_k - 1) + 1):
            for skip in (False, True):
                r, _ = evaluate([score(svc.stub, w, d, skip) for w in wins], wins, exact_am)
                rows.append({"mode": f"{'skip' if skip else 'defer'} {d} of {cfg.top_k}", **r})
    finally:
        svc.stop()
    import transformers
    ref = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = [ref(torch.tensor([w])).logits[0] for w in wins]
    hf, _ = evaluate(ref_logits, wins, exact_am)
    rows.append({"mode": "transformers (reference)", **hf})
    for r in rows:
        r["ppl_change"] = r["ppl"] / exact["ppl"] - 1
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    print(f"\n{len(wins)} held-out windows x {a.len} tokens ({exact['tokens']} predictions), fp32\n")
    print("| mode | perplexity | vs exact | top-1 agreement with exact | next-token accuracy |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ppl']:.3f} | {r['ppl_change']:+.2%} | {r['agree']:.2%} | {r['acc']:.2%} |")


if __name__ == "__main__":
    main()
