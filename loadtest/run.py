"""One headless Locust run against one target, and a sweep of them; each writes its report folder."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest import html_report
from loadtest.metrics_scrape import ServerSampler, scrape, window
from loadtest.report import load_rows, summarize
from loadtest.target import Target, UsageError

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
REPO = Path(__file__).resolve().parent.parent


@dataclass
class RunResult:
    summary: dict  # vLLM's benchmark keys, plus "server": the /metrics figures of the window
    rows: list[dict]  # requests.jsonl
    samples: list[dict]  # the server's gauges once a second
    t0: float  # wall time of the first request


def locust_env(out: Path, target: Target, args: argparse.Namespace, seed: int) -> dict[str, str]:
    return {**os.environ, "LOADTEST_OUT": str(out), "LOADTEST_ENDPOINT": args.endpoint,
            "LOADTEST_INPUT_LEN": args.input_len, "LOADTEST_OUTPUT_LEN": args.output_len,
            "LOADTEST_SHARED_PREFIX": str(args.shared_prefix), "LOADTEST_RATE": str(args.rate or 0),
            "LOADTEST_SHAPE": args.shape or "", "LOADTEST_MODEL": target.model_name or "",
            "LOADTEST_SEED": str(seed), "LOADTEST_API_KEY": target.api_key or "",
            "LOADTEST_MAX_IN_FLIGHT": str(getattr(args, "max_in_flight", 256)),
            "LOADTEST_TEMPERATURE": str(getattr(args, "temperature", 0.0)),
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip


def run_locust(target: Target, out: Path, users: int, args: argparse.Namespace,
               seed: int | None = None) -> RunResult:  # fmt: skip
    """One headless Locust run into `out`: summary.json, requests.jsonl, Locust's files, plots, report.html.
    The prompts are drawn from `seed` (default --seed)."""
    seed = args.seed if seed is None else seed
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("requests.jsonl", "locust_extra.json"):
        (out / stale).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", target.url,
           "--csv", str(out / "locust"), "--html", str(out / "locust.html"), "--only-summary",
           "--loglevel", "WARNING", "--stop-timeout", "30", "--exit-code-on-error", "0"]  # fmt: skip
    if not args.shape:
        spawned = 1 if args.rate else users  # open loop: one user sends the whole schedule
        cmd += ["-u", str(spawned), "-r", str(spawned), "-t", f"{max(1, round(args.duration_s))}s"]
    before = scrape(target.url, target.api_key)
    sampler = ServerSampler(target.url, target.api_key)
    sampler.start()
    started = time.monotonic()
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with (out / "locust.log").open("w") as log:
        env = locust_env(out, target, args, seed)
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    elapsed = time.monotonic() - started
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    locust_cpu = sum(getattr(children_after, f) - getattr(children_before, f) for f in ("ru_utime", "ru_stime"))
    sampler.stop()
    after = scrape(target.url, target.api_key)
    if code not in (0, 1):  # 1: some requests failed, which the report shows
        raise UsageError(f"locust exited with status {code}; see {out / 'locust.log'}", 1)
    rows = load_rows(out / "requests.jsonl")
    from loadtest import plots  # matplotlib loads when a run has something to draw, not for a flag error

    extra = json.loads((out / "locust_extra.json").read_text()) if (out / "locust_extra.json").exists() else {}
    t0, t1 = plots.span(rows)
    if rows:  # the measured window: first request sent to last answer received
        elapsed = max(t1 - t0, 1e-3)
    else:
        t0 = time.time() - elapsed
    summary = summarize(rows, elapsed, args.slos, extra.get("max_concurrent_requests", 0))
    summary["server"] = window(before, after, sampler.samples)
    if "open_loop" in extra:  # offered against sent and dropped arrivals
        summary["open_loop"] = extra["open_loop"]
    summary["load_generator_cpu_s"] = locust_cpu  # Locust's own CPU time: on a small machine it competes
    summary["target"] = {"name": target.name, "url": target.url, "model": target.model_name,
                         "readiness": target.readiness}  # fmt: skip
    summary["settings"] = {**settings(args, users), "seed": seed}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "server_samples.json").write_text(json.dumps(sampler.samples))
    result = RunResult(summary, rows, sampler.samples, t0)
    write_plots({target.name: result}, args.slos, out)
    html_report.write_run(out, summary, list(PLOTS))
    return result


def settings(args: argparse.Namespace, users: int) -> dict:
    return {"users": users, "duration_s": args.duration_s, "rate": args.rate, "shape": args.shape,
            "endpoint": args.endpoint, "input_len_words": args.input_len, "output_len_tokens": args.output_len,
            "shared_prefix_words": args.shared_prefix, "seed": args.seed, "slos": args.slos,
            "temperature": getattr(args, "temperature", 0.0)}  # fmt: skip


PLOTS = ("throughput_over_time.png", "server_over_time.png", "latency_cdf.png", "latency_ccdf.png",
         "ttft_vs_prompt.png")  # fmt: skip


def write_plots(runs: dict[str, RunResult], slos: dict[str, float], out: Path) -> None:
    from loadtest import plots

    rows = {name: r.rows for name, r in runs.items()}
    plots.throughput_over_time(rows, out / PLOTS[0])
    plots.server_over_time({name: (r.samples, r.t0) for name, r in runs.items()}, out / PLOTS[1])
    plots.latency_cdfs(rows, slos, out / PLOTS[2])
    plots.latency_ccdfs(rows, slos, out / PLOTS[3])
    plots.ttft_vs_prompt(rows, out / PLOTS[4])


def sweep(target: Target, out: Path, args: argparse.Namespace) -> list[dict]:
    """Users 1, 2, 4, ... until doubling them raises throughput by less than 10%; one folder per point."""
    points, best = [], 0.0
    users = 1
    while users <= args.sweep_max:
        result = run_locust(target, out / f"c{users}", users, args)
        summary = result.summary
        points.append({"concurrency": users, **summary})
        print(f"  {users:>3} users: {summary['output_throughput']:8.1f} output tok/s, "
              f"median e2e {summary['median_e2el_ms']:8.1f} ms")  # fmt: skip
        if best and summary["output_throughput"] < best * 1.1:
            break
        best = max(best, summary["output_throughput"])
        users *= 2
    (out / "sweep.json").write_text(json.dumps(points, indent=2))
    from loadtest import plots

    plots.sweep_curve(points, out / "sweep.png")
    html_report.write_sweep(out, points)
    return points
