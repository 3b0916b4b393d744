"""Every kind of bad input gets its status and an OpenAI-shaped body; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
CASES = [
    # (path, body (dict, or raw str), status, param)
    (C, "{not json", 400, None),
    (C, "[1, 2]", 400, None),
    (C, {}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": [1, 2, 99999]}, 400, "prompt"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "n": 1000}, 400, "n"),
    (C, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    (C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (C, {"prompt": "x", "stop": 5}, 400, "stop"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "x", "seed": 1.5}, 400, "seed"),
    (C, {"prompt": "x " * 5000, "max_tokens": 5}, 400, "prompt"),  # beyond the model's context
    (C, {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),  # beyond the cache
    (C, {"prompt": "x", "model": "other-model"}, 404, "model"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": "yes"}, 400, "logprobs"),
    (CHAT, {"messages": MSG, "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[f"{p}-{i}" for i, (p, *_) in enumerate(CASES)])
def test_bad_input_gets_an_openai_error(server, path, body, status, param) -> None:
    if isinstance(body, str):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    # and the server still serves
    ok = httpx.post(server.url + C, json={"prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200


def test_request_id_is_echoed(server) -> None:
    r = httpx.post(server.url + C, json={"prompt": "x", "max_tokens": 1}, headers={"x-request-id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.post(server.url + C, json={"prompt": 5}, headers={"x-request-id": "bad-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"


def test_tokenize_and_detokenize_round_trip(server) -> None:
    ids = httpx.post(server.url + "/tokenize", json={"prompt": "The capital of France"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 4096
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text.endswith("The capital of France")


REFUSALS = [  # structured output and tools: tests/server/test_structured_output.py
    (CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"messages": MSG, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    (C, {"prompt": "x", "best_of": 2}, "best_of"),
    (C, {"prompt": "x", "suffix": "end"}, "suffix"),
    (C, {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSALS)
def test_what_cbserve_cannot_honour_is_refused_naming_the_field(server, path, body, param) -> None:
    r = httpx.post(server.url + path, json={**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_no_op_values_and_unknown_fields_are_accepted(server) -> None:
    for path, body in [(C, {"prompt": "x", "response_format": {"type": "text"}, "best_of": 1, "user": "u1",
                            "some_new_field": 1}),
                       (CHAT, {"messages": MSG, "tool_choice": "none", "store": False, "metadata": {"a": "b"}})]:  # fmt: skip
        r = httpx.post(server.url + path, json={**body, "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert "ignoring the request field 'some_new_field'" in server.log.read_text()
