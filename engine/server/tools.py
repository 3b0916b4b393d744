"""Tool calling for the chat endpoint: tools into the prompt, tool calls out of the text.

`tool_choice` decides how a call comes out:
- "auto" (the default with tools): the model writes calls in the Hermes style that Qwen, Hermes
  and SmolLM2 were trained on, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (or a
  JSON list of such objects inside one tag); the text is parsed, and text before the first tag
  stays `content`. Text that does not parse stays content: nothing is lost.
- "required": decoding is constrained to a JSON list of calls, `[{"name", "arguments"}]`, each
  name one of the tools and its arguments valid against that tool's `parameters` schema.
- a named function: decoding is constrained to that function's `parameters` schema; the output
  is its arguments (as vLLM and OpenAI do, the choice then finishes with "stop").
- "none": the tools stay out of the prompt and nothing is parsed.

Tools reach the chat template as `tools=`. A template that never mentions `tools` (the embedded
SmolLM2-135M's, for one) gets them in a system message instead, in the format above.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.server.errors import bad
from engine.structured import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.S)


@dataclass
class ToolRequest:
    """A chat request's tools and what `tool_choice` asks of them."""

    functions: list[dict[str, Any]]  # each {"name", "description"?, "parameters"?}, as given
    choice: str  # "auto", "required", or "function" (then `name`)
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def template_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions]

    def structured_output(self) -> StructuredOutput | None:
        """The grammar that forces a call ("required", a named function); None for "auto"."""
        if self.choice == "function":
            return StructuredOutput(json=_parameters(self._function(self.name)))
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for f in self.functions]  # fmt: skip
            schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput(json=schema)
        return None

    def _function(self, name: str | None) -> dict[str, Any]:
        return next(f for f in self.functions if f["name"] == name)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def parse_tools(body: dict) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body; None when no tool is in play."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", "'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise bad("tools", "'tools' must be a list of {'type': 'function', 'function': {...}}")
    if len(tools) > MAX_TOOLS:
        raise bad("tools", f"'tools' has {len(tools)} tools; at most {MAX_TOOLS} are allowed")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad("tools", f"tools[{i}].function.description must be a string")
        functions.append({k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad("tools", "two tools have the same name")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "'parallel_tool_calls' must be a boolean")
    if choice is None or choice == "auto":
        return ToolRequest(functions, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolRequest(functions, "required", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad("tool_choice", f"'tool_choice' names the function {name!r}, which is not in 'tools'")
        return ToolRequest(functions, "function", name=name, parallel=parallel)
    raise bad("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")  # fmt: skip


def template_takes_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(template.values())
    return isinstance(template, str) and "tools" in template


def system_prompt(tools: ToolRequest) -> str:
    """The tools in a system message, for a chat template that does not take them."""
    listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.functions)
    return (
        "You may call functions to answer. These are the functions, as JSON schemas:\n"
        f"<tools>\n{listed}\n</tools>\n"
        f'To call functions, reply with {OPEN}[{{"name": "<function name>", "arguments": {{<arguments>}}}}]{CLOSE} '
        "and nothing else; a function's result comes back in a message from the tool."
    )


def without_template_tools(conversation: list[dict[str, Any]], tools: ToolRequest | None) -> list[dict[str, Any]]:
    """The conversation for a template without tools: the tools (if any) in the first system
    message, and earlier assistant calls written back as text in the format the model is asked to use."""
    out = []
    for message in conversation:
        calls = message.get("tool_calls")
        if calls:
            listed = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
            text = (message.get("content") or "") + OPEN + json.dumps(listed, ensure_ascii=False) + CLOSE
            message = {"role": message["role"], "content": text}
        else:
            message = {"role": message["role"], "content": message.get("content") or ""}
        out.append(message)
    if tools is None:
        return out
    prompt = system_prompt(tools)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def message_tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant message's earlier `tool_calls`, checked, with JSON-text arguments parsed (chat
    templates render them as objects)."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise bad("messages", f"{where} must be a list")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad("messages", f"{where} entries must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise bad("messages", f"{where}: the arguments of {fn['name']!r} are not JSON") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


# -- the output ---------------------------------------------------------------------------------
def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _calls_of(value: Any) -> list[dict[str, Any]] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(_call(item["name"], args))
    return calls or None


def parse_output(text: str, tools: ToolRequest) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) of a finished choice's text. Text that holds no parsable call is
    returned whole as content with no calls."""
    if tools.choice == "function":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return text, None
        return None, [_call(tools.name, text)]
    if tools.choice == "required":
        try:
            calls = _calls_of(json.loads(text))
        except json.JSONDecodeError:
            calls = None
        return (None, calls) if calls else (text, None)
    calls = []
    for block in _BLOCK.findall(text):
        try:
            found = _calls_of(json.loads(block))
        except json.JSONDecodeError:
            found = None
        if found is None:
            return text, None
        calls += found
    if not calls:
        return text, None
    if not tools.parallel:
        calls = calls[:1]
    content = text[: text.index(OPEN)].strip()
    return content or None, calls


@dataclass
class ToolStream:
    """One choice's text on its way out: content streams as usual until a tool call may be
    starting, then is held until the end, where the calls are parsed."""

    tools: ToolRequest
    held: str = ""  # text not streamed yet
    content: str = ""  # text streamed
    in_call: bool = False
    calls: list[dict[str, Any]] | None = field(default=None)

    def feed(self, text: str) -> str:
        """What of `text` may go out now."""
        if self.tools.forced or self.in_call:
            self.held += text
            return ""
        pending = self.held + text
        at = pending.find(OPEN)
        if at >= 0:
            self.in_call, self.held = True, pending[at:]
            return self._out(pending[:at])
        keep = next((k for k in range(min(len(OPEN) - 1, len(pending)), 0, -1) if OPEN.startswith(pending[-k:])), 0)
        self.held = pending[len(pending) - keep :]
        return self._out(pending[: len(pending) - keep])

    def _out(self, text: str) -> str:
        self.content += text
        return text

    def finish(self) -> str:
        """At the end: the calls are parsed into `calls`; returns the text still to go out (all of
        it when nothing parsed)."""
        content, calls = parse_output(self.content + self.held, self.tools)
        held, self.held = self.held, ""
        if calls is None:
            return held
        self.calls = calls
        return ""
