"""Prometheus metrics with vLLM's names under the `cbserve:` prefix, labelled by model_name.

The live queue, running and KV-cache gauges are also exposed under vLLM's own `vllm:` names, the ones
the Gateway API Inference Extension's endpoint pickers read (`vllm:gpu_cache_usage_perc` is older
pickers' name for the KV-cache use): same values, read once per scrape.

Request-level figures (latencies, token counts) are observed by the server when a request ends;
the engine's live figures (queue, running, KV usage, preemptions, prefix cache) are read from the
manager at scrape time by a collector, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "cbserve:"
# The gauges endpoint pickers read, under vLLM's names: cbserve's name -> the `vllm:` names it is also exposed as.
PICKER_NAMES = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip


def token_buckets(max_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_len (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_len:
                return buckets
            buckets.append(float(value))
        exponent += 1


ENGINE_GAUGES = (
    ("num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "Share of KV-cache blocks in use (0..1)."),
    ("prefill_token_cap", "Prompt tokens the last step with running decodes could take (max_decode_stall)."),
)
ENGINE_COUNTERS = (  # (name, key in the engine's stats, doc)
    ("num_preemptions", "num_preemptions_total", "Preemptions of running requests."),
    ("prefix_cache_queries", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
    ("steps_ahead", "steps_ahead_total", "Steps launched before the last step's tokens were back (async batching)."),
)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict], model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def describe(self):
        """The families without values: the registry learns the names (a scrape restricted by name finds them)."""
        return self._families(None)

    def collect(self):
        return self._families(self.stats())

    def _families(self, s: dict | None):
        for name, doc in ENGINE_GAUGES:
            for full_name in (P + name, *PICKER_NAMES.get(name, ())):
                g = GaugeMetricFamily(full_name, doc, labels=["model_name"])
                if s is not None:
                    g.add_metric([self.model_name], float(s[name]))
                yield g
        for name, key, doc in ENGINE_COUNTERS:
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            if s is not None:
                c.add_metric([self.model_name], float(s[key]))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int, engine_stats: Callable[[], dict]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, label = self.registry, ["model_name"]
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests.", label, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens reported in usage.", label, registry=r)
        self.request_success = Counter(P + "request_success", "Finished requests by finish reason.",
                                       label + ["finished_reason"], registry=r)  # fmt: skip
        self.admission_rejections = Counter(P + "admission_rejections", "Requests refused at admission.",
                                            label + ["reason"], registry=r)  # fmt: skip
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.", label, buckets=TTFT_BUCKETS,
                              registry=r)  # fmt: skip
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between tokens.", label, buckets=ITL_BUCKETS,
                             registry=r)  # fmt: skip
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency.", label,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Time waiting before the first step.", label,
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prefill_time = Histogram(P + "request_prefill_time_seconds", "From first step to first token.", label,
                                      buckets=REQUEST_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.decode_time = Histogram(P + "request_decode_time_seconds", "From first to last token.", label,
                                     buckets=REQUEST_LATENCY_BUCKETS, registry=r)  # fmt: skip
        buckets = token_buckets(max_model_len)
        self.prompt_len = Histogram(P + "request_prompt_tokens", "Prompt length.", label, buckets=buckets, registry=r)
        self.generation_len = Histogram(P + "request_generation_tokens", "Generated tokens per request.", label,
                                        buckets=buckets, registry=r)  # fmt: skip
        r.register(_EngineCollector(engine_stats, model_name))

    def rejected(self, reason: str) -> None:
        self.admission_rejections.labels(self.model_name, reason).inc()

    def finished(self, out, prompt_tokens: int, completion_tokens: int, finish_reason: str) -> None:
        """One engine request (one choice) ended; `out` is its last GenerationOutput (None if none came)."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.request_success.labels(m, finish_reason).inc()
        if prompt_tokens:  # 0 for the extra samples of an n > 1 request
            self.prompt_len.labels(m).observe(prompt_tokens)
        self.generation_len.labels(m).observe(completion_tokens)
        if out is None:  # withdrawn before its first output
            return
        end = out.finished_time
        if end is not None:
            self.e2e.labels(m).observe(end - out.created_time)
        if out.scheduled_time is not None:
            self.queue_time.labels(m).observe(out.scheduled_time - out.created_time)
            if out.first_token_time is not None:
                self.prefill_time.labels(m).observe(out.first_token_time - out.scheduled_time)
        if out.first_token_time is not None:
            self.ttft.labels(m).observe(out.first_token_time - out.created_time)
            if end is not None:
                self.decode_time.labels(m).observe(end - out.first_token_time)
        stamps = (out.timestamps or [])[:completion_tokens]
        for a, b in zip(stamps, stamps[1:]):
            self.itl.labels(m).observe(b - a)
