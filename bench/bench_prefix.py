"""Prefix caching at work: a multi-turn conversation whose history grows to ~4000 tokens, its time to first token
per turn with the prefix cache and without it, in one run on both services (gpu_service/engine/prefix_cache.py).

    python bench/bench_prefix.py [--synth qwen3-30b-a3b --layers 4 | --model DIR] [--turns 6] [--start 1000]
                                 [--added 50] [--answer 16] [--weight-format int4 --dense-format int4]

Each turn's prompt is the previous prompt, the previous answer, and --added new tokens (the next user message),
as token ids (the chat template's rendering is not what is measured). "Cached" continues the conversation;
"uncached" sends the same prompt with its first token changed, so that no remembered prefix matches: the same
lengths, the same server, the turns interleaved. Goal (issue #30): a turn that adds 50 tokens to a 3000-token
history reaches its first token in <= 0.1x the uncached time; the cache's bytes (its Prometheus gauge) stay
within --prefix-cache-gb.

    python bench/bench_prefix.py --reasoning [--turns 6]

Templates that drop earlier turns' reasoning (Qwen3's and DeepSeek-R1's do): on the embedded default model, a
conversation whose answers are "<think>reasoning</think>answer", rendered by a ChatML template of ours that either
drops or keeps earlier answers' reasoning, tokenized by the model's tokenizer. Each turn sends the rendered prompt
and then the prompt with the answer appended (as if generated: the cache then holds both); the next turn's cached
share is what the server reports.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import urllib.request

import numpy as np

from common import ROOT, Services, cpu_name, free_port, synth_model  # noqa: E402
from protos import generate_pb2  # noqa: E402


def turn(stub, ids: list[int], answer: int) -> tuple[float, list[int], int]:
    """-> (seconds to the first token, the answer's ids, prompt tokens the cache had)."""
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=ids), max_tokens=answer, ignore_eos=True,
                                       sampling=generate_pb2.SamplingParams(temperature=0))
    chunks = list(stub.Generate(req, timeout=3600))
    return chunks[-1].time_to_first_token_s, [t for c in chunks for t in c.token_ids], chunks[-1].usage.cached_tokens


def gauge(port: int, name: str) -> float:
    """A metric's value; name may carry its labels: 'moe_kv_cache_blocks{state="used"}'."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


# ChatML as Qwen3 writes it; `drop`: earlier answers lose their reasoning (Qwen3's and DeepSeek-R1's rule)
CHATML = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'assistant' and m.reasoning and not drop %}<think>
{{ m.reasoning }}
</think>

{% endif %}{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def reasoning(a) -> None:
    import jinja2
    from tokenizers import Tokenizer

    model = ROOT / "models" / "default"
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    template = jinja2.Environment().from_string(CHATML)
    rng = np.random.default_rng(0)
    words = "the a list dict value key sort return function loop file path read write string number".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words, n))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    svc = Services(model, tmp, gpu_args=("--threads", str(a.threads)), expert_args=("--threads", str(a.threads)))
    print(f"CPU: {cpu_name()}; model {model}; {a.turns} turns of 15-word messages, answers of 40 words of reasoning and 20 of answer")
    print("\n| template | turn | prompt tokens | cached tokens | cached share | recomputed |\n|---|---|---|---|---|---|")
    try:
        for drop in (True, False):
            msgs = [{"role": "system", "content": text(80)}]
            for i in range(a.turns):
                msgs.append({"role": "user", "content": text(15)})
                prompt = tok.encode(template.render(messages=msgs, add_generation_prompt=True, drop=drop)).ids
                _, _, cached = turn(svc.stub, prompt, 1)
                answer = {"role": "assistant", "reasoning": text(40), "content": text(20)}
                full = tok.encode(template.render(messages=msgs + [answer], add_generation_prompt=False,
                                                  drop=False)).ids
                turn(svc.stub, full, 1)  # the answer as if generated: the cache holds prompt and answer
                msgs.append(answer)
                print(f"| {'drops' if drop else 'keeps'} reasoning | {i} | {len(prompt)} | {cached} | "
                      f"{cached / len(prompt):.2f} | {len(prompt) - cached} |", flush=True)
    finally:
        svc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", type=pathlib.Path)
    src.add_argument("--synth", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--start", type=int, default=1000, help="tokens of the first prompt")
    ap.add_argument("--added", type=int, default=50, help="new tokens each turn (besides the previous answer)")
    ap.add_argument("--grow", type=int, default=600, help="history added between turns besides --added (earlier "
                    "turns' tool results and answers), so that it reaches ~4000 tokens")
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--weight-format", default="int4")
    ap.add_argument("--dense-format", default="int4")
    ap.add_argument("--prefix-cache-gb", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reasoning", action="store_true", help="measure the hit rate of a template that drops earlier "
                    "turns' reasoning (see above) instead")
    a = ap.parse_args()
    if a.reasoning:
        return reasoning(a)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    model = a.model or synth_model(a.synth, a.layers, tmp / "ckpt")
    vocab = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]
    metrics = free_port()
    svc = Services(model, tmp, gpu_args=("--threads", str(a.threads), "--dense-format", a.dense_format,
                                         "--prefix-cache-gb", str(a.prefix_cache_gb), "--metrics-port", str(metrics),
                                         "--max-context", "8192"),
                   expert_args=("--threads", str(a.threads), "--weight-format", a.weight_format))
    print(f"CPU: {cpu_name()}; model {model}; experts {a.weight_format}, dense {a.dense_format}; "
          f"{a.turns} turns from {a.start} tokens, +{a.added} (+{a.grow} history) each, {a.answer}-token answers")
    rng = np.random.default_rng(0)
    history = rng.integers(3, vocab, a.start).tolist()
    rows = []
    try:
        turn(svc.stub, rng.integers(3, vocab, 64).tolist(), 2)  # warm
        for i in range(a.turns):
            other = [3 + (history[0] + 1 + i) % (vocab - 3)] + history[1:]  # a first token of its own
            t_miss, _, c_miss = turn(svc.stub, other, a.answer)
            t_hit, ans, c_hit = turn(svc.stub, history, a.answer)
            row = {"turn": i, "prompt_tokens": len(history), "ttft_uncached_s": round(t_miss, 3),
                   "ttft_cached_s": round(t_hit, 3), "cached_tokens": c_hit, "uncached_had": c_miss,
                   "ratio": round(t_hit / t_miss, 4), "cache_bytes": gauge(metrics, "moe_prefix_cache_bytes")}
            print(json.dumps(row))
            rows.append(row)
            history = history + ans + rng.integers(3, vocab, a.added + (a.grow if i < a.turns - 2 else 0)).tolist()
    finally:
        svc.stop()
    print("\n| turn | prompt tokens | cached tokens | TTFT uncached s | TTFT cached s | cached / uncached | cache MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_uncached_s']} | "
              f"{r['ttft_cached_s']} | {r['ratio']} | {r['cache_bytes'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()
