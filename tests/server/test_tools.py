"""Tool calls in and out, without a server: the prompt a template gets, the calls parsed from text."""

from __future__ import annotations

import json

import pytest

from engine.server.protocol import parse_chat
from engine.server.tools import ToolRequest, ToolStream, parse_output, parse_tools
from engine.testing import build_test_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
AUTO = ToolRequest([WEATHER["function"]], "auto")
# a Qwen-style template: tools in the system turn, calls as <tool_call> blocks
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
         [("get_weather", {"city": "Paris"})]),  # Hermes, Qwen
        ('Let me check.<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
         '{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>', "Let me check.",
         [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})]),  # SmolLM2: a list
        ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "parameters": {"x": 1}}',
         None, [("a", {}), ("b", {"x": 1})]),  # two blocks, the last cut off by the end
        ("Paris is sunny.", "Paris is sunny.", None),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", None),  # nothing lost
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', None),
    ],
)  # fmt: skip
def test_auto_calls_are_parsed_from_the_text(text: str, content, calls) -> None:
    got_content, got_calls = parse_output(text, AUTO)
    assert got_content == content
    if calls is None:
        assert got_calls is None
    else:
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
        assert len({c["id"] for c in got_calls}) == len(got_calls)


def test_parallel_false_keeps_the_first_call() -> None:
    text = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]</tool_call>'
    _, calls = parse_output(text, ToolRequest([WEATHER["function"]], "auto", parallel=False))
    assert [c["function"]["name"] for c in calls] == ["a"]


def test_the_stream_holds_back_only_what_may_become_a_call() -> None:
    stream = ToolStream(AUTO)
    pieces = ["Sure", ", <to", "ol", "_c", "all>{\"name\": \"get_weather\", ", '"arguments": {"city": "X"}}', "</tool_call>"]
    out = [stream.feed(p) for p in pieces]
    assert "".join(out) == "Sure, " and out[1] == ", "  # "<to" waited, and never came out
    assert stream.finish() == "" and stream.calls[0]["function"]["name"] == "get_weather"
    plain = ToolStream(AUTO)
    assert [plain.feed(p) for p in ["a <", "b", " <tool"]] == ["a ", "<b", " "]
    assert plain.finish() == "<tool"  # an unfinished tag at the end is text


def test_forced_choices_hold_everything_and_parse_json() -> None:
    named = ToolStream(ToolRequest([WEATHER["function"]], "function", name="get_weather"))
    assert named.feed('{"city": ') == "" and named.feed('"Lima"}') == "" and named.finish() == ""
    assert json.loads(named.calls[0]["function"]["arguments"]) == {"city": "Lima"}
    required = ToolStream(ToolRequest([WEATHER["function"]], "required"))
    required.feed('[{"name": "get_weather", "arguments": {"city": "Lima"}}')
    assert required.finish() == '[{"name": "get_weather", "arguments": {"city": "Lima"}}'  # cut by max_tokens
    assert required.calls is None


def test_the_required_grammar_lists_every_tool_with_its_parameters() -> None:
    tools = parse_tools({"tools": [WEATHER, {"type": "function", "function": {"name": "now"}}], "tool_choice": "required",
                         "parallel_tool_calls": False})  # fmt: skip
    schema = tools.structured_output().json
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "now"]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert parse_tools({"tool_choice": "auto"}) is None


def test_tools_reach_a_template_that_takes_them() -> None:
    tok = build_test_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]  # fmt: skip
    req = parse_chat({"messages": messages, "tools": [WEATHER]}, tok, 512)
    prompt = tok.decode(req.prompts[0])
    assert "Tools: get_weather" in prompt
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in prompt  # arguments as an object


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    tok = build_test_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]  # fmt: skip
    prompt = tok.decode(parse_chat({"messages": messages, "tools": [WEATHER]}, tok, 512).prompts[0])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou may call functions")
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>' in prompt
    assert "<|im_start|>tool\n21 C" in prompt
    plain = tok.decode(parse_chat({"messages": messages, "tools": [WEATHER], "tool_choice": "none"}, tok, 512).prompts[0])
    assert "<tools>" not in plain and "<tool_call>" in plain  # no tools offered; the history stays
