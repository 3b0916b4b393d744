"""Read a cbserve /metrics page and turn two readings into the figures of the window between them."""

from __future__ import annotations

import threading

import requests
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, float]:
    """{sample name (+ sorted labels but model_name): value} of one /metrics reading; {} if unreachable."""
    try:
        text = requests.get(url.rstrip("/") + "/metrics", timeout=5).text
    except requests.RequestException:
        return {}
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return values


class GaugeSampler(threading.Thread):
    """Samples the KV-cache usage gauge during the run (its maximum is what matters)."""

    def __init__(self, url: str, every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.values: list[float] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every):
            v = scrape(self.url).get("cbserve:kv_cache_usage_perc")
            if v is not None:
                self.values.append(v)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def window(before: dict[str, float], after: dict[str, float], kv_samples: list[float]) -> dict[str, float | None]:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    if not after:
        return {}
    count = delta("cbserve:request_queue_time_seconds_count")
    queries = delta("cbserve:prefix_cache_queries_total")
    return {
        "mean_queue_time_ms": 1000 * delta("cbserve:request_queue_time_seconds_sum") / count if count else None,
        "max_kv_cache_usage": max(kv_samples) if kv_samples else None,
        "preemptions": delta("cbserve:num_preemptions_total"),
        "prefix_cache_hit_rate": delta("cbserve:prefix_cache_hits_total") / queries if queries else None,
        "generation_tokens": delta("cbserve:generation_tokens_total"),
    }
