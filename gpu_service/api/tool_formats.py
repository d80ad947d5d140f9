"""The tool-call syntax of each model family: how its calls are parsed out of an answer as it streams, and the
grammar that makes an answer a call (tool_choice required or named).

    hermes        Qwen3, Qwen2.5, Qwen3-Next:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    deepseek_v3   DeepSeek-V3/R1:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
                  <｜tool▁call▁end｜><｜tool▁calls▁end｜>
    deepseek_v31  DeepSeek-V3.1:   ...<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
                  (the parser of either reads both layouts; the grammar writes the checkpoint's)
    deepseek_v32  DeepSeek-V3.2 (DSML):  <｜DSML｜function_calls>\\n<｜DSML｜invoke name="f">\\n
                  <｜DSML｜parameter name="k" string="true|false">v</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n
                  </｜DSML｜function_calls>
    glm45         GLM-4.5/4.6:  <tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>
    glm47         GLM-4.7 and GLM-5:  <tool_call>f<arg_key>k</arg_key><arg_value>v</arg_value></tool_call> (glm45's,
                  written without the newlines)
    minimax_m2    MiniMax-M2:  <minimax:tool_call>\\n<invoke name="f">\\n<parameter name="k">v</parameter>\\n
                  </invoke>\\n</minimax:tool_call>
    kimi_k2       Kimi-K2, K2-Thinking, K2.5, K2.6:  <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0
                  <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>
    harmony       gpt-oss (harmony.py: its channels carry the reasoning and the calls)

In GLM-4.5's and MiniMax-M2's syntax a string value is written raw and any other value as JSON: the tool's schema
says which; DeepSeek-V3.2's DSML says it per parameter (string="true": raw). Markers that are one token of the
checkpoint's vocabulary (its added tokens: special or not) are matched as that token only, never as the same
characters spelled by other tokens: the detokenizer writes each as one private-use character (Markers), so an answer
that merely quotes "<tool_call>" in prose is not a call.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Callable

from gpu_service.api.text import partial_tail
from gpu_service.api.tools import ToolCallDelta, ToolChoice, new_call_id

log = logging.getLogger("gpu_service.api.tools")
SYMBOLS = 0xF0000  # Supplementary Private Use Area-A: marker k is written as chr(SYMBOLS + k)
# what the forced grammars' JSON looks like: compact but spaced as the templates' tojson writes it (so the model
# sees its own style), and never free whitespace (a finite schema always ends)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Markers:
    """A format's marker strings as its parser sees them in the detokenized answer."""

    def __init__(self, strings, added: dict[str, int]):
        """added: the vocabulary's added tokens (content -> id); a marker among them is one symbol."""
        self.sym: dict[str, str] = {}
        self.ids: dict[int, str] = {}  # token id -> symbol, for the detokenizer
        self.token: dict[str, int] = {}
        self._text: dict[str, str] = {}
        for k, s in enumerate(dict.fromkeys(strings)):
            tid = added.get(s)
            if tid is None:
                self.sym[s] = s
            else:
                c = chr(SYMBOLS + k)
                self.sym[s], self.ids[tid], self.token[s], self._text[c] = c, c, tid, s
        self._re = re.compile("|".join(map(re.escape, self._text))) if self._text else None

    def restore(self, text: str) -> str:
        """Symbols back to the markers' text (for what is shown as content or reasoning)."""
        return self._re.sub(lambda m: self._text[m.group()], text) if self._re and text else text

    def lark(self, s: str) -> str:
        """s in a Lark grammar: its token (by id) or its text."""
        return f"<[{self.token[s]}]>" if s in self.token else json.dumps(s)


def _value(raw: str, schema: dict | None) -> str:
    """A raw-written argument value (GLM-4.5, MiniMax-M2) as JSON: a string where the schema says so, else the
    JSON it is written as (a string again when it is not JSON)."""
    kind = (schema or {}).get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return json.dumps(raw, ensure_ascii=False)
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)


