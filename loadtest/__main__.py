"""`python -m loadtest`: serve (or reach) an endpoint, run Locust headless, write and print a report.

    python -m loadtest [--url URL | --model PATH] [--users N] [--duration 60s] [--rate R]
                       [--shape steps:1,2,4@10] [--sweep] [--endpoint chat|completions]
                       [--input-len 64:192] [--output-len 64] [--shared-prefix 0]
                       [--slo ttft_ms=500 --slo tpot_ms=50] [--fail-on-slo] [--out DIR]

With no --url it starts `cbserve serve` (the embedded SmolLM2 model unless --model) on a free
port of 127.0.0.1 and waits for /ready. The output folder holds summary.json, requests.jsonl,
Locust's CSV and HTML, the server's figures over the run, and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from loadtest import plots
from loadtest.dataset import LengthSpec
from loadtest.metrics_scrape import GaugeSampler, scrape, window
from loadtest.report import load_rows, parse_slos, summarize, table

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


class UsageError(Exception):
    """Bad flags or an unreachable server: one line to stderr, exit status 2 or 1."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m|h)?", text.strip())
    if not m:
        raise UsageError(f"--duration must look like 30s, 2m or 1h, got {text!r}")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


def check_shape(text: str) -> str:
    if not re.fullmatch(r"steps:\d+(,\d+)*@\d+(\.\d+)?|ramp:\d+-\d+@\d+(\.\d+)?", text):
        raise UsageError(f"--shape must be steps:U1,U2,...@SECONDS or ramp:LOW-HIGH@SECONDS, got {text!r}")
    return text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise UsageError(f"the server exited with status {proc.returncode} before it was ready", 1)
        try:
            r = requests.get(url.rstrip("/") + "/ready", timeout=3)
            if r.status_code == 200:
                return
            last = f"/ready answered {r.status_code}"
        except requests.RequestException as exc:
            last = type(exc).__name__
        time.sleep(0.5)  # polling a readiness probe, bounded by the deadline
    raise UsageError(f"{url} is not ready after {timeout:.0f} s ({last})", 1)


