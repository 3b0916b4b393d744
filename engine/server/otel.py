"""OpenTelemetry: one span per HTTP request, with queue, prefill and decode as events, and the
engine's `cbserve.request` spans (engine/telemetry.py) of its choices as its children.

On only when the `otel` extra is installed and OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; otherwise every call here is a no-op.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _tracer() -> Any:
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "cbserve")}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)  # global: the engine's spans (engine/telemetry.py) go there too
    return provider.get_tracer("cbserve")


def request_span(gen) -> Any:
    tracer = _tracer()
    if tracer is None:
        return None
    return tracer.start_span(f"{gen.req.kind} {gen.id}", attributes={"cbserve.choices": gen.req.num_choices})


@contextlib.contextmanager
def current(span) -> Iterator[None]:
    """`span` is the current span inside the block (and in threads started with asyncio.to_thread
    from it): the engine requests made there record their spans as its children."""
    if span is None:
        yield
        return
    from opentelemetry import trace

    with trace.use_span(span, end_on_exit=False):
        yield


def end_span(span, gen, error: str | None = None) -> None:
    if span is None:
        return
    timings = gen.timings()
    for name in ("queue_s", "prefill_s", "decode_s", "time_to_first_token_s"):
        if timings.get(name) is not None:
            span.add_event(name.removesuffix("_s"), {"seconds": timings[name]})
    if error is not None:
        from opentelemetry import trace

        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    usage = gen.usage()
    span.set_attribute("gen_ai.usage.input_tokens", usage["prompt_tokens"])
    span.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
    span.end()
