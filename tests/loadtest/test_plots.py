"""The latency figures: the tail view's data, its percentile marks, and axes a reader can read."""

from __future__ import annotations

import math
import random

import matplotlib.pyplot as plt
import pytest

from loadtest import plots
from loadtest.report import METRICS, latency_values, summarize


def fake_rows(seed: int, step_ms: float, n: int = 120, together: float = 0.0, scale: float = 1.0) -> list[dict]:
    """Requests of 32 tokens with lognormal gaps around `step_ms` and a rare long stall; a share
    `together` of the gaps come in the same read as the chunk before (a few microseconds)."""
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        gaps = [rnd.uniform(0.002, 0.02) if rnd.random() < together
                else step_ms * rnd.lognormvariate(0, 0.2) * (10 if rnd.random() < 0.01 else 1) for _ in range(31)]
        ttft = scale * 400 * rnd.lognormvariate(0, 0.5)
        e2e = ttft + sum(gaps)
        rows.append({"start": float(i), "ok": True, "ttft_ms": ttft, "itl_ms": gaps, "e2e_ms": e2e,
                     "output_tokens": 32, "tpot_ms": (e2e - ttft) / 31, "prompt_tokens": 50})  # fmt: skip
    return rows


def test_the_ccdf_is_the_share_at_or_above_each_value() -> None:
    assert plots.ccdf([3.0, 1.0, 2.0, 2.0]) == ([1.0, 2.0, 2.0, 3.0], [1.0, 0.75, 0.5, 0.25])
    assert plots.ccdf([]) == ([], [])


def test_the_marks_are_the_tables_percentiles() -> None:
    rows = fake_rows(0, 50, together=0.05)
    summary = summarize(rows, 60.0, {})
    for metric in METRICS:
        marks = plots.tail_markers(latency_values(rows, metric))
        assert [(q, share) for q, _, share in marks] == [(50, 0.5), (90, pytest.approx(0.1)), (99, pytest.approx(0.01))]
        assert [value for _, value, _ in marks] == [summary[f"p{q}_{metric}_ms"] for q in (50, 90, 99)]


def test_the_axis_cut_is_a_hundredth_of_the_lowest_median_never_under_a_tenth_of_a_ms() -> None:
    assert plots.axis_cut({"a": [0.01] * 5 + [60.0] * 100, "b": [300.0]}) == 0.5
    assert plots.axis_cut({"a": [250.0], "b": []}) == 2.0
    assert plots.axis_cut({"a": [0.5, 1.0, 2.0]}) == 0.1
    assert plots.axis_cut({"a": []}) == 0.1


@pytest.mark.parametrize("lo", [0.12, 0.9, 3.0, 31.0, 180.0, 1800.0, 7000.0, 25000.0])
@pytest.mark.parametrize("ratio", [1.0, 1.2, 1.6, 3.0, 12.0, 150.0, 4000.0])
def test_log_axis_ticks_are_round_and_inside_limits_that_hold_the_range(lo: float, ratio: float) -> None:
    hi = lo * ratio
    (left, right), ticks = plots.log_axis(lo, hi)
    assert left <= lo and hi <= right
    assert 2 <= len(ticks) <= plots.MAX_TICKS and ticks == sorted(ticks)
    assert all(left <= t <= right for t in ticks)
    finest = plots.SERIES[-1]
    for t in ticks:
        mantissa = t / 10 ** math.floor(math.log10(t) + 1e-9)
        assert any(math.isclose(mantissa, m) for m in finest), t
    labels = [plots.ms_label(t) for t in ticks]
    assert len(set(labels)) == len(labels) and all(float(x.replace(",", "")) == t for x, t in zip(labels, ticks))


def visible_tick_labels(fig, axis: str) -> list[list]:
    """Per axes: the drawn major tick labels of its x or y axis (in view, with text)."""
    fig.canvas.draw()
    out = []
    for ax in fig.axes:
        lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
        ticks = ax.xaxis.get_major_ticks() if axis == "x" else ax.yaxis.get_major_ticks()
        out.append([t.label1 for t in ticks if t.label1.get_visible() and t.label1.get_text()
                    and lo <= t.get_loc() <= hi])  # fmt: skip
    return out


def assert_apart(labels: list) -> None:
    boxes = [t.get_window_extent() for t in labels]
    for i, a in enumerate(boxes):
        for j, b in enumerate(boxes[i + 1 :], i + 1):
            assert not a.overlaps(b), f"tick labels overlap: {labels[i].get_text()!r} and {labels[j].get_text()!r}"


def test_the_tail_view_has_log_axes_marked_percentiles_and_the_gaps_that_came_together_off_its_axis() -> None:
    runs = {"fast": fake_rows(1, 40, together=0.05), "slow": fake_rows(2, 90)}
    fig = plots.ccdf_figure(runs, {"itl_ms": 200})
    try:
        axes = dict(zip(plots.TITLES, fig.axes[:4]))
        for metric, ax in axes.items():
            assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
            assert ax.get_ylim()[0] <= 1e-3
            assert [t.get_text() for t in ax.yaxis.get_minorticklabels() if t.get_text()] == []
            assert [t.get_text() for t in ax.xaxis.get_minorticklabels() if t.get_text()] == []
            legend = [t.get_text() for t in ax.get_legend().get_texts()]
            for (name, rows), text in zip(runs.items(), legend):
                values = latency_values(rows, metric)
                marks = plots.tail_markers(values)
                assert text.startswith(f"{name}: p50 {plots.ms_value(marks[0][1])}, p90 ")
                assert f"p99 {plots.ms_value(marks[2][1])} ms (n={len(values):,}" in text
                # the marks are drawn where the table's percentiles are
                drawn = [line for line in ax.get_lines() if line.get_marker() == "o" and line.get_label() != text]
                assert any(list(line.get_xdata()) == [v for _, v, _ in marks] for line in drawn)
        itl = axes["itl"]
        together = sum(g < 0.1 for g in latency_values(runs["fast"], "itl"))
        cut = plots.axis_cut({n: latency_values(r, "itl") for n, r in runs.items()})
        assert together > 0 and cut == 0.2  # a hundredth of 40 ms, rounded down
        assert itl.get_xlim()[0] > cut
        assert f"gaps under {plots.ms_label(cut)} ms" in itl.get_xlabel()
        assert f", {together:,} under 0.2 ms" in itl.get_legend().get_texts()[0].get_text()
        assert "under" not in axes["ttft"].get_xlabel()
        assert "SLO 200 ms" in [t.get_text() for t in itl.get_legend().get_texts()]
        for labels in visible_tick_labels(fig, "x") + visible_tick_labels(fig, "y"):
            assert len(labels) >= 2
            assert_apart(labels)
    finally:
        plt.close(fig)


@pytest.mark.parametrize("scale", [0.05, 1.0, 7.0, 40.0])
def test_no_tick_labels_touch_at_any_scale(scale: float) -> None:
    runs = {"a": fake_rows(3, 5 * scale, scale=scale), "b": fake_rows(4, 9 * scale, together=0.1, scale=scale)}
    for build in (plots.ccdf_figure, plots.cdf_figure):
        fig = build(runs, {})
        try:
            for labels in visible_tick_labels(fig, "x"):
                assert len(labels) >= 2
                assert_apart(labels)
        finally:
            plt.close(fig)
