"""Engine-level OpenTelemetry (engine/telemetry.py), read back through in-process exporters."""

from __future__ import annotations

import pytest

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, generate_batch, telemetry
from tests.engine.conftest import model_for, prompts_for, reference

CONFIG = ContinuousBatchingConfig(block_size=16, num_blocks=64)
EVENTS = ["queued", "scheduled", "first_token", "finished"]


@pytest.fixture(scope="module")
def otel():
    """The SDK's providers with in-memory exporters, installed as the global ones (OTel lets a
    process set them once), and shut down after this module so later tests keep nothing."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import Counter, Histogram, MeterProvider
    from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    reader = InMemoryMetricReader(
        preferred_temporality={Counter: AggregationTemporality.DELTA, Histogram: AggregationTemporality.DELTA}
    )
    tracer_provider, meter_provider = TracerProvider(), MeterProvider(metric_readers=[reader])
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    if trace.get_tracer_provider() is not tracer_provider or metrics.get_meter_provider() is not meter_provider:
        pytest.skip("another global OpenTelemetry provider was installed earlier in this process")
    yield exporter, reader
    tracer_provider.shutdown()
    meter_provider.shutdown()


@pytest.fixture
def spans(otel):
    """Clears what earlier tests recorded; returns a function giving this test's spans by name."""
    exporter, reader = otel
    exporter.clear()
    reader.get_metrics_data()  # delta temporality: the next collection has this test's measurements only
    return lambda name: [s for s in exporter.get_finished_spans() if s.name == name]


def measured(otel) -> dict[str, dict]:
    """{metric: {attributes: sum (counters) or count (histograms)}} since the last collection."""
    data = otel[1].get_metrics_data()
    found: dict[str, dict] = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            if sm.scope.name == "cbserve.engine":
                for m in sm.metrics:
                    for p in m.data.data_points:
                        value = p.count if hasattr(p, "count") else p.value
                        found.setdefault(m.name, {})[tuple(sorted(p.attributes.items()))] = value
    return found


@pytest.fixture
def manager(otel, spans):
    mgr = ContinuousBatchingManager(model_for("llama"), continuous_batching_config=CONFIG)
    mgr.warmup()
    assert spans("cbserve.request") == []  # the warm-up request is not traced
    mgr.start()
    yield mgr
    mgr.stop(block=True, timeout=30)


def test_generate_batch_span_parents_a_span_per_sequence_and_metrics_add_up(otel, spans) -> None:
    from opentelemetry.trace import StatusCode

    prompts = [list(p) for p in prompts_for()[:3]]
    out = generate_batch(model_for("llama"), prompts, continuous_batching_config=CONFIG, max_new_tokens=4,
                         ignore_eos=True, num_return_sequences=2, progress_bar=False)  # fmt: skip
    assert len(out) == 6
    [batch] = spans("cbserve.generate_batch")
    assert batch.attributes["cbserve.num_prompts"] == 3 and batch.attributes["cbserve.num_sequences"] == 6
    assert batch.attributes["gen_ai.usage.input_tokens"] == sum(map(len, prompts))
    assert batch.attributes["gen_ai.usage.output_tokens"] == 6 * 4
    reqs = {s.attributes["cbserve.request_id"]: s for s in spans("cbserve.request")}
    assert set(reqs) == set(out)
    for rid, span in reqs.items():
        o = out[rid]
        assert span.parent.span_id == batch.context.span_id and span.context.trace_id == batch.context.trace_id
        a = span.attributes
        assert a["gen_ai.usage.input_tokens"] == len(o.prompt_ids)
        assert a["gen_ai.usage.output_tokens"] == len(o.generated_tokens) == 4
        assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.response.finish_reasons"] == ("length",)
        assert min(a["cbserve.queue_s"], a["cbserve.prefill_s"], a["cbserve.decode_s"]) >= 0
        assert [e.name for e in span.events] == EVENTS
        times = [e.timestamp for e in span.events]
        assert span.start_time == times[0] <= times[1] <= times[2] <= times[3] == span.end_time
        assert span.status.status_code == StatusCode.UNSET

    got = measured(otel)
    assert got["cbserve.prompt_tokens"] == {(): sum(map(len, prompts))}  # once per prompt, not per sequence
    assert got["cbserve.generation_tokens"] == {(): sum(len(o.generated_tokens) for o in out.values())}
    assert got["cbserve.requests"] == {(("finish_reason", "length"),): 6}
    for name in ("time_to_first_token", "time_per_output_token", "e2e_request_latency", "request_queue_time"):
        assert got[f"cbserve.{name}"] == {(): 6}, name


def test_manager_request_span_is_a_child_of_the_callers_span(manager, spans) -> None:
    from opentelemetry import trace

    with trace.get_tracer("test").start_as_current_span("user") as user:
        rid = manager.add_request([5, 6, 7], max_new_tokens=4, ignore_eos=True)
    lone = manager.add_request([8, 9, 10], max_new_tokens=4, ignore_eos=True)
    assert manager.get_result(rid, timeout=60).is_finished() and manager.get_result(lone, timeout=60).is_finished()
    reqs = {s.attributes["cbserve.request_id"]: s for s in spans("cbserve.request")}
    assert reqs[rid].parent.span_id == user.get_span_context().span_id
    assert reqs[rid].context.trace_id == user.get_span_context().trace_id
    assert reqs[lone].parent is None  # added outside any span: a trace of its own


def test_cancelled_request_span_says_abort(manager, spans, otel) -> None:
    rid = manager.add_request([5, 6, 7], max_new_tokens=500, streaming=True, ignore_eos=True)
    assert manager.get_result(rid, timeout=60) is not None  # running: it produced a token
    manager.cancel_request(rid)
    last = list(manager.request_id_iter(rid))[-1]
    assert last.finish_reason == "abort"
    [span] = spans("cbserve.request")
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert span.attributes["gen_ai.usage.output_tokens"] == len(last.generated_tokens)
    assert [e.name for e in span.events] == EVENTS
    assert measured(otel)["cbserve.requests"] == {(("finish_reason", "abort"),): 1}


def test_failed_request_span_has_error_status(manager, spans, monkeypatch) -> None:
    from opentelemetry.trace import StatusCode

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(manager.engine.runner, "run", boom)
    rid = manager.add_request([5, 6, 7], max_new_tokens=4, ignore_eos=True)
    out = manager.get_result(rid, timeout=60)
    assert out.finish_reason == "error" and "boom" in out.error
    [span] = spans("cbserve.request")
    assert span.status.status_code == StatusCode.ERROR and "boom" in span.status.description
    assert span.attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert [e.name for e in span.events] == ["queued", "scheduled", "finished"]  # no token came


def test_disabled_records_nothing_and_generation_still_works(otel, spans, monkeypatch) -> None:
    monkeypatch.setattr(telemetry, "ENABLED", False)  # as when opentelemetry is not installed
    prompts = [list(p) for p in prompts_for()[:2]]
    out = generate_batch(model_for("llama"), prompts, continuous_batching_config=CONFIG, max_new_tokens=4,
                         ignore_eos=True, progress_bar=False)  # fmt: skip
    assert [tuple(o.generated_tokens) for o in out.values()] == [reference("llama", tuple(p), 4) for p in prompts]
    assert spans("cbserve.generate_batch") == [] and spans("cbserve.request") == []
    assert measured(otel) == {}
