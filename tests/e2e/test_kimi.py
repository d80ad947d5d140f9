"""Kimi-K2 / K2-Thinking (model_type kimi_k2) and Kimi-K2.5 / K2.6 (kimi_k25, the text model of a vision-language
wrapper) as published, through both services: the greedy tokens and every prompt logit equal DeepseekV3ForCausalLM's
on the same weights (fp32; transformers has no kimi_k2 type: its Kimi-K2.5 config reads one as deepseek_v3), the
tiktoken vocabulary and Kimi's chat template serve a chat, and a forced tool call comes back through the official
openai client in Kimi's syntax."""
from __future__ import annotations

import json

import openai
import pytest
import torch

import tiny_kimi
from harness import Services, free_port, greedy
from moe_exchange import codec
from protos import generate_pb2

N_NEW = 24
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.mark.parametrize("wrapped", [False, True], ids=["kimi_k2", "kimi_k25"])
def test_kimi_matches_deepseek_v3_on_the_same_weights(tmp_path, wrapped):
    d, ref = tiny_kimi.build(tmp_path / "ckpt", wrapped, seed=4)
    torch.manual_seed(1)
    prompt = torch.randint(2, 300, (9,)).tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        ref_logits = ref(torch.tensor([prompt])).logits[0]
    (tmp_path / "logs").mkdir()
    s = Services(d, tmp_path / "logs", gpu_args=("--http-listen", f"127.0.0.1:{(http := free_port())}",
                                                 "--served-model-name", "kimi"))
    try:
        assert greedy(s.stub, prompt, N_NEW) == want, s.logs()
        resp = s.stub.Score(generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=prompt)), timeout=60)
        logits = codec.decode(resp.logits, "logits")
        assert (logits - ref_logits).abs().max().item() < 1e-4
        info = s.stub.Info(generate_pb2.ServerInfoRequest(), timeout=10)
        assert info.architecture == ("kimi_k25" if wrapped else "kimi_k2")
        if wrapped:
            assert "the vision tower and projector are not loaded" in s.logs()
        # a chat through the tiktoken vocabulary and Kimi's template: the prompt's ids are tiktoken's own
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="kimi", messages=[{"role": "user", "content": "東京 weather? 12345"}],
                                           tools=[TOOL], tool_choice="required", max_tokens=60, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and not msg.content, msg
        assert [c.function.name for c in msg.tool_calls] == ["get_time"]
        assert json.loads(msg.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")
    finally:
        s.stop()