def _object(parts: list[str], final: bool) -> str:
    """The arguments' JSON text from its "key": value parts; before the call ends, without the closing brace
    (so every later version extends the earlier ones)."""
    return "{" + ", ".join(parts) + ("}" if final else "")


# -- bodies: (text between a call's markers, the call complete?) -> (name or None, arguments so far, ok) ----------
# ok False: not a call after all (its text goes back to the content); name None and ok: not known yet
HERMES_NAME = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
HERMES_ARGS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def hermes_body(body: str, final: bool, m: Markers, params: dict) -> tuple[str | None, str, bool]:
    s = body.lstrip()
    if not s:
        return None, "", not final
    if s[0] != "{":
        return None, "", False
    head = HERMES_NAME.match(s)
    if final:
        try:
            obj = json.loads(s)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):  # the arguments as a JSON string (some models write them so)
                return obj["name"], args, True
            raw = _hermes_args(s, head, True)
            try:
                same = raw is not None and json.loads(raw) == args
            except ValueError:
                same = False
            return obj["name"], raw if same else json.dumps(args, ensure_ascii=False), True
    if head is None:  # undecided while what is there could still begin {"name": "...
        r = s[1:].lstrip()
        return None, "", not final and len(s) < 4096 and (r.startswith('"name"') or '"name"'.startswith(r))
    return json.loads(head.group(1)), _hermes_args(s, head, final) or "", True


def _hermes_args(s: str, head, final: bool) -> str | None:
    """The arguments' text after the name: all of it once the call ends (less the wrapper's brace), before then
    less what could still be that brace."""
    if head is None:
        return None
    m = HERMES_ARGS.match(s, head.end())
    if m is None:
        return None
    args = s[m.end():].rstrip()
    if final:
        return args[:-1].rstrip() if args.endswith("}") else args
    if args.startswith('"'):
        return ""  # a JSON string: its text is known once the call ends
    return re.sub(r"\s*\}?\s*$", "", s[m.end():])


def deepseek_body(body: str, final: bool, m: Markers, params: dict) -> tuple[str | None, str, bool]:
    sep = m.sym["<｜tool▁sep｜>"]
    i = body.find(sep)
    if i < 0:
        return None, "", not final
    head, tail = body[:i].strip(), body[i + len(sep):]
    if head != "function":  # V3.1: the name, then the arguments
        return (head or None), tail.strip(), bool(head)
    nl = tail.find("\n")  # V3/R1: the name on its line, then a ```json block
    if nl < 0:
        if not final:
            return None, "", True
        return tail.strip() or None, "{}", bool(tail.strip())
    name, rest = tail[:nl].strip(), tail[nl + 1:]
    fence = re.match(r"\s*```(?:json)?[ \t]*\n", rest)
    if fence is None:
        return name, rest.strip() if final else "", bool(name)
    args = rest[fence.end():]
    end = args.find("\n```")
    if end >= 0:
        args = args[:end]
    elif final:
        args = args.rstrip().removesuffix("```").rstrip()
    else:
        args = args[:len(args) - partial_tail(args, "\n```")]
    return name, args, bool(name)


def glm_body(body: str, final: bool, m: Markers, params: dict) -> tuple[str | None, str, bool]:
    k0, k1, v0, v1 = (m.sym[t] for t in ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))
    i = body.find(k0)
    if i < 0:
        if not final and "\n" not in body:
            return None, "", True
        name = body.split("\n")[0].strip()
        return name or None, "{}" if final and name else ("{" if name else ""), bool(name) or not final
    name = body[:i].strip()
    pattern = re.escape(k0) + r"(.*?)" + re.escape(k1) + r"\s*" + re.escape(v0) + r"(.*?)" + re.escape(v1)
    props = (params.get(name) or {}).get("properties", {})
    parts = [f"{json.dumps(k.strip(), ensure_ascii=False)}: {_value(v, props.get(k.strip()))}"
             for k, v in re.findall(pattern, body[i:], re.S)]
    return name or None, _object(parts, final), bool(name)


