"""PNG plots of runs. Each takes {label: rows} so one run and a comparison of servers share them.

Rows are the lines of requests.jsonl: `start` (wall time), `ttft_ms`, `itl_ms` (gaps between text
chunks), `e2e_ms`, `output_tokens`. Time axes start at the run's first request and end at its last
answer.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("ok")]


def span(rows: list[dict]) -> tuple[float, float]:
    """(first request's start, last answer's end) in wall time; (0, 0) with no rows."""
    if not rows:
        return 0.0, 0.0
    return min(r["start"] for r in rows), max(r["start"] + r.get("e2e_ms", 0) / 1000 for r in rows)


def token_times(row: dict) -> list[float]:
    """Wall times of the row's text chunks: first token, then each inter-token gap."""
    t = row["start"] + row["ttft_ms"] / 1000
    times = [t]
    for gap in row.get("itl_ms", []):
        t += gap / 1000
        times.append(t)
    return times


def series(rows: list[dict], bin_s: float) -> tuple[list[float], list[float], list[float]]:
    """(bin edges in s since the first request, output tok/s and mean requests in flight per bin).

    The values repeat their last element so that `step(where="post")` draws the last bin too.
    """
    t0, t1 = span(rows)
    n = max(1, math.ceil((t1 - t0) / bin_s))
    tokens, busy = [0.0] * n, [0.0] * n
    for r in rows:
        end = r["start"] + r.get("e2e_ms", 0) / 1000
        lo, hi = r["start"] - t0, end - t0
        for i in range(int(lo // bin_s), min(n, int(hi // bin_s) + 1)):  # time in flight, split over bins
            busy[i] += max(0.0, min(hi, (i + 1) * bin_s) - max(lo, i * bin_s))
        if r.get("ok"):
            stamps = token_times(r)
            per_chunk = r["output_tokens"] / len(stamps)
            for t in stamps:
                tokens[min(n - 1, int((t - t0) // bin_s))] += per_chunk
    widths = [max(1e-3, min(bin_s, (t1 - t0) - i * bin_s)) for i in range(n)]  # the last bin may be short
    xs = [i * bin_s for i in range(n)] + [t1 - t0]
    tps = [x / w for x, w in zip(tokens, widths)]
    flight = [b / w for b, w in zip(busy, widths)]
    return xs, tps + tps[-1:], flight + flight[-1:]


def throughput_over_time(runs: dict[str, list[dict]], path: Path) -> None:
    """Output tokens/s (top) and requests in flight (bottom) over each run's whole span."""
    longest = max((span(rows)[1] - span(rows)[0] for rows in runs.values()), default=0.0)
    bin_s = max(1.0, longest / 60)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, height_ratios=(2, 1))
    for (label, rows), color in zip(runs.items(), COLORS):
        if not rows:
            continue
        xs, tps, busy = series(rows, bin_s)
        top.step(xs, tps, where="post", color=color, label=label)
        bottom.step(xs, busy, where="post", color=color, label=label)
    top.set_ylabel("output tokens/s")
    top.set_title(f"Throughput and load over the run ({bin_s:.0f} s bins)")
    bottom.set_ylabel("requests in flight")
    bottom.set_xlabel("seconds since the first request")
    bottom.set_xlim(0, max(longest, 1.0))
    top.set_ylim(bottom=0)
    bottom.set_ylim(bottom=0)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        top.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # outside: it hides no data
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def server_over_time(runs: dict[str, tuple[list[dict], float]], path: Path) -> None:
    """Queue depth, running requests and KV-cache use from /metrics scrapes; runs: {label: (samples, t0)}."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10.5, 5.5), sharex=True)
    drawn = False
    end = 1.0
    for (label, (samples, t0)), color in zip(runs.items(), COLORS):
        xs = [s["t"] - t0 for s in samples]
        if xs:
            end = max(end, xs[-1])
        prefix = f"{label}: " if len(runs) > 1 else ""
        for key, style, name in (("running", "-", "running"), ("waiting", "--", "waiting")):
            pts = [(x, s[key]) for x, s in zip(xs, samples) if s.get(key) is not None]
            if pts:
                top.plot(*zip(*pts), style, color=color, label=prefix + name)
                drawn = True
        pts = [(x, 100 * s["kv_usage"]) for x, s in zip(xs, samples) if s.get("kv_usage") is not None]
        if pts:
            bottom.plot(*zip(*pts), color=color, label=label)
            drawn = True
    if not drawn:
        top.text(0.5, 0.5, "the endpoint exposes no known /metrics: not available", ha="center", va="center",
                 transform=top.transAxes)  # fmt: skip
    top.set_ylabel("requests")
    top.set_title("Server state from /metrics (scraped every second)")
    bottom.set_ylabel("KV cache in use (%)")
    bottom.set_xlabel("seconds since the first request")
    bottom.set_xlim(0, end)
    top.set_ylim(bottom=0)
    bottom.set_ylim(bottom=0)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    if top.get_legend_handles_labels()[0]:
        top.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # outside: it hides no data
    if len(runs) > 1 and bottom.get_legend_handles_labels()[0]:
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cdf(ax, values: list[float], color: str, label: str) -> None:
    ordered = sorted(values)
    if ordered:
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", color=color,
                label=label)  # fmt: skip


def latency_cdfs(runs: dict[str, list[dict]], slos: dict[str, float], path: Path) -> None:
    """Distributions of time to first token and inter-token latency, with the SLO lines when given."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for (label, rows), color in zip(runs.items(), COLORS):
        ok = _ok(rows)
        _cdf(left, [r["ttft_ms"] for r in ok], color, label)
        _cdf(right, [g for r in ok for g in r.get("itl_ms", [])], color, label)
    for ax, key, title in ((left, "ttft_ms", "Time to first token"), (right, "itl_ms", "Inter-token latency")):
        if key in slos:
            ax.axvline(slos[key], color="black", linestyle=":", label=f"SLO {slos[key]:g} ms")
        ax.set_xscale("log")  # the bulk and the tail (a prefill stall can be 100x a decode step) both show
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("share of requests" if key == "ttft_ms" else "share of gaps")
        ax.set_title(title)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ttft_vs_prompt(runs: dict[str, list[dict]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for (label, rows), color in zip(runs.items(), COLORS):
        ok = _ok(rows)
        ax.scatter([r["prompt_tokens"] for r in ok], [r["ttft_ms"] for r in ok], s=8, alpha=0.6, color=color,
                   label=label)  # fmt: skip
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT against prompt length")
    ax.grid(alpha=0.3)
    if len(runs) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep_curve(points: list[dict], path: Path) -> None:
    """One point per concurrency: output throughput against median and p99 end-to-end latency."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p["output_throughput"] for p in points]
    ax.plot(xs, [p["median_e2el_ms"] / 1000 for p in points], "o-", label="median")
    ax.plot(xs, [p["p99_e2el_ms"] / 1000 for p in points], "s--", label="p99")
    for p, x in zip(points, xs):
        label = f"{p['concurrency']} user" + ("s" if p["concurrency"] > 1 else "")
        ax.annotate(label, (x, p["median_e2el_ms"] / 1000), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title("Throughput against latency, one point per concurrency")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rounds_bars(throughputs: dict[str, list[float]], path: Path) -> None:
    """Output tokens/s of each target in each round, side by side."""
    fig, ax = plt.subplots(figsize=(7, 4))
    rounds = max((len(v) for v in throughputs.values()), default=0)
    width = 0.8 / max(1, len(throughputs))
    for k, ((label, values), color) in enumerate(zip(throughputs.items(), COLORS)):
        xs = [i + k * width for i in range(len(values))]
        bars = ax.bar(xs, values, width, color=color, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    centres = [i + width * (len(throughputs) - 1) / 2 for i in range(rounds)]
    ax.set_xticks(centres, [f"round {i + 1}" for i in range(rounds)])
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput of each target in each round")
    ax.set_ylim(0, 1.15 * max((max(v) for v in throughputs.values() if v), default=1.0))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=max(1, len(throughputs)))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
