"""OpenTelemetry: one span per request, with queue, prefill and decode as events.

On only when the `otel` extra is installed and OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; otherwise every call here is a no-op.
"""

from __future__ import annotations

import os
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
    return provider.get_tracer("cbserve")


def request_span(gen) -> Any:
    tracer = _tracer()
    if tracer is None:
        return None
    return tracer.start_span(f"{gen.req.kind} {gen.id}", attributes={"cbserve.choices": gen.req.num_choices})


def end_span(span, gen) -> None:
    if span is None:
        return
    timings = gen.timings()
    for name in ("queue_s", "prefill_s", "decode_s", "time_to_first_token_s"):
        if timings.get(name) is not None:
            span.add_event(name.removesuffix("_s"), {"seconds": timings[name]})
    usage = gen.usage()
    span.set_attribute("gen_ai.usage.input_tokens", usage["prompt_tokens"])
    span.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
    span.end()
