"""PNG plots of runs. Each takes {label: rows} so one run and a comparison of servers share them.

Rows are the lines of requests.jsonl: `start` (wall time), `ttft_ms`, `itl_ms` (gaps between text
chunks), `e2e_ms`, `output_tokens`. Time axes start at the run's first request and end at its last
answer.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter, NullLocator  # noqa: E402

from loadtest.report import latency_values, percentile  # noqa: E402

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


# the latency figures: each metric's values per run, on a log ms axis with round, spaced labels
TITLES = {"ttft": "Time to first token", "itl": "Inter-token latency", "tpot": "Time per output token",
          "e2el": "End-to-end latency"}  # fmt: skip
# an x axis starts at the smallest value at or above its cut: a hundredth of the lowest median (rounded
# down to 1, 2 or 5), and never under 0.1 ms. Shorter gaps are text chunks delivered with the one before
# (in one read, or one step's writes), not steps: counted in every share, not drawn.
MIN_CUT_MS = 0.1
CUT_BELOW_MEDIAN = 100
TAIL = (50, 90, 99)  # the percentiles marked on the tail view
SERIES = ((1,), (1, 3), (1, 2, 5), (1, 2, 3, 5, 7), (1, 1.5, 2, 3, 5, 7), (1, 2, 3, 4, 5, 6, 7, 8, 9),
          (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9))  # tick mantissas, coarse to fine
AXIS_EM = 28.0  # a latency panel's x axis, in ems of its 10-point tick font (14 px at 100 dpi): about 390 px
MAX_TICKS = 8


def ms_label(value: float) -> str:
    """A tick's label in ms: 0.1, 1.5, 30, 500, 2,000."""
    return f"{value:,.0f}" if value >= 1 and value == round(value) else f"{value:g}"


def ms_value(value: float) -> str:
    """A measured value in ms, as precise as a reader needs: 0.042, 3.5, 63, 1,883."""
    return f"{value:,.0f}" if value >= 10 else f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def _label_em(label: str) -> float:
    """A label's width in em of the default font: a digit is 0.64 em, a comma or a point 0.32."""
    return sum(0.32 if c in ",." else 0.64 for c in label)


def log_axis(lo: float, hi: float, axis_em: float = AXIS_EM) -> tuple[tuple[float, float], list[float]]:
    """(limits, ticks) of a log axis showing [lo, hi] (0 < lo <= hi). The limits are the range with 3%
    of it spare each side, widened to the series' nearest values outside where fewer than two fall
    inside; the ticks are round values, of the finest series of SERIES with at most MAX_TICKS whose
    labels stay an em apart on an axis `axis_em` wide (the coarsest where none does)."""
    hi = max(hi, lo * 1.01)  # one value: an axis around it
    pad = (hi / lo) ** 0.03
    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 2)
    chosen: tuple[tuple[float, float], list[float]] | None = None
    for mantissas in SERIES:
        values = sorted({round(m * 10.0**e, 12) for e in decades for m in mantissas})
        limits = (lo / pad, hi * pad)
        if sum(limits[0] <= v <= limits[1] for v in values) < 2:
            limits = (max(v for v in values if v <= limits[0]), min(v for v in values if v >= limits[1]))
        ticks = [v for v in values if limits[0] <= v <= limits[1]]
        em_per_decade = axis_em / math.log10(limits[1] / limits[0])
        fits = len(ticks) <= MAX_TICKS and all(
            math.log10(b / a) * em_per_decade >= (_label_em(ms_label(a)) + _label_em(ms_label(b))) / 2 + 1.0
            for a, b in zip(ticks, ticks[1:]))  # fmt: skip
        if fits or chosen is None:
            chosen = (limits, ticks)
        if not fits:
            break
    assert chosen is not None
    return chosen


def axis_cut(values: dict[str, list[float]]) -> float:
    """The ms under which a panel draws no value (see MIN_CUT_MS)."""
    medians = [statistics.median(vs) for vs in values.values() if vs]
    cut = min(medians, default=0.0) / CUT_BELOW_MEDIAN
    if cut <= MIN_CUT_MS:
        return MIN_CUT_MS
    decade = 10.0 ** math.floor(math.log10(cut))
    return max(m * decade for m in (1, 2, 5) if m * decade <= cut * (1 + 1e-9))


def _ms_axis(ax, values: dict[str, list[float]], cut: float, unit: str) -> None:
    """A log ms x axis over the values at or above `cut`: labels on round values only, no minor
    labels; the axis label says what is not drawn where any value lies under the cut."""
    drawn = [v for vs in values.values() for v in vs if v >= cut]
    limits, ticks = log_axis(min(drawn), max(drawn)) if drawn else ((1.0, 10.0), [1.0, 10.0])
    ax.set_xscale("log")
    ax.set_xlim(*limits)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FixedFormatter([ms_label(t) for t in ticks]))
    ax.xaxis.set_minor_formatter(NullFormatter())
    under = any(v < cut for vs in values.values() for v in vs)
    note = f"\n{unit} under {ms_label(cut)} ms (sent with the chunk before) not drawn"
    ax.set_xlabel("ms (log scale)" + (note if under else ""))


