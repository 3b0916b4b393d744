"""Disconnects, overload, metrics against usage, SIGTERM drain (must-shows 3-6)."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import signal
import threading
import time

import httpx

from tests.server.conftest import Server

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def test_metrics_token_counters_equal_reported_usage(server) -> None:
    """The file's first test: the shared server's counters still count from its start."""
    usage = {"prompt_tokens": 0, "completion_tokens": 0}
    reasons: collections.Counter[str] = collections.Counter()
    calls = [("/v1/completions", {"prompt": "a b c", "max_tokens": 7}),
             ("/v1/completions", {"prompt": ["x y", "z"], "max_tokens": 5, "n": 2}),  # sampled: may end on EOS
             ("/v1/completions", {"prompt": "stop here", "max_tokens": 20, "stop": ["e"]}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})]
    for path, body in calls:
        r = httpx.post(server.url + path, json=body, timeout=60).json()
        for k in usage:
            usage[k] += r["usage"][k]
        reasons.update(c["finish_reason"] for c in r["choices"])
    m = server.metrics()
    assert m["cbserve:prompt_tokens_total"] == usage["prompt_tokens"]
    assert m["cbserve:generation_tokens_total"] == usage["completion_tokens"]
    assert sum(reasons.values()) == 7
    for reason, count in reasons.items():
        assert m[f"cbserve:request_success_total{{finished_reason={reason}}}"] == count
    assert m["cbserve:time_to_first_token_seconds_count"] == 7


def test_disconnected_streams_are_cancelled_and_free_their_blocks(server) -> None:
    started = threading.Barrier(21)

    def drop_mid_stream() -> int:  # (3000 tokens: none ends by itself while the others reach the barrier)
        with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions",
                                                      json={**LONG, "max_tokens": 3000, "stream": True}) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break
            started.wait(60)  # all 20 are mid-stream before anyone leaves
            return got  # leaving the with-blocks closes the connection mid-stream

    with cf.ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(drop_mid_stream) for _ in range(20)]
        started.wait(60)
        assert all(f.result() == 3 for f in futures)
    m = server.wait_for(lambda m: m["cbserve:num_requests_running"] == 0 and m["cbserve:num_requests_waiting"] == 0)
    assert m["cbserve:kv_cache_usage_perc"] == 0.0
    assert m["cbserve:request_success_total{finished_reason=abort}"] >= 20


def test_disconnected_non_streaming_request_is_cancelled(server) -> None:
    with httpx.Client(timeout=0.5) as c:
        try:
            c.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 3000})
        except httpx.ReadTimeout:
            pass  # the client gave up and closed the connection
    server.wait_for(lambda m: m["cbserve:num_requests_running"] == 0 and m["cbserve:kv_cache_usage_perc"] == 0.0)


def test_endpoint_pickers_read_the_live_gauges_under_vllms_names(server) -> None:
    """The Gateway API Inference Extension's pickers read vllm:num_requests_waiting, vllm:num_requests_running
    and vllm:kv_cache_usage_perc (older ones vllm:gpu_cache_usage_perc): the same values as cbserve's, in
    one scrape, while a request runs."""
    pairs = {"vllm:num_requests_running": "cbserve:num_requests_running",
             "vllm:num_requests_waiting": "cbserve:num_requests_waiting",
             "vllm:kv_cache_usage_perc": "cbserve:kv_cache_usage_perc",
             "vllm:gpu_cache_usage_perc": "cbserve:kv_cache_usage_perc"}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions",
                                                  json={**LONG, "max_tokens": 3000, "stream": True}) as r:
        lines = r.iter_lines()  # held: a generator dropped mid-stream closes the response
        for line in lines:
            if line.startswith("data: {"):
                break  # running: the stream stays open until the with-block closes it
        m = server.metrics()
        assert m["vllm:num_requests_running"] >= 1 and m["vllm:kv_cache_usage_perc"] > 0
        assert {v: m[v] for v in pairs} == {v: m[cb] for v, cb in pairs.items()}
        assert m["cbserve:prefill_token_cap"] >= 1 and "vllm:prefill_token_cap" not in m  # cbserve's own gauge
    m = server.wait_for(lambda m: m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0)
    assert {v: m[v] for v in pairs} == {v: m[cb] for v, cb in pairs.items()}


def test_metrics_page_restricted_by_name_and_in_openmetrics_on_request(server) -> None:
    """As prometheus_client's own exposition: `name[]` query parameters keep only the samples they name
    (the load test's once-a-second sampler reads three gauges, not every histogram), none keeps all;
    an OpenMetrics Accept header gets OpenMetrics."""
    from prometheus_client.parser import text_string_to_metric_families

    from loadtest.metrics_scrape import GAUGES, scrape

    def names(text: str) -> set[str]:
        return {s.name for f in text_string_to_metric_families(text) for s in f.samples}

    httpx.post(server.url + "/v1/completions", json={"prompt": "a b", "max_tokens": 2}, timeout=60).raise_for_status()
    asked = ["cbserve:num_requests_running", "vllm:kv_cache_usage_perc"]
    r = httpx.get(server.url + "/metrics", params={"name[]": asked})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert names(r.text) == set(asked)
    full = httpx.get(server.url + "/metrics").text
    assert len(full) > 20 * len(r.text) and "cbserve:time_to_first_token_seconds_bucket" in names(full)
    assert set(scrape(server.url, only=GAUGES)) == {
        "cbserve:num_requests_running", "cbserve:num_requests_waiting", "cbserve:kv_cache_usage_perc",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}  # fmt: skip
    om = httpx.get(server.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text") and om.text.endswith("# EOF\n")


def test_overload_gets_503_with_retry_after_and_admitted_requests_complete(model_dir, tmp_path) -> None:
    srv = Server(model_dir, tmp_path, {"block_size": 16, "num_blocks": 256, "max_queue_size": 2,
                                       "max_requests_per_batch": 1})
    try:
        def call(_):
            return httpx.post(srv.url + "/v1/completions", json={**LONG, "max_tokens": 150}, timeout=120)

        with cf.ThreadPoolExecutor(10) as pool:
            responses = list(pool.map(call, range(10)))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 3
        for r in responses:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
            else:
                assert r.json()["usage"]["completion_tokens"] == 150
        m = srv.metrics()
        assert m["cbserve:admission_rejections_total{reason=queue_full}"] == codes.count(503)
    finally:
        assert srv.stop() == 0


def test_sigterm_drains_with_the_listener_open_and_exits_0(model_dir, tmp_path) -> None:
    """While in-flight streams finish, the port stays open: /ready answers 503 "draining", /health
    200, a new request 503 with Retry-After; then the server exits 0 (docs/server.md)."""
    srv = Server(model_dir, tmp_path, {"block_size": 16, "num_blocks": 256})
    all_streaming = threading.Barrier(5)

    def in_flight() -> tuple[int, str]:
        with httpx.Client(timeout=120) as c, c.stream("POST", srv.url + "/v1/completions",
                                                      json={**LONG, "max_tokens": 1500, "stream": True}) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: {") and len(lines) == 0:
                    all_streaming.wait(60)  # every client has its first token before SIGTERM goes out
                lines.append(line)
            return r.status_code, lines[-2] if len(lines) > 1 else ""

    with cf.ThreadPoolExecutor(4) as pool, httpx.Client(timeout=10) as probe:
        futures = [pool.submit(in_flight) for _ in range(4)]
        all_streaming.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while (ready := probe.get(srv.url + "/ready")).status_code == 200:  # until the handler has run
            assert time.monotonic() < deadline, "still ready 10 s after SIGTERM"
        assert ready.status_code == 503 and ready.json() == {"status": "draining"}
        assert probe.get(srv.url + "/health").status_code == 200
        late = probe.post(srv.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert late.status_code == 503 and late.headers["retry-after"] and late.json()["error"]["message"]
        assert not any(f.done() for f in futures)  # all of this happened while the streams ran
        for f in futures:
            status, last = f.result()
            assert status == 200 and last == "data: [DONE]"
    assert srv.proc.wait(60) == 0
