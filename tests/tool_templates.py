"""Chat templates for the tool-calling tests, one per call syntax, and tiny checkpoints that carry them.

There is no model hub here and the published templates' text may not be copied into this repository, so these
are written for the tests: each renders tools, earlier calls and tool results, and the generation prompt in its
family's published syntax (the markers, where they go, how arguments are written: JSON, or GLM-4.5's and
MiniMax-M2's raw strings), with the family's control tokens, special or not as the published vocabularies have
them. What the parsers and grammars must agree with is that syntax, which these reproduce. One liberty: MiniMax-M2's
template has no switch for its thinking; this one takes Qwen3's enable_thinking, since a model with random weights
that starts thinking may never stop."""
from __future__ import annotations

import json
import pathlib

from tokenizers import AddedToken, Tokenizer

import tiny_models

QWEN = r"""
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}
{%- for tc in m.tool_calls or [] %}
{%- if m.content or not loop.first %}{{ '\n' }}{% endif %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

DEEPSEEK_TOOLS = r"""{{ bos_token }}{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- if tools %}

## Tools
You have access to the following tools:
{% for tool in tools %}
### {{ tool.function.name }}
Description: {{ tool.function.description }}

Parameters: {{ tool.function.parameters | tojson }}
{% endfor %}

IMPORTANT: ALWAYS adhere to this exact format for tool use:
"""

DEEPSEEK_V3 = DEEPSEEK_TOOLS + r"""<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_call_name
```json
tool_call_arguments
```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}
{%- if m.tool_calls %}<｜tool▁calls▁begin｜>
{%- for tc in m.tool_calls %}{% if not loop.first %}{{ '\n' }}{% endif %}<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ tc.function.name + '\n```json\n' + tc.function.arguments + '\n```' }}<｜tool▁call▁end｜>
{%- endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>
{%- elif m.role == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"""

DEEPSEEK_V31 = DEEPSEEK_TOOLS + r"""<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜><｜tool▁calls▁end｜>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content }}
{%- if m.tool_calls %}<｜tool▁calls▁begin｜>
{%- for tc in m.tool_calls %}<｜tool▁call▁begin｜>{{ tc.function.name + '<｜tool▁sep｜>' + tc.function.arguments }}<｜tool▁call▁end｜>
{%- endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>
{%- elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"""

GLM45 = r"""[gMASK]<sop>
{%- if tools %}<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}<|system|>
{{ m.content }}
{%- elif m.role == 'user' %}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|>
<think></think>
{{ m.content }}
{%- for tc in m.tool_calls or [] %}
<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>{% endfor %}
{%- elif m.role == 'tool' %}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}
<think></think>{% endif %}{% endif %}"""

# GLM-4.7's and GLM-5's: GLM-4.5's tags, a call's name, keys and values written without newlines
GLM47 = GLM45.replace("<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}"
                      "</arg_value>\n...\n</tool_call>",
                      "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
                      "...</tool_call>").replace(
    "<tool_call>{{ tc.function.name }}\n{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}",
    "<tool_call>{{ tc.function.name }}{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>{% endfor %}")

# DeepSeek-V3.2's, cut down from its published template (llama.cpp's models/templates keeps it): the tools as JSON in
# the system prompt, calls in DSML (string="true" for a string value, raw; JSON otherwise), results in
# <function_results>
DEEPSEEK_V32 = r"""{{ bos_token }}
{%- if tools %}## Tools

You can invoke functions by writing a "<｜DSML｜function_calls>" block.
<functions>
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}</functions>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<｜User｜>{{ m.content }}
{%- elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content }}
{%- if m.tool_calls %}

<｜DSML｜function_calls>
{% for tc in m.tool_calls %}<｜DSML｜invoke name="{{ tc.function.name }}">
{% for k, v in tc.function.arguments.items() %}{% if v is string %}<｜DSML｜parameter name="{{ k }}" string="true">{{ v }}</｜DSML｜parameter>
{% else %}<｜DSML｜parameter name="{{ k }}" string="false">{{ v | tojson }}</｜DSML｜parameter>
{% endif %}{% endfor %}</｜DSML｜invoke>
{% endfor %}</｜DSML｜function_calls>{% endif %}<｜end▁of▁sentence｜>
{%- elif m.role == 'tool' %}

<function_results>
<result>{{ m.content }}</result>
</function_results>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"""

MINIMAX_M2 = r"""]~!b[]~b]system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}
{%- if tools %}

# Tools
You may call one or more tools to assist with the user query.
Here are the tools available in JSONSchema format:

<tools>
{% for tool in tools %}<tool>{{ tool.function | tojson }}</tool>
{% endfor %}</tools>

When making tool calls, use XML format to invoke tools and pass parameters:

