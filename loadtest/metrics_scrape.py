"""Read an endpoint's Prometheus /metrics: the server's own view of a run, whichever server it is.

cbserve and vLLM use the same names under their own prefix (`cbserve:`, `vllm:`); llama.cpp's
`llama-server --metrics` has a smaller set under `llamacpp:`. Whatever a server does not expose is
None in the figures and "not available" in the report.

The once-a-second sampler asks only for the gauges it plots (`name[]` query parameters, which
prometheus_client's exposition and so cbserve and vLLM honour; llama-server sends its short page
whole): every histogram made, sent and parsed each second would be the observer's own load on the
cores the server under test runs on, and a load that grows with how many metrics a server has.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import requests
from prometheus_client.parser import text_string_to_metric_families

from loadtest.target import auth_headers


@dataclass(frozen=True)
class MetricNames:
    """Where one kind of server keeps each figure (None: it has no such metric)."""

    server: str
    waiting: str | None
    running: str | None
    kv_usage: str | None  # a share, 0..1
    queue_time: str | None  # a histogram's base name, in seconds
    preemptions: str | None
    prefix_queries: str | None
    prefix_hits: str | None
    generation_tokens: str | None


def _vllm_style(prefix: str) -> MetricNames:
    p = prefix + ":"
    return MetricNames(prefix, p + "num_requests_waiting", p + "num_requests_running", p + "kv_cache_usage_perc",
                       p + "request_queue_time_seconds", p + "num_preemptions_total", p + "prefix_cache_queries_total",
                       p + "prefix_cache_hits_total", p + "generation_tokens_total")  # fmt: skip


KNOWN = (
    _vllm_style("cbserve"),
    _vllm_style("vllm"),
    MetricNames("llama.cpp", "llamacpp:requests_deferred", "llamacpp:requests_processing",
                None, None, None, None, None, "llamacpp:tokens_predicted_total"),  # fmt: skip
)


# The gauges the sampler reads, under every known server's names.
GAUGES = tuple(name for names in KNOWN for name in (names.waiting, names.running, names.kv_usage) if name)


def scrape(url: str, api_key: str | None = None, only: tuple[str, ...] = ()) -> dict[str, float]:
    """{sample name: value summed over its labels} of one /metrics reading; {} if there is none. `only`:
    the sample names to ask for (a server that cannot restrict its page sends all of it)."""
    try:
        r = requests.get(url.rstrip("/") + "/metrics", params={"name[]": list(only)} if only else None, timeout=5,
                         headers=auth_headers(api_key))  # fmt: skip
        if r.status_code != 200:
            return {}
        families = list(text_string_to_metric_families(r.text))
    except (requests.RequestException, ValueError):
        return {}
    values: dict[str, float] = {}
    for family in families:
        for s in family.samples:
            if "le" in s.labels or "quantile" in s.labels:
                continue
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def detect(values: dict[str, float]) -> MetricNames | None:
    """The known server whose names this reading has, or None."""
    for names in KNOWN:
        if names.running in values or names.generation_tokens in values:
            return names
    return None


class ServerSampler(threading.Thread):
    """Samples the queue, running and KV-cache gauges once a second during a run."""

    def __init__(self, url: str, api_key: str | None = None, every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.api_key, self.every = url, api_key, every
        self.samples: list[dict[str, float | None]] = []  # {"t": wall time, "waiting", "running", "kv_usage"}
        self.names: MetricNames | None = None
        self._halt = threading.Event()

    def sample(self) -> None:
        values = scrape(self.url, self.api_key, GAUGES)
        self.names = self.names or detect(values)
        if self.names is None:
            return
        n = self.names
        self.samples.append({"t": time.time(), "waiting": _get(values, n.waiting), "running": _get(values, n.running),
                             "kv_usage": _get(values, n.kv_usage)})  # fmt: skip

    def run(self) -> None:
        self.sample()
        while not self._halt.wait(self.every):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def _get(values: dict[str, float], name: str | None) -> float | None:
    return values.get(name) if name else None


def window(before: dict[str, float], after: dict[str, float], samples: list[dict]) -> dict[str, object]:
    """The server's figures for the run between two readings; None where the server has no such metric."""
    names = detect(after)
    if names is None:
        return {"server": None}

    def delta(name: str | None) -> float | None:
        if name is None or name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    queue_count = delta(names.queue_time and names.queue_time + "_count")
    queue_sum = delta(names.queue_time and names.queue_time + "_sum")
    queries, hits = delta(names.prefix_queries), delta(names.prefix_hits)
    kv = [s["kv_usage"] for s in samples if s.get("kv_usage") is not None]
    waiting = [s["waiting"] for s in samples if s.get("waiting") is not None]
    return {
        "server": names.server,
        "mean_queue_time_ms": 1000 * queue_sum / queue_count if queue_count and queue_sum is not None else None,
        "max_kv_cache_usage": max(kv) if kv else None,
        "max_requests_waiting": max(waiting) if waiting else None,
        "preemptions": delta(names.preemptions),
        "prefix_cache_hit_rate": hits / queries if queries and hits is not None else None,
        "generation_tokens": delta(names.generation_tokens),
    }
