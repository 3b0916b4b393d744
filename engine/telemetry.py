"""Engine-level OpenTelemetry: a span per engine request and per `generate_batch`, and metrics that
mirror the server's Prometheus ones.

Only `opentelemetry-api` is used (`pip install 'cbserve[otel]'`): spans and measurements go to the
global TracerProvider / MeterProvider the application installs (none installed: the API's no-ops).
Without opentelemetry every call here is a no-op behind one module-level flag, `ENABLED`.

Spans (tracer "cbserve.engine"):
  cbserve.generate_batch   one per call, current while it runs; cbserve.num_prompts,
                           cbserve.num_sequences, gen_ai.usage.input_tokens / output_tokens
  cbserve.request          one per sequence (each of num_return_sequences too), recorded when it
                           finishes, aborts or fails, from its own timestamps. Its parent is the span
                           current where it was made (`LLMEngine.make_request`: generate_batch's span,
                           or a caller's span around `manager.add_request`). Events queued, scheduled
                           (prefill starts), first_token, finished; attributes cbserve.request_id,
                           gen_ai.request.max_tokens / temperature / top_p / top_k,
                           gen_ai.usage.input_tokens / output_tokens, gen_ai.response.finish_reasons,
                           cbserve.prefix_cached_tokens, cbserve.preemptions, cbserve.queue_s,
                           cbserve.prefill_s, cbserve.decode_s; status ERROR with the error if failed.
Metrics (meter "cbserve.engine"), recorded when a request ends:
  cbserve.prompt_tokens          counter {token}    prompt tokens (siblings of n > 1 add none)
  cbserve.generation_tokens      counter {token}    generated tokens
  cbserve.requests               counter {request}  ended requests, attribute finish_reason
  cbserve.time_to_first_token    histogram s        created -> first token
  cbserve.time_per_output_token  histogram s        first -> last token, per later token (>= 2 tokens)
  cbserve.e2e_request_latency    histogram s        created -> finished
  cbserve.request_queue_time     histogram s        created -> first scheduled
Requests whose `otel_context` is None (built without make_request, the manager's warm-up) are skipped.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from engine.request import RequestStatus, child_id

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics, trace
except ImportError:  # the `otel` extra is not installed
    ENABLED = False
else:
    ENABLED = True
    _tracer = trace.get_tracer("cbserve.engine")
    _meter = metrics.get_meter("cbserve.engine")
    _prompt_tokens = _meter.create_counter("cbserve.prompt_tokens", "{token}", "Prompt tokens of ended requests.")
    _generation_tokens = _meter.create_counter("cbserve.generation_tokens", "{token}", "Generated tokens.")
    _requests = _meter.create_counter("cbserve.requests", "{request}", "Ended requests by finish reason.")
    _ttft = _meter.create_histogram("cbserve.time_to_first_token", "s", "Time to first token.")
    _tpot = _meter.create_histogram("cbserve.time_per_output_token", "s", "Time per token after the first.")
    _e2e = _meter.create_histogram("cbserve.e2e_request_latency", "s", "End-to-end request latency.")
    _queue = _meter.create_histogram("cbserve.request_queue_time", "s", "Time waiting before the first step.")

_EPOCH_NS = time.time_ns() - time.perf_counter_ns()  # perf_counter seconds -> epoch nanoseconds
_CHILD = child_id("", 0)[:-1]  # "__child#": in the ids of the siblings forked for n > 1


def _ns(t: float) -> int:
    return _EPOCH_NS + round(t * 1e9)


def current_context() -> Any:
    """The context a request made now records its span under (None: telemetry is off)."""
    return otel_context.get_current() if ENABLED else None


def request_finished(req) -> None:
    """Record an ended (finished, aborted or failed) request: its span and its metrics."""
    if not ENABLED or req.otel_context is None:
        return
    created, scheduled, first = req.created_time, req.scheduled_time, req.first_token_time
    end = req.finished_time if req.finished_time is not None else time.perf_counter()
    reason = req.finish_reason or "unknown"
    s = req.sampling
    attrs: dict[str, Any] = {
        "cbserve.request_id": req.request_id,
        "gen_ai.request.max_tokens": req.max_new_tokens,
        "gen_ai.request.temperature": s.temperature,
        "gen_ai.usage.input_tokens": req.num_prompt_tokens,
        "gen_ai.usage.output_tokens": req.num_generated,
        "gen_ai.response.finish_reasons": [reason],
        "cbserve.prefix_cached_tokens": req.num_cached_tokens,
        "cbserve.preemptions": req.num_preemptions,
    }
    if s.top_p < 1.0:
        attrs["gen_ai.request.top_p"] = s.top_p
    if s.top_k:
        attrs["gen_ai.request.top_k"] = s.top_k
    if scheduled is not None:
        attrs["cbserve.queue_s"] = scheduled - created
        if first is not None:
            attrs["cbserve.prefill_s"] = first - scheduled
    if first is not None:
        attrs["cbserve.decode_s"] = end - first
    span = _tracer.start_span("cbserve.request", context=req.otel_context, start_time=_ns(created), attributes=attrs)
    for name, t in (("queued", created), ("scheduled", scheduled), ("first_token", first), ("finished", end)):
        if t is not None:
            span.add_event(name, timestamp=_ns(t))
    if req.status == RequestStatus.FAILED:
        span.set_status(trace.Status(trace.StatusCode.ERROR, req.error))
    span.end(end_time=_ns(end))

    if _CHILD not in req.request_id:
        _prompt_tokens.add(req.num_prompt_tokens)
    _generation_tokens.add(req.num_generated)
    _requests.add(1, {"finish_reason": reason})
    _e2e.record(end - created)
    if scheduled is not None:
        _queue.record(scheduled - created)
    if first is not None:
        _ttft.record(first - created)
        if req.num_generated > 1:
            _tpot.record((end - first) / (req.num_generated - 1))


def traced_batch(fn):
    """Decorates `generate_batch`: a "cbserve.generate_batch" span, current while it runs, so the
    spans of its requests are its children."""

    @functools.wraps(fn)
    def wrapper(model, inputs, *args, **kwargs):
        if not ENABLED:
            return fn(model, inputs, *args, **kwargs)
        with _tracer.start_as_current_span("cbserve.generate_batch", attributes={"cbserve.num_prompts": len(inputs)}) as span:
            result = fn(model, inputs, *args, **kwargs)
            span.set_attributes({
                "cbserve.num_sequences": len(result),
                "gen_ai.usage.input_tokens": sum(len(o.prompt_ids) for r, o in result.items() if _CHILD not in r),
                "gen_ai.usage.output_tokens": sum(len(o.generated_tokens) for o in result.values()),
            })  # fmt: skip
            return result

    return wrapper
