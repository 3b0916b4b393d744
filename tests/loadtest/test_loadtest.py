"""Real short Locust runs against a real cbserve and a real non-cbserve server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.testing import save_test_model
from loadtest.report import METRICS, load_rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_test_model(tmp_path_factory.mktemp("lt-model") / "tiny-llama", "llama")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loadtest", *args], capture_output=True, text=True, timeout=300)


def test_short_run_report_is_consistent(model_dir, tmp_path) -> None:
    out = tmp_path / "run"
    r = run("--model", str(model_dir), "--duration", "5s", "--users", "3", "--input-len", "8:60",
            "--output-len", "12", "--endpoint", "completions", "--slo", "ttft_ms=2000", "--temperature", "1",
            "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "time to first token" in r.stdout and "output tok/s" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["temperature"] == 1.0  # sampled requests (the server's sampler under load)
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
    assert summary["server"]["server"] == "cbserve" and summary["target"]["readiness"] == "/ready"
    assert "(cbserve /metrics)" in r.stdout
    for name in ("throughput_over_time.png", "server_over_time.png", "latency_cdf.png", "latency_ccdf.png",
                 "ttft_vs_prompt.png", "locust.html", "locust_stats.csv"):  # fmt: skip
        assert (out / name).stat().st_size > 0
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 5
    assert json.loads((out / "server_samples.json").read_text())


@pytest.mark.serial  # each arrival is checked against its scheduled time
def test_open_loop_sends_the_seeded_schedule_whatever_the_answers(model_dir, tmp_path) -> None:
    from loadtest.arrivals import arrivals_within

    out = tmp_path / "open"
    r = run("--model", str(model_dir), "--rate", "8", "--duration", "6s", "--input-len", "8:30", "--output-len",
            "3:9", "--endpoint", "completions", "--seed", "5", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "open loop  8.00 req/s offered" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    rows = sorted(load_rows(out / "requests.jsonl"), key=lambda x: x["start"])
    o = summary["open_loop"]
    assert o["dropped"] == 0 and o["sent"] == o["offered"] == len(rows) == summary["completed"] > 10
    assert 4 < o["schedule_s"] <= 6.5
    schedule = arrivals_within(8.0, 5, o["schedule_s"])
    assert abs(len(schedule) - o["offered"]) <= 1  # the arrivals whose time came, not one more or less
    assert 0.5 * 8 < o["sent_rate"] < 1.6 * 8  # one seeded draw of a Poisson count: near the offered rate
    sent = [x["start"] - rows[0]["start"] for x in rows]
    planned = [t - schedule[0] for t in schedule[: len(sent)]]
    assert max(abs(a - b) for a, b in zip(sent, planned)) < 0.5  # each left at its time, never waiting its turn
    assert {x["users"] for x in rows} == {1}  # one Locust user sends the whole schedule
    lengths = [x["output_tokens"] for x in rows]
    assert all(3 <= n <= 9 for n in lengths) and len(set(lengths)) > 1
    assert lengths == [x["max_tokens"] for x in rows]  # ignore_eos held every drawn length


@pytest.mark.parametrize("standin", [["--token-ms", "100"]], indirect=True)
def test_open_loop_drops_arrivals_beyond_the_in_flight_bound(standin, tmp_path) -> None:
    out = tmp_path / "bounded"
    r = run("--url", standin, "--rate", "20", "--max-in-flight", "2", "--duration", "3s", "--output-len", "10",
            "--endpoint", "completions", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    o = summary["open_loop"]
    assert summary["max_concurrent_requests"] == 2  # each answer takes a second: two at once, never more
    assert o["dropped"] > o["sent"] > 0 and o["sent"] + o["dropped"] == o["offered"]
    assert summary["completed"] == o["sent"]


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
    assert "data:image/png;base64," in (out / "report.html").read_text()


@pytest.mark.parametrize("args,message,status", [
    (["--url", "http://127.0.0.1:9", "--ready-timeout", "2"], "not ready", 1),
    (["--slo", "ttft=5"], "--slo takes KEY=MS", 2),
    (["--slo", "ttft_ms=fast"], "not a number", 2),
    (["--shape", "zigzag:3"], "--shape must be", 2),
    (["--duration", "soon"], "--duration", 2),
    (["--input-len", "9:3"], "--input-len", 2),
    (["--output-len", "0:5"], "--output-len", 2),
    (["--rate", "2", "--max-in-flight", "0"], "--max-in-flight", 2),
    (["--temperature", "-1"], "--temperature must be in [0, 2]", 2),
    (["--fail-on-slo"], "needs at least one --slo", 2),
])
def test_bad_flags_and_unreachable_servers_are_one_clear_line(args, message, status) -> None:
    r = run(*args)
    assert r.returncode == status
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_requests_ask_for_the_temperature_given() -> None:
    code = "from loadtest.locustfile import LLMUser\nprint(LLMUser._body(None, 'hi', 5)[1]['temperature'])"
    for given, sent in ((None, "0.0"), ("0.7", "0.7")):
        env = {k: v for k, v in os.environ.items() if k != "LOADTEST_TEMPERATURE"}
        if given:
            env["LOADTEST_TEMPERATURE"] = given
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert r.stdout.split() == [sent], r.stdout + r.stderr


def test_a_flag_error_answers_before_the_plotting_library_loads() -> None:
    """matplotlib (0.6 s to import) loads when a run has something to draw, not for a bad flag."""
    code = ("import sys\nfrom loadtest.cli import main\n"
            "status = main(['--duration', 'soon'])\nprint(status, 'matplotlib' in sys.modules)")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr


STANDIN = Path(__file__).with_name("openai_standin.py")


@pytest.fixture
def standin(request) -> Iterator[str]:
    """A real uvicorn serving the stand-in on a socket bound here (it accepts as soon as it runs)."""
    flags = getattr(request, "param", [])
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    proc = subprocess.Popen([sys.executable, str(STANDIN), "--fd", str(sock.fileno()), *flags],
                            pass_fds=[sock.fileno()])  # fmt: skip
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        proc.terminate()
        proc.wait(10)
        sock.close()


@pytest.mark.parametrize("standin,readiness", [(["--api-key", "s3cret"], "/health"),
                                               (["--api-key", "s3cret", "--no-health"], "/v1/models")],
                         indirect=["standin"])  # fmt: skip
def test_any_openai_endpoint_without_ready_or_metrics(standin, readiness, tmp_path) -> None:
    out = tmp_path / "run"
    r = run("--url", standin, "--api-key", "s3cret", "--duration", "3s", "--users", "2", "--output-len", "5",
            "--endpoint", "completions", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "/metrics not available" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target"]["readiness"] == readiness and summary["target"]["model"] == "standin-model"
    assert summary["completed"] > 0 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 5 * summary["completed"]
    assert summary["server"] == {"server": None}
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 5 and "standin-model" in html


@pytest.mark.parametrize("standin", [["--token-ms", "1", "--hold-every", "4"]], indirect=True)
def test_tokens_whose_text_came_with_the_next_are_counted_apart_from_the_gaps(standin, tmp_path) -> None:
    """10 tokens, the 4th's and 8th's text held for the next: 7 gaps between text chunks, 2 held tokens
    (the empty-text chunks vLLM sends for them are no arrival)."""
    out = tmp_path / "run"
    r = run("--url", standin, "--duration", "2s", "--users", "1", "--output-len", "10", "--endpoint", "completions",
            "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = load_rows(out / "requests.jsonl")
    assert rows and all(len(x["itl_ms"]) == 7 for x in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["held_tokens"] == 2 * summary["completed"]
    assert summary["held_token_share"] == pytest.approx(2 / 9)
    assert f"{2 * summary['completed']} tokens (22.22%) came in one chunk with the next" in r.stdout


def test_a_server_that_holds_no_text_reports_no_held_tokens() -> None:
    from loadtest.report import summarize, table

    rows = [{"ok": True, "prompt_tokens": 5, "output_tokens": 4, "ttft_ms": 10.0, "e2e_ms": 40.0, "tpot_ms": 10.0,
             "itl_ms": [10.0, 10.0, 10.0]},
            {"ok": True, "prompt_tokens": 5, "output_tokens": 1, "ttft_ms": 10.0, "e2e_ms": 10.0, "tpot_ms": 0.0,
             "itl_ms": []}]  # fmt: skip
    summary = summarize(rows, 1.0, {})
    assert summary["held_tokens"] == 0 and summary["held_token_share"] == 0.0
    assert "came in one chunk" not in table(summary)


def test_the_gap_after_the_first_token_is_its_own_row() -> None:
    """Three requests whose second token waited 900 ms and whose other 99 gaps took 50: the inter-token p99
    stays near 50 (3 gaps in 300), the first-gap row says 900; a one-token request has no such gap."""
    from loadtest.report import summarize, table

    rows = [{"ok": True, "prompt_tokens": 5, "output_tokens": 101, "ttft_ms": 100.0, "e2e_ms": 6000.0, "tpot_ms": 59.0,
             "itl_ms": [900.0] + [50.0] * 99} for _ in range(3)]  # fmt: skip
    rows.append({"ok": True, "prompt_tokens": 5, "output_tokens": 1, "ttft_ms": 10.0, "e2e_ms": 10.0, "tpot_ms": 0.0,
                 "itl_ms": []})  # fmt: skip
    summary = summarize(rows, 1.0, {})
    assert summary["p99_itl_ms"] < 60.0
    assert summary["p50_first_itl_ms"] == summary["p99_first_itl_ms"] == 900.0
    assert any(line.startswith("after the first token") and "900.0" in line for line in table(summary).splitlines())


@pytest.mark.parametrize("standin", [["--api-key", "s3cret"]], indirect=True)
def test_the_key_comes_from_openai_api_key_and_a_wrong_one_fails_every_request(standin, tmp_path) -> None:
    env = {**os.environ, "OPENAI_API_KEY": "s3cret"}
    args = [sys.executable, "-m", "loadtest", "--url", standin, "--duration", "2s", "--users", "1", "--output-len",
            "3", "--out", str(tmp_path / "env")]  # fmt: skip
    good = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    bad = subprocess.run([*args, "--api-key", "wrong"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1  # /health is open, so the run happens and every request is refused
    assert "HTTP 401" in bad.stdout and "0 completed" in bad.stdout


@pytest.mark.parametrize("standin", [["--api-key", "s3cret", "--no-health"]], indirect=True)
def test_a_refused_readiness_check_names_the_key(standin) -> None:
    r = run("--url", standin, "--ready-timeout", "5")
    assert r.returncode == 1
    assert "answered 401" in r.stderr and "--api-key" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("standin", [["--token-ms", "1"]], indirect=True)
def test_compare_runs_the_same_load_on_each_target_and_writes_one_report(standin, tmp_path) -> None:
    out = tmp_path / "cmp"
    slow = f"slow=cmd:{sys.executable} {STANDIN} --port {{port}} --token-ms 10"
    r = run("compare", "--target", f"fast={standin}", "--target", slow, "--rounds", "2", "--duration", "2s",
            "--users", "2", "--output-len", "6", "--input-len", "5:60", "--seed", "7", "--slo", "ttft_ms=1000",
            "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((out / "compare.json").read_text())
    fast, slow_ = report["targets"]["fast"], report["targets"]["slow"]
    assert len(fast["rounds_output_throughput"]) == len(slow_["rounds_output_throughput"]) == 2
    assert fast["output_throughput"] > 2 * slow_["output_throughput"]
    assert fast["failed"] == slow_["failed"] == 0
    assert report["idle_cpu_seconds"]["fast"] is None and report["idle_cpu_seconds"]["slow"] >= 0
    assert report["busy_cpu_seconds"]["fast"] is None and report["busy_cpu_seconds"]["slow"] > 0
    assert fast["load_generator_cpu_s"] > 0 and "server CPU-s per 1k tokens" in r.stdout
    assert "ratio to fast" in r.stdout and "output tok/s" in r.stdout
    # the same seeded prompts went to both in a round, new ones in the next: compare first requests
    def first_prompt(name: str, k: int) -> int:
        return min(load_rows(out / name / f"round{k}" / "requests.jsonl"), key=lambda x: x["start"])["prompt_words"]

    assert first_prompt("fast", 1) == first_prompt("slow", 1)
    assert first_prompt("fast", 2) == first_prompt("slow", 2)
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 5  # the tail view too
    port = int(report["settings"]["targets"]["slow"].split("--port ")[1].split()[0])
    with pytest.raises(OSError):  # the started target was stopped
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


@pytest.mark.parametrize("args,message", [
    (["compare", "--target", "nope"], "NAME=URL or NAME=cmd:COMMAND"),
    (["compare", "--target", "a=cmd:python server.py"], "{port}"),
    (["compare", "--target", "a=ftp://x"], "neither a URL"),
    (["compare", "--target", "a=http://x", "--target", "a=http://y"], "names must differ"),
    (["compare", "--target", "a=http://x", "--rounds", "0"], "--rounds"),
])
def test_bad_compare_flags_are_one_clear_line(args, message) -> None:
    r = run(*args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("standin", [["--api-key", "s3cret"]], indirect=True)
def test_compare_stops_with_one_line_when_a_target_refuses_the_warm_up(standin, tmp_path) -> None:
    r = run("compare", "--target", f"locked={standin}", "--duration", "2s", "--out", str(tmp_path / "cmp"))
    assert r.returncode == 1  # /health is open; the completions route wants the key
    assert "locked: warm-up request got HTTP 401" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_compare_table_keeps_every_cell_apart_however_many_rounds() -> None:
    from loadtest.compare import compare_table

    def pooled(rounds: list[float]) -> dict:
        keys = {f"p{q}_{k}_ms": 1000.0 + q for q in (50, 90, 99) for k in METRICS}
        return {"output_throughput": sum(rounds) / len(rounds), "request_throughput": 1.0, "completed": 10,
                "failed": 0, "total_output_tokens": 1000, "load_generator_cpu_s": 1.0, "duration": 60.0,
                "rounds_output_throughput": rounds, **keys}  # fmt: skip

    table = compare_table({"cbserve": pooled([130.0, 159.3, 164.8, 156.5]), "vllm": pooled([118.3, 135.0, 135.9, 136.7])},
                          {"cbserve": None, "vllm": None}, {"cbserve": None, "vllm": None})  # fmt: skip
    line = next(line for line in table.splitlines() if line.startswith("  each round"))
    assert "156.5 118.3" not in line and "156.5118.3" not in line
    assert line.split() == ["each", "round", "130.0", "159.3", "164.8", "156.5", "118.3", "135.0", "135.9", "136.7"]
    assert "156.5  118.3" in line  # two spaces at least between the targets


@pytest.mark.parametrize("standin", [["--token-ms", "1"]], indirect=True)
def test_compare_runs_each_load_and_derives_the_open_loop_rate(standin, tmp_path) -> None:
    """Three loads on the same two servers, in process: the open loop's rate is 0.8x the slowest
    server's requests/s in the desynchronised closed loop, each load has its section and folder."""
    from loadtest.cli import parse_compare_args
    from loadtest.compare import compare
    from loadtest.loads import Load

    out = tmp_path / "loads"
    slow = f"slow=cmd:{sys.executable} {STANDIN} --port {{port}} --token-ms 30"
    args = parse_compare_args(["--target", f"fast={standin}", "--target", slow, "--duration", "2s", "--users", "2",
                               "--output-len", "6", "--input-len", "5:20", "--endpoint", "completions",
                               "--out", str(out)])  # fmt: skip
    loads = [Load("lockstep", "lockstep closed loop"), Load("desync", "desynchronised closed loop", output_len="3:9"),
             Load("poisson", "open loop", output_len="3:9", open_loop=True, rate_from="desync")]  # fmt: skip
    assert compare(args.targets, args, loads, ["vLLM preload: a note"]) == 0
    report = json.loads((out / "compare.json").read_text())
    assert report["notes"] == ["vLLM preload: a note"] and list(report["loads"]) == ["lockstep", "desync", "poisson"]
    desync = report["loads"]["desync"]["targets"]
    slowest = min(desync["fast"]["request_throughput"], desync["slow"]["request_throughput"])
    assert report["loads"]["poisson"]["rate"] == pytest.approx(0.8 * slowest)
    assert report["loads"]["lockstep"]["rate"] is None
    for name in ("fast", "slow"):
        rows = load_rows(out / "desync" / name / "round1" / "requests.jsonl")
        assert all(3 <= x["output_tokens"] <= 9 for x in rows) and len({x["output_tokens"] for x in rows}) > 1
        assert all(x["output_tokens"] == 6 for x in load_rows(out / "lockstep" / name / "round1" / "requests.jsonl"))
        poisson = report["loads"]["poisson"]["targets"][name]
        assert poisson["open_loop"]["offered_rate"] == pytest.approx(0.8 * slowest) and poisson["completed"] > 0
        assert (out / "poisson" / name / "round1" / "summary.json").is_file()
    seeds = {load: json.loads((out / load / "fast" / "round1" / "summary.json").read_text())["settings"]["seed"]
             for load in ("lockstep", "desync", "poisson")}  # fmt: skip
    assert seeds == {"lockstep": 0, "desync": 1, "poisson": 2}  # each load its own prompts
    for load in ("lockstep", "desync", "poisson"):
        section = report["loads"][load]
        assert section["busy_cpu_seconds"]["fast"] is None and section["busy_cpu_seconds"]["slow"] > 0
        cores = section["targets"]["slow"]["server_busy_cores"]
        assert 0 < cores <= os.cpu_count()
        assert cores == pytest.approx(section["busy_cpu_seconds"]["slow"] / section["targets"]["slow"]["duration"])
        assert json.loads((out / load / "compare.json").read_text())["targets"]["slow"]["completed"] > 0
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 15 and "vLLM preload: a note" in html
    assert "offered / sent requests/s" in html and "server busy cores" in html
