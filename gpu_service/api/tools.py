"""Tool calling, the request side: the tools a chat request offers, which of them it requires (tool_choice), the
history's assistant calls and tool results in the form chat templates read, and the calls the model makes as
they stream out (ToolCallDelta). The model's own call syntax, per family, is in tool_formats.py."""
from __future__ import annotations

import dataclasses
import json
import re
import uuid

from moe_core.errors import BadRequest

NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")  # OpenAI's function names, plus the dots and colons MCP tools use
MODES = ("none", "auto", "required")
MAX_TOOLS = 128


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"       # none | auto | required | function (name: which)
    name: str | None = None

    @property
    def forced(self) -> bool:
        """The answer must be a call (the grammar makes it one)."""
        return self.mode in ("required", "function")


@dataclasses.dataclass
class ToolCallDelta:
    """A piece of the index-th call of an answer: its first piece has the id and the name, the arguments (JSON
    text) come in pieces whose concatenation is the whole (as OpenAI streams delta.tool_calls)."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def check_tools(tools) -> list[dict]:
    """The request's tools in OpenAI's form, checked: [{"type": "function", "function": {"name", "description"?,
    "parameters"?, "strict"?}}] with distinct names and object schemas (what chat templates are given)."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest("tools", f"a list of at most {MAX_TOOLS} tools expected")
    out, seen = [], set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise BadRequest("tools", f"[{i}]: expected {{\"type\": \"function\", \"function\": {{...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise BadRequest("tools", f"[{i}].function.name: 1-64 characters of a-z, A-Z, 0-9, _ . : -, got {name!r}")
        if name in seen:
            raise BadRequest("tools", f"[{i}].function.name: {name!r} is given twice")
        seen.add(name)
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadRequest("tools", f"[{i}].function.parameters: a JSON schema object expected")
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise BadRequest("tools", f"[{i}].function.description: a string expected")
        fn = {"name": name, **({"description": desc} if desc is not None else {}), "parameters": params}
        if f.get("strict") is not None:
            fn["strict"] = bool(f["strict"])
        out.append({"type": "function", "function": fn})
    return out


def check_choice(choice: ToolChoice, tools: list[dict] | None) -> ToolChoice:
    if choice.mode not in MODES + ("function",):
        raise BadRequest("tool_choice", f"none, auto, required or a function, got {choice.mode!r}")
    if choice.forced and not tools:
        raise BadRequest("tool_choice", f"{choice.mode!r} needs tools")
    if choice.mode == "function" and choice.name not in {t["function"]["name"] for t in tools}:
        raise BadRequest("tool_choice", f"no tool named {choice.name!r} in tools")
    return choice


def parameters(tools: list[dict] | None) -> dict[str, dict]:
    """name -> the parameters' JSON schema."""
    return {t["function"]["name"]: t["function"]["parameters"] for t in tools or ()}


class Arguments(str):
    """A call's arguments as chat templates read them: the JSON text (DeepSeek-V3's template concatenates it to
    strings; Qwen's prints it when it is a string) that is also the object (GLM-4.5's and MiniMax-M2's iterate
    over .items(); gpt-oss's prints it with tojson, which text.py's filter writes as the object)."""

    def __new__(cls, obj: dict):
        s = super().__new__(cls, json.dumps(obj, ensure_ascii=False))
        s.obj = obj
        return s

    def items(self):
        return self.obj.items()

    def keys(self):
        return self.obj.keys()

    def values(self):
        return self.obj.values()

    def get(self, key, default=None):
        return self.obj.get(key, default)


def history_call(call, where: str) -> dict:
    """An assistant message's earlier call, as templates read it: {"id", "type": "function", "function": {"name",
    "arguments": Arguments}}."""
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise BadRequest("messages", f"{where}: expected {{\"function\": {{\"name\", \"arguments\"}}}}")
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise BadRequest("messages", f"{where}.function.arguments: not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise BadRequest("messages", f"{where}.function.arguments: a JSON object expected")
    return {"id": str(call.get("id") or new_call_id()), "type": "function",
            "function": {"name": f["name"], "arguments": Arguments(args)}}