def _count(values: list[float], cut: float) -> str:
    under = sum(v < cut for v in values)
    return f"n={len(values):,}" + (f", {under:,} under {ms_label(cut)} ms" if under else "")


def _values(runs: dict[str, list[dict]], metric: str) -> dict[str, list[float]]:
    return {label: latency_values(_ok(rows), metric) for label, rows in runs.items()}


def _slo_line(ax, slos: dict[str, float], metric: str) -> None:
    if f"{metric}_ms" in slos:
        limit = slos[f"{metric}_ms"]
        ax.axvline(limit, color="black", linestyle=":", label=f"SLO {limit:g} ms")


def cdf_figure(runs: dict[str, list[dict]], slos: dict[str, float]) -> Figure:
    """Distributions of time to first token and inter-token latency (the bulk), with the SLO lines when given."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ttft", "itl")):
        values = _values(runs, metric)
        cut = axis_cut(values)
        unit = "gaps" if metric == "itl" else "requests"
        for (label, vs), color in zip(values.items(), COLORS):
            ordered = sorted(vs)
            if ordered:
                ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", color=color,
                        label=f"{label} ({_count(vs, cut)})")  # fmt: skip
        _slo_line(ax, slos, metric)
        _ms_axis(ax, values, cut, unit)
        ax.set_ylabel(f"share of {unit}")
        ax.set_title(TITLES[metric])
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)  # a CDF's empty corner
    fig.tight_layout()
    return fig


def latency_cdfs(runs: dict[str, list[dict]], slos: dict[str, float], path: Path) -> None:
    fig = cdf_figure(runs, slos)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def ccdf(values: list[float]) -> tuple[list[float], list[float]]:
    """The tail of a distribution: the sorted values and, for each, the share of values at or above
    it (1 - F just below it: from 1 down to 1/n), drawn as `step(where="pre")`."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(n - i) / n for i in range(n)]


def tail_markers(values: list[float]) -> list[tuple[int, float, float]]:
    """(q, its percentile in ms, the share above it: 1 - q/100) for each q of TAIL, as the report's table has them."""
    return [(q, percentile(values, q), 1 - q / 100) for q in TAIL] if values else []


def ccdf_figure(runs: dict[str, list[dict]], slos: dict[str, float]) -> Figure:
    """The tail view: for each latency metric the share of values at or above x, on log axes down to
    at least 1e-3 (p99.9), one line per run, p50/p90/p99 marked on each and given in its legend."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 9 + 0.3 * len(runs)))
    for ax, metric in zip(axes.flat, TITLES):
        values = _values(runs, metric)
        cut = axis_cut(values)
        unit = "gaps" if metric == "itl" else "requests"
        bottom = 1e-3
        for (label, vs), color in zip(values.items(), COLORS):
            if not vs:
                continue
            xs, ys = ccdf(vs)
            marks = tail_markers(vs)
            text = ", ".join(f"p{q} {ms_value(x)}" for q, x, _ in marks)
            ax.step(xs, ys, where="pre", color=color, label=f"{label}: {text} ms ({_count(vs, cut)})")
            ax.plot([x for _, x, _ in marks], [y for _, _, y in marks], "o", color=color, markersize=5,
                    markeredgecolor="white")  # fmt: skip
            bottom = min(bottom, 0.5 / len(vs))  # below the largest value's 1/n
        _slo_line(ax, slos, metric)
        _ms_axis(ax, values, cut, unit)
        ax.set_yscale("log")
        ax.set_ylim(bottom, 1.5)
        shares = [1, 0.5, 0.1, 0.01, 0.001] + ([1e-4] if bottom <= 1e-4 else [])
        ax.yaxis.set_major_locator(FixedLocator(shares))
        ax.yaxis.set_major_formatter(FixedFormatter(["1", "0.5  p50", "0.1  p90", "0.01  p99", "0.001  p99.9",
                                                     "1e-4  p99.99"][: len(shares)]))  # fmt: skip
        ax.yaxis.set_minor_locator(NullLocator())  # shares are labelled where they matter; no grid between
        ax.set_ylabel(f"share of {unit} at or above x")
        ax.set_title(f"{TITLES[metric]}: the tail")
        ax.grid(alpha=0.3)
        ax.grid(alpha=0.12, which="minor", axis="x")
        if ax.get_legend_handles_labels()[0]:  # below the panel: the lines run into any corner of it
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def latency_ccdfs(runs: dict[str, list[dict]], slos: dict[str, float], path: Path) -> None:
    fig = ccdf_figure(runs, slos)
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
