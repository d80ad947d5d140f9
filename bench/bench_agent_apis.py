"""A tool-using agent's conversation through each agent API: OpenAI's Responses (each turn continues the last through
previous_response_id) and Anthropic's Messages (each turn resends the whole history), both services on a
qwen3_moe-shaped checkpoint whose chat template renders tools (Qwen3's hermes layout; the embedded default model's
template renders none). Every turn forces a call (the model's weights are random: a free answer could be anything)
and the next turn carries its result; per turn: the time to the first streamed delta, the prompt's tokens and the
share the prefix cache had. (The two conversations' system prompts differ from their first token: neither finds the
other's blocks.)

    python bench/bench_agent_apis.py [--synth qwen3-30b-a3b --layers 4 | --model DIR] [--turns 10] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile
import time

from common import Services, cpu_name, free_port, synth_model  # noqa: E402

import anthropic  # noqa: E402
import openai  # noqa: E402
import tool_templates  # noqa: E402  (tests/: the hermes template the tool tests use)

TOOL = {"name": "read_file", "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40},
                                                        "lines": {"type": "integer", "minimum": 1, "maximum": 400}},
                       "required": ["path", "lines"], "additionalProperties": False}}
SYSTEM = ("You are a coding agent working in a large repository. Read files before you change them; explain each "
          "step briefly. " * 8)
RESULT = "def main():\n    parse_args()\n    run()\n" * 6
KW = {"chat_template_kwargs": {"enable_thinking": False}}


def with_tool_template(model: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """The checkpoint with Qwen3's hermes tool template (links to its weights)."""
    out.mkdir(parents=True)
    for f in model.iterdir():
        (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").unlink()
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": tool_templates.QWEN}))
    return out


def responses_turns(client: openai.OpenAI, turns: int) -> list[tuple[float, int, int]]:
    out, prev, item = [], None, {"role": "user", "content": "Find where the command line is parsed."}
    for _ in range(turns):
        t0, first = time.perf_counter(), None
        with client.responses.stream(model="m", input=[item], previous_response_id=prev, instructions="A " + SYSTEM,
                                     tools=[{"type": "function", **TOOL}], tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=60, temperature=0,
                                     extra_body=KW) as s:
            for e in s:
                if first is None and e.type.endswith(".delta"):
                    first = time.perf_counter() - t0
            r = s.get_final_response()
        call = next(o for o in r.output if o.type == "function_call")
        out.append((first, r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens))
        prev, item = r.id, {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    return out


def messages_turns(client: anthropic.Anthropic, turns: int) -> list[tuple[float, int, int]]:
    out, history = [], [{"role": "user", "content": "Find where the command line is parsed."}]
    for _ in range(turns):
        t0, first = time.perf_counter(), None
        with client.messages.stream(model="m", system="B " + SYSTEM, messages=history, max_tokens=60, tools=[{
                "name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}],
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                extra_body={"temperature": 0, **KW}) as s:
            for e in s:
                if first is None and e.type == "content_block_delta":
                    first = time.perf_counter() - t0
            m = s.get_final_message()
        use = next(b for b in m.content if b.type == "tool_use")
        # Anthropic's input_tokens exclude the cached part
        out.append((first, m.usage.input_tokens + m.usage.cache_read_input_tokens, m.usage.cache_read_input_tokens))
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", type=pathlib.Path)
    src.add_argument("--synth", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weight-format", default="int4")
    a = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-agents-"))
    try:
        model = a.model or synth_model(a.synth, a.layers, work / "synth")
        model = with_tool_template(model, work / "model")
        http = free_port()
        svc = Services(model, work, gpu_args=("--http-listen", f"127.0.0.1:{http}", "--served-model-name", "m",
                                              "--threads", str(a.threads)),
                       expert_args=("--threads", str(a.threads), "--weight-format", a.weight_format))
        print(f"CPU: {cpu_name()}; {a.model or f'{a.synth}, {a.layers} layers'}, experts {a.weight_format}; "
              f"{a.turns} turns, each a forced call whose result the next turn carries", flush=True)
        try:
            rows = {"responses": responses_turns(openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x",
                                                                max_retries=0, timeout=600), a.turns),
                    "messages": messages_turns(anthropic.Anthropic(base_url=f"http://127.0.0.1:{http}", api_key="x",
                                                                    max_retries=0, timeout=600), a.turns)}
        finally:
            svc.stop()
        print("\n| API | turn | time to first delta ms | prompt tokens | cached | cached share |\n|---|---|---|---|---|---|")
        for api, turns in rows.items():
            for i, (ttft, prompt, cached) in enumerate(turns):
                print(f"| {api} | {i + 1} | {ttft * 1e3:.0f} | {prompt} | {cached} | {cached / prompt:.0%} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
