"""From raw per-request timings to vLLM-style summary keys, goodput, and a readable table."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

SLO_KEYS = {"ttft_ms": "ttft_ms", "tpot_ms": "tpot_ms", "e2el_ms": "e2e_ms", "itl_ms": "itl_ms"}  # -> row key
METRICS = {"ttft": "time to first token", "itl": "inter-token", "first_itl": "after the first token",
           "tpot": "time per output token", "e2el": "end to end"}  # fmt: skip


def parse_slos(items: list[str]) -> dict[str, float]:
    """["ttft_ms=500", "tpot_ms=50"] -> {"ttft_ms": 500.0, ...}; a bad item is a ValueError saying which."""
    slos = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--slo takes KEY=MS with KEY in {', '.join(SLO_KEYS)}, got {item!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo {key}: {value!r} is not a number of milliseconds") from None
        if slos[key] <= 0:
            raise ValueError(f"--slo {key} must be > 0 ms")
    return slos


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), interpolated linearly between the two nearest values; 0 with none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def latency_values(ok: list[dict], metric: str) -> list[float]:
    """What a latency metric of METRICS is taken over, in ms: one value per successful request, or
    per gap between text chunks for "itl" (TPOT only of requests with more than one token). "first_itl"
    is each request's first gap, between its first text and its second: a server that sends the first
    token early and then makes the request wait for other prompts' prefill shows it there, where
    the inter-token p99 (one gap of a request's many) can hide it."""
    if metric == "itl":
        return [gap for r in ok for gap in r["itl_ms"]]
    if metric == "first_itl":
        return [r["itl_ms"][0] for r in ok if r["itl_ms"]]
    if metric == "tpot":
        return [r["tpot_ms"] for r in ok if r["output_tokens"] > 1]
    return [r[SLO_KEYS[f"{metric}_ms"]] for r in ok]


def held_tokens(ok: list[dict]) -> tuple[int, int]:
    """(tokens that reached the client in one chunk with a later token, gaps between text chunks).
    A server holds a token's text back while it may be an incomplete UTF-8 character or the start of
    a stop string, and sends it with the next one (cbserve, vLLM's text and llama-server all do), so
    the gap before that chunk spans two steps or more: at a p99 these counts say how many of the
    tail's gaps are such pairs, which depend on the tokens a model draws, not on a server's speed."""
    held = sum(max(0, r["output_tokens"] - 1 - len(r["itl_ms"])) for r in ok if r["output_tokens"] > 1)
    return held, sum(len(r["itl_ms"]) for r in ok)


def _stats(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        values = [0.0]
    out = {f"mean_{name}_ms": statistics.fmean(values), f"median_{name}_ms": statistics.median(values),
           f"std_{name}_ms": statistics.pstdev(values)}  # fmt: skip
    for q in (50, 90, 99):
        out[f"p{q}_{name}_ms"] = percentile(values, q)
    return out


def meets(row: dict, slos: dict[str, float]) -> bool:
    for key, limit in slos.items():
        value = row.get(SLO_KEYS[key])
        if key == "itl_ms":
            if any(gap > limit for gap in row.get("itl_ms", [])):
                return False
        elif value is None or value > limit:
            return False
    return True


def summarize(rows: list[dict], duration: float, slos: dict[str, float], max_concurrent: int = 0) -> dict[str, Any]:
    ok = [r for r in rows if r.get("ok")]
    inputs = sum(r["prompt_tokens"] for r in ok)
    outputs = sum(r["output_tokens"] for r in ok)
    duration = max(duration, 1e-9)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(rows) - len(ok),
        "duration": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration,
        "request_goodput": sum(meets(r, slos) for r in ok) / duration if slos else None,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        "max_concurrent_requests": max_concurrent,
        "slos": slos,
    }
    for metric in METRICS:
        summary.update(_stats(metric, latency_values(ok, metric)))
    held, gaps = held_tokens(ok)
    summary["held_tokens"] = held
    summary["held_token_share"] = held / (held + gaps) if held + gaps else 0.0
    errors: dict[str, int] = {}
    for r in rows:
        if not r.get("ok"):
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    summary["errors"] = errors
    return summary


def table(summary: dict[str, Any], server: dict[str, Any] | None = None) -> str:
    s = summary
    lines = [
        f"requests   {s['completed']} completed, {s['failed']} failed in {s['duration']:.1f} s "
        f"(max {s['max_concurrent_requests']} at once)",
        f"throughput {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s",
    ]
    if s.get("open_loop"):
        lines.append(open_loop_line(s["open_loop"]))
    if s.get("request_goodput") is not None:
        slo = ", ".join(f"{k} <= {v:g}" for k, v in s["slos"].items())
        lines.append(f"goodput    {s['request_goodput']:.2f} req/s within {slo}")
    lines.append("")
    lines.append(f"{'latency (ms)':<22}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for key, label in METRICS.items():
        lines.append(f"{label:<22}" + "".join(f"{s[f'{m}_{key}_ms']:>10.1f}" for m in ("mean", "median", "p90", "p99")))
    if s.get("held_tokens"):
        lines.append(f"{'':<22}{s['held_tokens']} tokens ({s['held_token_share']:.2%}) came in one chunk with the next "
                     "(text held back), their gap two steps or more")  # fmt: skip
    lines.append("")
    lines.append(server_line(server))
    if s["errors"]:
        lines.append("")
        lines += [f"error x{n}: {e}" for e, n in s["errors"].items()]
    return "\n".join(lines)


def open_loop_line(o: dict[str, Any]) -> str:
    """Offered against sent: arrivals dropped at the in-flight bound, and how late the sent ones left."""
    return (f"open loop  {o['offered_rate']:.2f} req/s offered: {o['offered']} arrivals in {o['schedule_s']:.1f} s, "
            f"{o['sent']} sent ({o['sent_rate']:.2f}/s), {o['dropped']} dropped at {o['max_in_flight']} in flight; "
            f"send lag p50 {o['median_send_lag_ms']:.1f} ms, max {o['max_send_lag_ms']:.1f} ms")


def server_line(server: dict[str, Any] | None) -> str:
    """The server's own figures of the run, each "not available" where its /metrics has no such thing."""
    if not server or not server.get("server"):
        return "server     /metrics not available (no cbserve, vLLM or llama.cpp metrics at this endpoint)"

    def fig(key: str, label: str, fmt: str) -> str:
        value = server.get(key)
        return f"{label} {'not available' if value is None else format(value, fmt)}"

    parts = [fig("mean_queue_time_ms", "mean queue (ms)", ".1f"), fig("max_requests_waiting", "peak waiting", ".0f"),
             fig("max_kv_cache_usage", "peak KV cache", ".1%"), fig("preemptions", "preemptions", ".0f"),
             fig("prefix_cache_hit_rate", "prefix-cache hits", ".0%")]  # fmt: skip
    return f"server     ({server['server']} /metrics) " + ", ".join(parts)
