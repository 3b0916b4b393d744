"""OpenTelemetry through `cbserve serve`: a real OTLP/HTTP exporter posting to a collector on 127.0.0.1;
each HTTP request's span is the parent of its choices' engine spans."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.server.conftest import Server


class Collector:
    """An OTLP/HTTP trace receiver: it keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def test_http_span_parents_the_engine_spans_of_its_choices(model_dir, tmp_path, collector) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_SERVICE_NAME": "cbserve-test"}
    srv = Server(model_dir, tmp_path, {"block_size": 16, "num_blocks": 128}, env=env)
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": "Once upon a time", "max_tokens": 4, "n": 2, "seed": 1})  # fmt: skip
        assert r.status_code == 200, r.text
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                "stream": True}) as s:  # fmt: skip
            assert s.status_code == 200 and "[DONE]" in s.read().decode()
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "logit_bias": {"5": "a"}})
        assert bad.status_code == 400
    finally:
        assert srv.stop() == 0  # the exporter flushes at exit
    http = {s.span_id: s for s in collector.spans if not s.name.startswith("cbserve.")}
    engine = [s for s in collector.spans if s.name == "cbserve.request"]
    by_parent: dict[bytes, list] = {}
    for s in engine:
        by_parent.setdefault(s.parent_span_id, []).append(s)
    completion = next(s for s in http.values() if s.name.startswith("completion "))
    chat = next(s for s in http.values() if s.name.startswith("chat "))
    assert len(by_parent[completion.span_id]) == 2  # n=2: one engine span per choice
    assert len(by_parent[chat.span_id]) == 1
    assert all(s.trace_id == completion.trace_id for s in by_parent[completion.span_id])
    assert set(by_parent) == {completion.span_id, chat.span_id}  # the warm-up is not traced
    assert len(http) == 2  # the refused request never reached the engine: no span