KIMI_ID = re.compile(r"\s*(?:functions\.)?([^:\s]*)(?::\d+)?\s*$")


def kimi_body(body: str, final: bool, m: Markers, params: dict) -> tuple[str | None, str, bool]:
    """functions.NAME:INDEX (the call's id as the template writes it), the argument marker, the arguments' JSON."""
    sep = m.sym["<|tool_call_argument_begin|>"]
    i = body.find(sep)
    if i < 0:
        return None, "", not final and len(body) < 1024
    head = KIMI_ID.match(body[:i])
    name = head.group(1) if head else ""
    return name or None, body[i + len(sep):].strip(), bool(name)


KIMI_CALL_ID = re.compile(r"functions\.[^:\s]+:\d+")


def kimi_call_id(body: str, m: Markers) -> str | None:
    """The call's id as the model wrote it (functions.NAME:INDEX): Kimi's templates render a tool result under its
    call's id, so the client is given the id the model will see again (as vLLM's Kimi parser does)."""
    i = body.find(m.sym["<|tool_call_argument_begin|>"])
    head = body[:i].strip() if i >= 0 else ""
    return head if KIMI_CALL_ID.fullmatch(head) else None


MINIMAX_PARAM = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.S)


def minimax_body(body: str, final: bool, m: Markers, params: dict) -> tuple[str | None, str, bool]:
    i = body.find('"')
    if i < 0:
        return None, "", not final and len(body) < 256
    name = body[:i]
    props = (params.get(name) or {}).get("properties", {})
    parts = [f"{json.dumps(k, ensure_ascii=False)}: {_value(v.removeprefix(chr(10)).removesuffix(chr(10)), props.get(k))}"
             for k, v in MINIMAX_PARAM.findall(body, i + 2)]
    return name or None, _object(parts, final), bool(name)


DSML_INNER = ('<｜DSML｜invoke name="', "</｜DSML｜invoke>")
DSML_PARAM = ('<｜DSML｜parameter name="', "</｜DSML｜parameter>")


def dsml_body(body: str, final: bool, m: Markers, params: dict) -> tuple[str | None, str, bool]:
    """f">, then its parameters, each raw (string="true") or JSON (string="false": a value that is not JSON is kept
    as a string)."""
    i = body.find('"')
    if i < 0:
        return None, "", not final and len(body) < 256
    name = body[:i]
    p0, p1 = (re.escape(m.sym[t]) for t in DSML_PARAM)
    value = lambda v, raw: json.dumps(v, ensure_ascii=False) if raw == "true" else _value(v, None)  # noqa: E731
    parts = [f"{json.dumps(k, ensure_ascii=False)}: {value(v, raw)}"
             for k, raw, v in re.findall(p0 + r'([^"]*)" string="(true|false)">(.*?)' + p1, body[i + 1:], re.S)]
    return name or None, _object(parts, final), bool(name)


# -- the forced grammars (Lark, llguidance's dialect) -----------------------------------------------------------
def json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def _raw_value(schema: dict) -> str:
    """A value as GLM-4.5 and MiniMax-M2 write it: a string raw (no quotes; never a '<', which would start the
    next marker), anything else as JSON."""
    if schema.get("type") == "string":
        if isinstance(schema.get("enum"), list) and all(isinstance(e, str) for e in schema["enum"]):
            return " | ".join(json.dumps(e) for e in schema["enum"]) or '""'
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        return f"/[^<]{{{lo},{int(hi)}}}/" if hi is not None else (f"/[^<]{{{lo},}}/" if lo else "/[^<]*/")
    return json_rule(schema)


def _kv_rules(name: str, schema: dict, one) -> tuple[str, list[str]]:
    """The sequence of one call's parameters in schema order (the required ones always, the others optional) and
    the rules for their values; one(key, value_rule, its schema) writes a parameter."""
    seq, rules = [], []
    required = set(schema.get("required", ()))
    for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
        rule, sub = f"v_{name}_{j}", sub if isinstance(sub, dict) else {}
        rules.append(f"{rule}: {_raw_value(sub)}")
        seq.append(one(key, rule, sub) if key in required else f"({one(key, rule, sub)})?")
    return " ".join(seq) or '""', rules


