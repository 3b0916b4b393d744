"""A real server against an attacker's requests (issue 36): every count and size limit is checked
before the work it bounds, no internal text reaches a client, every refusal is one log line with
the request id, and while the hostile requests are handled another user's stream keeps its pace."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import re
import signal
import threading
import time

import httpx
import pytest

from engine.server.constraints import ConstraintCompiler
from engine.server.errors import APIError
from engine.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from engine.structured import MAX_ALTERNATIVES, MAX_CHOICES, GrammarCompiler, client_error, count_alternatives
from engine.testing import build_test_tokenizer
from tests.server.conftest import Server
from tests.server.pacing import StreamPacer

INTERNAL = re.compile(r"Traceback|panic|backtrace|\b\w+(Error|Exception)\b|File \"")


def lark(alternatives: int) -> str:
    return "start: " + " | ".join(f'"a{i}"' for i in range(alternatives))


def gbnf(alternatives: int) -> str:
    return "root ::= " + " | ".join(f'"a{i}"' for i in range(alternatives))


def assert_refused(r: httpx.Response, status: int, words: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert words in error["message"], error
    assert not INTERNAL.search(error["message"]), error
    if param is not None:
        assert error["param"] == param, error
    return error


# (what, path, body, status, words in the message, param)
HOSTILE = [
    ("500,000 one-letter prompts", "/v1/completions", {"prompt": ["a"] * 500_000, "max_tokens": 1}, 400,
     "makes 500000 generations", "prompt"),
    ("800,000 one-token prompts", "/v1/completions", {"prompt": [[5]] * 800_000, "max_tokens": 1}, 400,
     "holds 800002 JSON arrays and objects; at most 65536", None),
    ("60,000 one-token prompts", "/v1/completions", {"prompt": [[5]] * 60_000, "max_tokens": 1}, 400,
     "makes 60000 generations", "prompt"),
    ("2,001 choices", "/v1/completions", {"prompt": "x", "guided_choice": [f"c{i}" for i in range(2001)]}, 400,
     f"at most {MAX_CHOICES}", "guided_choice"),
    ("100,000 choices", "/v1/completions", {"prompt": "x", "guided_choice": [f"choice {i:06}" for i in range(100_000)]},
     400, f"at most {MAX_CHOICES}", "guided_choice"),
    ("a Lark grammar of 50,000 alternatives", "/v1/completions", {"prompt": "x", "guided_grammar": lark(50_000)}, 400,
     "at most 65536 are allowed", "guided_grammar"),
    ("a GBNF grammar of 2,001 alternatives, streamed", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "guided_grammar": gbnf(2001), "stream": True}, 400,
     f"at most {MAX_ALTERNATIVES} are allowed", "guided_grammar"),
    (f"{MAX_STOP_STRINGS + 1} stop strings", "/v1/completions",
     {"prompt": "x", "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], "max_tokens": 1}, 400,
     f"at most {MAX_STOP_STRINGS}", "stop"),
    ("300,000 stop strings, 16 samples", "/v1/completions",
     {"prompt": "x", "stop": [f"{i:08}" for i in range(300_000)], "n": 16, "max_tokens": 100}, 400,
     f"at most {MAX_STOP_STRINGS}", "stop"),
    (f"{MAX_STOP_CHARS + 1} characters of stop strings", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stop": ["x" * MAX_STOP_CHARS, "y"]}, 400,
     f"at most {MAX_STOP_CHARS} in all", "stop"),
    (f"{MAX_STOP_STRINGS} stop strings of {MAX_STOP_CHARS // MAX_STOP_STRINGS} characters, 16 samples (served)",
     "/v1/completions", {"prompt": "x", "n": 16, "max_tokens": 64, "ignore_eos": True,
                         "stop": [f"{i:0{MAX_STOP_CHARS // MAX_STOP_STRINGS}}" for i in range(MAX_STOP_STRINGS)]},
     200, None, None),
    ("a lone byte's token 256 times, 16 samples (served)", "/v1/completions",
     {"prompt": "x", "n": 16, "max_tokens": 256, "ignore_eos": True, "logit_bias": {"98": 100}}, 200, None, None),
    ("1.3 M ids to detokenize", "/detokenize", {"tokens": [5] * 1_300_000}, 400, "more than 4096 ids", "tokens"),
    ("a context of ids to detokenize, the last outside the vocabulary", "/detokenize",
     {"tokens": [5] * 4095 + [10**6]}, 400, "outside the vocabulary", "tokens"),
]  # fmt: skip


def test_hostile_requests_are_refused_at_once_while_another_stream_keeps_its_pace(server, quiet_collector):
    """Each hostile request is answered within seconds (the count and caps are checked before any
    tokenising or compiling), and another user's stream never waits more than 0.3 s (or 0.1 s over
    its own worst gap alone, on a loaded machine) for its next chunk while it is handled."""
    encoded = [(what, path, json.dumps(body, separators=(",", ":")).encode(), status, words, param)
               for what, path, body, status, words, param in HOSTILE]  # before the clocks start  # fmt: skip
    windows = []
    with StreamPacer(server.url) as pacer, httpx.Client(base_url=server.url, timeout=120) as client:
        pacer.wait_for(400)
        usual = pacer.worst()  # this machine's worst gap with nothing else to do
        for what, path, raw, status, words, param in encoded:
            started = time.monotonic()
            r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
            ended = time.monotonic()
            windows.append((what, started, ended))
            if words is None:
                assert r.status_code == status, (what, r.text[:300])
            else:
                assert_refused(r, status, words, param)
            assert ended - started < 5, (what, ended - started)
        pacer.wait_for(len(pacer.gaps) + 5)  # the stream goes on after the last of them
    limit = max(0.3, usual + 0.1)
    worst = {what: round(pacer.worst(start, end), 3) for what, start, end in windows}
    assert max(worst.values()) < limit, (usual, worst)


def test_six_requests_of_100000_choices_at_once_are_each_refused_in_seconds(server):
    body = json.dumps({"prompt": "x", "guided_choice": [f"choice {i:06}" for i in range(100_000)]}).encode()

    def send(_) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                       timeout=120)  # fmt: skip
        return r, time.monotonic() - started

    with cf.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(send, range(6)))
    for r, took in answers:
        assert_refused(r, 400, f"at most {MAX_CHOICES}", "guided_choice")
        assert took < 10, took


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value, words", [
    ("guided_choice", [f"c{i}" for i in range(MAX_CHOICES + 1)], "strings"),
    ("guided_grammar", lark(MAX_ALTERNATIVES + 2), "alternatives"),
    ("guided_grammar", gbnf(MAX_ALTERNATIVES + 2), "alternatives"),
])  # fmt: skip
def test_a_constraint_over_its_caps_is_a_400_before_the_stream_begins(server, field, value, words, stream):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, field: value,
                                                         "stream": stream}, timeout=60)  # fmt: skip
    assert_refused(r, 400, words, field)


def test_constraints_at_their_caps_are_served(server):
    body = {"prompt": "x", "max_tokens": 8, "temperature": 0}
    choices = [f"c{i}" for i in range(MAX_CHOICES)]
    r = httpx.post(server.url + "/v1/completions", json={**body, "guided_choice": choices}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in choices, r.text[:300]
    r = httpx.post(server.url + "/v1/completions", json={**body, "guided_grammar": lark(MAX_ALTERNATIVES)}, timeout=60)
    assert r.status_code == 200 and re.fullmatch(r"a\d+", r.json()["choices"][0]["text"]), r.text[:300]


def test_text_that_is_no_text_is_a_400_on_every_route(server):
    raw = b'{"prompt": "\\udfff"}'
    for path in ("/tokenize", "/v1/completions"):
        r = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"})
        assert_refused(r, 400, "lone UTF-16 surrogate", "prompt")
    raw = b'{"messages": [{"role": "user", "content": "\\udfff"}]}'
    for path in ("/tokenize", "/v1/chat/completions"):
        r = httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"})
        assert_refused(r, 400, "lone UTF-16 surrogate", "messages")
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x", "add_special_tokens": "yes"})
    assert_refused(r, 400, "must be a boolean", "add_special_tokens")


def test_roles_and_content_are_checked(server):
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.url + path, json={"messages": [{"role": "hacker", "content": "hi"}], "max_tokens": 2})
        assert_refused(r, 400, "role must be one of", "messages")
        r = httpx.post(server.url + path, json={"messages": [{"role": "user"}], "max_tokens": 2})
        assert_refused(r, 400, "has no 'content'", "messages")
    for role in ("system", "developer", "user"):
        r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": role, "content": "hi"}]})
        assert r.status_code == 200, r.text


def test_request_ids_are_plain_tokens_on_every_response_and_in_every_refusal_line(server):
    for hostile in ("x" * 8000, "a\tb", "<script>alert(1)</script>", "id with spaces"):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                       headers={"x-request-id": hostile})  # fmt: skip
        assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]), r.headers
    calls = [("post", "/v1/completions", {"prompt": "hi", "max_tokens": 1}, 200),
             ("post", "/tokenize", {"prompt": "hi"}, 200), ("post", "/detokenize", {"tokens": [5]}, 200),
             ("post", "/v1/chat/completions", {"messages": [{"role": "hacker", "content": "x"}]}, 400),
             ("post", "/detokenize", {"tokens": ["x"]}, 400), ("get", "/v1/nothing", None, 404),
             ("get", "/v1/models", None, 200)]  # fmt: skip
    for k, (method, path, body, status) in enumerate(calls):
        rid = f"client-id_{k}.test:1"
        r = httpx.request(method, server.url + path, json=body, headers={"x-request-id": rid})
        assert r.status_code == status and r.headers["x-request-id"] == rid, (path, r.status_code, r.headers)
    log = server.log.read_text()
    for k, (method, path, _, status) in enumerate(calls):
        lines = [line for line in log.splitlines() if f"request client-id_{k}.test:1:" in line]
        if status < 400:
            assert not lines, lines
        else:
            (line,) = lines
            assert f" WARNING cbserve.server: request client-id_{k}.test:1: {method.upper()} {path} refused with " \
                   f"{status}: " in line, line  # fmt: skip
    assert "Traceback" not in log


def test_the_server_still_serves_and_logged_no_traceback(server):
    """Runs after the rest of this module's tests (pytest keeps the file's order)."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "still here", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    log = server.log.read_text()
    assert "Traceback" not in log and "panic" not in log.lower().replace("panicked", ""), log[-3000:]


