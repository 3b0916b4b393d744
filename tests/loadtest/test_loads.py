"""The loads of a comparison: the seeded Poisson schedule, drawn output lengths, the open-loop rate, the
CPU trace behind busy cores, and serve_compare's choice of loads (no server runs here)."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

from loadtest.arrivals import OpenLoopTally, arrivals_within, pool_tallies, poisson_arrivals
from loadtest.cpu_trace import CpuTrace
from loadtest.dataset import LengthSpec, PromptSource
from loadtest.loads import Load, first_seed, load_args, open_loop_rate
from loadtest.target import UsageError


def test_the_schedule_is_seeded_and_poisson_at_the_rate() -> None:
    a, b = arrivals_within(5.0, seed=3, horizon_s=2000), arrivals_within(5.0, seed=3, horizon_s=2000)
    assert a == b and a != arrivals_within(5.0, seed=4, horizon_s=2000)
    assert all(x < y for x, y in zip(a, a[1:])) and 0 < a[0] and a[-1] < 2000
    assert len(a) / 2000 == pytest.approx(5.0, rel=0.04)  # 10,000 arrivals: one standard deviation is 1%
    gaps = [y - x for x, y in zip([0.0, *a], a)]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.04)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)  # exponential gaps
    in_first_second = [sum(1 for x in a if k <= x < k + 1) for k in range(2000)]
    assert statistics.pvariance(in_first_second) == pytest.approx(5.0, rel=0.1)  # Poisson counts: variance = mean
    assert arrivals_within(5.0, seed=3, horizon_s=10) == [x for x in a if x < 10]  # a prefix of the same schedule


def test_the_schedule_does_not_move_the_prompt_sequence() -> None:
    source = PromptSource(LengthSpec(4, 8), LengthSpec(1, 9), seed=0)
    expected = [source.next() for _ in range(5)]
    interleaved, arrivals = PromptSource(LengthSpec(4, 8), LengthSpec(1, 9), seed=0), poisson_arrivals(2.0, 0)
    got = []
    for _ in range(5):
        next(arrivals)  # the open loop draws an arrival, then the prompt it sends
        got.append(interleaved.next())
    assert got == expected


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_a_rate_must_be_positive(rate) -> None:
    with pytest.raises(ValueError, match="> 0"):
        next(poisson_arrivals(rate, 0))


def test_an_arrival_finding_the_bound_is_dropped_and_counted() -> None:
    tally = OpenLoopTally(rate=4.0, max_in_flight=2)
    assert tally.arrival(0, 0.001) and tally.arrival(1, -0.5)
    assert not tally.arrival(2, 0.0) and not tally.arrival(3, 0.0)
    tally.schedule_s = 2.0
    d = tally.as_dict()
    assert (d["offered"], d["sent"], d["dropped"], d["max_in_flight"]) == (4, 2, 2, 2)
    assert d["sent_rate"] == 1.0 and d["offered_rate"] == 4.0
    assert d["median_send_lag_ms"] == pytest.approx(0.5) and d["max_send_lag_ms"] == pytest.approx(1.0)
    pooled = pool_tallies([d, {**d, "schedule_s": 6.0, "sent": 6, "offered": 6, "dropped": 0, "max_send_lag_ms": 9}])
    assert (pooled["offered"], pooled["sent"], pooled["dropped"]) == (10, 8, 2)
    assert pooled["sent_rate"] == 1.0 and pooled["max_send_lag_ms"] == 9


def test_drawn_output_lengths_are_seeded_and_cover_the_range() -> None:
    spec = LengthSpec.parse("32:224", "--output-len")
    source = PromptSource(LengthSpec(4, 8), spec, seed=1)
    lengths = [source.next()[1] for _ in range(4000)]
    assert min(lengths) == 32 and max(lengths) == 224
    assert statistics.fmean(lengths) == pytest.approx(128, rel=0.03)
    again = PromptSource(LengthSpec(4, 8), spec, seed=1)
    assert [again.next()[1] for _ in range(4000)] == lengths
    for bad in ("0:5", "9:3", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--output-len"):
            LengthSpec.parse(bad, "--output-len")


def test_the_open_loop_rate_is_a_fraction_of_the_slowest() -> None:
    assert open_loop_rate({"cbserve": 2.0, "vllm": 1.5, "llama.cpp": 1.75}) == pytest.approx(1.2)
    assert open_loop_rate({"a": 3.0, "b": 0.0}, fraction=0.5) == pytest.approx(1.5)  # a server that did nothing
    with pytest.raises(ValueError, match="no server completed"):
        open_loop_rate({"a": 0.0})


def test_a_load_overrides_only_its_own_flags() -> None:
    args = argparse.Namespace(output_len="128", rate=3.0, users=16, seed=5, rounds=2)
    closed = load_args(args, Load("lockstep", "lockstep"), None)
    assert (closed.output_len, closed.rate, closed.users) == ("128", None, 16)
    drawn = load_args(args, Load("desync", "desync", output_len="32:224"), None)
    assert (drawn.output_len, drawn.rate) == ("32:224", None)
    opened = load_args(args, Load("poisson", "open", output_len="32:224", open_loop=True), 1.25)
    assert (opened.output_len, opened.rate) == ("32:224", 1.25)
    assert args.output_len == "128" and args.rate == 3.0  # the run's own flags untouched


def test_each_load_draws_prompts_no_other_load_draws() -> None:
    """Load i's rounds are seeded seed + i x rounds + r: no load meets an earlier one's prompts in a prefix cache."""
    args = argparse.Namespace(output_len="128", rate=None, users=16, seed=5, rounds=2)
    loads = [Load("lockstep", "lockstep"), Load("desync", "desync", output_len="32:224"),
             Load("poisson", "open", output_len="32:224", open_loop=True)]  # fmt: skip
    seeds = [load_args(args, load, 1.0, i).seed + r for i, load in enumerate(loads) for r in range(args.rounds)]
    assert seeds == [5, 6, 7, 8, 9, 10]
    assert first_seed(args, len(loads)) == 11  # where vLLM's preload calibration starts: after every load's
    assert load_args(args, loads[0], None).seed == 5 and args.seed == 5  # one load: the run's own seeds


def test_the_cpu_trace_reads_a_window_between_samples() -> None:
    trace = CpuTrace(lambda: None)
    trace.samples = [(100.0, 10.0), (101.0, 12.0), (103.0, 13.0)]
    assert trace.at(100.5) == pytest.approx(11.0)
    assert trace.between(100.5, 102.0) == pytest.approx(1.5)
    assert trace.at(99.0) == 10.0 and trace.at(200.0) == 13.0
    assert CpuTrace(lambda: None).between(0, 1) is None
    clock = iter(range(1000))
    live = CpuTrace(lambda: float(next(clock)), period_s=0.01).start()
    live.sample()
    live.stop()
    cpus = [c for _, c in live.samples]
    assert len(cpus) >= 3 and cpus == sorted(cpus) and not live._thread.is_alive()


SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_compare.py"


@pytest.fixture(scope="module")
def serve_compare():
    spec = importlib.util.spec_from_file_location("serve_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    for name in ("vllm_peer", "llama_cpp_peer"):
        sys.modules.pop(name, None)


def test_serve_compare_runs_three_loads_the_open_loop_rate_from_the_desynchronised_one(serve_compare) -> None:
    opts, rest = serve_compare.own_flags(["--users", "4", "--systems", "cbserve,vllm"])
    assert rest == ["--users", "4"] and opts.systems == ["cbserve", "vllm"]
    loads = serve_compare.compare_loads(opts)
    assert [x.name for x in loads] == ["lockstep", "desync", "poisson"]
    lockstep, desync, poisson = loads
    assert lockstep.output_len is None and not lockstep.open_loop
    assert desync.output_len == poisson.output_len == "32:224"
    assert poisson.open_loop and poisson.rate is None and poisson.rate_from == "desync"
    assert poisson.rate_fraction == 0.8
    opts, _ = serve_compare.own_flags(["--loads", "lockstep,poisson"])
    assert serve_compare.compare_loads(opts)[-1].rate_from == "lockstep"
    opts, _ = serve_compare.own_flags(["--loads", "poisson", "--poisson-rate", "1.5"])
    (only,) = serve_compare.compare_loads(opts)
    assert only.rate == 1.5 and only.open_loop


@pytest.mark.parametrize("argv,message", [
    (["--systems", "cbserve,tgi"], "--systems"),
    (["--loads", "steady"], "--loads"),
    (["--loads", "poisson"], "needs --poisson-rate"),
    (["--poisson-rate", "0"], "--poisson-rate must be > 0"),
])  # fmt: skip
def test_serve_compare_refuses_bad_flags_in_one_line(serve_compare, argv, message) -> None:
    with pytest.raises(UsageError, match=message):
        serve_compare.own_flags(argv)
