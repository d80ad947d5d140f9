"""Structured outputs' cost at decode: aggregate decode tokens/s of N concurrent streams under a JSON-schema
constraint against the same streams unconstrained, in alternating rounds of one run, both services on this
host (the step's token masks are computed for the whole batch at once on the GPU side's CPU, in parallel, and
applied in one operation: llguidance, gpu_service/api/constraints.py mask_rows).

    python bench/bench_structured.py [--model models/default | --synth qwen3-30b-a3b --layers 4]
                                     [--batches 1,8] [--tokens 64] [--rounds 3]

The schema keeps the answer going (at least 16 records of two short strings), so the constrained streams decode
as long as the free ones; the rate is per stream (its tokens after the first / the time after the first)
summed over the streams of a round. Goal (issue #31): constrained >= 0.95x unconstrained at batch 1 and 8.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import statistics
import tempfile

from common import ROOT, Services, cpu_name, synth_model  # noqa: E402
from protos import generate_pb2  # noqa: E402

# at least 16 short records: the answer keeps going (past --tokens) through keys, punctuation and strings
SCHEMA = {"type": "array", "minItems": 16,
          "items": {"type": "object", "additionalProperties": False, "required": ["name", "note"],
                    "properties": {"name": {"type": "string", "maxLength": 12},
                                   "note": {"type": "string", "maxLength": 24}}}}


def stream_rate(stub, prompt: str, tokens: int, constrained: bool, seed: int) -> tuple[float, int]:
    req = generate_pb2.GenerateRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True,
                                       sampling=generate_pb2.SamplingParams(temperature=0.8, seed=seed))
    if constrained:
        req.constraint.json_schema = json.dumps(SCHEMA)
    last = list(stub.Generate(req, timeout=3600))[-1]
    n = last.usage.completion_tokens
    return ((n - 1) / (last.elapsed_s - last.time_to_first_token_s) if n > 1 else 0.0), n


def mask_cost_us(model: pathlib.Path, batch: int, steps: int = 64) -> float:
    """Median microseconds the constraints add to the GPU side's step at this batch: the batch's masks over the
    vocabulary applied to its logits (mask_rows), and each row's sampled token consumed (along a valid path: the
    most likely allowed token each step)."""
    import time

    import torch

    from gpu_service.api.constraints import ConstraintSpec, Grammars, mask_rows
    from gpu_service.api.text import TextCodec
    from moe_core.config import load_config

    cfg = load_config(model)
    g = Grammars(TextCodec(model).tok, cfg.vocab_size, list(cfg.eos_token_ids))
    ms = [g.matcher(ConstraintSpec("json_schema", json.dumps(SCHEMA))) for _ in range(batch)]
    logits, times = torch.randn(batch, cfg.vocab_size), []
    for _ in range(steps):
        t0 = time.perf_counter()
        masked = mask_rows(ms, logits)
        t1 = time.perf_counter()
        toks = torch.argmax(masked, -1).tolist()  # the sampler's own work, there with or without a constraint
        t2 = time.perf_counter()
        for m, tok in zip(ms, toks):
            m.consume(tok)
        times.append((t1 - t0 + time.perf_counter() - t2) * 1e6)
        if any(m.done for m in ms):
            break
    return statistics.median(times)


def round_rate(svc, batch: int, tokens: int, constrained: bool, r: int) -> tuple[float, float]:
    with concurrent.futures.ThreadPoolExecutor(batch) as ex:
        got = list(ex.map(lambda i: stream_rate(svc.stub, f"# task {i}\ndef f(x):", tokens, constrained, 100 * r + i),
                          range(batch)))
    return sum(rate for rate, _ in got), statistics.mean(n for _, n in got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", type=pathlib.Path, default=ROOT / "models" / "default")
    src.add_argument("--synth", help="an architecture of tools/synth_checkpoint.py, written for this run")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-structured-"))
    model = synth_model(a.synth, a.layers, tmp / "ckpt") if a.synth else a.model
    batches = [int(b) for b in a.batches.split(",")]
    svc = Services(model, tmp, gpu_args=("--max-batch", str(max(batches))), expert_args=())
    print(f"CPU: {cpu_name()}; model {model}; {a.tokens} tokens a stream; {a.rounds} alternating rounds")
    try:
        for b in batches:
            round_rate(svc, b, 8, True, 0)  # warm: the tokenizer's and the schema's first compile
            free, constrained, lengths = [], [], []
            for r in range(a.rounds):
                free.append(round_rate(svc, b, a.tokens, False, r)[0])
                rate, n = round_rate(svc, b, a.tokens, True, r)
                constrained.append(rate)
                lengths.append(n)
            ratio = statistics.median(c / f for c, f in zip(constrained, free))
            print(json.dumps({"batch": b, "free_tok_s": round(statistics.median(free), 2),
                              "mask_us_per_step": round(mask_cost_us(model, b), 1),
                              "constrained_tok_s": round(statistics.median(constrained), 2),
                              "constrained_over_free": round(ratio, 3),
                              "constrained_tokens_per_stream": round(statistics.mean(lengths), 1)}))
    finally:
        svc.stop()


if __name__ == "__main__":
    main()