# -- the drain ------------------------------------------------------------------------------------
def test_sigterm_past_the_drain_timeout_ends_every_stream_with_an_error_event_and_done(model_dir, tmp_path):
    srv = Server(model_dir, tmp_path, {"block_size": 16, "num_blocks": 512}, extra_args=["--drain-timeout", "1"])
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}
    all_running = threading.Barrier(4)

    def stream(k: int) -> list[str]:
        with httpx.Client(timeout=120) as c, c.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True},
                                                      headers={"x-request-id": f"cut-{k}"}) as r:  # fmt: skip
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: {") and not lines:
                    all_running.wait(60)  # every stream has its first chunk before SIGTERM goes out
                if line:
                    lines.append(line)
            return lines

    def whole() -> httpx.Response:
        return httpx.post(srv.url + "/v1/completions", json=body, headers={"x-request-id": "cut-whole"}, timeout=120)

    with cf.ThreadPoolExecutor(4) as pool:
        single = pool.submit(whole)
        srv.wait_for(lambda m: m["cbserve:num_requests_running"] == 1)  # admitted, and generating
        streams = [pool.submit(stream, k) for k in range(3)]
        all_running.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        for f in streams:
            lines = f.result()
            assert lines[-1] == "data: [DONE]", lines[-3:]
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert error["code"] == "shutting_down" and error["type"] == "service_unavailable", error
            assert len(lines) > 3  # tokens came before the cut
        r = single.result()
    assert_refused(r, 503, "shutting down")
    assert r.json()["error"]["code"] == "shutting_down"
    assert srv.proc.wait(60) == 0
    log = srv.log.read_text()
    cut = [line for line in log.splitlines() if "cut at shutdown" in line]
    assert sorted(line.split("request ")[1].split(":")[0] for line in cut) == ["cut-0", "cut-1", "cut-2", "cut-whole"]
    assert all(" WARNING " in line for line in cut)
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


# -- the pieces -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grammars() -> GrammarCompiler:
    return GrammarCompiler(build_test_tokenizer(512), 512, [2])


def test_a_compile_past_its_budget_is_a_400_and_holds_its_slot_until_it_ends(grammars):
    """A real llguidance compile (a 1,000-alternative grammar) against a budget of a millisecond: 400
    at the budget; the one slot stays taken until the compile really ends, so a second request waits
    for it (and gets 503 when that is longer than the budget). The grammar's compile is held open
    until the second request has its answer: how long a compile takes depends on the host."""
    release = threading.Event()

    def compile_held(spec):
        try:
            return grammars.compile(spec)
        finally:
            if "grammar" in spec:
                release.wait(30)

    async def run() -> tuple[APIError, APIError, object]:
        gate = ConstraintCompiler(compile_held, slots=1, budget=0.001)
        try:
            with pytest.raises(APIError) as slow:
                await gate.compile({"grammar": lark(MAX_ALTERNATIVES)}, "guided_grammar")
            with pytest.raises(APIError) as busy:
                await gate.compile({"regex": "[a-z]+"}, "guided_regex")
        finally:
            release.set()
        gate.budget = 30
        return slow.value, busy.value, await gate.compile({"regex": "[a-z]+"}, "guided_regex")

    slow, busy, grammar = asyncio.run(run())
    assert slow.status == 400 and slow.code == "constraint_too_complex" and slow.param == "guided_grammar"
    assert busy.status == 503 and busy.headers["Retry-After"] == "1"
    assert grammar.matcher() is not None


def test_a_grammar_that_fails_at_its_first_step_is_refused_when_compiled():
    """llguidance builds a choice of 2,001 strings, then fails at the first token (a parser row of
    2,002 items): compiling takes that first step, so the error comes at admission."""
    import llguidance.hf
    from llguidance import LLMatcher, grammar_from

    from engine.structured import _first_step

    tokenizer = llguidance.hf.from_tokenizer(build_test_tokenizer(512), n_vocab=512, eos_token=[2])
    matcher = LLMatcher(tokenizer, grammar_from("choice", json.dumps([f"c{i}" for i in range(2001)])), log_level=0)
    assert not matcher.is_error()  # built fine
    with pytest.raises(ValueError, match="Current row has 2002 items; max is 2000"):
        _first_step(matcher)


def test_alternatives_are_counted_outside_literals_regexes_and_comments():
    assert count_alternatives('a: "|" | /x|y/ | b // c | d\n# e | f\n| "\\"|" g') == 3
    assert count_alternatives(lark(10)) == 9


def test_a_panic_reaches_no_client():
    panic = "panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n   0: <unknown>"
    assert client_error(panic) == "the grammar engine cannot build this constraint (too large or too complex)"
    assert client_error("at 1(8): unknown name\n<state>\nTokens: x") == "at 1(8): unknown name"


def test_a_failed_choice_answers_without_internal_text(caplog):
    """A grammar failing mid-generation is the request's (400 with llguidance's line, no parser
    state); any other engine error is the server's: a 500 naming only the request id, the cause in
    the log."""
    from engine.server.generation import Choice, Generation
    from engine.server.protocol import GenerationRequest

    req = GenerationRequest(kind="completion", model=None, prompts=[[5]], structured_param="guided_grammar")
    gen = Generation(None, None, req, None, None, request_id="rid-1")  # what _failure reads, nothing else
    choice = Choice(0, "engine-0", [5])
    grammar = gen._failure(choice, "structured output: Parser Error: Current row has 2002 items; max is 2000\n"
                                   "<state>\nTokens: ⟦c⟧")  # fmt: skip
    assert grammar.status == 400 and grammar.code == "structured_output_failed" and grammar.param == "guided_grammar"
    assert grammar.message == ("the structured output constraint failed after 0 tokens: Parser Error: Current row "
                               "has 2002 items; max is 2000")  # fmt: skip
    with caplog.at_level("ERROR", logger="cbserve.server"):
        internal = gen._failure(choice, "RuntimeError: CUDA error: device-side assert triggered\nTraceback ...")
    assert internal.status == 500 and internal.type == "server_error"
    assert internal.message == "generation failed (request rid-1); the server log has the cause"
    assert "rid-1" in caplog.text and "device-side assert" in caplog.text
