"""A real short Locust run against a real cbserve on 127.0.0.1; the report adds up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.testing import save_test_model
from loadtest.report import load_rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_test_model(tmp_path_factory.mktemp("lt-model") / "tiny-llama", "llama")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loadtest", *args], capture_output=True, text=True, timeout=300)


def test_short_run_report_is_consistent(model_dir, tmp_path) -> None:
    out = tmp_path / "run"
    r = run("--model", str(model_dir), "--duration", "5s", "--users", "3", "--input-len", "8:60",
            "--output-len", "12", "--endpoint", "completions", "--slo", "ttft_ms=2000", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "time to first token" in r.stdout and "output tok/s" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    rows = load_rows(out / "requests.jsonl")
    assert summary["completed"] == len([x for x in rows if x["ok"]]) == len(rows) > 0
    assert summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(x["output_tokens"] for x in rows) == 12 * len(rows)
    assert summary["total_input_tokens"] == sum(x["prompt_tokens"] for x in rows)
    for x in rows:
        assert 0 < x["ttft_ms"] <= x["e2e_ms"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        p50, p90, p99 = (summary[f"p{q}_{metric}_ms"] for q in (50, 90, 99))
        assert p50 <= p90 <= p99
    assert 1 <= summary["max_concurrent_requests"] <= 3
    assert summary["server"]["generation_tokens"] >= summary["total_output_tokens"]
    for name in ("latency_over_time.png", "ttft_vs_prompt.png", "locust.html", "locust_stats.csv"):
        assert (out / name).stat().st_size > 0


def test_sweep_plots_one_point_per_concurrency(model_dir, tmp_path) -> None:
    out = tmp_path / "sweep"
    r = run("--model", str(model_dir), "--sweep", "--sweep-max", "4", "--duration", "3s", "--output-len", "8",
            "--input-len", "8:20", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    points = json.loads((out / "sweep.json").read_text())
    concurrencies = [p["concurrency"] for p in points]
    assert concurrencies == [1, 2, 4][: len(concurrencies)] and len(concurrencies) >= 2
    assert all(p["completed"] > 0 for p in points)
    assert (out / "sweep.png").stat().st_size > 0


@pytest.mark.parametrize("args,message,status", [
    (["--url", "http://127.0.0.1:9", "--ready-timeout", "2"], "not ready", 1),
    (["--slo", "ttft=5"], "--slo takes KEY=MS", 2),
    (["--slo", "ttft_ms=fast"], "not a number", 2),
    (["--shape", "zigzag:3"], "--shape must be", 2),
    (["--duration", "soon"], "--duration", 2),
    (["--input-len", "9:3"], "--input-len", 2),
    (["--fail-on-slo"], "needs at least one --slo", 2),
])
def test_bad_flags_and_unreachable_servers_are_one_clear_line(args, message, status) -> None:
    r = run(*args)
    assert r.returncode == status
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
