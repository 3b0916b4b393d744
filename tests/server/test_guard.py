"""A `cbserve serve` safe to expose: API keys, body size and pace, requests that can never fit, 404
and 405 as OpenAI JSON, and large inputs tokenised off the event loop. All against a real server."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from engine.testing import save_test_model
from tests.server.conftest import Server

KEYS = ("first-key", "second-key")
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("guarded"), {"block_size": 16, "num_blocks": 512},
                 extra_args=["--max-body-bytes", str(LIMIT), "--body-timeout", "1"],
                 env={"CBSERVE_API_KEY": ",".join(KEYS), "CBSERVE_MAX_QUEUE_SIZE": "8"})  # fmt: skip
    yield srv
    assert srv.stop() == 0


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if code is not None:
        assert error["code"] == code
    return error


def test_every_route_but_the_probes_needs_one_of_the_keys(guarded):
    for key in KEYS:
        assert httpx.get(guarded.url + "/v1/models", headers=auth(key)).status_code == 200
    for headers in ({}, auth("wrong"), {"Authorization": KEYS[0]}, auth(KEYS[0] + "x"), {"Authorization": "Basic x"}):
        r = httpx.get(guarded.url + "/v1/models", headers=headers)
        assert_openai_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/tokenize", {"prompt": "hi"}),
                       ("/detokenize", {"tokens": [5]})):  # fmt: skip
        assert_openai_error(httpx.post(guarded.url + path, json=body), 401, "invalid_api_key")
        assert httpx.post(guarded.url + path, json=body, headers=auth(KEYS[1])).status_code == 200
    for path in ("/health", "/ready", "/metrics"):  # probes and scrapers carry no key
        assert httpx.get(guarded.url + path).status_code == 200


def test_a_body_over_the_limit_gets_413_before_it_is_read(guarded):
    big = b'{"prompt": "' + b"x" * LIMIT + b'"}'
    r = httpx.post(guarded.url + "/v1/completions", content=big, headers=auth(KEYS[0]))
    assert_openai_error(r, 413, "request_too_large")
    # chunked, without a Content-Length: refused once what arrived passes the limit
    r = httpx.post(guarded.url + "/v1/completions", content=iter([big[:40000], big[40000:]]), headers=auth(KEYS[0]))
    assert_openai_error(r, 413, "request_too_large")
    # a Content-Length promising more than the limit: 413 with nothing sent after the headers
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {100 * LIMIT}\r\n\r\n".encode())  # fmt: skip
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    ok = httpx.post(guarded.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth(KEYS[0]))
    assert ok.status_code == 200


def test_a_half_sent_body_times_out_with_408(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ".encode())  # fmt: skip
        started = time.monotonic()
        answer = s.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - started < 5  # --body-timeout 1
    assert httpx.get(guarded.url + "/health").status_code == 200


def test_a_request_that_can_never_fit_the_queue_gets_400_not_503(guarded):
    body = {"prompt": ["one", "two", "three"], "n": 3, "max_tokens": 2}  # 9 generations, the queue holds 8
    error = assert_openai_error(httpx.post(guarded.url + "/v1/completions", json=body, headers=auth(KEYS[0])), 400)
    assert error["param"] == "n" and "at most 8" in error["message"]
    body["n"] = 2  # 6 fit
    assert httpx.post(guarded.url + "/v1/completions", json=body, headers=auth(KEYS[0])).status_code == 200


def test_unknown_routes_and_methods_are_openai_errors(guarded):
    r = httpx.get(guarded.url + "/v1/nothing-here", headers=auth(KEYS[0]))
    assert_openai_error(r, 404, "not_found")
    r = httpx.get(guarded.url + "/v1/completions", headers=auth(KEYS[0]))
    assert_openai_error(r, 405, "method_not_allowed")
    assert "POST" in r.headers["allow"]


@pytest.fixture(scope="module")
def slow_prefill(model_dir, tmp_path_factory):
    """The file's server without keys or a body limit: the abort test (first: it reads counters from
    zero), then the context and megabytes tests (a small max_batch_tokens changes nothing they check)."""
    srv = Server(model_dir, tmp_path_factory.mktemp("slow-prefill"),
                 {"block_size": 16, "num_blocks": 512, "max_batch_tokens": 16})  # a 1,500-token prompt: ~94 steps
    yield srv
    assert srv.stop() == 0


def test_a_stream_whose_client_leaves_during_prefill_is_aborted_before_its_first_token(slow_prefill):
    body = json.dumps({"prompt": [7] * 1500, "max_tokens": 50, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", slow_prefill.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
        assert s.recv(4096).startswith(b"HTTP/1.1 200")  # the stream began; its prompt is being prefilled
    # gone before any token: the request is aborted in its prefill (the handler's own watcher, and
    # Starlette's under uvicorn's ASGI 2.3), not at the first write
    m = slow_prefill.wait_for(lambda m: m.get("cbserve:request_success_total{finished_reason=abort}", 0) == 1)
    assert m["cbserve:generation_tokens_total"] == 0, m
    r = httpx.post(slow_prefill.url + "/v1/completions", json={"prompt": "still serving", "max_tokens": 2})
    assert r.status_code == 200


def test_prompt_plus_max_tokens_over_the_context_is_refused_in_vllms_words(slow_prefill):
    context = httpx.get(slow_prefill.url + "/v1/models").json()["data"][0]["max_model_len"]
    r = httpx.post(slow_prefill.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": context})
    error = assert_openai_error(r, 400, "context_length_exceeded")
    assert error["param"] == "max_tokens"
    assert error["message"] == (
        f"This model's maximum context length is {context} tokens. However, you requested {context + 3} tokens "
        f"(3 in the prompt, {context} in the completion). Please reduce the length of the prompt or completion."
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": context}
    error = assert_openai_error(httpx.post(slow_prefill.url + "/v1/chat/completions", json=chat), 400, "context_length_exceeded")
    assert "in the messages" in error["message"]
    r = httpx.post(slow_prefill.url + "/v1/completions", json={"prompt": [5] * context, "max_tokens": 1})
    assert "your request has" in assert_openai_error(r, 400, "context_length_exceeded")["message"]
    fits = httpx.post(slow_prefill.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": context - 3},
                      timeout=120)  # thousands of tokens: what is checked is that it fits, not how fast it runs
    assert fits.status_code == 200


@pytest.mark.serial  # /health's bound is 100 ms over its unloaded time: another xdist worker broke it once (102 ms)
def test_megabytes_of_text_are_refused_before_tokenising_and_nothing_stalls(slow_prefill):
    """3.5 MB of text can hold no context's worth of tokens: every route answers 400 before
    tokenising it, and while such bodies arrive and are parsed (in a worker thread), /health keeps
    answering within 100 ms of its usual time."""
    text = "cbserve tokenises large inputs in a worker thread. " * 70000
    requests = [("/v1/completions", {"prompt": text}), ("/tokenize", {"prompt": text}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})] * 3  # fmt: skip
    answers: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(base_url=slow_prefill.url, timeout=120) as client:
            answers.extend(client.post(path, json=body) for path, body in requests)

    with httpx.Client(base_url=slow_prefill.url, timeout=30) as probe:
        usual = min(_timed(probe) for _ in range(20))
        worker = threading.Thread(target=send)
        worker.start()
        gaps = []
        while worker.is_alive():
            gaps.append(_timed(probe))
        worker.join()
    assert len(answers) == len(requests)
    for r in answers:
        assert "more than" in assert_openai_error(r, 400, "context_length_exceeded")["message"]
    assert len(gaps) >= 3 and max(gaps) < usual + 0.1, (usual, sorted(gaps)[-5:])


def _timed(client: httpx.Client) -> float:
    started = time.monotonic()
    assert client.get("/health").status_code == 200
    return time.monotonic() - started


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """A model whose context (2M positions) admits a 4 MB prompt past the length check: it is
    tokenised (2.56M tokens of the test tokenizer), then refused for filling the context."""
    tmp = tmp_path_factory.mktemp("long-context")
    model = save_test_model(tmp / "long-llama", "llama", max_position_embeddings=1 << 21)
    srv = Server(model, tmp, {"block_size": 16, "num_blocks": 512}, extra_args=["--max-body-bytes", str(16 << 20)])
    yield srv
    assert srv.stop() == 0


@pytest.mark.serial  # its bounds are 100 ms over the unloaded times: another xdist worker breaks them
def test_a_4_mb_prompt_is_tokenised_while_a_stream_and_health_keep_their_pace(long_context, quiet_collector):
    """While a 4 MB prompt is tokenised (in the helper process, engine/server/tokenizing.py), a
    concurrent stream's inter-token gaps and /health stay within 100 ms of their usual times."""
    text = "cbserve tokenises large inputs in a helper process. " * 80000  # 4.2 MB
    url = long_context.url

    def stream_gaps(stop: threading.Event | None, max_tokens: int) -> list[float]:
        gaps, last = [], None
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                now = time.monotonic()
                if line.startswith("data: {"):
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                if stop is not None and stop.is_set():
                    break
        return gaps

    body = json.dumps({"prompt": text, "max_tokens": 1}).encode()  # encoded before the clocks start
    usual_gap = max(stream_gaps(None, 200))
    with httpx.Client(base_url=url, timeout=30) as probe:
        usual_health = min(_timed(probe) for _ in range(20))
        big: list[httpx.Response] = []
        done = threading.Event()

        def send() -> None:
            with httpx.Client(timeout=300) as c:
                big.append(c.post(url + "/v1/completions", content=body,
                                  headers={"Content-Type": "application/json"}))
            done.set()

        gaps_during: list[float] = []
        streamer = threading.Thread(target=lambda: gaps_during.extend(stream_gaps(done, 8000)))
        sender = threading.Thread(target=send)
        streamer.start()
        sender.start()
        health = []
        while not done.is_set():
            health.append(_timed(probe))
        sender.join()
        streamer.join()
    (r,) = big
    error = assert_openai_error(r, 400, None)
    assert "your request has 2560001 input tokens" in error["message"]  # tokenised (in the helper), then refused
    assert len(health) >= 10 and len(gaps_during) >= 10
    assert max(health) < usual_health + 0.1, (usual_health, sorted(health)[-5:])
    assert max(gaps_during) < usual_gap + 0.1, (usual_gap, sorted(gaps_during)[-5:])
