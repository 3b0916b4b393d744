"""No input yields a 500: 1,200 generated malformed requests at every route of a real server.

Each body is a valid one with one to three fields (known or not) set to a hostile value (wrong
types, huge and non-finite numbers, lone surrogates, deep nesting, long strings, constraints over
their caps, unknown roles, messages without content), or raw bytes that are not JSON at all; some
carry a hostile `x-request-id`. Then issue 36's large shapes, once each. Every answer must be a 2xx
(the mutation happened to be valid) or a 4xx with OpenAI's error JSON whose message carries nothing
internal (no traceback, panic or exception class), and the x-request-id of every answer is a plain
token; the server must still serve a normal request afterwards, and its log holds no traceback.
"""

from __future__ import annotations

import json
import random
import re

import httpx

from engine.structured import MAX_ALTERNATIVES, MAX_CHOICES

ROUTES = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6]},
}
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "logit_bias",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids", "min_tokens",
          "ignore_eos", "model", "tokens", "add_special_tokens", "user", "unknown_field", "guided_choice",
          "guided_grammar", "guided_regex", "guided_json", "response_format", "structured_outputs", "tools",
          "tool_choice"]  # fmt: skip
# raw JSON texts: what json.dumps cannot write (NaN, lone surrogates, depth) included
VALUES = ["null", "true", "false", "0", "-1", "1.5", "-0.0", str(2**70), str(-(2**70)), "1e308", "1e999", "NaN",
          "Infinity", "-Infinity", '""', '"x"', '"\\ud800"', '"a\\udfffb"', json.dumps("x" * 20000), "[]",
          "[null]", "[[[]]]", "{}", '{"a": 1}', "[" * 3000 + "]" * 3000, "[" * 100000 + "]" * 100000,
          json.dumps(list(range(2000))), "[-1]", f"[{2**40}]", '[{"role": "user"}]',
          '[{"role": "user", "content": "\\ud800"}]', '[{"role": 5, "content": "x"}]',
          '[{"role": "user", "content": [{"type": "image_url"}]}]', '{"include_usage": "yes"}',
          '{"5": NaN}', '{"-3": 1}', '["\\udc00"]', '[[1, 2], [3, "x"]]', '"\\udfff"',
          json.dumps([f"c{i}" for i in range(MAX_CHOICES + 1)]),
          json.dumps("start: " + " | ".join(f'"a{i}"' for i in range(MAX_ALTERNATIVES + 2))),
          json.dumps("root ::= " + " | ".join(f'"a{i}"' for i in range(MAX_ALTERNATIVES + 2))),
          json.dumps("start: " + "x" * 70000), '{"choice": ["a", "b"]}', '{"grammar": "start: foo"}',
          '[{"role": "hacker", "content": "x"}]', '[{"role": "user"}]', '[{"role": "assistant", "content": null}]',
          json.dumps([{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]), '"required"',
          json.dumps(["a"] * 5000), json.dumps([[5]] * 5000)]  # fmt: skip
REQUEST_IDS = ["x" * 8000, "a\tb", "<b>markup</b>", "ok-id", ""]
# issue 36's large shapes (megabytes each), sent once
LARGE = [("/v1/completions", {"prompt": ["a"] * 500_000, "max_tokens": 1}),
         ("/v1/completions", {"prompt": [[5]] * 800_000, "max_tokens": 1}),
         ("/v1/completions", {"prompt": "x", "guided_choice": [f"choice {i:06}" for i in range(100_000)]}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                                   "guided_grammar": "start: " + " | ".join(f'"a{i}"' for i in range(50_000))}),
         ("/detokenize", {"tokens": [5] * 1_300_000})]  # fmt: skip
INTERNAL = re.compile(r"Traceback|panic|backtrace|\b\w+(Error|Exception)\b|File \"")
RAW_BODIES = [b"", b"{", b"[1, 2", b"\xff\xfe\x00", b"null", b"42", b'"just a string"', b"{\"prompt\": \"\xc3\x28\"}",
              b"{} trailing", b"\x00" * 100]  # fmt: skip


def bodies(count: int, seed: int = 0):
    rng = random.Random(seed)
    for i in range(count):
        path = rng.choice(list(ROUTES))
        if i % 12 == 0:
            yield path, rng.choice(RAW_BODIES)
            continue
        body = {k: json.dumps(v) for k, v in ROUTES[path].items()}
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(FIELDS)] = rng.choice(VALUES)
        yield path, ("{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in body.items()) + "}").encode()


def check(r: httpx.Response, path: str, raw: bytes) -> None:
    assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:300])
    assert re.fullmatch(r"[A-Za-z0-9_.:/+=@-]{1,128}", r.headers["x-request-id"]), r.headers["x-request-id"][:300]
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["type"], (path, raw[:300], r.text[:300])
        assert not INTERNAL.search(error["message"]), (path, raw[:300], error)


def test_a_thousand_malformed_requests_get_4xx_never_500(server):
    statuses: dict[int, int] = {}
    rng = random.Random(1)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for path, raw in bodies(1200):
            headers = {"Content-Type": "application/json"}
            if rng.random() < 0.1:
                headers["x-request-id"] = rng.choice(REQUEST_IDS)
            r = client.post(path, content=raw, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            check(r, path, raw)
        for path, body in LARGE:
            raw = json.dumps(body, separators=(",", ":")).encode()
            r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, r.text[:300])
            check(r, path, raw)
        for path in ROUTES:  # the wrong method and unknown routes are OpenAI errors too
            assert client.get(path).json()["error"]["code"] == "method_not_allowed"
        assert client.post("/v2/nothing", json={}).json()["error"]["code"] == "not_found"
        ok = client.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert statuses.get(400, 0) > 600  # most mutations are invalid; the rest were valid by chance
    assert "Traceback" not in server.log.read_text()