def start_server(model: str | None, out: Path, engine_yaml: str | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]  # fmt: skip
    if model:
        cmd += ["--model", model]
    if engine_yaml:
        cmd += ["--config", engine_yaml]
    log = (out / "server.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def served_model(url: str) -> str | None:
    try:
        return requests.get(url.rstrip("/") + "/v1/models", timeout=5).json()["data"][0]["id"]
    except (requests.RequestException, KeyError, IndexError, ValueError):
        return None


def run_locust(url: str, out: Path, users: int, duration: float, args: argparse.Namespace) -> tuple[dict, dict]:
    """One headless Locust run into `out`; returns (summary, server figures)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.jsonl").unlink(missing_ok=True)
    env = {**os.environ, "LOADTEST_OUT": str(out), "LOADTEST_ENDPOINT": args.endpoint,
           "LOADTEST_INPUT_LEN": args.input_len, "LOADTEST_OUTPUT_LEN": args.output_len,
           "LOADTEST_SHARED_PREFIX": str(args.shared_prefix), "LOADTEST_RATE": str(args.rate or 0),
           "LOADTEST_SHAPE": args.shape or "", "LOADTEST_MODEL": args.model_name or "",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
           "--csv", str(out / "locust"), "--html", str(out / "locust.html"), "--only-summary",
           "--loglevel", "WARNING", "--stop-timeout", "30", "--exit-code-on-error", "0"]  # fmt: skip
    if not args.shape:
        cmd += ["-u", str(users), "-r", str(users), "-t", f"{max(1, round(duration))}s"]
    before = scrape(url)
    sampler = GaugeSampler(url)
    sampler.start()
    started = time.monotonic()
    with (out / "locust.log").open("w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    elapsed = time.monotonic() - started
    sampler.stop()
    after = scrape(url)
    if code not in (0, 1):  # 1: some requests failed, which the report shows
        raise UsageError(f"locust exited with status {code}; see {out / 'locust.log'}", 1)
    rows = load_rows(out / "requests.jsonl")
    extra = json.loads((out / "locust_extra.json").read_text()) if (out / "locust_extra.json").exists() else {}
    if rows:  # the measured window: first request sent to last answer received
        first = min(r["start"] for r in rows)
        last = max(r["start"] + r.get("e2e_ms", 0) / 1000 for r in rows)
        elapsed = max(last - first, 1e-3)
    summary = summarize(rows, elapsed, args.slos, extra.get("max_concurrent_requests", 0))
    server = window(before, after, sampler.values)
    summary["server"] = server
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plots.latency_over_time(rows, out / "latency_over_time.png")
    plots.ttft_vs_prompt(rows, out / "ttft_vs_prompt.png")
    return summary, server


def sweep(url: str, out: Path, args: argparse.Namespace) -> list[dict]:
    points, best = [], 0.0
    users = 1
    while users <= args.sweep_max:
        summary, _ = run_locust(url, out / f"c{users}", users, args.duration_s, args)
        points.append({"concurrency": users, **summary})
        print(f"  {users:>3} users: {summary['output_throughput']:8.1f} output tok/s, "
              f"median e2e {summary['median_e2el_ms']:8.1f} ms")  # fmt: skip
        if best and summary["output_throughput"] < best * 1.1:
            break  # saturated: doubling the users no longer raises throughput by 10%
        best = max(best, summary["output_throughput"])
        users *= 2
    (out / "sweep.json").write_text(json.dumps(points, indent=2))
    plots.sweep_curve(points, out / "sweep.png")
    return points


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.splitlines()[0])
    p.add_argument("--url", help="an endpoint to test (default: start cbserve serve here)")
    p.add_argument("--model", help="with no --url: the model folder cbserve serves (default: embedded SmolLM2)")
    p.add_argument("--engine-config", help="with no --url: engine YAML for the server")
    p.add_argument("--model-name", help="the model name to send (default: what /v1/models lists)")
    p.add_argument("--users", type=int, default=4, help="concurrent users (closed loop)")
    p.add_argument("--duration", default="60s")
    p.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests per second")
    p.add_argument("--shape", help="steps:1,2,4@10 or ramp:1-8@30 (users over time)")
    p.add_argument("--sweep", action="store_true", help="users 1, 2, 4, ... until throughput stops rising")
    p.add_argument("--sweep-max", type=int, default=64)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--input-len", default="64:192", help="prompt words: N or LOW:HIGH")
    p.add_argument("--output-len", default="64", help="output tokens: N or LOW:HIGH")
    p.add_argument("--shared-prefix", type=int, default=0, help="words every prompt shares (prefix caching)")
    p.add_argument("--slo", action="append", default=[], help="ttft_ms=MS, tpot_ms=MS, itl_ms=MS or e2el_ms=MS")
    p.add_argument("--fail-on-slo", action="store_true", help="exit 3 when fewer than 90%% of requests meet the SLOs")
    p.add_argument("--ready-timeout", type=float, default=300)
    p.add_argument("--out", default="reports/loadtest")
    args = p.parse_args(argv)
    args.duration_s = parse_duration(args.duration)
    if args.users < 1:
        raise UsageError(f"--users must be >= 1, got {args.users}")
    if args.rate is not None and args.rate <= 0:
        raise UsageError(f"--rate must be > 0 requests/s, got {args.rate}")
    if args.shape:
        check_shape(args.shape)
    try:
        LengthSpec.parse(args.input_len, "--input-len")
        LengthSpec.parse(args.output_len, "--output-len")
        args.slos = parse_slos(args.slo)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.fail_on_slo and not args.slos:
        raise UsageError("--fail-on-slo needs at least one --slo")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        proc = None
        if args.url:
            url = args.url
            wait_ready(url, min(args.ready_timeout, 30))
        else:
            print("starting cbserve serve" + (f" --model {args.model}" if args.model else " (embedded SmolLM2)"), flush=True)
            proc, url = start_server(args.model, out, args.engine_config)
        try:
            if proc is not None:
                wait_ready(url, args.ready_timeout, proc)
            args.model_name = args.model_name or served_model(url)
            print(f"load-testing {url} ({args.model_name})", flush=True)
            if args.sweep:
                points = sweep(url, out, args)
                print(f"\nsweep: {len(points)} points; plot {out / 'sweep.png'}")
                return 0
            summary, server = run_locust(url, out, args.users, args.duration_s, args)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        print()
        print(table(summary, server))
        print(f"\nreport: {out}/ (summary.json, requests.jsonl, locust.html, *.png)")
        if args.fail_on_slo and summary["completed"] and summary["request_goodput"] < 0.9 * summary["request_throughput"]:
            print("SLOs missed: fewer than 90% of requests met them", file=sys.stderr)
            return 3
        return 0 if summary["completed"] else 1
    except UsageError as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
