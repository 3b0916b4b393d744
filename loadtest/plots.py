"""PNG plots of a run: latency percentiles over time, TTFT against prompt length, a sweep's curve."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def latency_over_time(rows: list[dict], path: Path) -> None:
    ok = sorted((r for r in rows if r.get("ok")), key=lambda r: r["start"])
    fig, ax = plt.subplots(figsize=(8, 4))
    if ok:
        t0 = ok[0]["start"]
        bucket_s = max(1.0, (ok[-1]["start"] - t0) / 12)  # about a dozen points whatever the run's length
        buckets: dict[int, list[float]] = {}
        for r in ok:
            buckets.setdefault(int((r["start"] - t0) // bucket_s), []).append(r["e2e_ms"])
        xs = sorted(buckets)
        for q, style in ((50, "-"), (90, "--"), (99, ":")):
            ys = [sorted(buckets[x])[min(len(buckets[x]) - 1, int(len(buckets[x]) * q / 100))] for x in xs]
            ax.plot([x * bucket_s for x in xs], ys, style, label=f"p{q} end-to-end")
        ttft = [r["ttft_ms"] for r in ok]
        ax.scatter([r["start"] - t0 for r in ok], ttft, s=6, alpha=0.4, label="TTFT (each request)")
    ax.set_xlabel("seconds since the start")
    ax.set_ylabel("ms")
    ax.set_title("Latency over time")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ttft_vs_prompt(rows: list[dict], path: Path) -> None:
    ok = [r for r in rows if r.get("ok")]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([r["prompt_tokens"] for r in ok], [r["ttft_ms"] for r in ok], s=8, alpha=0.6)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT against prompt length")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep_curve(points: list[dict], path: Path) -> None:
    """One point per concurrency: output throughput against median end-to-end latency."""
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["output_throughput"] for p in points]
    ys = [p["median_e2el_ms"] for p in points]
    ax.plot(xs, ys, "o-")
    for p, x, y in zip(points, xs, ys):
        ax.annotate(f"{p['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("median end-to-end latency (ms)")
    ax.set_title("Throughput against latency (labels: concurrent users)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
