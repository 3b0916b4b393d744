"""Locust users that stream completions from an OpenAI-compatible endpoint and time every token.

Configured by environment variables (the runner, `python -m loadtest`, sets them):
  LOADTEST_OUT          folder for requests.jsonl (one line of raw timings per request)
  LOADTEST_ENDPOINT     "chat" or "completions"
  LOADTEST_MODEL        model name to send (optional)
  LOADTEST_INPUT_LEN    prompt length in words: N or LOW:HIGH
  LOADTEST_OUTPUT_LEN   output tokens: N or LOW:HIGH (sent with ignore_eos so they hold)
  LOADTEST_SHARED_PREFIX  words of a prefix every prompt shares (prefix caching), 0 = none
  LOADTEST_RATE         > 0: open loop, seeded Poisson arrivals at this many requests/s (one user sends them)
  LOADTEST_MAX_IN_FLIGHT  open loop: an arrival finding this many requests unanswered is dropped (default 256)
  LOADTEST_SHAPE        "steps:1,2,4@10" (users per step, seconds per step) or "ramp:1-8@30"
  LOADTEST_SEED         seed of the prompt sequence (the same seed sends every target the same prompts)
  LOADTEST_TEMPERATURE  every request's temperature (default 0: greedy)
  LOADTEST_API_KEY      sent as `Authorization: Bearer ...` when set

TTFT, ITL, TPOT and end-to-end latency are fired as custom Locust events (request_type METRIC);
output tokens come from the usage chunk, not from counting chunks.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import gevent
import gevent.pool
from locust import HttpUser, LoadTestShape, constant, events, task
from locust.user.task import LOCUST_STATE_STOPPING
from urllib3 import PoolManager

from loadtest.arrivals import OpenLoopTally, poisson_arrivals
from loadtest.dataset import LengthSpec, PromptSource
from loadtest.target import auth_headers

OUT = Path(os.environ.get("LOADTEST_OUT", "."))
ENDPOINT = os.environ.get("LOADTEST_ENDPOINT", "chat")
MODEL = os.environ.get("LOADTEST_MODEL") or None
RATE = float(os.environ.get("LOADTEST_RATE", "0") or 0)
MAX_IN_FLIGHT = int(os.environ.get("LOADTEST_MAX_IN_FLIGHT", "256") or 256)
SEED = int(os.environ.get("LOADTEST_SEED", "0") or 0)
TEMPERATURE = float(os.environ.get("LOADTEST_TEMPERATURE", "0") or 0)  # 0: greedy
HEADERS = auth_headers(os.environ.get("LOADTEST_API_KEY"))
SOURCE = PromptSource(
    LengthSpec.parse(os.environ.get("LOADTEST_INPUT_LEN", "64:192"), "--input-len"),
    LengthSpec.parse(os.environ.get("LOADTEST_OUTPUT_LEN", "64"), "--output-len"),
    shared_prefix=int(os.environ.get("LOADTEST_SHARED_PREFIX", "0") or 0),
    seed=SEED,
)
_lock = threading.Lock()
_log = None
_in_flight = 0
_max_in_flight = 0
_open_loop: OpenLoopTally | None = None
_schedule_claimed = False


def _record(row: dict) -> None:
    global _log
    with _lock:
        if _log is None:
            OUT.mkdir(parents=True, exist_ok=True)
            _log = (OUT / "requests.jsonl").open("a")
        _log.write(json.dumps(row) + "\n")
        _log.flush()


def _fire(env, name: str, ms: float, length: int = 0) -> None:
    env.events.request.fire(request_type="METRIC", name=name, response_time=ms, response_length=length,
                            exception=None, context={})  # fmt: skip


def _sse_events(response):
    """Parsed `data:` payloads of an SSE response, as they arrive."""
    buffer = b""
    for piece in response.iter_content(chunk_size=None):
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:].decode()


class LLMUser(HttpUser):
    wait_time = constant(0)
    if RATE > 0:  # the open loop's one user holds up to MAX_IN_FLIGHT connections at once
        pool_manager = PoolManager(maxsize=MAX_IN_FLIGHT)

    def _body(self, prompt: str, max_tokens: int) -> tuple[str, dict]:
        body = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True, "temperature": TEMPERATURE}  # fmt: skip
        if MODEL:
            body["model"] = MODEL
        if ENDPOINT == "chat":
            return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {**body, "prompt": prompt}

    def one_request(self, prompt: str, max_tokens: int) -> None:
        global _in_flight, _max_in_flight
        path, body = self._body(prompt, max_tokens)
        with _lock:
            _in_flight += 1
            _max_in_flight = max(_max_in_flight, _in_flight)
        start_wall, start = time.time(), time.perf_counter()
        stamps: list[float] = []
        usage, error = None, None
        try:
            with self.client.post(path, json=body, headers=HEADERS, stream=True, catch_response=True,
                                  name=path) as resp:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    resp.failure(error)
                else:
                    for data in _sse_events(resp):
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = chunk["error"].get("message", "error")
                            break
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for c in chunk.get("choices", []):
                            piece = c.get("delta", {}).get("content") if ENDPOINT == "chat" else c.get("text")
                            if piece:
                                stamps.append(time.perf_counter())
                    if error or usage is None:
                        resp.failure(error or "no usage chunk")
                        error = error or "no usage chunk"
                    else:
                        resp.success()
        except Exception as exc:  # connection errors: a failed request, never a dead user
            error = f"{type(exc).__name__}: {exc}"
        finally:
            with _lock:
                _in_flight -= 1
        end = time.perf_counter()
        row = {"start": start_wall, "ok": error is None, "error": error, "endpoint": path,
               "prompt_words": len(prompt.split()), "max_tokens": max_tokens,
               "users": self.environment.runner.user_count if self.environment.runner else None}  # fmt: skip
        if error is None:
            out_tokens = usage["completion_tokens"]
            ttft = (stamps[0] - start) * 1000 if stamps else (end - start) * 1000
            e2e = (end - start) * 1000
            itl = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]
            tpot = (e2e - ttft) / (out_tokens - 1) if out_tokens > 1 else 0.0
            row.update(prompt_tokens=usage["prompt_tokens"], output_tokens=out_tokens, ttft_ms=ttft, e2e_ms=e2e,
                       tpot_ms=tpot, itl_ms=itl)  # fmt: skip
            env = self.environment
            _fire(env, "ttft", ttft)
            _fire(env, "e2e", e2e, out_tokens)
            _fire(env, "tpot", tpot)
            for gap in itl:
                _fire(env, "itl", gap)
        _record(row)

    @task
    def generate(self) -> None:
        if RATE <= 0:
            self.one_request(*SOURCE.next())  # closed loop: the next request when this one ends
        else:
            self.open_loop()

    def open_loop(self) -> None:
        """Send the seeded Poisson schedule until the run time is up, each request in its own greenlet
        (slow answers do not lower the offered load), then wait for the answers. One user does it;
        any other only idles."""
        global _open_loop, _schedule_claimed
        if _schedule_claimed:
            gevent.sleep(1)
            return
        _schedule_claimed = True
        options = self.environment.parsed_options
        horizon = float(getattr(options, "run_time", None) or "inf")
        _open_loop = tally = OpenLoopTally(RATE, MAX_IN_FLIGHT)
        group = gevent.pool.Group()
        start = time.perf_counter()
        tally.schedule_s = horizon
        for offset in poisson_arrivals(RATE, SEED):
            if offset >= horizon:
                break
            delay = start + offset - time.perf_counter()
            if delay > 0:
                gevent.sleep(delay)
            if self._state == LOCUST_STATE_STOPPING:  # Locust's clock ran out first
                # the schedule ran up to this arrival, the first not sent: not up to when this greenlet
                # woke, which a busy host delays past later arrivals that were never offered either
                tally.schedule_s = offset
                break
            prompt, max_tokens = SOURCE.next()  # drawn in arrival order: the same for every server
            if tally.arrival(len(group), time.perf_counter() - (start + offset)):
                group.spawn(self.one_request, prompt, max_tokens)
        group.join()


@events.quitting.add_listener
def _close(environment, **_kwargs) -> None:
    with _lock:
        if _log is not None:
            _log.flush()
    extra: dict = {"max_concurrent_requests": _max_in_flight}
    if _open_loop is not None:
        extra["open_loop"] = _open_loop.as_dict()
    (OUT / "locust_extra.json").write_text(json.dumps(extra))


_SHAPE = os.environ.get("LOADTEST_SHAPE", "")
if _SHAPE:

    class StepOrRampShape(LoadTestShape):
        """steps:1,2,4@10 runs 1, 2, then 4 users for 10 s each; ramp:1-8@30 goes from 1 to 8 users over 30 s."""

        def __init__(self) -> None:
            super().__init__()
            kind, _, spec = _SHAPE.partition(":")
            users, _, seconds = spec.partition("@")
            self.kind, self.seconds = kind, float(seconds)
            if kind == "steps":
                self.steps = [int(u) for u in users.split(",")]
            else:
                lo, hi = users.split("-")
                self.lo, self.hi = int(lo), int(hi)

        def tick(self):
            t = self.get_run_time()
            if self.kind == "steps":
                i = int(t // self.seconds)
                return None if i >= len(self.steps) else (self.steps[i], self.steps[i])
            if t > self.seconds:
                return None
            return max(1, round(self.lo + (self.hi - self.lo) * t / self.seconds)), 100
