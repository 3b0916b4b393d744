"""No input yields a 500: 1,200 generated malformed requests at every route of a real server.

Each body is a valid one with one to three fields (known or not) set to a hostile value (wrong
types, huge and non-finite numbers, lone surrogates, deep nesting, long strings), or raw bytes that
are not JSON at all. Every answer must be a 2xx (the mutation happened to be valid) or a 4xx with
OpenAI's error JSON; the server must still serve a normal request afterwards.
"""

from __future__ import annotations

import json
import random

import httpx

ROUTES = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6]},
}
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "logit_bias",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids", "min_tokens",
          "ignore_eos", "model", "tokens", "add_special_tokens", "user", "unknown_field"]  # fmt: skip
# raw JSON texts: what json.dumps cannot write (NaN, lone surrogates, depth) included
VALUES = ["null", "true", "false", "0", "-1", "1.5", "-0.0", str(2**70), str(-(2**70)), "1e308", "1e999", "NaN",
          "Infinity", "-Infinity", '""', '"x"', '"\\ud800"', '"a\\udfffb"', json.dumps("x" * 20000), "[]",
          "[null]", "[[[]]]", "{}", '{"a": 1}', "[" * 3000 + "]" * 3000, "[" * 100000 + "]" * 100000,
          json.dumps(list(range(2000))), "[-1]", f"[{2**40}]", '[{"role": "user"}]',
          '[{"role": "user", "content": "\\ud800"}]', '[{"role": 5, "content": "x"}]',
          '[{"role": "user", "content": [{"type": "image_url"}]}]', '{"include_usage": "yes"}',
          '{"5": NaN}', '{"-3": 1}', '["\\udc00"]', '[[1, 2], [3, "x"]]']  # fmt: skip
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


def test_a_thousand_malformed_requests_get_4xx_never_500(server):
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for path, raw in bodies(1200):
            r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:300])
            if r.status_code >= 400:
                error = r.json()["error"]
                assert isinstance(error["message"], str) and error["type"], (path, raw[:300], r.text[:300])
        for path in ROUTES:  # the wrong method and unknown routes are OpenAI errors too
            assert client.get(path).json()["error"]["code"] == "method_not_allowed"
        assert client.post("/v2/nothing", json={}).json()["error"]["code"] == "not_found"
        ok = client.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert statuses.get(400, 0) > 600  # most mutations are invalid; the rest were valid by chance
