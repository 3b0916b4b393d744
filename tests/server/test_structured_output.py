"""Structured output and tool calls through `cbserve serve` (real uvicorn) with the official
openai client: every output parses and validates, tool calls come back as `tool_calls`, and a
constraint the grammar engine refuses is a 400 naming its field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                   "maximum": 14}, "indoor": {"type": "boolean"}},
    "required": ["city", "days", "indoor"],
    "additionalProperties": False,
}  # fmt: skip
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
MSG = [{"role": "user", "content": "Plan a short trip."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_outputs_parse_and_validate(client) -> None:
    out = client.chat.completions.create(
        model="tiny-llama", messages=MSG, n=4, temperature=1.0, seed=3, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}},
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_and_streaming_equal_non_streaming(client) -> None:
    kwargs = dict(model="tiny-llama", messages=MSG, max_tokens=60, temperature=0, response_format={"type": "json_object"})
    full = client.chat.completions.create(**kwargs).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs))
    assert streamed == full.message.content
    assert full.finish_reason == "length" or isinstance(json.loads(full.message.content), dict)


def test_vllm_guided_fields_on_completions(client) -> None:
    choice = client.completions.create(model="tiny-llama", prompt="Answer:", max_tokens=10, n=3, temperature=1.0,
                                       seed=1, extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]})
    assert {c.text for c in choice.choices} <= {"alpha", "beta", "gamma delta"}
    regex = client.completions.create(model="tiny-llama", prompt="Code:", max_tokens=10, temperature=0,
                                      extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"})  # fmt: skip
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", regex.choices[0].text)
    structured = client.completions.create(model="tiny-llama", prompt="Data:", max_tokens=120, temperature=0,
                                           extra_body={"structured_outputs": {"json": SCHEMA}})  # fmt: skip
    jsonschema.validate(json.loads(structured.choices[0].text), SCHEMA)


def test_named_tool_choice_returns_a_valid_call(client) -> None:
    out = client.chat.completions.create(
        model="tiny-llama", messages=MSG, tools=[WEATHER, TIME], max_tokens=60, temperature=1.0, seed=2,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_streams_valid_calls(client, parallel: bool) -> None:
    kwargs = dict(model="tiny-llama", messages=MSG, tools=[WEATHER, TIME], tool_choice="required", max_tokens=150,
                  temperature=1.0, seed=3, parallel_tool_calls=parallel)  # fmt: skip
    full = client.chat.completions.create(**kwargs).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.tool_calls
    if not parallel:
        assert len(full.message.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in full.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls]  # fmt: skip
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_conversation_with_earlier_calls_and_tool_results(client) -> None:
    messages = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    out = client.chat.completions.create(model="tiny-llama", messages=messages, tools=[WEATHER], max_tokens=8,
                                         temperature=0)  # fmt: skip
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model="tiny-llama", messages=messages, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0)  # fmt: skip
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
         "response_format", "wat"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "must be"),
        ({"guided_regex": "a("}, "guided_regex", "unclosed group"),
        ({"guided_choice": "abc"}, "guided_choice", "list of strings"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "not several"),
        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs", "takes the keys"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not in 'tools'"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "tools[0]"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_json": {}}, "guided_json", "cannot be combined"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
         "messages", "not JSON"),
        ({"functions": [{"name": "f"}]}, "functions", "use 'tools'"),
    ],
)
def test_bad_constraints_and_tools_are_400_naming_the_field(server, body: dict, param: str, words: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_tools_on_completions_are_refused(server) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "tools": [WEATHER]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