def grammar(fmt: "Format", m: Markers, tools: list[dict], choice: ToolChoice, parallel: bool) -> str:
    """A Lark grammar whose every sentence is one call (several when parallel and not a named choice) to the
    offered tools in fmt's syntax, with arguments that validate against the tool's schema."""
    chosen = [t["function"] for t in tools if choice.mode != "function" or t["function"]["name"] == choice.name]
    calls, rules = [], []
    for i, f in enumerate(chosen):
        body, more = fmt.call_grammar(m, f["name"], f.get("parameters") or {}, i)
        calls.append(f"c{i}")
        rules += [f"c{i}: {body}", *more]
    many = parallel and choice.mode != "function"
    start = fmt.wrap_grammar(m, "call" + (f" ({json.dumps(fmt.between)} call)*" if many else ""))
    return "\n".join([f"start: {start}", "call: " + " | ".join(calls), *rules])


def _hermes_call(m, name, schema, i):
    head = json.dumps(f'\n{{"name": {json.dumps(name)}, "arguments": ')
    return f'{m.lark("<tool_call>")} {head} a{i} "}}\\n" {m.lark("</tool_call>")}', [f"a{i}: {json_rule(schema)}"]


def _deepseek_call(v31: bool):
    def call(m, name, schema, i):
        cb, sep, ce = (m.lark(t) for t in ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"))
        if v31:
            return f"{cb} {json.dumps(name)} {sep} a{i} {ce}", [f"a{i}: {json_rule(schema)}"]
        return (f'{cb} "function" {sep} {json.dumps(name + chr(10) + "```json" + chr(10))} a{i} "\\n```" {ce}',
                [f"a{i}: {json_rule(schema)}"])
    return call


def _glm_call(newlines: bool):
    def call(m, name, schema, i):
        k0, k1, v0, v1 = (m.lark(t) for t in ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))
        nl = ' "\\n"' if newlines else ""
        seq, rules = _kv_rules(str(i), schema, lambda k, r, _: f'{k0} {json.dumps(k)} {k1}{nl} {v0} {r} {v1}{nl}')
        head = json.dumps(name + ("\n" if newlines else ""))
        return f'{m.lark("<tool_call>")} {head} {seq} {m.lark("</tool_call>")}', rules
    return call


def _minimax_call(m, name, schema, i):
    seq, rules = _kv_rules(str(i), schema, lambda k, r, _: f'{json.dumps(f"<parameter name={json.dumps(k)}>")} {r} '
                                                            f'"</parameter>\\n"')
    return f'{json.dumps(f"<invoke name={json.dumps(name)}>" + chr(10))} {seq} "</invoke>\\n"', rules


def _dsml_call(m, name, schema, i):
    def one(key, rule, sub):
        raw = "true" if sub.get("type") == "string" else "false"  # as _raw_value writes the value
        return f'{m.lark(DSML_PARAM[0])} {json.dumps(key + chr(34) + " string=" + json.dumps(raw) + ">")} {rule} ' \
               f'{m.lark(DSML_PARAM[1])} "\\n"'
    seq, rules = _kv_rules(str(i), schema, one)
    head = f'{m.lark(DSML_INNER[0])} {json.dumps(name + chr(34) + ">" + chr(10))}'
    return f'{head} {seq} {m.lark(DSML_INNER[1])} "\\n"', rules


