"""benchmarks/server_steps.py: the same decode step in `cbserve serve` and in a bare engine."""

from __future__ import annotations

import argparse
import json

import pytest


@pytest.fixture
def steps(bench_script):
    return bench_script("server_steps")


def test_a_variant_is_a_name_and_its_environment(steps) -> None:
    assert steps.parse_variant("quiet=CBSERVE_OUTPUT_THREAD=false,TOKENIZERS_PARALLELISM=false") == (
        "quiet", {"CBSERVE_OUTPUT_THREAD": "false", "TOKENIZERS_PARALLELISM": "false"})
    for bad in ("quiet", "quiet=", "=A=1", "quiet=A=1,B"):
        with pytest.raises(argparse.ArgumentTypeError):
            steps.parse_variant(bad)


def test_the_window_takes_one_row_decode_steps_within_it(steps, tmp_path) -> None:
    log = tmp_path / "steps.jsonl"
    rows = [(1.0, 1, 0, 0.010), (2.0, 1, 0, 0.020), (3.0, 1, 40, 0.500), (4.0, 2, 0, 0.900), (5.0, 1, 0, 0.030),
            (9.0, 1, 0, 0.700)]  # fmt: skip
    log.write_text("".join(json.dumps({"t": t, "decode_rows": d, "prefill_tokens": p, "seconds": s}) + "\n"
                           for t, d, p, s in rows))  # fmt: skip
    assert steps.window_median(log, 1.5, 6.0) == pytest.approx(0.025)  # 0.020 and 0.030: no prompt, one row
    assert steps.window_median(log, 6.0, 8.0) is None


def test_a_round_against_a_real_server(steps, capsys) -> None:
    """The embedded model: one server, one round of 12 tokens, beside the engine in this process."""
    assert steps.main(["--rounds", "1", "--tokens", "12", "--serve-args", "--num-blocks 16"]) == 0
    out = capsys.readouterr().out
    assert "round 1: engine " in out and ", server " in out and "median of rounds: engine" in out
