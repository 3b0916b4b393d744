"""benchmarks/hostile_stall.py: one costly request beside another user's stream."""

from __future__ import annotations

import pytest

from engine.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS


@pytest.fixture
def hostile(bench_script):
    return bench_script("hostile_stall")


def test_the_costly_requests_are_the_ones_its_docstring_names(hostile) -> None:
    stops = hostile.costly("stops", 16, 49152)
    assert len(stops["stop"]) == 300_000 and stops["n"] == 16
    caps = hostile.costly("stop-caps", 4, 49152)["stop"]
    assert len(caps) == MAX_STOP_STRINGS and sum(map(len, caps)) == MAX_STOP_CHARS  # served: at the caps
    bias = hostile.costly("bias", 16, 512)["logit_bias"]
    assert sorted(map(int, bias)) == list(range(512))
    assert hostile.costly("plain", 16, 512)["logit_bias"] == {}  # the control: the same request, no bias
    with pytest.raises(SystemExit, match="unknown request kind"):
        hostile.costly("everything", 1, 1)


def test_gaps_are_described_by_their_median_p90_and_worst(hostile) -> None:
    assert hostile.describe([0.01] * 9 + [0.5]) == "p50 10 ms, p90 500 ms, worst 500 ms"
    assert hostile.describe([]) == "no chunks"


def test_the_detokenizer_mode_times_a_lone_bytes_token_and_checks_the_text(hostile, capsys) -> None:
    hostile.main(["--detokenizer", "--tokens", "300"])
    out = capsys.readouterr().out
    assert out.startswith("300 tokens of a lone byte") and "equals a decode of all of them" in out