def _kimi_call(m, name, schema, i):
    cb, ab, ce = (m.lark(t) for t in ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"))
    return f'{cb} {json.dumps("functions." + name + ":")} /[0-9]{{1,4}}/ {ab} a{i} {ce}', [f"a{i}: {json_rule(schema)}"]


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    inner: tuple[str, str]             # a call's opening and closing markers
    outer: tuple[str, str] | None      # the block around an answer's calls, where there is one
    body: Callable                     # (body, final, markers, params) -> (name, arguments so far, ok)
    call_grammar: Callable             # (markers, name, schema, i) -> (Lark for the call, its rules)
    between: str = "\n"                # between two calls
    opened: str = ""                   # after the block's opening marker, before its first call
    extra: tuple[str, ...] = ()        # other markers the body reads
    call_id: Callable | None = None    # (body, markers) -> the call's own id where the syntax writes one, else None

    @property
    def markers(self) -> tuple[str, ...]:
        return (*(self.outer or ()), *self.inner, *self.extra)

    def wrap_grammar(self, m: Markers, calls: str) -> str:
        if self.outer is None:
            return calls
        opened = json.dumps(self.opened) if self.opened else ""
        return f"{m.lark(self.outer[0])} {opened} {calls} {m.lark(self.outer[1])}"


DS_OUTER = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DS_INNER = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
FORMATS = {f.name: f for f in (
    Format("hermes", ("<tool_call>", "</tool_call>"), None, hermes_body, _hermes_call),
    Format("deepseek_v3", DS_INNER, DS_OUTER, deepseek_body, _deepseek_call(False), extra=("<｜tool▁sep｜>",)),
    Format("deepseek_v31", DS_INNER, DS_OUTER, deepseek_body, _deepseek_call(True), between="",
           extra=("<｜tool▁sep｜>",)),
    Format("deepseek_v32", DSML_INNER, ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"), dsml_body,
           _dsml_call, between="", opened="\n", extra=DSML_PARAM),
    Format("glm45", ("<tool_call>", "</tool_call>"), None, glm_body, _glm_call(True),
           extra=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    Format("glm47", ("<tool_call>", "</tool_call>"), None, glm_body, _glm_call(False), between="",
           extra=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    Format("minimax_m2", ('<invoke name="', "</invoke>"), ("<minimax:tool_call>", "</minimax:tool_call>"),
           minimax_body, _minimax_call, between="", opened="\n"),
    Format("kimi_k2", ("<|tool_call_begin|>", "<|tool_call_end|>"),
           ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"), kimi_body, _kimi_call, between="",
           extra=("<|tool_call_argument_begin|>",), call_id=kimi_call_id),
)}
PARSERS = ("auto", *FORMATS, "harmony", "none")


def detect(chat_template: str | None) -> str | None:
    """The tool-call syntax a checkpoint's chat template writes its calls in (None: none we know). The template
    is the one place that shows it: it renders earlier calls the way the model was trained to write them."""
    t = chat_template or ""
    if "<|channel|>" in t and "to=functions" in t:
        return "harmony"
    if "｜DSML｜" in t:
        return "deepseek_v32"
    if "<｜tool▁calls▁begin｜>" in t:
        return "deepseek_v3" if "```json" in t else "deepseek_v31"  # V3 and R1 fence the arguments; V3.1 does not
    if "<minimax:tool_call>" in t:
        return "minimax_m2"
    if "<|tool_calls_section_begin|>" in t:
        return "kimi_k2"
    if "<arg_key>" in t:  # GLM-4.5/4.6 put each key and value on a line of its own, GLM-4.7 and GLM-5 do not
        return "glm45" if "\n<arg_key>" in t else "glm47"
    if "<tool_call>" in t:
        return "hermes"
    return None


class CallStream:
    """One answer's text in (symbols for single-token markers), its content and call deltas out. Text outside
    calls is content; a call whose name cannot be read is content too (malformed: shown as the model wrote it).
    After the first call, whitespace between calls is dropped."""

    def __init__(self, fmt: Format, m: Markers, params: dict[str, dict]):
        self.fmt, self.m, self.params = fmt, m, params
        self.inner = tuple(m.sym[s] for s in fmt.inner)
        self.outer = tuple(m.sym[s] for s in fmt.outer) if fmt.outer else None
        self.state = "text"  # text | outer (inside the calls' block) | call
        self.buf = ""
        self.calls = 0
        self.held_ws = ""  # whitespace after a call: dropped unless more content follows
        self.block, self.block_calls = "", 0  # an open block's text outside its calls; the calls before it
        self.ids: set[str] = set()  # the answer's call ids so far
        self._reset()

    def _reset(self) -> None:
        self.index, self.sent_args = None, ""

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        return self._run(False)

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        return self._run(True)

    def _content(self, out: list[str], text: str, final: bool) -> None:
        if not self.calls:
            out.append(text)
            return
        text = self.held_ws + text
        stripped = text.rstrip()
        out.append(stripped)
        self.held_ws = "" if final else text[len(stripped):]

    def _run(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self.state == "text":
                start = self.outer[0] if self.outer else self.inner[0]
                i = self.buf.find(start)
                if i < 0:
                    keep = 0 if final else partial_tail(self.buf, start)
                    self._content(content, self.buf[:len(self.buf) - keep], final)
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._content(content, self.buf[:i], False)
                self.buf = self.buf[i + len(start):]
                self.state = "outer" if self.outer else "call"
                self.block, self.block_calls = "", self.calls
            elif self.state == "outer":  # between the calls of a block: dropped, unless the block has none
                b, e = self.buf.find(self.inner[0]), self.buf.find(self.outer[1])
                if e >= 0 and (b < 0 or e < b):
                    self._close_block(content, self.buf[:e] + self.outer[1])
                    self.buf, self.state = self.buf[e + len(self.outer[1]):], "text"
                elif b >= 0:
                    self.block += self.buf[:b]
                    self.buf, self.state = self.buf[b + len(self.inner[0]):], "call"
                else:
                    keep = 0 if final else max(partial_tail(self.buf, self.inner[0]), partial_tail(self.buf, self.outer[1]))
                    self.block += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    if final:
                        self._close_block(content, "")
                    break
            else:
                e = self.buf.find(self.inner[1])
                done = e >= 0 or final
                body = self.buf[:e] if e >= 0 else self.buf[:len(self.buf) - (0 if final else partial_tail(self.buf, self.inner[1]))]
                name, args, ok = self.fmt.body(body, done, self.m, self.params)
                if not ok and self.index is None:  # not a call: the text as written, read again as content
                    opened = self.inner[0] if not self.outer else self.outer[0] + self.block + self.inner[0]
                    self._content(content, self.m.restore(opened + body), False)
                    self.buf = self.buf[len(body):]
                    self.state = "text"
                    continue
                if name is not None and self.index is None:
                    self.index, self.calls = self.calls, self.calls + 1
                    own = self.fmt.call_id(body, self.m) if self.fmt.call_id else None
                    cid = own if own and own not in self.ids else new_call_id()  # (ids stay unique in an answer)
                    self.ids.add(cid)
                    deltas.append(ToolCallDelta(self.index, cid, name, ""))
                if self.index is not None:
                    self._arguments(deltas, args, done)
                if not done:
                    break
                self.buf = self.buf[e + len(self.inner[1]):] if e >= 0 else ""
                self.state = "outer" if self.outer else "text"
                self._reset()
        return "".join(content), deltas

    def _close_block(self, content: list[str], end: str) -> None:
        """A block of calls ended: one without a call is content, as the model wrote it."""
        if self.calls == self.block_calls:
            self._content(content, self.m.restore(self.outer[0] + self.block + end), False)
        self.block = ""

    def _arguments(self, deltas: list[ToolCallDelta], args: str, done: bool) -> None:
        if not args.startswith(self.sent_args):
            # the final reading differs from what was streamed (the model wrote the wrapper out of order): the
            # streamed pieces stand
            log.warning("tool call %d: arguments read %r after streaming %r", self.index, args, self.sent_args)
            return
        more = args[len(self.sent_args):]
        if not more:
            return
        self.sent_args = args
        if deltas and deltas[-1].index == self.index:
            deltas[-1].arguments += more
        else:
            deltas.append(ToolCallDelta(self.index, arguments=more))
