"""benchmarks/gguf_one_stream.py: the gaps a single client sees between streamed tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gguf_one_stream  # noqa: E402


def test_gaps_leave_out_the_prompt_and_give_median_p90_p99_in_ms():
    arrivals = [0.0, 0.5] + [0.5 + 0.01 * i for i in range(1, 100)] + [1.49 + 0.2]  # one slow gap at the end
    stats = gguf_one_stream.gap_stats(arrivals)
    assert stats["tokens"] == 102 and stats["median_ms"] == 10.0 and stats["p90_ms"] == 10.0
    assert stats["p99_ms"] == 200.0  # the 100th of 100 gaps


def test_too_few_tokens_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than three tokens"):
        gguf_one_stream.gap_stats([0.0, 0.1])


def test_unknown_systems_are_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        gguf_one_stream.main(["x.gguf", "--systems", "vllm"])
    assert "unknown systems ['vllm']" in capsys.readouterr().err