<minimax:tool_call>
<invoke name="tool-name-1">
<parameter name="param-key-1">param-value-1</parameter>
...
</invoke>
</minimax:tool_call>
{%- endif %}[e~[
{% for m in messages %}
{%- if m.role == 'user' %}]~b]user
{{ m.content }}[e~[
{% elif m.role == 'assistant' %}]~b]ai
{{ m.content }}
{%- if m.tool_calls %}
<minimax:tool_call>
{% for tc in m.tool_calls %}<invoke name="{{ tc.function.name }}">
{% for k, v in tc.function.arguments.items() %}<parameter name="{{ k }}">{{ v if v is string else v | tojson }}</parameter>
{% endfor %}</invoke>
{% endfor %}</minimax:tool_call>
{%- endif %}[e~[
{% elif m.role == 'tool' %}]~b]tool
<response>{{ m.content }}</response>[e~[
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}]~b]ai
{% if enable_thinking is defined and not enable_thinking %}<think>
</think>
{% endif %}{% endif %}"""

HARMONY = r"""<|start|>system<|message|>You are a helpful assistant.
Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for tool in tools %}
// {{ tool.function.description }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{% endfor %}
} // namespace functions<|end|>
{%- endif %}
{%- set ns = namespace(last='') %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' %}
{%- if m.tool_calls %}{% for tc in m.tool_calls %}{% set ns.last = tc.function.name %}<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json<|message|>{{ tc.function.arguments | tojson }}<|call|>{% endfor %}
{%- else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}
{%- elif m.role == 'tool' %}<|start|>functions.{{ ns.last }} to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

# Kimi-K2's: roles as <|im_user|> / <|im_assistant|> / <|im_system|> NAME <|im_middle|>, tools declared as JSON in a
# tool_declare system turn, calls as functions.NAME:INDEX in a section, results as "## Return of ID"; K2-Thinking's
# and K2.5's <think> (closed at once where enable_thinking is false, as Qwen's template here does)
KIMI = r"""
{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}
{%- set ns = namespace(i=0) %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'system' %}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}
{%- if m.tool_calls %}<|tool_calls_section_begin|>{% for tc in m.tool_calls %}<|tool_call_begin|>functions.{{ tc.function.name }}:{{ ns.i }}<|tool_call_argument_begin|>{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}<|tool_call_end|>{% set ns.i = ns.i + 1 %}{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>
{%- elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>
{%- if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"""
KIMI_TOKENS = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>",
               "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>"]

DS_TOKENS = ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
             "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
             "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
# syntax -> (tiny family, template, special tokens, other added tokens, end-of-sequence tokens)
FAMILIES = {
    "hermes": ("qwen3_moe", QWEN, ["<|im_start|>", "<|im_end|>"],
               ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"],
               ["<|im_end|>"]),
    "deepseek_v3": ("deepseek_v3", DEEPSEEK_V3, DS_TOKENS[:3], DS_TOKENS[3:], ["<｜end▁of▁sentence｜>"]),
    "deepseek_v31": ("deepseek_v3", DEEPSEEK_V31, DS_TOKENS[:3], DS_TOKENS[3:] + ["<think>", "</think>"],
                     ["<｜end▁of▁sentence｜>"]),
    "glm45": ("glm4_moe", GLM45, ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                                  "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                  "</arg_value>", "<think>", "</think>", "<tool_response>", "</tool_response>"],
              [], ["<|user|>", "<|observation|>"]),
    # (the DSML tags added as tokens here so that a forced call fits the tests' budgets in the tiny vocabulary)
    "deepseek_v32": ("deepseek_v32", DEEPSEEK_V32, DS_TOKENS[:3],
                     ["<think>", "</think>", "<｜DSML｜function_calls>", "</｜DSML｜function_calls>",
                      '<｜DSML｜invoke name="', "</｜DSML｜invoke>", '<｜DSML｜parameter name="', "</｜DSML｜parameter>"],
                     ["<｜end▁of▁sentence｜>"]),
    "glm47": ("glm_moe_dsa", GLM47, ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                                     "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                     "</arg_value>", "<think>", "</think>", "<tool_response>", "</tool_response>"],
              [], ["<|user|>", "<|observation|>"]),
    "minimax_m2": ("minimax_m2", MINIMAX_M2, ["]~!b[", "]~b]", "[e~["],
                   ["<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>"], ["[e~["]),
    "kimi_k2": ("deepseek_v3", KIMI, KIMI_TOKENS, ["<think>", "</think>"], ["<|im_end|>"]),
    "harmony": ("gpt_oss", HARMONY, ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                     "<|return|>", "<|call|>"], [], ["<|return|>", "<|call|>"]),
}
ADDED = 32  # room in the model's vocabulary for the added tokens


def tokenizer(syntax: str, out: pathlib.Path) -> Tokenizer:
    """The tiny BPE tokenizer with this syntax's tokens added (ids from tiny_models.VOCAB on), saved to out with its
    template; -> the tokenizer."""
    _, template, special, normal, eos = FAMILIES[syntax]
    out.mkdir(parents=True, exist_ok=True)
    tiny_models.build_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in normal])
    assert tok.get_vocab_size() <= tiny_models.VOCAB + ADDED
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template, "eos_token": eos[0]}))
    return tok


def checkpoint(syntax: str, out: pathlib.Path) -> pathlib.Path:
    """A tiny random checkpoint of the syntax's family that speaks it (template, tokens, end-of-sequence ids)."""
    family, *_, eos = FAMILIES[syntax]
    tiny_models.build(family, out, vocab_size=tiny_models.VOCAB + ADDED, max_position_embeddings=4096)
    tok = tokenizer(syntax, out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [1] + [tok.token_to_id(t) for t in eos]}))
    return out
